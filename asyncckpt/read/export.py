"""Export to a Hugging Face model directory: shards written at disk speed, in parallel.

`from_pretrained` wants `model-0000i-of-0000N.safetensors` shards and
`model.safetensors.index.json`. Shards are planned from the manifest alone (names,
dtypes, shapes are all known before a byte is read), so the plan is the same in every
process that computes it: that is what splits one export over processes (`jobs`) and
hosts (`part`) without any messages. Each process writes its share of the shards
(shard_writer.py: reads, verification and conversion overlap the writes, memory is
two slabs of 16 MiB, never a whole tensor), each shard renamed into place whole; the
process that finds every share's marker in place once its own are done writes the
config, tokenizer and index, the index last, so a directory with an index is complete
(shards an earlier export left there never count: a marker names its export). A
sharded (DTensor) tensor is gathered from every rank's boxes, slab by slab.

An export into a directory holding an earlier one must never leave a directory that
`from_pretrained` opens as a mix of the two: it reads the index (or a single
`model.safetensors`, which it prefers) and then whichever shards those names hold. So
before its first shard each process of an export removes the old index, a single-file
`model.safetensors`, and the shards of other plans, and makes that durable; until the
new index is renamed in, the directory holds no model at all, whether the export fails,
runs, or is killed. The processes of one export must split it the same way: each host
leaves a layout marker (`-layout-<shares>`) before it writes, and a host that finds
another's with a different number of shares (a different `--jobs` or `N`) fails at once
with a usage error instead of writing shards that the others' plan never completes.

Processes rather than threads for `jobs`: a shard's bytes are checksummed, decompressed
and converted in C, but the per-tensor work between is Python under one GIL, and a
process per share scales across cores and hosts alike. Each costs an interpreter and a
torch import (about 2 s here) before it reads: worth it for models of many GB only.

When the checkpoint carries a Hugging Face config (the Checkpointer stores it for a
`transformers` model, see integrations/hf.py), the directory is made complete:
`config.json` naming the dtype the weights were actually written in,
`generation_config.json`, the tokenizer files of a given directory, and each tied weight
once (the name `save_pretrained` keeps), so `from_pretrained(out)` opens it as it is.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from asyncckpt import errors
from asyncckpt.config import ReadLimits, WriterKnobs
from asyncckpt.errors import CheckpointError
from asyncckpt.format.tree import BYTES_KINDS
from asyncckpt.read import hf
from asyncckpt.read.checkpoint import Checkpoint, Leaf
from asyncckpt.read.shard_writer import Item, write_shards
from asyncckpt.storage.durable import fsync_path, write_atomic
from asyncckpt.storage.paths import local_path
from asyncckpt.torchutil.dtypes import DTYPE_NAMES, DTYPES

log = logging.getLogger("asyncckpt.export")

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"  # save_pretrained's one-file model, preferred by from_pretrained
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
HELPER_POLL = 0.2  # seconds between progress ticks while the export's helper processes run
Shards = list[tuple[str, list[Item]]]


def export_hf(path: str | os.PathLike[str], out: str | os.PathLike[str], *, step: int | None = None,
              rank: int = 0, contents: str | None = "model", dtype: torch.dtype | None = None,
              max_shard_size: int = 5 << 30, limits: ReadLimits | None = None,
              progress: Callable[[int, int], None] | None = None,
              tokenizer: str | os.PathLike[str] | None = None, jobs: int = 1,
              part: tuple[int, int] = (0, 1)) -> dict:
    """Write the tensors under `contents` (a top-level key; None: everything) as a
    Hugging Face safetensors model directory.

    Args:
        path, step, rank: which checkpoint and whose tree (as `load`); sharded tensors
            are assembled from all ranks.
        dtype: convert floating-point tensors to this dtype (e.g. torch.bfloat16).
        max_shard_size: bytes per shard file at most (a larger tensor gets its own).
            Split over several processes or parts, shards are made small enough for
            each to get one where the model allows.
        limits: reader limits (default: `ReadLimits.from_env()`).
        progress: called after each tensor with (bytes exported so far, bytes in all),
            both counted in the exported dtype, over this call's shards.
        tokenizer: a directory whose tokenizer files are copied into `out`.
        jobs: processes of this host writing this call's shards side by side.
        part: (i, n): write only the i-th of n shares of the shards, for one export
            split over n hosts (or launches) that share `out` and are given the same
            arguments but `part`. The part that finds every other share done once its
            own are written finishes the directory (config, tokenizer, index last).
    Returns:
        The index (metadata.total_size and weight_map), plus "files": the config,
        generation config and tokenizer files written next to it (none if this call
        did not finish the directory), "shards": the shard files this call wrote, and
        "complete": whether the directory is now complete (its index written).
    Raises:
        CheckpointNotFoundError: nothing committed at `path`/`step`, or `rank` is not
            one of the checkpoint's ranks (negative ranks included).
        CorruptCheckpointError: the checkpoint fails verification; `out` then holds no
            index (and no partial shard: each is renamed into place whole). A root's
            damaged newest step is an error, as for `load`.
        CheckpointError: nothing to export under `contents`, or two keys flatten to
            one name.
        ValueError: `tokenizer` is not a directory holding tokenizer files, `jobs` < 1,
            or not 0 <= i < n (all checked before anything is written); or another
            host exports the same step into `out` split into another number of shares
            (its `jobs` or `n` differ from this call's), found before this call
            writes a shard.
    A process of `jobs` that fails raises its error here (the others are stopped).

    Hazard: `out` holds no model from this call's first shard until the index is
    written: an earlier export's index, `model.safetensors` and shards of other names
    are removed first, so a failed, running or killed export never leaves a directory
    that loads as a mix of two exports.

    A tied weight is exported once, as safetensors holds no aliasing: a view that is
    all of a tensor exported before it is left out, and with a stored config, so is
    each weight the model class ties to another (`from_pretrained` ties them again).
    """
    out = local_path(out)  # written with local files (an s3:// output is refused)
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise ValueError(f"tokenizer directory {tokenizer} does not exist")
    if jobs < 1 or not 0 <= part[0] < part[1]:
        raise ValueError(f"jobs={jobs}, part={part}: jobs must be 1 or more and part "
                         "(i, n) have 0 <= i < n")
    request = _Request(path, out, step, rank, contents, dtype, max_shard_size, limits,
                       parts=part[1] * jobs)
    shares = [part[0] * jobs + k for k in range(jobs)]  # this call's, of request.parts
    with Checkpoint.open(path, step, limits=limits) as ckpt:
        meta, items, shards = _plan(ckpt, request)
        token = _token(ckpt, request)
        ours = [shards[s] for share in shares for s in _assigned(shards, request.parts, share)]
        total = sum(i.nbytes for _, shard in ours for i in shard)
        out.mkdir(parents=True, exist_ok=True)
        _prepare(out, token, request.parts, shards, alone=part[1] == 1)
        with _Helpers(request, shares[1:]) as helpers:
            done = [0]

            def advance(nbytes: int) -> None:
                done[0] += nbytes
                if progress:
                    progress(done[0] + helpers.done(), total)
            _write_share(ckpt, request, shards, shares[0], advance)
            helpers.wait(lambda: advance(0))
    index = {"metadata": {"total_size": sum(i.nbytes for i in items)},
             "weight_map": {i.export_name: name for name, shard in shards for i in shard}}
    files = _finish(out, token, request.parts, index, meta, items, tokenizer)
    if files is not None and contents == "model" and "config" not in meta:
        log.warning("asyncckpt export: step %d holds no Hugging Face config, so %s has "
                    "weights and an index but no config.json (from_pretrained needs one: "
                    "copy the model's in, or save through a Checkpointer given a transformers "
                    "model or hf_config=)", ckpt.step, out)
    return {**index, "files": files or [], "complete": files is not None,
            "shards": sorted(name for name, _ in ours)}


@dataclass
class _Request:
    """What every process of one export is given (picklable)."""
    path: str | os.PathLike[str]
    out: Path
    step: int | None
    rank: int
    contents: str | None
    dtype: torch.dtype | None
    max_shard_size: int
    limits: ReadLimits | None
    parts: int  # shares the shards are split into, over every host and process


def _plan(ckpt: Checkpoint, request: _Request) -> tuple[dict[str, str], list[Item], Shards]:
    ckpt.check_rank(request.rank)
    ckpt.reader(request.rank)  # its header is checked even if every tensor comes from others
    meta = hf.read_hf_metadata(ckpt.tree(request.rank)) if request.contents == "model" else {}
    items = _drop_tied(_plan_items(ckpt, request.rank, request.contents, request.dtype), meta)
    return meta, items, _plan_shards(items, request.max_shard_size, request.parts)


def _plan_shards(items: list[Item], max_shard_size: int, parts: int) -> Shards:
    """Consecutive items packed into shards of at most `max_shard_size` bytes (a larger
    item alone), and of at most 1/`parts` of the model, so that each part gets one."""
    limit = min(max_shard_size, -(-sum(i.nbytes for i in items) // parts))
    shards: list[list[Item]] = [[]]
    size = 0
    for item in items:
        if shards[-1] and size + item.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.nbytes
    return [(f"model-{n:05d}-of-{len(shards):05d}.safetensors", shard)
            for n, shard in enumerate(shards, 1)]


def _assigned(shards: Shards, parts: int, share: int) -> list[int]:
    """The shards share `share` of `parts` writes: largest first, each to the share with
    the fewest bytes so far (the same answer in every process)."""
    sizes = [sum(i.nbytes for i in shard) for _, shard in shards]
    load, mine = [0] * parts, []
    for s in sorted(range(len(shards)), key=lambda s: (-sizes[s], s)):
        owner = min(range(parts), key=lambda p: (load[p], p))
        load[owner] += sizes[s]
        if owner == share:
            mine.append(s)
    return sorted(mine)


def _write_share(ckpt: Checkpoint, request: _Request, shards: Shards, share: int,
                 progress: Callable[[int], None]) -> None:
    """Write share `share`'s shards, then its marker: done, for this export."""
    mine = [shards[s] for s in _assigned(shards, request.parts, share)]
    with ckpt.reading():
        write_shards(ckpt, mine, request.out, WriterKnobs.from_env().flush_bytes, progress)
    write_atomic(_marker(request.out, _token(ckpt, request), share, request.parts), b"")


def _token(ckpt: Checkpoint, request: _Request) -> str:
    """What names one export: the step (as committed: a replaced step is another) and
    everything that shapes the shards. Markers of another export, or shards a previous
    export left in `out`, never count as this one's."""
    what = (ckpt.step, ckpt.manifest.created, request.rank, request.contents, str(request.dtype),
            request.max_shard_size)  # the shares are in each marker's name
    return xxhash.xxh3_64_hexdigest(repr(what).encode())


def _marker(out: Path, token: str, share: int, parts: int) -> Path:
    return out / f".asyncckpt-export-{token}-{share}-of-{parts}"


def _layout_marker(out: Path, token: str, parts: int) -> Path:
    return out / f".asyncckpt-export-{token}-layout-{parts}"


def _prepare(out: Path, token: str, parts: int, shards: Shards, *, alone: bool) -> None:
    """Before this host's first shard: claim the split (`_claim_layout`), then remove
    what `from_pretrained` would open in `out` besides this export's shards -- the index
    first, a single-file model, shards of other plans -- and make the removal durable.

    Raises:
        ValueError: another host splits this export into a different number of shares.
        OSError: they cannot be removed.
    """
    _claim_layout(out, token, parts, alone)
    (out / INDEX_NAME).unlink(missing_ok=True)
    (out / SINGLE_NAME).unlink(missing_ok=True)
    planned = {name for name, _ in shards}
    for name in os.listdir(out):
        if _SHARD.fullmatch(name) and name not in planned:
            (out / name).unlink(missing_ok=True)
    fsync_path(out)


def _claim_layout(out: Path, token: str, parts: int, alone: bool) -> None:
    """Leave this host's layout marker, then look for another host's of this export
    with another number of shares (written first, looked for second: of two hosts
    starting at once, at least one sees the other). With `alone` (part (0, 1): no other
    host may share this export) such markers are a killed run's, and are removed.

    Raises:
        ValueError: one is there (this host's own marker is taken back).
    """
    mine = _layout_marker(out, token, parts)
    write_atomic(mine, b"")
    pattern = re.compile(rf"\.asyncckpt-export-{token}-(?:layout-(\d+)|\d+-of-(\d+))")
    for name in sorted(os.listdir(out)):
        match = pattern.fullmatch(name)
        if match is None or int(match.group(1) or match.group(2)) == parts:
            continue
        if alone:
            (out / name).unlink(missing_ok=True)
            continue
        mine.unlink(missing_ok=True)
        theirs = int(match.group(1) or match.group(2))
        raise ValueError(
            f"another host exports this step into {out} split into {theirs} shares, this one "
            f"into {parts} (--part I/N with --jobs J makes N x J shares): give every host the "
            f"same N and --jobs (if no other export is running, remove {out / name}, left by "
            "an export that was killed)")


def _finish(out: Path, token: str, parts: int, index: dict, meta: dict[str, str],
            items: list[Item], tokenizer: str | os.PathLike[str] | None) -> list[str] | None:
    """Once every share of this export has its marker (else None): config, generation
    config, tokenizer, then the index, each renamed into place (a part finishing at the
    same moment writes the same bytes); then the markers go."""
    markers = [_marker(out, token, share, parts) for share in range(parts)]
    if not all(m.is_file() for m in markers):
        return None
    files = hf.write_model_files(out, meta, _written_dtype(items))
    if tokenizer is not None:
        files += hf.copy_tokenizer(tokenizer, out)
    write_atomic(out / INDEX_NAME, json.dumps(index, indent=2).encode())  # last: complete now
    for m in [*markers, _layout_marker(out, token, parts)]:
        m.unlink(missing_ok=True)
    return files


class _Helpers:
    """The processes writing this call's other shares (`jobs` - 1 of them): this
    interpreter run with `-c`, never a fork of a threaded process nor a re-import of the
    caller's `__main__` (what multiprocessing's spawn does to an unguarded script).
    Each is sent its request on stdin and reports bytes written, then its error if
    any, on stdout."""

    def __init__(self, request: _Request, shares: list[int]) -> None:
        self._jobs = [(request, share) for share in shares]
        self._procs: list[subprocess.Popen[bytes]] = []
        self._counts = [0] * len(shares)
        self._failures: list[tuple[str, str]] = []
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> _Helpers:
        package = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [package, *filter(None, [os.environ.get("PYTHONPATH")])])}
        for k, job in enumerate(self._jobs):
            proc = subprocess.Popen([sys.executable, "-c", _HELPER], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, env=env)
            self._procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(job))
            proc.stdin.close()
            thread = threading.Thread(target=self._follow, args=(k, proc), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _follow(self, k: int, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(b"+"):
                self._counts[k] += int(line[1:])
            elif line.startswith(b"!"):
                kind, _, message = line[1:].decode(errors="replace").rstrip("\n").partition("\t")
                self._failures.append((kind, message.replace("\\n", "\n")))

    def done(self) -> int:
        return sum(self._counts)

    def wait(self, tick: Callable[[], None]) -> None:
        """Until every helper exits; raises the first failure (typed as it was)."""
        for proc, thread in zip(self._procs, self._threads):
            while proc.poll() is None:
                thread.join(HELPER_POLL)
                tick()
            thread.join()
        tick()
        failed = [(n, proc.returncode) for n, proc in enumerate(self._procs) if proc.returncode]
        if self._failures or failed:
            kind, message = self._failures[0] if self._failures else (
                "CheckpointError", f"an export process exited with status {failed[0][1]}")
            if kind == "OSError":
                raise OSError(message)
            error = getattr(errors, kind, CheckpointError)
            raise (error if isinstance(error, type) and issubclass(error, CheckpointError)
                   else CheckpointError)(message)

    def __exit__(self, *exc: Any) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()  # it removes the shard it was writing
            proc.wait()
        for thread in self._threads:
            thread.join()


_HELPER = "from asyncckpt.read.export import helper_main; helper_main()"


def helper_main() -> None:
    """A helper process of `export_hf(jobs=...)`: its (request, share) on stdin."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    request, share = pickle.loads(sys.stdin.buffer.read())

    def advance(nbytes: int) -> None:
        sys.stdout.write(f"+{nbytes}\n")
        sys.stdout.flush()
    try:
        with Checkpoint.open(request.path, request.step, limits=request.limits) as ckpt:
            _, _, shards = _plan(ckpt, request)
            _write_share(ckpt, request, shards, share, advance)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        kind = type(e).__name__ if isinstance(e, CheckpointError) else (
            "OSError" if isinstance(e, OSError) else "CheckpointError")
        text = str(e) if kind != "CheckpointError" or isinstance(e, CheckpointError) \
            else f"{type(e).__name__}: {e}"
        sys.stdout.write(f"!{kind}\t{text}".replace("\n", "\\n") + "\n")
        sys.stdout.flush()
        sys.exit(1)


def _drop_tied(items: list[Item], meta: dict[str, str]) -> list[Item]:
    """`items` less the second name of each tied weight."""
    exported = {i.leaf.tensor.name for i in items if i.leaf.view is None}
    drop = {i.export_name for i in items if i.leaf.view is not None
            and i.leaf.tensor.name in exported and _whole(i.leaf)}
    if "config" in meta:
        drop |= hf.tied_duplicates(meta["config"], [i.export_name for i in items])
    return [i for i in items if i.export_name not in drop]


def _whole(leaf: Leaf) -> bool:
    """A view that is its whole base, element for element (a tied weight)."""
    view = leaf.view
    assert view is not None
    strides, step = [], 1
    for n in reversed(view.shape):
        strides.append(step)
        step *= n
    return (view.offset == 0 and tuple(view.shape) == tuple(leaf.tensor.shape)
            and tuple(view.stride) == tuple(reversed(strides)))


def _written_dtype(items: list[Item]) -> str | None:
    """The floating-point dtype holding most of the exported bytes ("bfloat16"), if any."""
    weight: dict[str, int] = {}
    for item in items:
        if DTYPES[item.dtype].is_floating_point:
            weight[item.dtype] = weight.get(item.dtype, 0) + item.nbytes
    if not weight:
        return None
    return str(DTYPES[max(weight, key=weight.__getitem__)]).removeprefix("torch.")


def _plan_items(ckpt: Checkpoint, rank: int, contents: str | None,
                dtype: torch.dtype | None) -> list[Item]:
    items = []
    for leaf in ckpt.leaves(rank):
        key = leaf.path
        if leaf.kind in BYTES_KINDS:  # an object's bytes, not a weight
            continue
        if contents is not None:
            if not key or key[0] != contents:
                continue
            key = key[1:]
        target = leaf.tensor.dtype
        if dtype is not None and leaf.dtype.is_floating_point:
            target = DTYPE_NAMES[dtype]
        items.append(Item(".".join(map(str, key)), target, leaf))
    if not items:
        raise CheckpointError(f"no tensors under {contents!r}", step=ckpt.step, rank=rank)
    names = [i.export_name for i in items]
    if len(set(names)) != len(names):
        clash = sorted({n for n in names if names.count(n) > 1})[:5]
        raise CheckpointError(f"key paths flatten to the same name: {clash}", step=ckpt.step)
    return items
