"""The methods compared: what a user would otherwise pick, and asyncckpt.

Each method is driven the way its documentation says to use it, on its defaults, and
reports two moments of every save: when the training loop may continue (it may modify
the tensors again) and when the checkpoint is durable (fsynced and, where the method
has the notion, committed). Synchronous methods reach both at once. For asyncckpt the
first moment is `save()` plus `handle.wait_staged()`, because the loop may not run the
next optimizer step before; that is the counterpart of the return of DCP `async_save`,
whose default stager copies the whole state before returning.

The codec peer is ZipNN (byte grouping + Huffman, on the package registry), measured
in `codec_contest` against every stored codec of asyncckpt's registry (asyncckpt.codec
REGISTRY / make_codec, the interface the writer uses, so a codec added there is measured
without an edit here) on the same tensors, one thread each: stored/raw and encode and
decode GB/s per thread. Our codecs get the writer's frames (4 MiB slots, probed once per
tensor, `FrameHints` of the tensor's element width) but not its packing across tensors:
frames are cut per tensor, as ZipNN compresses per tensor. ZipNN reorders its input
tensor in place, so it compresses clones made before the clock starts; it decodes into
a tensor it allocates, ours into a preallocated buffer (as a load into a target does).

Only torch.save and safetensors need an explicit fsync (they do not sync); DCP's
FileSystemWriter fsyncs its files itself (sync_files=True by default) and asyncckpt
commits with fsyncs. safetensors holds tensors only, so it saves the state's tensors
under dotted names and drops the few non-tensor optimizer fields.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncckpt.storage.durable import fsync_path

from . import measure, workloads

MiB = 1 << 20


class Pending:
    """A save after the caller was released: poll `done()`, block in `wait()`."""

    def __init__(self, done: Callable[[], bool], wait: Callable[[], Any]) -> None:
        self.done = done
        self.wait = wait

    @classmethod
    def finished(cls) -> Pending:
        return cls(lambda: True, lambda: None)

    @classmethod
    def of_future(cls, future: Future) -> Pending:
        return cls(future.done, future.result)


class Method:
    """One way of saving; subclasses fill in setup/start/load."""

    name = ""
    label = ""
    synchronous = False
    loader = ""  # what load() uses, for the report ("" = no load measured)
    modules: tuple[str, ...] = ()  # imported before the memory baseline

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.root = Path()
        self.facts: dict[str, Any] = {}

    def setup(self, root: Path, state: dict[str, Any]) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def start(self, step: int, state: dict[str, Any]) -> Pending:
        """Begin saving `state` as `step`; return once the caller may modify it again."""
        raise NotImplementedError

    def output(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def load(self, step: int, like: dict[str, Any]) -> Any:
        raise NotImplementedError

    def rep_stats(self) -> dict[str, Any]:
        """Method-specific figures of the last save (asyncckpt's pipeline stages)."""
        return {}

    def discard(self, step: int) -> None:
        path = self.output(step)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        pass


class TorchSave(Method):
    name, label, synchronous, loader = "torch.save", "torch.save + fsync", True, "torch.load"

    def output(self, step: int) -> Path:
        return self.root / f"step-{step}.pt"

    def start(self, step: int, state: dict[str, Any]) -> Pending:
        path = self.output(step)
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.root)
        return Pending.finished()

    def load(self, step: int, like: dict[str, Any]) -> Any:
        return torch.load(self.output(step), weights_only=True)


class SafetensorsSave(Method):
    name, label, synchronous = "safetensors", "safetensors save_file + fsync", True
    modules = ("safetensors.torch",)
    loader = "safetensors.torch.load_file"

    def output(self, step: int) -> Path:
        return self.root / f"step-{step}.safetensors"

    def start(self, step: int, state: dict[str, Any]) -> Pending:
        from safetensors.torch import save_file
        path = self.output(step)
        save_file(workloads.flat_tensors(state), str(path))
        fsync_path(path)
        fsync_path(self.root)
        return Pending.finished()

    def load(self, step: int, like: dict[str, Any]) -> Any:
        from safetensors.torch import load_file
        loaded = load_file(str(self.output(step)))
        # load_file maps the file lazily: fault every page in so the bytes are in memory
        measure.touch_pages(list(loaded.values()))
        return loaded


class _Dcp(Method):
    loader = "dcp.load"
    modules = ("torch.distributed.checkpoint",)

    def setup(self, root: Path, state: dict[str, Any]) -> None:
        super().setup(root, state)
        init_gloo()

    def load(self, step: int, like: dict[str, Any]) -> Any:
        import torch.distributed.checkpoint as dcp
        target = workloads.empty_like_state(like)
        dcp.load(target, checkpoint_id=str(self.output(step)))
        return target


class DcpSave(_Dcp):
    name, label, synchronous = "dcp.save", "torch.distributed.checkpoint.save", True

    def start(self, step: int, state: dict[str, Any]) -> Pending:
        import torch.distributed.checkpoint as dcp
        dcp.save(state, checkpoint_id=str(self.output(step)))
        return Pending.finished()


class DcpAsyncThread(_Dcp):
    name, label = "dcp.async-thread", "DCP async_save, thread, default stager"
    loader = ""

    def start(self, step: int, state: dict[str, Any]) -> Pending:
        import torch.distributed.checkpoint as dcp
        future = dcp.async_save(state, checkpoint_id=str(self.output(step)))
        return Pending.of_future(future)  # type: ignore[arg-type]


class DcpAsyncStager(_Dcp):
    """async_save with a DefaultStager that stages in a background thread and is reused
    across saves (its staging buffers are allocated once); the caller still waits for
    `staging_completion` before it may touch the tensors."""

    name, label = "dcp.async-stager", "DCP async_save, thread, reused background stager"
    loader = ""

    def setup(self, root: Path, state: dict[str, Any]) -> None:
        super().setup(root, state)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        # pinned memory and non-blocking copies need an accelerator; there is none here
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False,
                                                   use_shared_memory=False,
                                                   use_async_staging=True,
                                                   use_non_blocking_copy=False))

    def start(self, step: int, state: dict[str, Any]) -> Pending:
        import torch.distributed.checkpoint as dcp
        response = dcp.async_save(state, checkpoint_id=str(self.output(step)),
                                  async_stager=self.stager)
        response.staging_completion.result()  # type: ignore[union-attr]
        return Pending.of_future(response.upload_completion)  # type: ignore[union-attr]

    def close(self) -> None:
        self.stager.close()


class DcpAsyncProcess(_Dcp):
    name, label = "dcp.async-process", "DCP async_save, process (1-rank gloo)"
    loader = ""

    def start(self, step: int, state: dict[str, Any]) -> Pending:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        future = dcp.async_save(state, checkpoint_id=str(self.output(step)),
                                async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        return Pending.of_future(future)  # type: ignore[arg-type]


class AsyncCkpt(Method):
    loader = "asyncckpt.load (xxh3-verified)"
    modules = ("asyncckpt.rank.client", "asyncckpt.read.loader")

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        self.codec = str(options["codec"])
        self.ring_bytes = int(options.get("ring_bytes") or 0)  # 0: the state's size
        self.name = f"asyncckpt-{self.codec}" + (f"-ring{self.ring_bytes // MiB}M"
                                                 if self.ring_bytes else "")
        ring = f"{self.ring_bytes // MiB} MiB ring" if self.ring_bytes else "ring = state"
        self.label = f"asyncckpt, codec {self.codec}, {ring}"
        # references the worker times in this process next to the saves and loads
        # ("memcpy", "write", "load"; see worker.py): raw carries the staging, durable and
        # load targets; the other codecs' loads are reported next to the same references
        self.refs: tuple[str, ...] = tuple(options.get("refs", ()))
        self._handle: Any = None

    def setup(self, root: Path, state: dict[str, Any]) -> None:
        super().setup(root, state)
        import asyncckpt
        slot = 4 * MiB
        ring = self.ring_bytes or -(-workloads.state_bytes(state) // slot) * slot
        # full saves, as the peers make (`make bench-incremental` measures incremental ones)
        self.writer = asyncckpt.start_writer(root, codec=self.codec, incremental=False,
                                             log_file=root.parent / f"{self.name}.writer.log")
        self.client = asyncckpt.connect(self.writer.address, rank=0, world_size=1,
                                        slot_size=slot, ring_size=ring)
        self.facts.update(ring_bytes=ring, slot_bytes=slot, writer_pid=self.writer.pid)

    def start(self, step: int, state: dict[str, Any]) -> Pending:
        handle = self.client.save(step, state)
        handle.wait_staged()
        self._handle = handle
        return Pending(handle.done, handle.wait)

    def output(self, step: int) -> Path:
        from asyncckpt.format.layout import step_dir_name
        return self.root / step_dir_name(step)

    def rep_stats(self) -> dict[str, Any]:
        return self._handle.stats.to_json() if self._handle is not None else {}

    def load(self, step: int, like: dict[str, Any]) -> Any:
        import asyncckpt
        return asyncckpt.load(self.root, step=step)

    def codec_report(self, step: int) -> dict[str, Any]:
        """Stored/raw per dtype and frames per codec of a committed step (asyncckpt inspect)."""
        from asyncckpt.read.summary import codec_summary
        from asyncckpt.storage.local import read_manifest
        return codec_summary(read_manifest(self.output(step)))

    def close(self) -> None:
        self.client.close()
        self.writer.stop()


class AsyncCkptDefaults(AsyncCkpt):
    """A plain `connect()` with no knob: the ring is whatever the client picks (sized
    from the first save's state), the codec the writer's default."""

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__({**options, "codec": "auto"})
        self.name, self.label = "asyncckpt-defaults", "asyncckpt, plain connect(), default knobs"

    def setup(self, root: Path, state: dict[str, Any]) -> None:
        Method.setup(self, root, state)
        import asyncckpt
        self.writer = asyncckpt.start_writer(root, incremental=False,
                                             log_file=root.parent / f"{self.name}.writer.log")
        self.client = asyncckpt.connect(self.writer.address, rank=0, world_size=1)
        self.facts.update(writer_pid=self.writer.pid)

    def start(self, step: int, state: dict[str, Any]) -> Pending:
        pending = super().start(step, state)
        self.facts["ring_bytes"] = self.client.knobs.ring_size  # chosen at the first save
        return pending


METHODS: dict[str, tuple[type[Method], dict[str, Any]]] = {
    "torch.save": (TorchSave, {}),
    "safetensors": (SafetensorsSave, {}),
    "dcp.save": (DcpSave, {}),
    "dcp.async-thread": (DcpAsyncThread, {}),
    "dcp.async-stager": (DcpAsyncStager, {}),
    "dcp.async-process": (DcpAsyncProcess, {}),
    "asyncckpt-raw": (AsyncCkpt, {"codec": "raw", "refs": ("memcpy", "write", "load")}),
    "asyncckpt-zstd": (AsyncCkpt, {"codec": "zstd", "refs": ("load",)}),
    "asyncckpt-zstd-ring64M": (AsyncCkpt, {"codec": "zstd", "ring_bytes": 64 * MiB}),
    "asyncckpt-bytegroup": (AsyncCkpt, {"codec": "bytegroup", "refs": ("load",)}),
    "asyncckpt-auto": (AsyncCkpt, {"codec": "auto"}),
    "asyncckpt-defaults": (AsyncCkptDefaults, {}),
}


# peers whose figures bound a target: timed as often as the targeted methods
TARGET_BOUNDS = ("dcp.async-stager",)


def make(name: str) -> Method:
    cls, options = METHODS[name]
    return cls(options)


def init_gloo() -> None:
    """A 1-rank gloo group on loopback, as DCP's async process mode requires."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)


# -- codec peers ---------------------------------------------------------------------------

FRAME_BYTES = 4 * MiB  # the writer's default slot: one frame per slot
ZIPNN = "zipnn"


def registry_codecs() -> list[str]:
    """Every stored codec of asyncckpt's registry except raw."""
    from asyncckpt.codec.registry import RAW, REGISTRY
    return [name for name in REGISTRY if name != RAW]


def plane_codecs() -> list[str]:
    """The registry's float-aware codecs (frames carry a plane layout): the ones held to
    ZipNN's ratio and to the per-thread speed targets."""
    from asyncckpt.codec.registry import REGISTRY
    return [name for name, spec in REGISTRY.items() if spec.plane_layout]


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def frame_hints(width: int, choice: Any) -> Any:
    """The `FrameHints` of a tensor-aligned frame (phase 0) from a codec's probe answer:
    a tuple of plane flags, or a named tuple whose fields are FrameHints fields (a probe
    that decides more than the planes, e.g. a sign rotation)."""
    from asyncckpt.codec.registry import FrameHints
    if hasattr(choice, "_asdict"):
        return FrameHints(width=width, phase=0, **choice._asdict())
    return FrameHints(width, 0, tuple(choice))


class _Ours:
    """A registry codec driven as the writer drives it, frame by frame."""

    def __init__(self, name: str) -> None:
        from asyncckpt.codec.registry import make_codec
        self.name = name
        self._make = make_codec
        self.codec = make_codec(name)
        self._decoders: dict[str, Any] = {}

    def encode(self, tensors: Sequence[torch.Tensor]) -> tuple[float, int, Any]:
        frames = []
        start = time.perf_counter()
        for t in tensors:
            raw = memoryview(_raw(t))
            width = t.element_size()
            hints = None
            for offset in range(0, len(raw), FRAME_BYTES):
                frame = raw[offset:offset + FRAME_BYTES]
                if hints is None:
                    hints = frame_hints(width, self.codec.probe(frame, width, 0))
                frames.append(self.codec.encode(frame, hints))
        seconds = time.perf_counter() - start
        stored = sum(f.length for f in frames)
        # the reader gets each frame's stored bytes contiguous, from the file (untimed)
        return seconds, stored, [(f.codec, bytes(f), f.layout) for f in frames]

    def decode(self, blob: Any, tensors: Sequence[torch.Tensor], out: np.ndarray,
               check: bool) -> tuple[float, bool | None]:
        view = memoryview(out)
        start = time.perf_counter()
        pos = 0
        frames = iter(blob)
        for t in tensors:
            end = pos + t.numel() * t.element_size()
            while pos < end:
                codec, stored, layout = next(frames)
                n = min(FRAME_BYTES, end - pos)
                decoder = self._decoders.get(codec) or self._decoders.setdefault(
                    codec, self._make(codec))
                decoder.decode_into(stored, view[pos:pos + n], layout)
                pos += n
        seconds = time.perf_counter() - start
        if not check:
            return seconds, None
        return seconds, bool(np.array_equal(out[:pos], np.concatenate([_raw(t) for t in tensors])))


class _ZipNN:
    """ZipNN 0.5.x on torch tensors, one thread."""

    name = ZIPNN

    def __init__(self) -> None:
        from zipnn import ZipNN
        self.zpn = ZipNN(input_format="torch", threads=1)

    def encode(self, tensors: Sequence[torch.Tensor]) -> tuple[float, int, Any]:
        clones = [t.clone() for t in tensors]  # it reorders the bytes of its input in place
        start = time.perf_counter()
        blobs = [self.zpn.compress(c) for c in clones]
        seconds = time.perf_counter() - start
        return seconds, sum(len(b) for b in blobs), blobs

    def decode(self, blob: Any, tensors: Sequence[torch.Tensor], out: np.ndarray,
               check: bool) -> tuple[float, bool | None]:
        start = time.perf_counter()
        back = [self.zpn.decompress(b) for b in blob]
        seconds = time.perf_counter() - start
        if not check:
            return seconds, None
        return seconds, all(b.dtype == t.dtype and b.shape == t.shape
                            and np.array_equal(_raw(b), _raw(t)) for b, t in zip(back, tensors))


def codec_contest(cases: dict[str, list[torch.Tensor]], reps: int) -> dict[str, Any]:
    """Stored/raw and encode/decode GB/s per thread of ZipNN and every registry codec on
    each case's tensors, one thread, interleaved per repetition (after one warm-up).

    Args:
        cases: case name -> the tensors compressed together (e.g. "bf16 weights").
        reps: timed repetitions; the first one also checks every decode bit-exact.
    Returns:
        {"threads": 1, "frame_bytes", "zipnn": version or an error, "cases": {case:
        {"bytes", "tensors", "codecs": {name: {"ratio", "encode": spread of GB/s,
        "decode": spread of GB/s, "exact"}}}}}
    """
    import statistics
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"threads": 1, "frame_bytes": FRAME_BYTES, "cases": {}}
    try:
        import zipnn
        out["zipnn"] = getattr(zipnn, "__version__", None) or _version("zipnn")
    except ImportError as e:
        out["zipnn"] = f"not installed ({e}); pip install zipnn"
    try:
        for case, tensors in cases.items():
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            contenders: list[Any] = [_Ours(name) for name in registry_codecs()]
            if not out["zipnn"].startswith("not installed"):
                contenders.append(_ZipNN())
            dst = np.zeros(nbytes, dtype=np.uint8)
            times: dict[str, dict[str, list[float]]] = {c.name: {"encode": [], "decode": []}
                                                        for c in contenders}
            entry: dict[str, Any] = {"bytes": nbytes, "tensors": len(tensors), "codecs": {}}
            for rep in range(reps + 1):
                shift = rep % len(contenders)
                for c in contenders[shift:] + contenders[:shift]:
                    enc, stored, blob = c.encode(tensors)
                    dec, exact = c.decode(blob, tensors, dst, check=rep == 1)
                    if rep:
                        times[c.name]["encode"].append(nbytes / enc / 1e9)
                        times[c.name]["decode"].append(nbytes / dec / 1e9)
                    row = entry["codecs"].setdefault(c.name, {})
                    row["ratio"] = stored / nbytes
                    if exact is not None:
                        row["exact"] = exact
            for name, t in times.items():
                for key, values in t.items():
                    if values:
                        entry["codecs"][name][key] = {"median": statistics.median(values),
                                                      "min": min(values), "max": max(values)}
            out["cases"][case] = entry
    finally:
        torch.set_num_threads(threads)
    return out


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"
