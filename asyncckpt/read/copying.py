"""Self-contained copies: one step as a checkpoint directory that needs nothing else.

A step of an incremental save references frames of older steps in its root, so its
directory alone is not a checkpoint that can be moved to another machine or bucket.
`copy_step` writes every frame's stored bytes -- its own and the referenced ones --
into new data files, so the copy holds no reference and is a format-1 checkpoint (any
asyncckpt reader of any version reads it; a step saved in parts stays one, below). Each
frame is verified on the way (stored checksum, then decoded and checked against the raw
checksum), and the directory appears in one rename, complete or not at all.

A referenced frame keeps the codec it was stored with, which need not be one the copy's
file admits (docs/FORMAT.md: a raw file holds only raw frames, a zstd file only zstd
ones, a bytegroup file bytegroup and raw ones): with codec="auto", or a writer
restarted with another codec, a raw step references bytegroup frames. Such a frame is
re-encoded with the file's codec from its verified raw bytes (same raw checksum and
xxh3_128, new stored checksum and planes); the others are copied as stored. Each rank
keeps its codec and file name rather than getting a codec that admits every frame:
there is not always one (raw and zstd frames share no file), and a raw step's copy is
then what a raw file promises, a safetensors file any tool opens. Re-encoding uses the
codecs' default settings, not those of the save (a manifest does not record them).

A step saved in parts (format_version 3) is copied in parts: the same node directories
and ranks, each rank's part file written again (its frames' places change) and the root
with new entries, so a copy of a step too large for one manifest file stays readable.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
from pathlib import Path

from asyncckpt.codec.registry import CodecParams
from asyncckpt.config import ReadLimits
from asyncckpt.format.encoding import FrameEncoder
from asyncckpt.format.layout import FORMAT_VERSION, MANIFEST_NAME
from asyncckpt.format.manifest import Manifest, check_readable
from asyncckpt.format.parts import PartEntry, node_part
from asyncckpt.format.records import RankPart, admitted_codecs
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.read.reader import scratch_buffer
from asyncckpt.storage.durable import fsync_path, write_atomic
from asyncckpt.storage.local import read_local
from asyncckpt.storage.paths import local_path


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
    out = local_path(out)  # a stand-alone local directory (an s3:// output is refused)
    limits = limits or ReadLimits.from_env()
    if os.path.lexists(out):
        raise FileExistsError(f"{out} exists; a copy never replaces anything")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        with Checkpoint.open(path, step, limits=limits) as ckpt:
            m = ckpt.manifest
            if m.parts is None:
                parts = [_copy_rank(ckpt, rank, tmp) for rank in range(ckpt.world_size)]
                entries = None
            else:  # every rank's tables read, and global tensors checked to tile
                ckpt.sharded  # noqa: B018
                parts, entries = [], [_copy_part(ckpt, entry, tmp) for entry in m.parts]
            manifest = Manifest(m.step, m.world_size, parts, created=m.created,
                                writer_version=m.writer_version, format_version=FORMAT_VERSION,
                                parts=entries)
        data = manifest.to_bytes()
        # re-encoded frames make it larger: still within bounds (every part read back)
        check_readable(data, limits, lambda name, limit: read_local(tmp, name, limit))
        write_atomic(tmp / MANIFEST_NAME, data)
        os.rename(tmp, out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _copy_part(ckpt: Checkpoint, entry: PartEntry, directory: Path) -> PartEntry:
    """Node part `entry` copied into `directory`: its node directory, its ranks' data
    files and part files; returns its new root entry."""
    (directory / entry.dir).mkdir()
    ranks = [_copy_rank(ckpt, rank, directory) for rank in entry.ranks]
    new, files = node_part(ckpt.step, ranks)
    for name, data in files.items():
        write_atomic(directory / name, data)
    return new


def _copy_rank(ckpt: Checkpoint, rank: int, directory: Path) -> RankPart:
    reader = ckpt.reader(rank)
    part = reader.part
    admitted = admitted_codecs(part.codec)
    encoder: FrameEncoder | None = None  # made for the first frame that needs one
    context: dict = {}
    frames, position = [], 0
    fd = os.open(directory / part.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        for index, frame in enumerate(part.frames):
            if frame.codec in admitted:
                with ckpt.reading():
                    pieces: list[bytes | bytearray | memoryview] = [reader.read_stored(index)]
                copied = dataclasses.replace(frame, stored_offset=position,
                                             stored_length=len(pieces[0]), ref=None)
            else:
                encoder = encoder or FrameEncoder(part.codec, CodecParams().level, part.tensors)
                view = scratch_buffer(context, "raw", frame.raw_length)
                with ckpt.reading():
                    reader.read_frame_into(index, view)
                encoded = encoder.encode(frame.raw_offset, view, context)
                pieces = encoded.pieces
                copied = dataclasses.replace(
                    frame, stored_offset=position, stored_length=encoded.stored_length,
                    codec=encoded.codec, xxh3_stored=encoded.xxh3_stored, layout=encoded.layout,
                    ref=None)
            for piece in pieces:
                piece = memoryview(piece).cast("B")
                while piece:
                    piece = piece[os.write(fd, piece):]
            frames.append(copied)
            position += copied.stored_length
        os.fsync(fd)
    finally:
        os.close(fd)
    return dataclasses.replace(part, stored_size=position, frames=frames)
