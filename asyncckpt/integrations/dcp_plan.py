"""DCP's save plan, made once per structure: what `async_save` through asyncckpt blocks on
besides the copy into the ring.

DCP plans every save from scratch: each rank lists its write items, the coordinator
deduplicates them, builds the global plan and its metadata and validates it. For a
state of thousands of tensors that is tens of milliseconds per save, paid while the
caller waits, although a training job saves the same structure every time. DCP's
own answer is its plan cache (`DefaultSavePlanner(enable_plan_caching=True)`): a rank
whose local plan equals the cached one sends an empty plan, and when no rank's plan
changed the coordinator reuses the cached global plan and every rank its cached final
plan. `stage()` plans with it, under a key of the writer's root, with two guards for
what asyncckpt puts in the final plans:

- DCP's comparison of local plans looks at keys, sizes and chunks, not dtypes; a
  tensor whose dtype changed makes the local plan new here.
- When some rank's plan changed, DCP sends new final plans only to the ranks whose
  final plan differs by its (dtype-blind) comparison; but every rank's final plan
  carries the catalogue of every tensor (and objects go to the lowest rank holding
  them), so then every rank gets its whole new plan.

DCP still rebuilds every write item of the local plan on each save, only to compare it
with the cached one (8 of the 12 ms of planning a 1 GiB state of 564 tensors, on the
caller's thread). So the planner also keeps what the cached local plan was made from
(`_structure`: each key, a tensor's dtype and size, a DTensor's placements, mesh and
this rank's place in it), and a state whose structure is that one reuses the cached
plan without rebuilding it. What DCP's comparison looks at (keys, sizes, offsets, item
types) follows from the structure; a state it cannot vouch for (a ShardedTensor, an
object that makes its own write items) is planned as DCP plans it.

What the writer derives from a final plan (the boxes it writes, the catalogue's empty
boxes, DCP's write results for tensors) is kept beside the plan object (`layout`):
with the plan cached, a save only resolves each item's tensor and hands it over.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from asyncckpt.format.timeline import TimelineStart
from asyncckpt.format.tree import MAX_DEPTH
from asyncckpt.rank.flatten import KeyedChunk
from asyncckpt.torchutil.dtensor import Chunk

LAYOUTS_KEPT = 16  # final plans whose layouts are kept (one per root and structure in use)


@dataclasses.dataclass(frozen=True)
class Catalogue:
    """Sent with every rank's final plan: each tensor of the checkpoint, (dtype, size),
    the timeline start every rank's save carries (dcp_timeline.py), and each key's path
    in the state as DCP flattened it (its planner_data, merged over the ranks)."""

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    timeline: TimelineStart | None = None
    paths: dict[str, tuple[str | int, ...]] = dataclasses.field(default_factory=dict)


class CachingPlanner(DefaultSavePlanner):
    """DCP's default save planner with its plan cache, keyed by `root` and `version` (a
    new version drops the root's plans of the older one from DCP's class-level caches,
    which would otherwise keep them for the process's life), guarded as the module
    docstring says."""

    def __init__(self, root: str, version: int = 0) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = key = f"asyncckpt.dcp:{root}|{version}"
        with _versions_lock:
            old = _versions.get(root)
            _versions[root] = key
        if old is not None and old != key:
            for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans,
                          SavePlanner._cached_global_plan, SavePlanner._cached_metadata,
                          SavePlanner._cached_final_save_plan, _structures):
                cache.pop(old, None)
        self._structure: tuple[Any, ...] | None = None

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        """DCP's, except that its second pass over the flattened state, which rebuilds
        the whole dict to split ShardedTensors with nested shards, runs only for a
        state that holds a ShardedTensor (a tenth of the caller's planning time for a
        state of plain tensors and DTensors, on every save)."""
        flat, self.mappings = flatten_state_dict(state_dict)
        if any(isinstance(v, ShardedTensor) for v in flat.values()):
            flat = _flatten_sharded_tensors(flat)
        self.state_dict = flat
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        key = self._cached_plans_key
        cached = SavePlanner._cached_save_plan.get(key)
        self._structure = _structure(self.state_dict, self.is_coordinator)
        if (cached is not None and self._structure is not None
                and _structures.get(key) == self._structure):
            self.plan = dataclasses.replace(cached, planner_data=self.mappings)
            return SavePlan([], usable=False)  # what DCP returns for an unchanged plan
        plan = super().create_local_plan()
        if not plan.usable and (cached is None or not _same_dtypes(self.plan, cached)):
            self._pending_local_plan = self.plan  # promoted to the cache by finish_plan
            return self.plan
        return plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """DCP's; the cached local plan is now this save's, so its structure is kept."""
        finished = super().finish_plan(new_plan)
        if self._structure is not None:
            _structures[self._cached_plans_key] = self._structure
        else:
            _structures.pop(self._cached_plans_key, None)
        return finished

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        delta, metadata = super().create_global_plan(all_plans)
        if any(p.usable for p in all_plans):
            delta = list(self.global_plan)  # a catalogue spans ranks: all or none anew
        return delta, metadata


_versions: dict[str, str] = {}  # root -> the cache key its plans are kept under
_versions_lock = threading.Lock()
_structures: dict[str, tuple[Any, ...]] = {}  # cache key -> what its local plan was made of


def _structure(state_dict: dict[str, Any], coordinator: bool) -> tuple[Any, ...] | None:
    """What DCP's local save plan of the flattened `state_dict` follows from: per key, a
    plain tensor's dtype and size (one item at offset 0), a DTensor's dtype, global size,
    placements, mesh and this rank's coordinate in it (its chunk), or an object's key
    (one bytes item). None for a state with anything that plans itself otherwise (a
    ShardedTensor, a tensor subclass also as a DTensor's local tensor, an object with
    `__create_write_items__`)."""
    parts: list[Any] = [coordinator]
    for fqn, value in state_dict.items():
        kind = type(value)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            parts.append((fqn, value.dtype, value.shape))
        elif kind is DTensor and type(value._local_tensor) is torch.Tensor:
            mesh = value.device_mesh
            coordinate = mesh.get_coordinate()
            parts.append((fqn, value.dtype, value.shape, tuple(value.placements), mesh,
                          None if coordinate is None else tuple(coordinate)))
        elif isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            return None
        else:
            parts.append(fqn)
    return tuple(parts)


def _same_dtypes(plan: SavePlan, cached: SavePlan) -> bool:
    return len(plan.items) == len(cached.items) and all(
        (a.tensor_data is None) == (b.tensor_data is None)
        and (a.tensor_data is None or b.tensor_data is None
             or a.tensor_data.properties.dtype == b.tensor_data.properties.dtype)
        for a, b in zip(plan.items, cached.items))


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a rank writes of a final plan, besides the values themselves.

    Attributes:
        empty: every tensor of the checkpoint as a box this rank does not write.
        tensors: (item, global size, dtype, offsets, result) per tensor item.
        objects: the object (bytes) items.
        paths: each key's path in the saved state (DCP's planner_data), where known.
    """

    empty: dict[str, Chunk]
    tensors: list[tuple[WriteItem, tuple[int, ...], torch.dtype, tuple[int, ...], WriteResult]]
    objects: list[WriteItem]
    paths: dict[str, tuple[str | int, ...]] = dataclasses.field(default_factory=dict)


_layouts: dict[int, tuple[SavePlan, Layout]] = {}
_layouts_lock = threading.Lock()


def layout(plan: SavePlan) -> Layout:
    """The layout of final plan `plan`, made once per plan object (a cached final plan is
    the same object save after save). A tensor may have several items (several chunks
    on this rank): each is a box of it."""
    with _layouts_lock:
        kept = _layouts.get(id(plan))
        if kept is not None and kept[0] is plan:
            return kept[1]
    made = _layout(plan)
    with _layouts_lock:
        if len(_layouts) >= LAYOUTS_KEPT:
            _layouts.pop(next(iter(_layouts)))
        _layouts[id(plan)] = (plan, made)
    return made


def _layout(plan: SavePlan) -> Layout:
    catalogue = plan.storage_data if isinstance(plan.storage_data, Catalogue) else Catalogue({})
    paths = {fqn: path for fqn, path in catalogue.paths.items() if key_path_of(fqn, path)}
    empty: dict[str, Chunk] = {fqn: KeyedChunk(size, dtype, key_path=paths.get(fqn, ()))
                               for fqn, (dtype, size) in catalogue.tensors.items()}
    tensors = []
    objects = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            objects.append(item)
            continue
        td = item.tensor_data
        assert td is not None
        dtype = td.properties.dtype
        nbytes = td.chunk.sizes.numel() * dtype.itemsize
        tensors.append((item, tuple(td.size), dtype, tuple(td.chunk.offsets),
                        WriteResult(item.index, nbytes, None)))
    return Layout(empty, tensors, objects, paths)


def key_path_of(fqn: str, path: Any) -> bool:
    """Whether `path` is a key path DCP's flattening makes `fqn` of: str and int keys
    (no bool) joined by `.`, nested no deeper than a tree is."""
    return (isinstance(path, tuple) and 0 < len(path) <= MAX_DEPTH
            and all(type(k) is str or (type(k) is int and k >= 0) for k in path)
            and ".".join(map(str, path)) == fqn)


@dataclasses.dataclass(frozen=True)
class Holds:
    """A rank's local plan note: the objects (bytes items) it holds."""

    objects: tuple[str, ...]


def objects_to_lowest_holder(plans: list[SavePlan]) -> list[list[Any]]:
    """Each plan's items, every object moved to the lowest rank that holds it, so that
    rank 0's part has the objects every rank has (DCP spreads them for balance)."""
    holders: dict[str, int] = {}
    for rank, plan in enumerate(plans):
        if isinstance(plan.storage_data, Holds):
            for fqn in plan.storage_data.objects:
                holders.setdefault(fqn, rank)
    items: list[list[Any]] = [[] for _ in plans]
    for rank, plan in enumerate(plans):
        for item in plan.items:
            byte_io = item.type == WriteItemType.BYTE_IO
            owner = holders.get(item.index.fqn, rank) if byte_io else rank
            items[owner].append(item)
    return items
