"""A rank's part of a DCP save, flattened once per plan: what `async_save` through
asyncckpt blocks on besides the copy and DCP's own planning.

`Client.save` walks the state it is given into a JSON tree and its tensor leaves
(rank/flatten.py), on the caller's thread. A DCP save's state is this rank's boxes of
the plan's tensors, then its objects, and with DCP's plan cached (dcp_plan.py) the
boxes are the same save after save: only their tensors and the objects' values change.
The walk of 564 boxes took 3.6 ms of the caller's CPU per save of a 1 GiB state, more
than DCP's cached planning. So the boxes' part of the tree and the names of their
leaves are kept per final plan (the plan object DCP reuses, as `layout` keeps its
layout), and each save puts its tensors in those leaves and walks its objects alone.

The result must be what `flatten` makes of the whole state, so the kept part is used
only where it provably is: a plan whose boxes are one per tensor (no `Boxes`), tensors
that are plain dense tensors of the planned dtype and box shape, and objects whose
leaves do not take a name a box has. Anything else is walked whole, as before, which
also raises what `flatten` raises.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from asyncckpt.integrations.dcp_plan import LAYOUTS_KEPT, Layout
from asyncckpt.rank.flatten import KeyedChunk, TensorEntry, flatten
from asyncckpt.rank.pending import Flat

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Kept:
    """The boxes' part of a plan's flattened state.

    Attributes:
        items: the tree's [key, node] pairs of every tensor of the catalogue, in order.
        leaves: per written box, in stream order: (its index in layout.tensors, the
            entry name, the key path).
        names: every name the boxes' nodes take (written here or not).
    """

    def __init__(self, items: list[Any], leaves: list[tuple[int, str, tuple[str | int, ...]]]
                 ) -> None:
        self.items = items
        self.leaves = leaves
        self.names = frozenset(node["dtensor"]["name"] for _, node in items) | {"__metadata__"}


_kept: dict[int, tuple[Layout, _Kept | None]] = {}
_kept_lock = threading.Lock()


def flat_state(kept: Layout, state: dict[str, Any], tensors: list[torch.Tensor],
               objects: dict[str, Any]) -> Flat | dict[str, Any]:
    """This rank's part as `Client.save` takes it: `Flat` where the plan's kept part
    holds, else `state` itself (walked whole by the client).

    Args:
        kept: the final plan's layout.
        state: the part as a dict: every tensor of the catalogue (this rank's boxes
            given, the others empty), then the objects.
        tensors: the tensor of each of `kept.tensors`, in order.
        objects: the objects of `state`, by key.
    """
    part = _part_of(kept, state)
    if part is None or not _fits(kept, tensors) or any(fqn in kept.empty for fqn in objects):
        return state  # an object keyed as a tensor would sit among the boxes
    entries = [TensorEntry(name, path, tensors[i].detach()) for i, name, path in part.leaves]
    items = list(part.items)  # the kept nodes are shared, the list is this save's
    if objects:
        tree, more = flatten(objects)
        if any(e.name in part.names for e in more):
            return state
        items += tree["dict"]
        entries += more
    return Flat({"dict": items}, entries)


def _part_of(kept: Layout, state: dict[str, Any]) -> _Kept | None:
    """The kept part of `kept`'s plan, made from `state` on its first save; None for a
    plan that has none (several boxes of a tensor on this rank)."""
    with _kept_lock:
        found = _kept.get(id(kept))
        if found is not None and found[0] is kept:
            return found[1]
    part = _made(kept, state)
    with _kept_lock:
        if len(_kept) >= LAYOUTS_KEPT:
            _kept.pop(next(iter(_kept)))
        _kept[id(kept)] = (kept, part)
    return part


def _made(kept: Layout, state: dict[str, Any]) -> _Kept | None:
    index = {id(item): i for i, (item, *_) in enumerate(kept.tensors)}
    values = list(state.values())
    count = len(state) - len(kept.objects)
    boxes = dict(list(state.items())[:count])
    if (not all(isinstance(v, KeyedChunk) for v in values[:count])
            or any(isinstance(v, KeyedChunk) for v in values[count:])
            or len(kept.tensors) != len({item.index.fqn for item, *_ in kept.tensors})):
        return None  # several boxes of one tensor here, or an object among the boxes
    by_fqn = {item.index.fqn: index[id(item)] for item, *_ in kept.tensors}
    tree, entries = flatten(boxes)
    leaves = []
    for entry in entries:
        fqn = entry.path[0] if len(entry.path) == 1 else None
        if fqn not in by_fqn:
            return None
        leaves.append((by_fqn[fqn], entry.name, entry.path))
    return _Kept(tree["dict"], leaves)


def _fits(kept: Layout, tensors: list[torch.Tensor]) -> bool:
    """Whether this save's tensors make the same tree as the plan's first: plain dense
    tensors of the planned dtype and box shape (a written box has elements)."""
    for (item, _, dtype, _, _), t in zip(kept.tensors, tensors):
        td = item.tensor_data
        if (type(t) not in _PLAIN or t.dtype != dtype or t.layout != torch.strided
                or t.is_meta or td is None or t.shape != td.chunk.sizes):
            return False
    return True
