"""Flattening a state dict into tensors plus a JSON tree (the saving side of tree.py).

The walk happens in `save()` itself, on the caller's thread, so that anything that
cannot be saved (an object that is not JSON, an unnamed dtype, a cycle, a key that is
not str or int) fails there, before a byte is sent, with the key path in the message.
Tensors that share memory with an earlier saved contiguous tensor become view nodes
(see tree.py) and are neither staged nor written. Global tensors (DTensor, ShardedTensor)
become "dtensor" nodes holding this rank's box (dtensor.py), and so do `Chunk`s, boxes
given explicitly (DCP's write items), and `Boxes`, several boxes of one tensor on a rank.
A `bytes` value is saved as a 1-D uint8 tensor behind a "bytes" node (a `Pickled` one
behind a "pickled" node): it is data, so it goes through the ring, not the JSON tree.

What comes back from a load is a dict, list, tuple, str, int, float, bool, None, bytes
or tensor: a subclass (an OrderedDict, a namedtuple, an IntEnum, a torch.Size) or a
bytearray is saved as its base type. `kept_exactly` says when that loses nothing, for
callers that have another way to keep an object as itself (DCP's pickle of it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from asyncckpt.errors import UnsupportedStateError
from asyncckpt.format.tree import JSON, MAX_DEPTH, MAX_INT_BITS, View, show_path
from asyncckpt.torchutil import dtensor
from asyncckpt.torchutil.dtypes import DTYPE_NAMES


@dataclasses.dataclass(frozen=True)
class KeyedChunk(dtensor.Chunk):
    """A `Chunk` that knows its key path in the state its saver flattened (PyTorch DCP's
    `planner_data`: `("model", "net1.weight")` for the flat key `model.net1.weight`),
    saved as its dtensor node's `key_path`, so that a reader can nest a state that the
    tree holds flat as it was. An empty path is not saved."""

    key_path: tuple[str | int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Boxes:
    """Several boxes of one global tensor that this rank writes (PyTorch DCP plans them
    for layouts with several shards of a tensor on one rank): saved as one dtensor node,
    its first written box as `offsets` and each other one in `boxes` under a tensor name
    of its own. The chunks share the global shape and dtype."""

    chunks: tuple[KeyedChunk, ...]


class Pickled(bytes):
    """Bytes that are the pickle of an object (what PyTorch DCP makes of one it cannot
    store otherwise): saved as a "pickled" node, returned as these bytes, never unpickled."""


@dataclasses.dataclass
class TensorEntry:
    """One tensor leaf: where it sits in the tree, and the source to copy from."""

    name: str
    path: tuple[str | int, ...]
    tensor: torch.Tensor

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.tensor.dtype]


def flatten(state: Any) -> tuple[JSON, list[TensorEntry]]:
    """Split `state` into a JSON tree and its tensor leaves, in a stable order.

    Raises:
        UnsupportedStateError: a key, object or tensor that cannot be saved; the message
            names its path.
    """
    entries: list[TensorEntry] = []
    names: set[str] = {"__metadata__"}  # reserved by safetensors
    active: set[int] = set()
    bases: dict[tuple, list[tuple[str, torch.Tensor]]] = {}  # storage -> saved contiguous

    def plain_tensor(node: torch.Tensor, path: tuple[str | int, ...]) -> JSON:
        check_tensor(node, path)
        key = _storage_key(node)
        view = _view_within(node, bases.get(key, ())) if key else None
        if view is not None:
            return view.to_json()
        name = _unique_name(path, names)
        # a state dict's tensors need no grad: detach() would only make another object
        entries.append(TensorEntry(name, path, node.detach() if node.requires_grad else node))
        if key and node.is_contiguous():
            bases.setdefault(key, []).append((name, node))
        return {"tensor": name}

    def visit(node: Any, path: tuple[str | int, ...]) -> JSON:
        kind = type(node)  # the exact common types first: most of a state's nodes
        if kind is str or kind is bool or node is None:
            return node
        if kind is torch.Tensor:  # plain: neither global nor bytes
            return plain_tensor(node, path)
        if kind is int and node.bit_length() <= MAX_INT_BITS:
            return node
        if isinstance(node, Boxes):
            written = [c for c in node.chunks if c.local is not None and c.local.numel()]
            body = visit(written[0] if written else node.chunks[0], path)["dtensor"]
            further = []
            for chunk in written[1:]:
                if (chunk.shape, chunk.dtype) != (written[0].shape, written[0].dtype):
                    raise UnsupportedStateError(
                        f"{show_path(path)}: boxes of one tensor disagree on its shape or "
                        f"dtype ({tuple(chunk.shape)} {chunk.dtype} vs "
                        f"{tuple(written[0].shape)} {written[0].dtype})")
                name = _unique_name(path, names)
                local, _ = dtensor.describe(chunk, name, show_path(path))
                assert local is not None  # written: a box with elements
                check_tensor(local, path)
                entries.append(TensorEntry(name, path, local.detach()))
                further.append({"name": name, "offsets": list(chunk.offsets)})
            if further:
                body["boxes"] = further
            return {"dtensor": body}
        if dtensor.is_global(node):
            name = _unique_name(path, names)
            local, body = dtensor.describe(node, name, show_path(path))
            if isinstance(node, KeyedChunk) and node.key_path:
                body["key_path"] = list(node.key_path)
            if local is not None:
                check_tensor(local, path)
                entries.append(TensorEntry(name, path, local.detach()))
            return {"dtensor": body}
        if isinstance(node, torch.Tensor):
            return plain_tensor(node, path)
        if isinstance(node, (bytes, bytearray, memoryview)):
            name = _unique_name(path, names)
            copy = bytearray(node)  # its own memory: the caller may reuse a bytearray
            data = (torch.frombuffer(copy, dtype=torch.uint8) if copy
                    else torch.empty(0, dtype=torch.uint8))
            entries.append(TensorEntry(name, path, data))
            return {"pickled" if isinstance(node, Pickled) else "bytes": name}
        if node is None or isinstance(node, (bool, str)):
            return node
        if isinstance(node, int):
            if node.bit_length() > MAX_INT_BITS:
                raise UnsupportedStateError(
                    f"{show_path(path)}: int of {node.bit_length()} bits is too large")
            return node
        if isinstance(node, float):
            return node if math.isfinite(node) else {"float": repr(node)}
        if not isinstance(node, (dict, list, tuple)):
            raise UnsupportedStateError(
                f"{show_path(path)}: cannot save {_described(node)}; only tensors, "
                "dict/list/tuple, str, bytes, int, float, bool and None are saved (never pickle)")
        if id(node) in active:
            raise UnsupportedStateError(f"{show_path(path)}: the state contains a cycle")
        if len(path) >= MAX_DEPTH:
            raise UnsupportedStateError(
                f"{show_path(path[:3])}...: nested deeper than {MAX_DEPTH} levels")
        active.add(id(node))
        try:
            if isinstance(node, dict):
                items = []
                for key, value in node.items():
                    if isinstance(key, bool) or not isinstance(key, (str, int)):
                        raise UnsupportedStateError(
                            f"{show_path(path)}: dict key {key!r} is a {type(key).__name__}; "
                            "keys must be str or int")
                    if isinstance(key, str) and not key.isascii() and not _is_utf8(key):
                        raise UnsupportedStateError(
                            f"{show_path(path)}: dict key {key!r} is not valid Unicode")
                    if isinstance(key, int) and key.bit_length() > MAX_INT_BITS:
                        raise UnsupportedStateError(f"{show_path(path)}: int key is too large")
                    items.append([key, visit(value, path + (key,))])
                return {"dict": items}
            seq = "list" if isinstance(node, list) else "tuple"
            return {seq: [visit(v, path + (i,)) for i, v in enumerate(node)]}
        finally:
            active.discard(id(node))

    return visit(state, ()), entries


_EXACT = frozenset({dict, list, tuple, str, int, float, bool, type(None), bytes})


def kept_exactly(obj: Any) -> bool:
    """True when a load gives `obj` back as it is, types included: every part of it is
    exactly a dict (keys exactly str or int), list, tuple, str, int, float, bool, None,
    bytes or plain torch.Tensor. False for anything `flatten` would store as another
    type (a subclass of one of these, a bytearray or memoryview) and for what it refuses."""
    active: set[int] = set()

    def exact(node: Any, depth: int) -> bool:
        kind = type(node)
        if kind is torch.Tensor:
            return True
        if kind not in _EXACT:
            return False
        if kind not in (dict, list, tuple):
            return True
        if depth >= MAX_DEPTH or id(node) in active:
            return False
        active.add(id(node))
        try:
            if kind is dict:
                return all(type(k) in (str, int) and exact(v, depth + 1) for k, v in node.items())
            return all(exact(v, depth + 1) for v in node)
        finally:
            active.discard(id(node))

    return exact(obj, 0)


def _storage_key(t: torch.Tensor) -> tuple | None:
    """(device, storage address) of a non-empty CPU/CUDA tensor, else None."""
    if t.numel() == 0 or t.device.type not in ("cpu", "cuda"):
        return None
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return None


def _view_within(t: torch.Tensor, bases: Any) -> View | None:
    """`t` as a view of the first saved base whose elements hold all of its own."""
    if any(s < 0 for s in t.stride()):
        return None
    for name, base in bases:
        offset = t.storage_offset() - base.storage_offset()
        if base.dtype != t.dtype or offset < 0:
            continue
        view = View(name, DTYPE_NAMES[t.dtype], offset, tuple(t.shape), tuple(t.stride()))
        if view.extent <= base.numel():
            return view
    return None


def check_tensor(t: torch.Tensor, path: tuple[str | int, ...]) -> None:
    """Raise UnsupportedStateError unless `t` is a dense tensor of a nameable dtype."""
    problem = None
    if t.layout != torch.strided:
        problem = f"layout {t.layout} is not supported; save a dense tensor"
    elif t.is_meta:
        problem = "a meta tensor has no data to save"
    elif t.is_quantized:
        problem = "quantized tensors are not supported; save int_repr() and the scales"
    elif t.dtype not in DTYPE_NAMES:
        problem = (f"dtype {t.dtype} has no safetensors name; supported: "
                   f"{', '.join(str(d).removeprefix('torch.') for d in DTYPE_NAMES)}")
    if problem:
        raise UnsupportedStateError(f"{show_path(path)}: {problem}")


def _unique_name(path: tuple[str | int, ...], taken: set[str]) -> str:
    base = ".".join(str(p) for p in path) or "tensor"
    name, n = base, 1
    while name in taken:
        name, n = f"{base}~{n}", n + 1
    taken.add(name)
    return name


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _described(node: object) -> str:
    """What `node` is, with the conversion a user wants for numpy's types (whose
    scalars print like Python numbers)."""
    kind = type(node)
    if kind.__module__ == "numpy":
        if hasattr(node, "shape") and getattr(node, "ndim", False):
            return f"a numpy.{kind.__name__} (pass torch.from_numpy(x))"
        return f"a numpy.{kind.__name__}, a numpy scalar (pass x.item() or torch.tensor(x))"
    return f"a {kind.__name__}"
