"""Reading checkpoints back: every byte checked before it is returned.

The manifest is the only thing trusted, and only after its own checksum and field
checks pass. Data files are opened by the names the manifest's rules allow, never by a
path it could aim elsewhere, must have exactly the stored size it declares, and each
frame is verified twice: the stored bytes against their xxh3 before decoding (so a
decoder never sees corrupt input), the decoded bytes against theirs after. Frames that
lie inside one tensor decode straight into the tensor's memory; frames shared by small
tensors decode once into a one-frame scratch buffer.
"""

from __future__ import annotations

import ctypes
import os
import stat
from pathlib import Path
from typing import Any

import torch
import xxhash

from . import commit
from .client import resolve_rank
from .codec import Codec, make_codec
from .errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                     StateMismatchError)
from .dtypes import DTYPES
from .format import MANIFEST_NAME, TensorSpec, layout, parse_step_dir, step_dir_name
from .manifest import Frame, Manifest, RankPart, read_manifest
from .tree import tensor_paths, unflatten


def resolve_checkpoint(path: str | os.PathLike[str], step: int | None = None) -> Path:
    """The committed checkpoint directory that `path` (a checkpoint or a root) and `step` name.

    Without `step`, a root resolves to its newest committed step.

    Raises:
        CheckpointNotFoundError: nothing committed there.
        CorruptCheckpointError: the step directory asked for exists but has no manifest
            (the writer never makes one: its manifest was deleted).
    """
    path = Path(path)
    if parse_step_dir(path.name) is not None and path.is_dir():
        _require_manifest(path)
        named = parse_step_dir(path.name)
        if step is not None and named is not None and named != step:
            raise CheckpointNotFoundError(f"{path} is step {named}, not {step}", step=step,
                                          file=str(path))
        return path
    if step is not None:
        candidate = path / step_dir_name(step)
        if candidate.is_dir():
            _require_manifest(candidate)
            return candidate
        raise CheckpointNotFoundError(f"no committed checkpoint for step {step} in {path}",
                                      step=step, file=str(path))
    steps = commit.committed_steps(path)
    if not steps:
        raise CheckpointNotFoundError(f"no committed checkpoint in {path}", file=str(path))
    return path / step_dir_name(steps[-1])


def _require_manifest(directory: Path) -> None:
    if not os.path.lexists(directory / MANIFEST_NAME):
        raise CorruptCheckpointError(f"{directory.name} has no {MANIFEST_NAME}: not a checkpoint "
                                     "(its manifest was deleted, or it was never committed)",
                                     file=str(directory))


class RankReader:
    """Verified access to one rank's data file. Not thread-safe (one codec context)."""

    def __init__(self, directory: Path, manifest: Manifest, rank: int) -> None:
        self.part: RankPart = manifest.ranks[rank]
        self.step = manifest.step
        self.rank = rank
        self.path = directory / self.part.file
        self._codec: Codec = make_codec(self.part.codec)
        self._scratch: tuple[int, bytearray] | None = None
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            raise self._corrupt(f"cannot open data file: {e.strerror}") from None
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != self.part.stored_size:
            self.close()
            raise self._corrupt(f"data file has {st.st_size} bytes, manifest says "
                                f"{self.part.stored_size}")
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # read ahead while we hash

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "RankReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_frame_into(self, index: int, out: memoryview, tensor: str | None = None) -> None:
        """Read, verify and decode frame `index` into `out` (exactly its raw length).

        Raises:
            CorruptCheckpointError: short read, checksum mismatch, or undecodable frame.
        """
        frame = self.part.frames[index]
        if index + 1 < len(self.part.frames):  # the disk fetches the next frame while we check this one
            following = self.part.frames[index + 1]
            os.posix_fadvise(self._fd, following.stored_offset, following.stored_length,
                             os.POSIX_FADV_WILLNEED)
        if frame.codec == "raw":
            self._pread_into(frame, index, out, tensor)
            self._check(frame, index, "raw", xxhash.xxh3_64_intdigest(out), tensor)
            return
        stored = bytearray(frame.stored_length)
        self._pread_into(frame, index, memoryview(stored), tensor)
        self._check(frame, index, "stored", xxhash.xxh3_64_intdigest(stored), tensor)
        try:
            self._codec.decode_into(stored, out)
        except CorruptCheckpointError as e:
            raise self._corrupt(f"frame {index}: {e.cause}", tensor) from None
        self._check(frame, index, "raw", xxhash.xxh3_64_intdigest(out), tensor)

    def read_range(self, begin: int, end: int, out: memoryview, tensor: str | None = None) -> None:
        """Fill `out` with raw stream bytes `begin`..`end`, verifying every frame touched."""
        frames = self.part.frames
        index = _frame_at(frames, begin)
        while begin < end:
            frame = frames[index]
            f_begin, f_end = frame.raw_offset, frame.raw_offset + frame.raw_length
            lo, hi = begin - f_begin, min(end, f_end) - f_begin
            if lo == 0 and hi == frame.raw_length:
                self.read_frame_into(index, out[:hi], tensor)
            else:
                if self._scratch is None or self._scratch[0] != index:
                    buf = bytearray(frame.raw_length)
                    self.read_frame_into(index, memoryview(buf), tensor)
                    self._scratch = (index, buf)
                out[:hi - lo] = memoryview(self._scratch[1])[lo:hi]
            out = out[hi - lo:]
            begin += hi - lo
            index += 1

    def check_header(self) -> None:
        """Read the stream's safetensors header (verified) and check it is exactly the
        one the manifest's tensor table implies, so dtypes, shapes and offsets agree.

        Raises:
            CorruptCheckpointError: it differs.
        """
        expected, _ = layout((t.name, t.dtype, t.shape) for t in self.part.tensors)
        end = self.part.tensors[0].begin if self.part.tensors else self.part.raw_size
        if end != len(expected):
            raise self._corrupt(f"tensors start at byte {end}, the header ends at {len(expected)}")
        buf = bytearray(end)
        self.read_range(0, end, memoryview(buf))
        if buf != expected:
            raise self._corrupt("safetensors header differs from the manifest's tensor table")

    def read_tensor(self, spec: TensorSpec, into: torch.Tensor | None = None) -> torch.Tensor:
        """A verified tensor; decoded straight into `into` when it is CPU, contiguous and
        of the same dtype and shape (else via a fresh tensor)."""
        dtype = DTYPES[spec.dtype]
        direct = (into is not None and into.device.type == "cpu" and into.is_contiguous()
                  and into.dtype == dtype and tuple(into.shape) == spec.shape)
        try:
            target = into if direct else torch.empty(spec.shape, dtype=dtype)
        except (RuntimeError, MemoryError) as e:  # the manifest bounds it; the host may not
            raise CheckpointError(f"cannot allocate {spec.end - spec.begin} bytes for tensor "
                                  f"{spec.name!r}: {e}", step=self.step, rank=self.rank) from None
        assert target is not None
        if spec.end > spec.begin:
            self.read_range(spec.begin, spec.end, tensor_bytes(target), spec.name)
        if into is not None and not direct:
            with torch.no_grad():
                into.copy_(target)
            return into
        return target

    def _pread_into(self, frame: Frame, index: int, out: memoryview, tensor: str | None) -> None:
        offset, view = frame.stored_offset, out[:frame.stored_length]
        while view:
            n = os.preadv(self._fd, [view], offset)
            if n == 0:
                raise self._corrupt(f"frame {index}: file ends early", tensor)
            view, offset = view[n:], offset + n

    def _check(self, frame: Frame, index: int, which: str, actual: int, tensor: str | None) -> None:
        expected = frame.xxh3_raw if which == "raw" else frame.xxh3_stored
        if actual != expected:
            raise self._corrupt(
                f"frame {index} (raw bytes {frame.raw_offset}..{frame.raw_offset + frame.raw_length}): "
                f"xxh3 of {which} bytes mismatch (manifest {expected:016x}, file {actual:016x})", tensor)

    def _corrupt(self, cause: str, tensor: str | None = None) -> CorruptCheckpointError:
        where = f" (tensor {tensor!r})" if tensor else ""
        return CorruptCheckpointError(cause + where, step=self.step, rank=self.rank,
                                      file=self.part.file)


def load(path: str | os.PathLike[str], *, step: int | None = None, rank: int | None = None,
         into: Any = None, strict: bool = True) -> Any:
    """Load what one rank saved, every byte verified.

    Args:
        path: a checkpoint directory, or a root (then its newest committed step, or `step`).
        rank: whose part to load (default: this process's rank, else 0).
        into: an existing state dict whose tensors are filled in place (shapes and dtypes
            must match the saved ones; CUDA and non-contiguous targets are filled via a
            temporary copy of one tensor at a time).
        strict: with `into`, every target tensor must be present in the checkpoint.
    Returns:
        The saved structure (dicts with their str/int keys, lists, tuples, objects);
        with `into`, its tensors are the target tensors, now filled.
    Raises:
        CheckpointNotFoundError: nothing committed at `path`/`step`.
        CorruptCheckpointError: any verification failure; no corrupt value is returned.
            With `into`, tensors already filled keep their new (verified) values and the
            one being read may be partly written: reload or discard the targets.
        StateMismatchError: `into` disagrees with the checkpoint (checked before reading).
    """
    directory = resolve_checkpoint(path, step)
    manifest = read_manifest(directory)
    if rank is None:
        rank = resolve_rank()[0] if manifest.world_size > 1 else 0
    if not 0 <= rank < manifest.world_size:
        raise CheckpointNotFoundError(f"checkpoint has ranks 0..{manifest.world_size - 1}",
                                      step=manifest.step, rank=rank, file=str(directory))
    check_files(directory, manifest)
    part = manifest.ranks[rank]
    specs = {s.name: s for s in part.tensors}
    paths = check_tree(part, manifest.step)
    targets = _match_targets(into, paths, specs, strict, manifest.step, rank) if into is not None else {}
    loaded: dict[str, torch.Tensor] = {}
    with RankReader(directory, manifest, rank) as reader:
        reader.check_header()
        for spec in part.tensors:
            loaded[spec.name] = reader.read_tensor(spec, targets.get(spec.name))
    return unflatten(part.tree, loaded.__getitem__)


def check_files(directory: Path, manifest: Manifest) -> None:
    """The directory must hold exactly the manifest and the data files it names.

    Raises:
        CorruptCheckpointError: a file is missing or one is there that should not be.
    """
    expected = {MANIFEST_NAME} | {p.file for p in manifest.ranks}
    present = set(os.listdir(directory))
    for name, problem in [(n, "missing") for n in sorted(expected - present)] + \
                         [(n, "unexpected") for n in sorted(present - expected)]:
        raise CorruptCheckpointError(f"{problem} file {name!r}", step=manifest.step,
                                     file=str(directory))


def check_tree(part: RankPart, step: int) -> dict[str, tuple]:
    """The tree must be well formed and reference each listed tensor exactly once.

    Returns:
        Each tensor name's path in the tree.
    Raises:
        CorruptCheckpointError: it does not.
    """
    paths = tensor_paths(part.tree)
    if set(paths) != {t.name for t in part.tensors}:
        raise CorruptCheckpointError("object tree and tensor table disagree", step=step,
                                     rank=part.rank, file=MANIFEST_NAME)
    unflatten(part.tree, lambda name: None)
    return paths


def _match_targets(into: Any, paths: dict[str, tuple], specs: dict[str, TensorSpec],
                   strict: bool, step: int, rank: int) -> dict[str, torch.Tensor]:
    by_path = {p: n for n, p in paths.items()}
    targets, problems = {}, []
    for target_path, tensor in _tensor_leaves(into):
        name = by_path.get(target_path)
        if name is None:
            if strict:
                problems.append(f"{_show(target_path)} is not in the checkpoint")
            continue
        spec = specs[name]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != DTYPES[spec.dtype]:
            problems.append(f"{_show(target_path)}: target {tensor.dtype} {tuple(tensor.shape)}, "
                            f"saved {DTYPES[spec.dtype]} {spec.shape}")
        targets[name] = tensor
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise StateMismatchError(shown, step=step, rank=rank)
    return targets


def _tensor_leaves(node: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    if isinstance(node, torch.Tensor):
        return [(path, node)]
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _tensor_leaves(v, path + (k,))]
    if isinstance(node, (list, tuple)):
        return [leaf for i, v in enumerate(node) for leaf in _tensor_leaves(v, path + (i,))]
    return []


def _show(path: tuple) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)


def _frame_at(frames: list[Frame], offset: int) -> int:
    lo, hi = 0, len(frames) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if frames[mid].raw_offset <= offset:
            lo = mid
        else:
            hi = mid - 1
    return lo


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no numpy needed).

    The view does not keep `t` alive: use it only while `t` is referenced.
    """
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
