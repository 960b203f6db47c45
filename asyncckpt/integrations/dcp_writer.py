"""asyncckpt as PyTorch DCP's storage layer, saving side: `dcp.save` and `dcp.async_save`
through a node's writer.

DCP plans a save (which rank writes which box of every tensor, replicas written once)
and hands each rank its write items; this writer turns a rank's items into one ordinary
asyncckpt save of the step: every tensor a `Chunk` of a global tensor, every object the
bytes DCP serialised. So a step saved through DCP is verified, listed, retained,
exported and deduplicated like any other, and `asyncckpt.load` reads it at any world
size. Every rank's tree names every tensor of the checkpoint (the coordinator sends the
catalogue with the plans), so any one rank's part rebuilds all tensors; an object is in
the part of the rank that wrote it, which is the lowest rank holding it, as itself when
asyncckpt stores exactly its type (JSON-like values, bytes, tensors; a subclass such as
a namedtuple or an IntEnum would come back as its base type), else as the pickle DCP
made of it (a "pickled" node, which asyncckpt's own load never unpickles).

The commit is the writer's, as for any save: it happens once every rank's part is
durable, and `finish()` on the coordinator waits for it, so `dcp.save` returns when the
step is committed, or raises the writer's error on every rank.

`async_save` stages through the ring instead of DCP's default copy into fresh memory:
`stage()` runs DCP's planning and hands the items to the client, returning once they
are in the ring (no second copy of the state in private memory); the background save
DCP then runs only waits for the commit. The planning needs the collectives that
`dcp.save` needs, on the default process group, in `stage()` on the caller's thread.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from concurrent.futures import Future as ConcurrentFuture
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from asyncckpt.errors import (
    CheckpointError,
    StepAlreadyCommittedError,
    UnsupportedStateError,
    WriterRootMismatchError,
)
from asyncckpt.integrations.dcp_flat import flat_state
from asyncckpt.integrations.dcp_ids import (
    checkpoint_location,
    checkpoint_target,
    parse_checkpoint_id,
)
from asyncckpt.integrations.dcp_outcome import for_dcp, publish_outcome, relay_outcome, unstaged
from asyncckpt.integrations.dcp_plan import (
    CachingPlanner,
    Catalogue,
    Holds,
    layout,
    objects_to_lowest_holder,
)
from asyncckpt.integrations.dcp_timeline import adopt, generation, handed_over, start_for
from asyncckpt.ipc.options import SaveOptions, check_step
from asyncckpt.ipc.protocol import same_root
from asyncckpt.rank.client import Client, shared_client
from asyncckpt.rank.flatten import Boxes, KeyedChunk, Pickled, flatten, kept_exactly
from asyncckpt.rank.handle import SaveHandle, mark_told
from asyncckpt.rank.launch import WriterProcess
from asyncckpt.rank.node_writer import given_address, node_writer
from asyncckpt.rank.pending import Flat
from asyncckpt.rank.ringsize import ring_for
from asyncckpt.storage.location import Location

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_started: dict[str, str] = {}  # root -> address of the node writer started for it here
_writers: list[WriterProcess] = []


class StorageWriter(dcp.StorageWriter):
    """`dcp.save(sd, storage_writer=StorageWriter(root, step))` commits `step` in the
    writer's root as an asyncckpt checkpoint; `dcp.async_save` stages through the ring.

    It is picklable (DCP's PROCESS async mode sends it to a helper process, which then
    waits for the commit of the step this process staged).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, step: int | None = None, *,
                 client: Client | None = None, address: str | None = None,
                 ring_size: int | None = None, keep_last: int | None = None,
                 keep_every: int = 0, staging_future: bool = False, overwrite: bool = False,
                 replace: bool | None = None, tier: str = "durable") -> None:
        """Args:
            root: the checkpoint root; it must be the root of the writer this rank
                reaches (checked on the first save). None: the writer's root.
            step: the step to commit; a `checkpoint_id` of the form `ROOT/step-N`
                given to `dcp.save` overrides both, one naming a root replaces `root`
                (`file://` URLs of this machine are paths: dcp_ids.py). Without a step,
                `async_save` copies the state (`stage`) until the id names one.
            client: this rank's connection; default one client per process and writer
                address (ASYNCCKPT_ADDRESS, or `address`), made on the first save with a
                ring sized from that save (`ring_size` sets it), closed at exit.
            keep_last, keep_every: retention sent with each save (Client.save).
            staging_future: `stage()` returns once the save is planned and handed to the
                client, with a future that completes once the state is in the ring
                (DCP's zero-overhead mode: `async_save` then returns an
                AsyncSaveResponse; do not change the tensors before its
                staging_completion).
            overwrite: a committed step of this number (a `checkpoint_id` saved before)
                is replaced by this save, atomically: the old step stays whole until the
                new one is committed (as DCP's FileSystemWriter overwrites). Without it a
                re-save fails with StepAlreadyCommittedError. `replace` is the same
                option under asyncckpt's name (`Client.save(replace=)`).
            tier: "memory": to the node writers' memory tier, not the root; each rank's
                write ends once its node holds it (integrations/dcp_memory.py).
        Raises:
            ValueError: a step, keep_last or keep_every that is not an int in
                0..MAX_STEP; overwrite and replace both given and different, or not
                bools; a tier not "durable" or "memory".
        """
        if step is not None:
            check_step(step)
        if replace is not None and replace != overwrite and overwrite:
            raise ValueError(f"overwrite and replace disagree ({overwrite!r}, {replace!r}): "
                             "they are one option, give one of them")
        self.root = None if root is None else checkpoint_location(root)
        self.step = step
        self.address = address
        self.ring_size = ring_size
        # checked here, not mid-save
        self.options = SaveOptions(keep_last, keep_every,
                                   replace=overwrite if replace is None else replace, tier=tier)
        self.staging_future = staging_future
        self._client = self._given = client
        self._target: tuple[Location | None, int | None] = (self.root, step)
        self._staging = False
        self._handle: SaveHandle | None = None      # this save's, or the staged one's
        self._staged: SaveHandle | None = None      # staged by stage(), awaiting its commit
        self._outcome: str | None = None            # PROCESS mode: where the outcome appears
        self._unstaged = False                      # a step-less memory save copied by stage()
        self._loads_staged: dict[str, Any] | None = None  # the recorded loads then

    # -- pickling (PROCESS mode) ---------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """The copy waits for the staged step's outcome (published to a file), and this
        object forgets it: the copy runs the background save, not this one. A save
        `stage()` copied without its step is planned by the copy, which brings this
        process's recorded loads as they were when `stage()` copied the state (a load
        made after it is not this save's: DCP pickles later, on its executor's thread;
        dcp_timeline.py); a memory one raises SaveFailedError (`unstaged`)."""
        if self._unstaged:
            self._unstaged = False
            raise unstaged()
        state = dict(self.__dict__)
        outcome = (None if self._staged is None
                   else publish_outcome(self._staged, self._target[0]))
        loads = self._loads_staged if self._loads_staged is not None else handed_over()
        state.update(_client=None, _given=None, _handle=None, _staged=None, _outcome=outcome,
                     _loads_staged=None, _loads=(os.getpid(), loads))
        self._staged, self._loads_staged = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """In another process (DCP's helper), adopt the loads the copy carries; in the
        one that pickled it (a user's copy), keep its own, which may be newer."""
        pid, loads = state.pop("_loads", (os.getpid(), None))
        self.__dict__.update(state)
        if loads is not None and pid != os.getpid():
            adopt(loads)

    # -- DCP's StorageWriter -------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        target = ((self.root, self.step) if checkpoint_id is None
                  else checkpoint_target(checkpoint_id, self.step))
        staged = self._staged or (self._outcome is not None)
        if staged and checkpoint_id is not None and target[1] != self._target[1]:
            raise ValueError(f"checkpoint_id {os.fspath(checkpoint_id)!r} names step {target[1]}, "
                             f"but step {self._target[1]} was staged")
        if not staged:
            self._target = target

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Find the writer: every rank hands its part to its node's writer alike, and
        only the coordinator is called to `finish()`, where it waits for the commit.

        Given no writer (no client, no address, no ASYNCCKPT_ADDRESS), the first save
        to a root starts the node's writer on it (rank/node_writer.py: DCP calls this
        on every rank, on the thread that plans, so every rank takes part); later saves
        to that root in this process reuse it. The writer is a child of the rank that
        started it and exits with it, after committing every save it holds whole.

        Raises:
            CheckpointError: no writer and no root to start one on.
            WriterUnavailableError: the node's writer could not start (on every rank).
        """
        if self._client is None and given_address(self.address) is None:
            self.address = _started_writer(self._target[0])

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        held = tuple(i.index.fqn for i in plan.items if i.type == WriteItemType.BYTE_IO)
        return dataclasses.replace(plan, storage_data=Holds(held))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for plan in plans:
            for item in plan.items:
                if item.tensor_data is not None:
                    data = item.tensor_data
                    tensors.setdefault(item.index.fqn, (data.properties.dtype, tuple(data.size)))
        paths: dict[str, tuple[str | int, ...]] = {}
        for plan in plans:  # DCP's planner_data: each rank's key paths (none: a custom planner)
            if isinstance(plan.planner_data, dict):
                for fqn, path in plan.planner_data.items():
                    paths.setdefault(fqn, tuple(path))
        # the coordinator draws the timeline start after a recorded load (dcp_timeline.py)
        catalogue = Catalogue(tensors, start_for(self._target[0]), paths)
        return [dataclasses.replace(p, items=items, storage_data=catalogue)
                for p, items in zip(plans, objects_to_lowest_holder(plans))]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if not self._staging and (self._staged is not None or self._outcome is not None):
            return self._await_staged(plan)
        self._unstaged = False
        root, step = self._target
        if step is None:
            raise ValueError("StorageWriter has no step: give StorageWriter(root, step) or a "
                             "checkpoint_id ROOT/step-N")
        state, results = self._rank_state(plan, planner)
        client = self._connect(root, sum(r.size_in_bytes for r in results))
        timeline = (plan.storage_data.timeline if isinstance(plan.storage_data, Catalogue)
                    else None)
        handle = client.save(step, state, keep_last=self.options.keep_last,
                             keep_every=self.options.keep_every, replace=self.options.replace,
                             timeline=timeline, tier=self.options.tier)
        # DCP tells the outcome itself (finish() on the coordinator raises on every rank,
        # the async future): the client's next save must not raise it a second time
        mark_told(handle)
        self._handle = handle
        future: Future[list[WriteResult]] = Future()
        if self._staging and self.staging_future:
            future.set_result(results)  # handed over; stage()'s future reports the copy
        elif self._staging:
            # stage() blocks until the copy is done anyway: wait here, on the caller's
            # thread, rather than start a watcher thread that wakes this one
            error = _staged_error(handle, root)
            if error is None:
                future.set_result(results)
            else:
                future.set_exception(error)  # type: ignore[arg-type]  # torch's stub: the result type
        else:  # a memory save: held by this rank's node once done
            _when(handle, staged=self.options.tier == "durable", root=root,
                  then=lambda error: future.set_exception(error) if error
                  else future.set_result(results))
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._staging or self._handle is None:
            return  # stage(): the commit is awaited by the background save
        try:
            self._handle.wait()
        except StepAlreadyCommittedError as e:
            raise for_dcp(e, self._target[0]) from None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            parse_checkpoint_id(checkpoint_id)
        except (ValueError, CheckpointError):
            return False
        return True

    # -- DCP's AsyncStager (a runtime-checked protocol: these names make it one) ------------

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> Any:
        """Plan the save and put this rank's items in the ring; return `{}` (or, with
        `staging_future`, a future of it) for DCP's background save, which only
        waits for the commit.

        Without a step (`async_save` given only a `checkpoint_id`, which DCP passes
        after staging), the ring cannot take the items yet (a save in the ring is a
        save of a step): the state is copied into private CPU memory instead, as DCP's
        own stager does, and DCP's background save then plans and saves the copy
        once the id names the step. That costs a copy of the state in memory; give
        the step (`StorageWriter(root, step)`) to stage through the ring.

        Raises:
            RuntimeError: a save staged by this writer has not been picked up yet.
            CheckpointError: planning or handing the items to the client failed.
        """
        if self.step is None:
            copied = _private_copy(state_dict)
            self._unstaged = self.options.tier == "memory"
            self._loads_staged = handed_over()  # the timeline this save was staged in
            if not self.staging_future:
                return copied
            done: ConcurrentFuture[dict] = ConcurrentFuture()
            done.set_result(copied)
            return done
        if self._staged is not None:
            raise RuntimeError(f"this StorageWriter still holds staged step {self._staged.step}, "
                               "whose background save has not started: use one StorageWriter "
                               "per async_save")
        self._staged, self._outcome, self._staging = None, None, True
        try:
            # planned once per structure (dcp_plan.py): the plan is what stage() blocks
            # on besides the copy
            root = self._target[0]
            dcp.save(state_dict, storage_writer=self,
                     planner=CachingPlanner(str(root), generation(root)))
        finally:
            self._staging = False
        handle = self._handle
        assert handle is not None
        self._staged = handle
        if not self.staging_future:
            return {}
        staged: ConcurrentFuture[dict] = ConcurrentFuture()
        _when(handle, staged=True, root=root, then=lambda error: staged.set_exception(error)
              if error else staged.set_result({}))
        return staged

    @property
    def stats(self) -> Any:
        """This rank's last save's `handle.stats` (its `tier`: "durable", "memory" or
        "skipped": its node's writer held nothing of it), None before a save."""
        return None if self._handle is None else self._handle.stats

    def synchronize_staging(self) -> None:
        if self._staged is not None:
            self._staged.wait_staged()

    def close(self) -> None:
        """Wait for this writer's saves and close the process's client it used (not a
        `client=` given to it, which stays the caller's); a later save makes a new one.
        Without a call, the client is closed at exit."""
        client, self._client = self._client, self._given
        if client is not None and client is not self._given:
            client.close()

    # -- internals -------------------------------------------------------------------------

    def _rank_state(self, plan: SavePlan, planner: SavePlanner
                    ) -> tuple[dict[str, Any] | Flat, list[WriteResult]]:
        """This rank's part of the step (a flat dict by DCP key, or that dict already
        flattened: dcp_flat.py) and DCP's results for it."""
        kept = layout(plan)
        state: dict[str, Any] = dict(kept.empty)
        results = []
        boxes: dict[str, list[KeyedChunk]] = {}
        tensors = []
        # our own planner resolves a plain tensor's whole box to the tensor: look it up
        flat = planner.state_dict if type(planner) is CachingPlanner else {}
        for item, size, dtype, offsets, result in kept.tensors:
            data = flat.get(item.index.fqn)
            if type(data) not in _PLAIN or any(offsets):
                data = planner.resolve_data(item)
            assert isinstance(data, torch.Tensor)
            tensors.append(data)
            if data.dtype != dtype:
                raise UnsupportedStateError(f"{item.index.fqn}: planned as {dtype}, but it is "
                                            f"{data.dtype} now")
            boxes.setdefault(item.index.fqn, []).append(KeyedChunk(
                size, dtype, offsets, data.detach(), kept.paths.get(item.index.fqn, ())))
            results.append(result)
        for fqn, chunks in boxes.items():  # several: DCP planned several chunks here
            state[fqn] = chunks[0] if len(chunks) == 1 else Boxes(tuple(chunks))
        objects = {}
        for item in kept.objects:
            value = _object(planner, item)
            state[item.index.fqn] = objects[item.index.fqn] = value
            results.append(WriteResult(item.index, len(value) if isinstance(value, bytes)
                                       else 0, None))
        return flat_state(kept, state, tensors, objects), results

    def _connect(self, root: Location | None, nbytes: int) -> Client:
        if self._client is None:
            self._client = _client_for(self.address, ring_for(nbytes, self.ring_size), root)
        if root is not None and not same_root(str(root.resolve()), str(self._client.root)):
            raise WriterRootMismatchError(
                f"this rank's writer serves {self._client.root}, not {root.resolve()}: start "
                "the writer on the root the checkpoint_id names (or give no client and no "
                "address: the StorageWriter then starts one)", step=self._target[1],
                rank=self._client.rank)
        return self._client

    def _await_staged(self, plan: SavePlan) -> Future[list[WriteResult]]:
        """The background save after `stage()`: its result is the staged step's commit."""
        future: Future[list[WriteResult]] = Future()
        if self._staged is not None:
            _when(self._staged, staged=False, root=self._target[0],
                  then=lambda error: future.set_exception(error) if error
                  else future.set_result([]))
        else:
            assert self._outcome is not None
            outcome = self._outcome
            threading.Thread(target=relay_outcome, args=(outcome, future), daemon=True,
                             name="asyncckpt-dcp-outcome").start()
        self._staged, self._outcome = None, None
        return future


def _private_copy(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` copied into fresh CPU memory by DCP's own stager (tensors copied,
    other values deep-copied), for a save whose step is not known yet."""
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        staged = stager.stage(state_dict)
    finally:
        stager.close()
    assert isinstance(staged, dict)  # synchronous staging (use_async_staging False)
    return staged


def _object(planner: SavePlanner, item: Any) -> Any:
    """A bytes item's value as asyncckpt saves it: the object itself when a load gives it
    back as it is (the planner can look it up; every part exactly a dict, list, tuple,
    str, int, float, bool, None, bytes or tensor: `kept_exactly`), else the bytes DCP
    serialised, kept as `Pickled` (a namedtuple, an IntEnum, a bytearray, a torch.Size
    stay themselves through DCP's reader, as with DCP's own storage)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is not None:
        obj = lookup(item.index)
        if kept_exactly(obj):
            try:
                flatten(obj)
            except UnsupportedStateError:
                pass
            else:
                return obj
    data = planner.resolve_data(item)
    return Pickled(data.getvalue() if isinstance(data, io.BytesIO) else bytes(data))


def _when(handle: SaveHandle, *, staged: bool, then: Any, root: Location | None = None) -> None:
    """Call `then(error or None)` once `handle` is staged (or, with `staged` False,
    done), on a thread of its own; the error as `for_dcp` words it for `root`."""
    def watch() -> None:
        if staged:
            then(_staged_error(handle, root))
            return
        try:
            handle.wait()
        except BaseException as e:  # noqa: BLE001 - the save's error is the future's
            then(for_dcp(e, root))
            return
        then(None)
    threading.Thread(target=watch, daemon=True, name=f"asyncckpt-dcp-{handle.step}").start()


def _staged_error(handle: SaveHandle, root: Location | None) -> BaseException | None:
    """Once `handle` is staged: None, or the save's error as `for_dcp` words it for
    `root` when staging ended it (failed before or while copying). A failure that
    came after the copy (the writer's disk filling up), even one already known when
    this thread wakes, is not staging's: the background save's future raises it."""
    handle.wait_staged()
    if _copied(handle) or not handle.done() or handle.exception() is None:
        return None
    try:
        handle.wait()
    except BaseException as e:  # noqa: BLE001 - the save's error is the caller's
        return for_dcp(e, root)
    return None


def _copied(handle: SaveHandle) -> bool:
    """Whether every byte of the save reached the ring: the client's stager sets
    `staging_seconds` then, before it sends the save's end, and never for a save that
    failed before or while copying (rank/client.py)."""
    return handle.stats.staging_seconds > 0


def _started_writer(root: Location | None) -> str:
    """The address of the node's writer this process's ranks started on `root`,
    starting it on the first call (every rank calls it together)."""
    if root is None:
        raise CheckpointError("no writer to save to and no root to start one on: give "
                              "StorageWriter a root (or a checkpoint_id ROOT/step-N), an "
                              "address, or set ASYNCCKPT_ADDRESS")
    key = str(root)
    if key not in _started:
        address, writer = node_writer(root)
        _started[key] = address
        if writer is not None:
            _writers.append(writer)  # referenced for the process's life: it exits with it
    return _started[key]


def _client_for(address: str | None, ring_size: int | None, root: Location | None) -> Client:
    """The process's client for `address` (default ASYNCCKPT_ADDRESS), shared with
    `asyncckpt.save` and made on first use; the writer there must serve `root` (None:
    any)."""
    return shared_client(address, root=root,
                         **({} if ring_size is None else {"ring_size": ring_size}))
