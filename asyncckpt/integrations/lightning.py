"""PyTorch Lightning: a `CheckpointIO` that saves through asyncckpt.

Lightning's default `TorchCheckpointIO` `torch.save`s the whole checkpoint dict on rank 0
while the loop waits (pickled, no checksum, not fsynced: a kill mid-write leaves a torn
`.ckpt` that `ckpt_path="last"` then picks), and its `AsyncCheckpointIO` clones every
tensor on the loop's thread (+1x the state in host memory) before a thread does the same.
This plugin keeps Lightning's calls and files; underneath each save is one asyncckpt step
(checksummed, compressed, committed atomically) staged in the background:

    trainer = Trainer(..., plugins=[AsyncckptCheckpointIO()])

Lightning calls `save_checkpoint` and `remove_checkpoint` on global rank 0 only (under
DDP the state is replicated), so this process saves as a world of one (rank 0 of 1) to a
writer it starts itself, and never waits for ranks that will not come. `load_checkpoint`
is called on every rank; each reads the step alone (no collective either).

Files: for a checkpoint `DIR/NAME.ckpt` Lightning asks for, the step goes to the root
`DIR/asyncckpt/` (the root of the first save, for every later one) and `DIR/NAME.ckpt`
becomes a small JSON marker naming the step, pending before `save_checkpoint` returns
and final once the step is committed (lightning_marker.py: what a marker of a save cut
short loads, and the step numbers reserved beside the root). So `ckpt_path="last"` (the
newest `last*.ckpt` by mtime, or `save_last="link"`'s link), `"best"` and explicit paths
work as Lightning knows them and never load a torn step. Step numbers count saves
(1, 2, ... above anything already in the root), not Lightning's global step: `save_last`
saves the same global step a second time with other callback state.

Retention is Lightning's alone (`ModelCheckpoint`'s top-k and `save_last`): the writer
keeps every step, and `remove_checkpoint` of a marker retires its step (a save still in
flight is retired once committed instead of being named). A path that is not a marker
(a `torch.save`d `.ckpt` of an earlier run) is loaded and removed as Lightning's own IO
does, so a run switches to this plugin mid-way.

Timelines: `load_checkpoint` of step N makes the `TimelineStart` that every later save
to that root carries, so a run resumed from an older checkpoint abandons the root's newer
steps at its first commit: they are never the root's newest again. A run started from
another run's checkpoint (another directory, another root) reads there and saves into
its own root, with no timeline: the other run is left as it was.

Asynchrony and its hazard: `save_checkpoint` returns once the state is flattened; the
tensors are copied into the ring in the background. A global optimizer step pre-hook (the
fence) holds every `optimizer.step()` until that copy is done, so weights and optimizer
state are never torn. A tensor changed in place before its copy finished otherwise (a
BatchNorm buffer in the next forward) fails that save loudly (its version counter), never
silently: the next `save_checkpoint` or the end of `fit` (`teardown`) raises it.

RNG: with `rng=True` (default) the save also holds rank 0's CPU/numpy/Python (and CUDA)
RNG state, which `load_checkpoint` restores on every rank: under DDP with
`seed_everything` the ranks draw alike, so rank 0's state is every rank's. Lightning
itself restores none, so a resumed run with dropout would otherwise differ.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from asyncckpt.config import KEEP_ALL
from asyncckpt.errors import CheckpointNotFoundError
from asyncckpt.format.timeline import TimelineStart
from asyncckpt.integrations.lightning_followup import FollowUp, PendingSave, Retirement
from asyncckpt.integrations.lightning_marker import (
    MARKER_VERSION,
    WRITER_WAIT,
    Marker,
    claim,
    marker_of,
    pending_steps,
    read_marker,
    reserved,
    resolve_marker,
    steps_named,
    write_pending,
)
from asyncckpt.integrations.rng import rng_state, set_rng_state
from asyncckpt.rank.client import Client
from asyncckpt.rank.handle import SaveHandle
from asyncckpt.rank.launch import WriterProcess, start_writer
from asyncckpt.rank.ringsize import ring_for, state_bytes
from asyncckpt.read.loader import load
from asyncckpt.read.resolve import timeline_start
from asyncckpt.storage.location import storage_for
from asyncckpt.torchutil.map_location import mapped

__all__ = ["AsyncckptCheckpointIO", "MARKER_VERSION", "read_marker"]
log = logging.getLogger("asyncckpt.lightning")

ROOT_NAME = "asyncckpt"
MAX_IN_FLIGHT = 4  # saves handed over and not yet named before a save waits for the oldest
TRIM_BEFORE = 4  # a longer `before` keeps only steps in flight or committed (not retired)
# keys of the saved state: the model's weights apart (so `asyncckpt export` finds them)
MODEL, REST, ORDER, RNG = "model", "lightning", "keys", "rng"

_CheckpointIO: Any = importlib.import_module("lightning.fabric.plugins").CheckpointIO


class AsyncckptCheckpointIO(FollowUp, _CheckpointIO):
    """Lightning's `CheckpointIO`, saving through asyncckpt (see the module docstring).

    Args:
        root: the asyncckpt root (default: `asyncckpt/` beside the first checkpoint
            Lightning saves; never the root of a marker loaded from elsewhere).
        codec: the writer's codec ("auto", "raw", "zstd", "bytegroup"; default its knob).
        rng: save rank 0's RNG state and restore it on every rank at load.
    Attributes:
        blocked_seconds: per save, the seconds `save_checkpoint` held the loop.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, codec: str | None = None,
                 rng: bool = True) -> None:
        super().__init__()
        self.root = None if root is None else Path(root).resolve()
        self.codec, self.rng = codec, rng
        self.blocked_seconds: list[float] = []
        self._writer: WriterProcess | None = None
        self._client: Client | None = None
        self._next: int | None = None  # the next step number
        self._reserved: int | None = None  # numbers reserved up to (-1: cannot reserve)
        self._committed_any = False  # the root holds a committed step: markers may pend
        self._timeline: TimelineStart | None = None  # made by a load, carried by saves
        self._restored: tuple[Path, int] | None = None
        self._deferred: set[int] = set()  # the fork point, removed before the fork commits
        self._lock = threading.Lock()
        self._pending: list[PendingSave] = []
        self._failures: list[str] = []
        self._hook: Any = None
        self._retiring: list[Retirement] = []  # queued, not yet retired
        self._queue: queue.Queue[PendingSave | Retirement] = queue.Queue()  # in call order
        self._thread: threading.Thread | None = None

    # -- saving (global rank 0) --------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any = None) -> None:
        """Hand `checkpoint` to the writer as a new step and return; `path` becomes its
        pending marker at once, its final marker once it is committed.

        Raises:
            TypeError: `storage_options` given (as Lightning's own IO).
            SaveFailedError: an earlier save failed (raised once).
            UnsupportedStateError: a value that is neither a tensor nor JSON (a custom
                object in `hyper_parameters`), named by its key path; nothing is sent.
        """
        entered = time.perf_counter()
        if storage_options is not None:
            raise TypeError("AsyncckptCheckpointIO.save_checkpoint takes no storage_options; "
                            f"got {storage_options!r}")
        path, root, step = self._begin(path)
        self._track(path, root, step, self._hand_over(root, step, checkpoint))
        self.blocked_seconds.append(time.perf_counter() - entered)

    def _begin(self, path: str | os.PathLike[str]) -> tuple[Path, Path, int]:
        """A save to `path` begins (once fewer than MAX_IN_FLIGHT are in flight): its
        absolute path, its root and its step number.

        Raises:
            SaveFailedError: an earlier save failed (raised once).
        """
        self._raise_failures()
        while True:  # at most MAX_IN_FLIGHT saves in flight: the oldest is waited for
            with self._lock:
                oldest = self._pending[0] if len(self._pending) >= MAX_IN_FLIGHT else None
            if oldest is None:
                break
            oldest.done.wait()
        absolute = Path(path).absolute()
        root = self._root_for(absolute)
        step = self._step_number(root, absolute.parent)
        if self._reserved != -1:
            try:
                step, self._reserved = claim(root, step, self._reserved)
            except OSError as e:  # then markers are written at the commit only
                log.warning("asyncckpt: step numbers of %s cannot be reserved (%s): no "
                            "pending markers", root, e)
                self._reserved = -1
        self._next = step + 1
        return absolute, root, step

    def _hand_over(self, root: Path, step: int, checkpoint: dict[str, Any]) -> SaveHandle:
        """Send `checkpoint` as `step` of `root` to this process's writer."""
        state: dict[str, Any] = {
            MODEL: checkpoint.get("state_dict", {}),
            REST: {k: v for k, v in checkpoint.items() if k != "state_dict"},
            ORDER: list(checkpoint),
        }
        if self.rng:
            state[RNG] = rng_state()
        client = self._connect(root, state)
        resumed_here = self._restored is not None and self._restored[0] == root
        return client.save(step, state, keep_last=KEEP_ALL,  # a load of another root: none
                           timeline=self._timeline if resumed_here else None)

    def _track(self, path: Path, root: Path, step: int, handle: SaveHandle) -> None:
        """`path` becomes the pending marker of `step` of `root` now (once the root
        holds a committed step and the number is reserved), its final marker once
        `handle` is committed (follow-up). A pending marker that cannot be written is
        warned only: the final one is written at the commit all the same."""
        with self._lock:  # the follow-up writes markers under it too
            before = steps_named(path, root)  # and the saves to it still in flight here
            for earlier in (p for p in self._pending if p.path == path):
                before |= {earlier.step, *earlier.before}
            if len(before) > TRIM_BEFORE:  # what is neither in flight nor committed goes
                kept = set(storage_for(root).committed_steps()) | {p.step for p in self._pending}
                before &= kept
            pending = PendingSave(path, step, handle, before)
            self._pending.append(pending)
            try:
                if self._committed_any and self._reserved is not None \
                        and step <= self._reserved:
                    write_pending(path, root, step, before)
                    pending.written = True
            except OSError as e:
                log.warning("asyncckpt: the pending marker %s of step %d was not written "
                            "(it is written once the step is committed): %s", path, step, e)
        self._enqueue(pending)

    def _root_for(self, path: Path) -> Path:
        if self.root is None:
            self.root = (path.parent / ROOT_NAME).resolve()
        return self.root

    def _connect(self, root: Path, state: dict[str, Any]) -> Client:
        """This process's client (rank 0 of a world of one) to a writer it starts, and
        the fence; made at the first save."""
        if self._client is None:
            if self._writer is None:
                self._writer = start_writer(root, codec=self.codec, export=False)
            self._client = Client(self._writer.address, rank=0, world_size=1, root=root,
                                  ring_size=ring_for(state_bytes(state), None, log))
        if self._hook is None:
            self._hook = register_optimizer_step_pre_hook(self._fence)
        return self._client

    def _fence(self, *_: Any) -> None:
        """Before any optimizer's step: every save in flight has copied its tensors."""
        with self._lock:
            handles = [p.handle for p in self._pending if not p.handle.staged()]
        for handle in handles:
            handle.wait_staged()

    def _step_number(self, root: Path, folder: Path) -> int:
        """Above every step the root holds (committed, abandoned or retired), the steps
        pending markers in `folder` (the checkpoint's) name, the step restored and the
        last saved: a new step never replaces one, nor becomes what a marker of a save
        that never completed names."""
        if self._next is None:
            storage = storage_for(root)
            committed = storage.committed_steps()
            self._committed_any = self._committed_any or bool(committed)
            taken = (committed + storage.retired_steps() + pending_steps(folder, root)
                     + [reserved(root)])
            if self._restored is not None and self._restored[0] == root:
                taken.append(self._restored[1])
            self._next = max(taken, default=0) + 1
        return self._next

    # -- rotation (global rank 0) --------------------------------------------------------

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove Lightning's checkpoint `path`: a marker goes at once and its step is
        retired on the follow-up thread (after the saves made before it: a save still
        in flight once committed); a symbolic link (`save_last="link"`) goes alone, the
        checkpoint it points to and its step untouched; any other file is deleted."""
        path = Path(path).absolute()
        if path.is_symlink():  # `save_last="link"`'s: the file it points to is another
            path.unlink()      # checkpoint (one of the top k), whose step stays
            return
        with self._lock:  # the follow-up writes markers under it too
            for pending in self._pending:
                if pending.path == path:
                    pending.removed = True
            if not path.exists():
                return
            named = (steps_named(path, self.root)
                     if path.is_file() and self.root is not None else set())
            path.unlink() if path.is_file() else shutil.rmtree(path)  # another IO's folder
        if named:  # a pending marker's: also what it named before (of an ended process)
            retirement = Retirement(named)
            with self._lock:
                self._retiring.append(retirement)
            self._enqueue(retirement)

    # -- loading (every rank) ------------------------------------------------------------

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict Lightning saved at `path`, every byte verified. A marker's
        step also begins the timeline later saves carry. A pending marker whose save
        never completed loads the newest committed step before it (warned).

        Args:
            map_location: where the tensors go, as `torch.load` takes it, each tensor's
                saved location being "cpu" (the step records no device): None or a
                function returning its storage argument: the CPU; a device or its
                name: there; a dict: its "cpu" entry, if any; a function of (storage,
                "cpu"): the device of the storage it returns (None: the CPU).

        Raises:
            FileNotFoundError: no file at `path`.
            CheckpointNotFoundError: the marker's step is not committed in its root (a
                pending marker's: nor any step before it).
            CorruptCheckpointError: the step fails verification.
        """
        marker = marker_of(path)
        wait = WRITER_WAIT
        if marker is not None and marker.pending:
            wait = self._own_wait(marker)
            marker = marker_of(path)  # final now, if it was this process's save
        if marker is None:
            torch_io = importlib.import_module("lightning.fabric.plugins").TorchCheckpointIO
            loaded: dict[str, Any] = torch_io().load_checkpoint(path, map_location=map_location,
                                                               weights_only=weights_only)
            return loaded
        root, step = marker.root, resolve_marker(path, marker, wait)
        start = timeline_start(root, step)  # the root's current gen before the read
        try:
            state = load(root, step=step, rank=0)
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(f"{path} names step {step} of {root}, which is not "
                                          f"committed there: {e.cause}", step=step,
                                          file=str(path)) from e
        if self.rng and state.get(RNG) is not None:
            set_rng_state(state[RNG])
        self._loaded(root, step, start)
        rest = state[REST]
        loaded = {k: state[MODEL] if k == "state_dict" else rest[k] for k in state[ORDER]}
        return loaded if map_location is None else mapped(loaded, map_location)

    def _own_wait(self, marker: Marker) -> float:
        """Before a load of pending `marker`: this process's save of its step, if in
        flight, is waited for. Returns how long the load may wait for a writer on the
        root: none while this process's writer runs (it holds the root: no other
        writer commits there), else WRITER_WAIT."""
        with self._lock:
            ours = [p for p in self._pending if p.step == marker.step and marker.root == self.root]
        for pending in ours:
            pending.done.wait()
        return 0.0 if self._writer is not None else WRITER_WAIT

    def _loaded(self, root: Path, step: int, start: TimelineStart | None) -> None:
        """Step `step` of `root` was restored: later saves to `root` carry `start` (a
        new timeline) and are numbered above it; its removal waits for their commit.
        The saves' root stays theirs (beside the files Lightning saves): a run started
        from another run's checkpoint reads there and saves here, never into the
        other run's root."""
        self._timeline, self._restored, self._next = start, (root, step), None

    # -- the end of fit (every rank) -------------------------------------------------------

    def wait_until_finished(self) -> None:
        """Block until every save in flight is committed and named (or retired), and
        every removed marker's step retired.

        Raises:
            SaveFailedError: a save failed and has not been raised yet.
        """
        with self._lock:
            pending: list[PendingSave | Retirement] = [*self._pending, *self._retiring]
        for p in pending:
            p.done.wait()
        self._raise_failures()

    def teardown(self) -> None:
        """Wait for the saves in flight, remove the fence, close the client and stop the
        writer (Lightning calls it at the end of fit; a later save starts them again).

        Raises:
            SaveFailedError: a save failed and has not been raised yet.
        """
        try:
            self.wait_until_finished()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if self._client is not None:
                client, self._client = self._client, None
                client.close()
            if self._writer is not None:
                writer, self._writer = self._writer, None
                writer.stop()
