"""Steps in parts (format_version 3) made by hand from single-file steps, for tests.

A real writer saves a several-rank step as one manifest; `to_parts` rewrites it in place
as the root manifest, node directories and rank part files a several-node save writes, using
the format's own functions (so what is tested is what a writer would produce), and
rewrites references into steps already rewritten so they name their node directories.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from asyncckpt.format.layout import MANIFEST_NAME, node_dir_name
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.parts import PartEntry, node_part
from asyncckpt.format.records import RankPart
from asyncckpt.storage.local import read_manifest


def firsts(sizes: list[int]) -> list[int]:
    """The first rank of each part of `sizes` ranks."""
    return [0, *itertools.accumulate(sizes)][:-1]


def node_of(rank: int, sizes: list[int]) -> str:
    """The node directory holding `rank` when parts hold `sizes` ranks."""
    return node_dir_name(max(f for f in firsts(sizes) if f <= rank))


def to_parts(step_dir: Path, sizes: list[int],
             moved: dict[int, list[int]] | None = None) -> Manifest:
    """Rewrite the single-file step `step_dir` in parts of `sizes` ranks each.

    Args:
        moved: step -> the sizes that step (of the same root) was rewritten with: its
            files are in node directories now, and references to them say so.
    Returns:
        The root manifest written.
    """
    m = read_manifest(step_dir)
    assert m.parts is None and sum(sizes) == m.world_size
    moved = moved or {}
    ranks = [_moved(p, sizes, moved) for p in m.ranks]
    entries: list[PartEntry] = []
    for first, size in zip(firsts(sizes), sizes):
        node = step_dir / node_dir_name(first)
        node.mkdir()
        group = ranks[first:first + size]
        for flat, part in zip(m.ranks[first:first + size], group):
            (step_dir / flat.file).rename(step_dir / part.file)
        entry, files = node_part(m.step, group)
        for name, data in files.items():
            (step_dir / name).write_bytes(data)
        entries.append(entry)
    root = Manifest(m.step, m.world_size, [], created=m.created,
                    writer_version=m.writer_version, parts=entries)
    (step_dir / MANIFEST_NAME).write_bytes(root.to_bytes())
    return root


def _moved(part: RankPart, sizes: list[int], moved: dict[int, list[int]]) -> RankPart:
    frames = []
    for f in part.frames:
        if f.ref is not None and f.ref.step in moved:
            rank = int(f.ref.file.split("-")[1].split(".")[0])
            f = dataclasses.replace(f, ref=f.ref._replace(
                file=f"{node_of(rank, moved[f.ref.step])}/{f.ref.file}"))
        frames.append(f)
    return dataclasses.replace(part, file=f"{node_of(part.rank, sizes)}/{part.file}",
                               frames=frames)
