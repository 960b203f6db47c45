"""torchtitan's CheckpointManager saving and loading through asyncckpt (torchtitan 0.3).

    from asyncckpt.integrations.torchtitan import CheckpointManager   # not torchtitan's

    writer = asyncckpt.start_writer(config.folder)        # local rank 0 of each node
    os.environ["ASYNCCKPT_ADDRESS"] = writer.address       # or the launcher exports it
    checkpointer = CheckpointManager(config, dataloader=..., model_parts=..., ...)

torchtitan hard-codes DCP's storage (`dcp_save` passes no storage writer, `dcp_load` no
reader) and its own on-disk conventions, so the subclass replaces exactly those hooks.
It makes torchtitan's calls (`dcp.save`, `dcp.async_save`, `dcp.load`, each with
torchtitan's `checkpoint_id`), with asyncckpt's storage added:

- Saves go to `asyncckpt.dcp.StorageWriter`: `ROOT/step-N` is committed as asyncckpt's
  step N (directory `step-0000000N`, found by its manifest).
- A folder may also hold what torchtitan wrote before asyncckpt: DCP-format `step-N`
  folders (`.metadata`), or a seed checkpoint named by `initial_load_path`. The newest
  step is the newest of both kinds, and a DCP-format folder is read as DCP wrote it, but
  without running its pickles: its `.metadata` through asyncckpt's restricted unpickler
  (integrations/dcp_metadata.py, every range checked against its file), its objects
  through torch's `weights_only` loader (UntrustedPickleError names one that needs
  more), its tensors by DCP's own reader (`weights_only`). A DCP folder on a remote
  fsspec store (`gs://`, `memory://`: no asyncckpt backend) is read by DCP itself, which
  unpickles its `.metadata`: only for folders whose writers you trust. A folder that is
  neither kind is handed to DCP as torchtitan does. `asyncckpt import-dcp` turns a DCP
  folder into a verified asyncckpt step.
- Retention: asyncckpt's `keep_last = keep_latest_k` retires asyncckpt's steps, because
  torchtitan's purge thread deletes any folder matching `step-N` with `rmtree` when it
  dispatches a save: that would delete a retired step whose bytes a kept step still
  references, and an in-flight one. torchtitan's purge still retires DCP-format `step-N`
  folders (never one holding an asyncckpt manifest) that fall outside the newest
  `keep_latest_k` steps of both kinds.
- torchtitan's `async_with_pinned_mem` builds a pinned-memory stager that needs an
  accelerator; here the ring is the staging buffer (the StorageWriter is DCP's
  `async_stager`: a PROCESS-mode save that returns once the state is in the ring), so
  that stager is never made.

- The memory tier (docs/MEMORY_TIER.md): `CheckpointManager.Config(memory_interval=M)`
  (`--checkpoint.memory_interval` where the job's config names this class) also saves
  every M-th step that torchtitan's `interval` does not make durable to the node
  writers' memory: the same states, staged through the ring the DCP saves use, held by
  the writer (`save()` returns once they are staged; with async_mode "disabled", once
  the node holds them). `load()` (the newest step, `step=-1`) then takes the newest step
  across both tiers: a memory generation every rank can read that is at least the
  newest durable step, else the durable step as before (said at WARNING).
  `restored_tier` says which. The writer's address: ASYNCCKPT_ADDRESS, else the node
  writer the DCP saves start on the folder. Timelines as `Checkpointer.restore()`: a
  memory save carries the timeline the DCP saves would (dcp_timeline.py: forked at the
  step `load()` read); a generation of a run that resumed from an older step and has
  not committed since counts as newer than the root's steps above its fork, and the
  saves after its restore go on in that run's timeline (its first commit abandons
  them, read/memory_restore.py); one that is the newest durable step forks there.

Saving to Hugging Face format (`to_hf`) and loading from it stay torchtitan's own.
"""

from __future__ import annotations

import io
import logging
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components import checkpoint as titan
from torchtitan.tools import filesystem

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CheckpointError, UntrustedPickleError
from asyncckpt.format.layout import MANIFEST_NAME, step_dir_name
from asyncckpt.format.timeline import TimelineStart
from asyncckpt.integrations.dcp_memory import go_on_from
from asyncckpt.integrations.dcp_metadata import METADATA_NAME, read_metadata
from asyncckpt.integrations.dcp_reader import StorageReader
from asyncckpt.integrations.dcp_timeline import generation, start_for
from asyncckpt.integrations.dcp_writer import StorageWriter, _started_writer, parse_checkpoint_id
from asyncckpt.rank.client import shared_client
from asyncckpt.rank.handle import SaveHandle
from asyncckpt.rank.node_writer import given_address
from asyncckpt.read.memory_restore import restore_memory
from asyncckpt.storage.base import Storage
from asyncckpt.storage.location import root_path
from asyncckpt.storage.registry import shared_storage
from asyncckpt.storage.timeline import newest_live, read_current

_TITAN_STEP = re.compile(r"step-(0|[1-9][0-9]*)")  # torchtitan's own folder names
MEMORY_STEP_KEY = "asyncckpt_step"  # beside torchtitan's states in a memory save
log = logging.getLogger("asyncckpt.checkpointer")


class CheckpointManager(titan.CheckpointManager):
    """torchtitan's CheckpointManager with asyncckpt as its storage and retention."""

    @dataclass(kw_only=True, slots=True)
    class Config(titan.CheckpointManager.Config):
        memory_interval: int = 0
        """asyncckpt: also save every this many steps to the node writers' memory tier
        (the steps `interval` does not make durable); 0: never."""

        def __post_init__(self) -> None:
            titan.CheckpointManager.Config.__post_init__(self)
            if type(self.memory_interval) is not int or self.memory_interval < 0:
                raise ValueError(f"memory_interval must be 0 (never) or more, not "
                                 f"{self.memory_interval!r}")

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.memory_interval = getattr(config, "memory_interval", 0)
        self.restored_tier: str | None = None  # where load() found its step
        self._memory_handle: SaveHandle | None = None
        self._timeline: tuple[int, TimelineStart | None] | None = None  # (load count, start)
        self.stager = types.SimpleNamespace(close=lambda: None)  # the ring stages instead

    # -- the memory tier ----------------------------------------------------------

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self._should_save(curr_step, last_step) or not self._memory_due(curr_step):
            return super()._save(curr_step, last_step)
        self._take_memory_result()
        state = {k: v.state_dict() if hasattr(v, "state_dict") else v
                 for k, v in self.states.items() if v is not None}
        state[MEMORY_STEP_KEY] = curr_step
        client = shared_client(self._memory_address(), root=root_path(self.folder))
        handle = client.save(curr_step, state, tier="memory", timeline=self._memory_timeline())
        if self.async_mode == titan.AsyncMode.DISABLED:
            handle.wait()
        else:  # the states may change once they are in the ring; the result is taken
            handle.wait_staged()  # by maybe_wait_for_saving, the next save or close
            self._memory_handle = handle
            before: Any = getattr(self, "save_future", None)  # a DCP async save's
            self.save_future = _Saving(before, handle)
        return True

    def _memory_due(self, step: int) -> bool:
        return bool(self.enable and not self.load_only and self.memory_interval
                    and step % self.memory_interval == 0)

    def _memory_timeline(self) -> TimelineStart | None:
        """The timeline start a memory save carries: the one this process's DCP saves
        to the folder carry (dcp_timeline.py), rank 0's, broadcast once per load so that
        every rank carries the same (the DCP saves' coordinator hands it to the ranks in
        its plan; a memory save has no plan)."""
        root = root_path(self.folder)
        loads = generation(root)
        if self._timeline is None or self._timeline[0] != loads:
            start: list[Any] = [None]
            if not dist.is_initialized() or dist.get_rank() == 0:
                start = [None if (s := start_for(root)) is None else s.to_json()]
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list(start, src=0, group=self.pg)
            self._timeline = (loads, None if start[0] is None
                              else TimelineStart.from_json(start[0]))
        return self._timeline[1]

    def _memory_address(self) -> str:
        return given_address(None) or _started_writer(root_path(self.folder))

    def _take_memory_result(self) -> None:
        """Raise the failure of the last memory save, if it failed (waits for it)."""
        handle, self._memory_handle = self._memory_handle, None
        if handle is not None:
            handle.wait()

    def _close(self) -> None:
        try:
            self._take_memory_result()
        finally:
            super()._close()

    def _load(self, step: int = -1) -> bool:
        """The newest step across the memory tier and the durable one (step -1, with
        memory_interval), else torchtitan's load of `step`."""
        self.restored_tier = None
        if step == -1 and self.memory_interval and self._load_memory():
            self.restored_tier = "memory"
            return True
        loaded = super()._load(step)
        self.restored_tier = "durable" if loaded else None
        return loaded

    def _load_memory(self) -> bool:
        """Load the newest memory generation every rank can read, when it is at least
        the newest durable step (every rank calls it: it agrees across ranks)."""
        storage = _storage(self.folder)
        current = (read_current(storage) if storage is not None and storage.is_dir(storage.root)
                   else None)  # before the listings, as Checkpointer.restore reads it
        newest = self._find_load_step() if filesystem.exists(self.folder) else -1
        keys = {k for k, v in self.states.items()
                if v is not None and k not in self.exclude_from_loading}
        found = restore_memory(root_path(self.folder), self._memory_address(), None,
                               None if newest < 0 else newest, self._memory_targets,
                               keys | {MEMORY_STEP_KEY}, expected=True, current=current)
        if found is None:
            return False
        for key in sorted(keys):
            self.states[key].load_state_dict(found.state[key])
        go_on_from(root_path(self.folder), found, newest, current)
        log.info("asyncckpt: torchtitan resumed at step %d from the memory tier", found.step)
        return True

    def _memory_targets(self) -> dict[str, Any]:
        """The model's tensors, filled in place by the load (DTensor shards too)."""
        if titan.MODEL in self.states and titan.MODEL not in self.exclude_from_loading:
            return {titan.MODEL: self.states[titan.MODEL].state_dict()}
        return {}

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection, to_hf)
        pinned = async_mode == titan.AsyncMode.ASYNC_WITH_PINNED_MEM
        writer = StorageWriter(*parse_checkpoint_id(checkpoint_id),
                               keep_last=self.keep_latest_k or None, staging_future=pinned)
        if async_mode == titan.AsyncMode.DISABLED:
            return dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        if pinned:  # the writer stages into its ring: it is the stager DCP would use anyway
            return dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                                  process_group=self.pg, async_stager=writer,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        return dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                              process_group=self.pg)

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        """Load `checkpoint_id`: an asyncckpt step, a DCP-format folder (see the module
        docstring), or anything else DCP itself reads.

        Raises:
            UntrustedPickleError: a local DCP folder's `.metadata` or object needs a
                global the safe loaders refuse (nothing of it ran).
            CorruptCheckpointError: a local DCP folder's `.metadata` is damaged or names
                ranges its files do not hold.
        """
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        kind = checkpoint_kind(checkpoint_id)
        if kind == "asyncckpt":
            dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=StorageReader())
        elif kind == "dcp" and not filesystem.is_remote(checkpoint_id):
            source = Path(checkpoint_id)
            dcp.load(state_dict, checkpoint_id=checkpoint_id,
                     storage_reader=_DcpFolderReader(source), planner=_PlainObjects(source))
        else:
            dcp.load(state_dict, checkpoint_id=checkpoint_id)
        if titan.MODEL in self.states:
            self.states[titan.MODEL].load_state_dict(state_dict)
        return None

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        """asyncckpt's step directory where it holds `step`, else torchtitan's `step-N`
        (a DCP-format folder, or the id of a step about to be saved)."""
        folder = folder or self.folder
        ours = filesystem.join(folder, step_dir_name(step))
        storage = _storage(folder)
        if storage is not None and storage.is_file(root_path(ours) / MANIFEST_NAME):
            return ours
        return filesystem.join(folder, f"step-{step}")

    def _find_load_step(self, folder: str = "") -> int:
        """The newest step in `folder`: asyncckpt's newest live step (where a backend
        serves the folder) or torchtitan's newest DCP-format / HF folder (any fsspec
        store), whichever is higher; -1 when there is none."""
        folder = folder or self.folder
        storage = _storage(folder)
        newest = newest_live(storage) if storage is not None and storage.is_dir(storage.root) \
            else None
        return max(-1 if newest is None else newest, super()._find_load_step(folder))

    def _purge_stale_checkpoints(self) -> None:
        """Retire DCP-format `step-N` folders outside the newest `keep_latest_k` steps
        (asyncckpt's retention, keep_last, retires asyncckpt's own steps)."""
        if not self._should_purge():
            return
        storage = _storage(self.folder)
        ours = set(storage.committed_steps()) if storage is not None else set()
        foreign: dict[int, str] = {}
        for name in filesystem.listdir(self.folder):  # basenames, on any fsspec store
            m = _TITAN_STEP.fullmatch(name)
            path = filesystem.join(self.folder, name)
            if m and not filesystem.isfile(filesystem.join(path, MANIFEST_NAME)):
                foreign[int(m.group(1))] = path
        kept = sorted(ours | set(foreign))[-self.keep_latest_k:]
        for step, path in sorted(foreign.items()):
            if step not in kept:
                assert self.purge_thread is not None  # keep_latest_k > 0 started it
                self.purge_queue.put(path)


class _Saving:
    """torchtitan's `save_future` while a memory save is in flight: `result()` waits
    for the save before it (a DCP async save), then for the memory save (raising its
    failure)."""

    def __init__(self, before: Any, handle: SaveHandle) -> None:
        self.before, self.handle = before, handle

    def result(self, timeout: float | None = None) -> Any:
        if self.before is not None:
            self.before.result()
        return self.handle.wait(timeout)

    def done(self) -> bool:
        return (self.before is None or self.before.done()) and self.handle.done()


def checkpoint_kind(checkpoint_id: str) -> str | None:
    """"asyncckpt" for an asyncckpt step (its directory, `ROOT/step-N` of a committed
    step, or a root holding one: a seed given as `initial_load_path`), "dcp" for a
    DCP-format folder (`.metadata`), else None."""
    if filesystem.isfile(filesystem.join(checkpoint_id, MANIFEST_NAME)):
        return "asyncckpt"
    if filesystem.isfile(filesystem.join(checkpoint_id, METADATA_NAME)):
        return "dcp"
    try:
        root, step = parse_checkpoint_id(checkpoint_id)
    except (ValueError, CheckpointError):
        storage = _storage(checkpoint_id)
        has_steps = storage is not None and storage.is_dir(storage.root) and bool(
            storage.committed_steps())
        return "asyncckpt" if has_steps else None
    storage = _storage(str(root))
    if storage is not None and storage.is_file(root / step_dir_name(step) / MANIFEST_NAME):
        return "asyncckpt"
    return None


def _storage(folder: str) -> Storage | None:
    """asyncckpt's storage of `folder`, or None where no backend serves its scheme."""
    try:
        return shared_storage(root_path(folder))
    except CheckpointError:
        return None


class _DcpFolderReader(dcp.FileSystemReader):
    """DCP's FileSystemReader whose `.metadata` is read by the restricted unpickler."""

    def __init__(self, source: Path) -> None:
        super().__init__(source)
        self.source = source

    def read_metadata(self) -> Metadata:  # no **kwargs: see dcp_reader.StorageReader's
        metadata = read_metadata(self.source, ReadLimits.from_env())
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _PlainObjects(DefaultLoadPlanner):
    """DCP's load planner, building objects with torch's `weights_only` loader."""

    def __init__(self, source: Path) -> None:
        super().__init__()
        self.source = source

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever the safe loader refuses
            raise UntrustedPickleError(
                f"object {fqn!r} needs more than torch's weights_only loader admits "
                f"({' '.join(str(e).split())[:200]}); nothing of it ran. `asyncckpt "
                "import-dcp` stores it as its bytes", file=str(self.source)) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
