"""Verifying checkpoints without loading them: `asyncckpt.verify` and `asyncckpt verify`.

Verification opens each checkpoint through `Checkpoint.examine` (the manifest, with
every rule of its parser -- no repeated key, every frame's codec one its data file's
suffix admits --, the directory's files, the global tensors and every rank's tree: the
checks `load` makes) and then reads every frame of every rank through the same checked
path as `load` (sizes, both checksums, decoding), plus what `load` does not need: the
safetensors header in each data file must be exactly the one the manifest implies. At
the root it also checks that `latest` names a committed step, and that the `timeline`
file (format/timeline.py) parses strictly and names a timeline the root holds: one with
a committed step, or a fresh fork whose fork step is committed (the file is written
before the first step of a new timeline is published). Read as the root timeline, a bad
file would make abandoned steps newest again, so it counts as corruption. Byte ranges that several
steps share (incremental saves reference older steps' frames) are read and checked once
per root: a range counts as checked only for the same codec, planes and checksums. It
never stops at the first bad checkpoint, nor at the first problem of one: the report
covers all of them, and corruption is reported, never raised.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CheckpointError, CheckpointNotFoundError
from asyncckpt.format.layout import LATEST_NAME, MANIFEST_NAME, parse_step_dir, step_dir_name
from asyncckpt.format.records import Frame
from asyncckpt.format.timeline import TIMELINE_NAME
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.storage.location import exists, is_file, root_path, storage_for
from asyncckpt.storage.paths import Location
from asyncckpt.storage.timeline import read_current, step_timeline

Progress = Callable[[str, int, int], None]
"""Called after each frame: (checkpoint path, stored bytes verified, stored bytes to verify)."""


@dataclass
class CheckpointReport:
    """What verifying one checkpoint directory (or the root's `latest`) found."""

    path: str
    step: int | None
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    raw_bytes: int = 0
    stored_bytes: int = 0
    referenced_bytes: int = 0  # stored bytes of reference frames (in older steps' files)
    frames: int = 0
    seconds: float = 0.0

    def problem(self, text: str) -> None:
        self.ok = False
        self.problems.append(text)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class VerifyReport:
    """The result of `verify(path)`: one report per checkpoint (and for `latest`)."""

    path: str
    checkpoints: list[CheckpointReport]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.checkpoints)

    @property
    def problems(self) -> list[str]:
        return [p for r in self.checkpoints for p in r.problems]

    def to_json(self) -> dict:
        return {"ok": self.ok, "checkpoints": [r.to_json() for r in self.checkpoints]}


def verify(path: str | os.PathLike[str], *, limits: ReadLimits | None = None,
           progress: Progress | None = None) -> VerifyReport:
    """Verify a checkpoint, or every checkpoint under a root, reading every byte.

    Args:
        path: a checkpoint directory, or a root (then every `step-N` under it, with or
            without a manifest, and its `latest`).
        limits: reader limits (default: `ReadLimits.from_env()`).
        progress: see `Progress`.
    Returns:
        The report; `report.ok` is False when anything is corrupt. Corruption is
        reported, never raised.
    Raises:
        CheckpointNotFoundError: `path` is neither a checkpoint nor a root holding one.
    """
    return VerifyReport(str(path), list(verify_iter(path, limits=limits, progress=progress)))


def verify_iter(path: str | os.PathLike[str], *, limits: ReadLimits | None = None,
                progress: Progress | None = None) -> Iterator[CheckpointReport]:
    """`verify`, one report at a time (each as soon as its checkpoint is done).

    Raises:
        CheckpointNotFoundError: on the first `next()`, as `verify`.
    """
    directories, root = checkpoints_under(path)
    seen: set = set()
    for directory in directories:
        yield verify_checkpoint(directory, progress, limits=limits, seen=seen)
    pointer = verify_root_pointer(root) if root else None
    if pointer:
        yield pointer
    timeline = verify_root_timeline(root) if root else None
    if timeline:
        yield timeline


def checkpoints_under(path: str | os.PathLike[str]) -> tuple[list[Location], Location | None]:
    """(the checkpoint directories `path` stands for, the root if it is one).

    Raises:
        CheckpointNotFoundError: `path` does not exist, or is neither a checkpoint nor
            a root holding one.
    """
    path = root_path(path)
    if not exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist", file=str(path))
    if is_file(path / MANIFEST_NAME) or parse_step_dir(path.name) is not None:
        return [path], None
    # a step-N without a manifest is reported, not skipped
    steps = storage_for(path).step_dirs()
    if not steps:
        raise CheckpointNotFoundError(f"{path} is not a checkpoint (no {MANIFEST_NAME}) "
                                      "and holds no committed checkpoint", file=str(path))
    return [path / step_dir_name(s) for s in steps], path


def verify_checkpoint(directory: Location, progress: Progress | None = None, *,
                      limits: ReadLimits | None = None, seen: set | None = None
                      ) -> CheckpointReport:
    """Check one checkpoint directory end to end; never raises for corruption.

    `seen`: byte ranges already verified (see `RankReader.check_frames`), shared by the
    checkpoints of one root so that each shared range is read once.
    """
    started = time.perf_counter()
    report = CheckpointReport(str(directory), None)
    ckpt, problems = Checkpoint.examine(directory, limits=limits)
    for problem in problems:
        report.problem(str(problem))
    if ckpt is None:
        report.seconds = time.perf_counter() - started
        return report
    report.step = ckpt.step
    ranks = [r for r in range(ckpt.world_size) if r not in ckpt.unreadable_ranks]
    total = sum(f.encoded_length for r in ranks for f in ckpt.manifest.ranks[r].frames)

    def count(frame: Frame) -> None:
        report.frames += 1
        report.raw_bytes += frame.raw_length
        report.stored_bytes += frame.stored_length
        report.referenced_bytes += frame.encoded_length - frame.stored_length
        if progress:
            progress(str(directory), report.stored_bytes + report.referenced_bytes, total)

    with ckpt:
        for rank in ranks:
            try:
                ckpt.reader(rank).check_frames(count, seen)
            except CheckpointError as e:
                report.problem(str(e))
    report.seconds = time.perf_counter() - started
    return report


def verify_root_pointer(root: Location) -> CheckpointReport | None:
    """A problem report if `root/latest` exists but names no committed step."""
    latest = root / LATEST_NAME
    if not exists(latest):
        return None
    storage = storage_for(root)
    report = CheckpointReport(str(latest), storage.read_latest())
    if report.step is None or report.step not in storage.committed_steps():
        text = storage.latest_bytes()
        shown = (repr(text.decode(errors="replace").strip()) if text is not None
                 else "something that is not a regular file of at most 64 bytes")
        report.problem(f"{LATEST_NAME} names {shown}, "
                       "which is not a committed checkpoint")
        return report
    return None


def verify_root_timeline(root: Location) -> CheckpointReport | None:
    """A problem report if `root/timeline` is damaged (not a regular file, over its bound,
    a bad checksum, a record breaking a rule) or names a timeline the root does not hold:
    no committed step is in it, and it is not a fresh fork (its last lineage entry
    `[parent, at]` names committed step `at` of timeline `parent`). Steps whose manifest
    does not read are skipped here (their own reports carry that)."""
    where = root / TIMELINE_NAME
    report = CheckpointReport(str(where), None)
    storage = storage_for(root)
    try:
        current = read_current(storage)
    except (CheckpointError, OSError) as e:
        report.problem(str(e))
        return report
    if current.is_root:
        return None
    held: dict[int, str] = {}
    for step in storage.committed_steps():
        try:
            held[step] = step_timeline(storage, step).id
        except CheckpointError:
            continue
    if current.id in held.values():
        return None
    if current.lineage:
        parent, at = current.lineage[-1]
        if held.get(at) == parent:
            return None  # a fresh fork: its first step is not published yet
        fork = f"its fork step {at} (of timeline {parent or 'root'}) is not a committed step"
    else:
        fork = "it has no lineage to fork from"
    report.problem(f"{TIMELINE_NAME} names {current.describe()}, which no committed step is "
                   f"in, and {fork}: the root's newest step cannot be told")
    return report
