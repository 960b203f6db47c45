"""Verifying checkpoints without loading them: `asyncckpt verify`.

Verification reads every frame of every rank through the same checked path as `load`
(sizes, both checksums, decoding), and adds what `load` does not need: the safetensors
header in each data file must be exactly the one the manifest implies, the object tree
must reference exactly the tensors listed, and the directory must hold no file the
manifest does not name. At the root it also checks that `latest` names a committed
step. It never stops at the first bad checkpoint: the report covers all of them.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from . import commit
from .errors import CheckpointError, CheckpointNotFoundError
from .format import LATEST_NAME, MANIFEST_NAME, parse_step_dir, step_dir_name
from .manifest import Frame, Manifest, read_manifest
from .reader import RankReader, check_tree
from .sharded import global_tensors

Progress = Callable[[int], None]


@dataclass
class Report:
    path: str
    step: int | None
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    raw_bytes: int = 0
    stored_bytes: int = 0
    frames: int = 0
    seconds: float = 0.0

    def problem(self, text: str) -> None:
        self.ok = False
        self.problems.append(text)

    def to_json(self) -> dict:
        return asdict(self)


def checkpoints_under(path: str | os.PathLike[str]) -> tuple[list[Path], Path | None]:
    """(the checkpoint directories `path` stands for, the root if it is one).

    Raises:
        CheckpointNotFoundError: `path` is neither a checkpoint nor a root holding one.
    """
    path = Path(path)
    if (path / MANIFEST_NAME).is_file() or parse_step_dir(path.name) is not None:
        return [path], None
    steps = commit.step_dirs(path)  # a step-N without a manifest is reported, not skipped
    if not steps:
        raise CheckpointNotFoundError(f"{path} is not a checkpoint (no {MANIFEST_NAME}) "
                                      "and holds no committed checkpoint", file=str(path))
    return [path / step_dir_name(s) for s in steps], path


def verify_checkpoint(directory: Path, progress: Progress | None = None) -> Report:
    """Check one checkpoint directory end to end; never raises for corruption."""
    started = time.perf_counter()
    report = Report(str(directory), None)
    try:
        manifest = read_manifest(directory)
    except CheckpointError as e:
        report.problem(str(e))
        return report
    report.step = manifest.step
    expected = {MANIFEST_NAME} | {p.file for p in manifest.ranks}
    present = set(os.listdir(directory))
    for name in sorted(present - expected):
        report.problem(f"unexpected file {name!r} in the checkpoint directory")
    try:
        global_tensors(manifest)
    except CheckpointError as e:
        report.problem(str(e))
    for rank in range(manifest.world_size):
        try:
            _verify_rank(directory, manifest, rank, report, progress)
        except CheckpointError as e:
            report.problem(str(e))
    report.seconds = time.perf_counter() - started
    return report


def _verify_rank(directory: Path, manifest: Manifest, rank: int, report: Report,
                 progress: Progress | None) -> None:
    check_tree(manifest.ranks[rank], manifest.step)

    def count(frame: Frame) -> None:
        report.frames += 1
        report.raw_bytes += frame.raw_length
        report.stored_bytes += frame.stored_length
        if progress:
            progress(frame.stored_length)

    with RankReader(directory, manifest, rank) as reader:
        reader.check_header()
        reader.check_frames(count)


def verify_root_pointer(root: Path) -> Report | None:
    """A problem report if `root/latest` exists but names no committed step."""
    latest = root / LATEST_NAME
    if not latest.exists():
        return None
    report = Report(str(latest), commit.read_latest(root))
    if report.step is None or report.step not in commit.committed_steps(root):
        report.problem(f"{LATEST_NAME} names {latest.read_text(errors='replace').strip()!r}, "
                       "which is not a committed checkpoint")
        return report
    return None
