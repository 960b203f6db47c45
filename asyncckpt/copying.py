"""Self-contained copies: one step as a checkpoint directory that needs nothing else.

A step of an incremental save references frames of older steps in its root, so its
directory alone is not a checkpoint that can be moved to another machine or bucket.
`copy_step` writes every frame's stored bytes -- its own and the referenced ones --
into new data files, so the copy holds no reference and is a format-1 checkpoint (any
asyncckpt reader of either version reads it). Frames are copied as stored (no
re-encoding), each one verified on the way (stored checksum, then decoded and checked
against the raw checksum), and the directory appears in one rename, complete or not at
all.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
from pathlib import Path

from .checkpoint import Checkpoint
from .commit import fsync_path, write_atomic
from .config import ReadLimits
from .format import FORMAT_VERSION, MANIFEST_NAME
from .manifest import Manifest, RankPart


def copy_step(path: str | os.PathLike[str], out: str | os.PathLike[str], step: int | None = None,
              *, limits: ReadLimits | None = None) -> Path:
    """Write checkpoint `path` (a step directory, or a root and `step`, default its
    newest) as the stand-alone checkpoint directory `out`, every byte materialised.

    Args:
        out: the new directory; it must not exist. Its parent is created if needed.
    Returns:
        `out`.
    Raises:
        CheckpointNotFoundError: no such checkpoint.
        CorruptCheckpointError: a frame (own or referenced) fails its checks; nothing
            is left at `out`.
        FileExistsError: `out` exists.
        OSError: writing the copy failed (nothing is left at `out`).
    """
    out = Path(out)
    if os.path.lexists(out):
        raise FileExistsError(f"{out} exists; a copy never replaces anything")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        with Checkpoint.open(path, step, limits=limits) as ckpt:
            parts = [_copy_rank(ckpt, rank, tmp) for rank in range(ckpt.world_size)]
            m = ckpt.manifest
            manifest = Manifest(m.step, m.world_size, parts, created=m.created,
                                writer_version=m.writer_version, format_version=FORMAT_VERSION)
        write_atomic(tmp / MANIFEST_NAME, manifest.to_bytes())
        os.rename(tmp, out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _copy_rank(ckpt: Checkpoint, rank: int, directory: Path) -> RankPart:
    reader = ckpt.reader(rank)
    part = reader.part
    frames, position = [], 0
    fd = os.open(directory / part.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        for index, frame in enumerate(part.frames):
            with ckpt.reading():
                stored = reader.read_stored(index)
            view = stored
            while view:
                view = view[os.write(fd, view):]
            frames.append(dataclasses.replace(frame, stored_offset=position,
                                              stored_length=len(stored), ref=None))
            position += len(stored)
        os.fsync(fd)
    finally:
        os.close(fd)
    return dataclasses.replace(part, stored_size=position, frames=frames)
