"""The object tree of a saved state: JSON with explicit node types, its checks, and
rebuilding the state from it (flatten.py makes it from a state dict).

Nothing here imports torch, because the writer checks every rank's tree against its
tensor table before it opens a file (a checkpoint its own reader would refuse is never
written), and the writer process never imports torch.

A state dict is a tree of dicts, lists and tuples whose leaves are tensors or small
JSON-able objects. We keep the tree as JSON with explicit node types rather than as
dotted key strings, because dotted keys lose information: `{'a': {'b.c': x}}` and
`{'a.b': {'c': y}}` collide, and optimizer state keyed by int would come back keyed by
str (which `load_state_dict` silently ignores). Tensors leave the tree as references to
names in the safetensors data; names are dotted paths for readability, made unique.
Nothing is ever pickled.

Tree nodes (see docs/FORMAT.md): a str, int, bool, null or finite float stands for
itself; `{"float": "nan"|"inf"|"-inf"}`; `{"dict": [[key, node], ...]}` with str or int
keys, none repeated (a reader that kept the first value and one that kept the last would
rebuild two different states); `{"list": [...]}`; `{"tuple": [...]}`; `{"tensor":
name}`; `{"bytes": name}`, a `bytes` value stored as the 1-D uint8 tensor `name`;
`{"pickled": name}`, the same for an object that only a pickle could hold (PyTorch
DCP serialises such objects with `torch.save`; no asyncckpt reader unpickles it, a
load returns its bytes); and for a DTensor `{"dtensor": {"name", "dtype", "shape",
"offsets", "placements"}}` (see `dtensor.py`): the global tensor `name`, of which this
rank wrote the box at `offsets` under the same name, or nothing (`offsets` null: a
replica another rank writes, or an empty shard); and
`{"view": {"of", "dtype", "offset", "shape", "stride"}}` for a tensor whose memory lies
inside an earlier saved tensor.

Views exist because tied weights (`lm_head.weight is wte.weight`, in most small language
models) and slices of one buffer would otherwise be written twice and come back as
independent tensors, silently untying them. A tensor is saved as a view only when its
memory lies inside an earlier *contiguous* tensor of the same dtype and storage: then
its elements are `base.flatten()[offset + sum(i_k * stride_k)]`, exactly what
`as_strided` rebuilds on load, whatever the devices. Anything else (a view saved before
its base, overlapping pieces neither of which holds the other, DTensors) is saved as its
own tensor: correct, only not deduplicated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncckpt.errors import CorruptCheckpointError

if TYPE_CHECKING:
    import torch

JSON = Any
MAX_DEPTH = 100
MAX_INT_BITS = 14000  # Python refuses to print ints beyond ~4300 digits
MAX_VIEW_DIMS = 64
_MAX_ELEMENTS = 1 << 62
BYTES_KINDS = ("bytes", "pickled")  # nodes whose data is a 1-D uint8 tensor read as bytes


@dataclasses.dataclass(frozen=True)
class View:
    """A view node: `shape`/`stride` elements of tensor `of`, from element `offset`."""

    of: str
    dtype: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def extent(self) -> int:
        """Elements of the base the view needs: one past its last element (0 if empty)."""
        if math.prod(self.shape) == 0:
            return 0
        return self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1

    def to_json(self) -> JSON:
        return {"view": {"of": self.of, "dtype": self.dtype, "offset": self.offset,
                         "shape": list(self.shape), "stride": list(self.stride)}}

    def of_tensor(self, base: torch.Tensor) -> torch.Tensor:
        """This view of `base`, a contiguous tensor holding at least `extent` elements."""
        return base.as_strided(self.shape, self.stride, base.storage_offset() + self.offset)


def show_path(path: tuple[Any, ...]) -> str:
    """A key path as Python would index the state: `state['model']['w'][0]`. Every
    message that names a place in a state (saving, staging, loading) spells it so."""
    return "state" + "".join(f"[{p!r}]" for p in path)


def parse_view(body: Any) -> View:
    """A view node's body, its fields checked for type and bounds (not against its base).

    Raises:
        CorruptCheckpointError: a field is missing, mistyped, negative or too large.
    """
    def dims(value: Any) -> bool:
        return (isinstance(value, list) and len(value) <= MAX_VIEW_DIMS
                and all(type(v) is int and 0 <= v < _MAX_ELEMENTS for v in value))
    if (not isinstance(body, dict) or set(body) != {"of", "dtype", "offset", "shape", "stride"}
            or not isinstance(body["of"], str) or not isinstance(body["dtype"], str)
            or type(body["offset"]) is not int or not 0 <= body["offset"] < _MAX_ELEMENTS
            or not dims(body["shape"]) or not dims(body["stride"])
            or len(body["shape"]) != len(body["stride"])
            or math.prod(body["shape"]) >= _MAX_ELEMENTS):
        raise CorruptCheckpointError(f"malformed view node: {body!r:.120}")
    view = View(body["of"], body["dtype"], body["offset"], tuple(body["shape"]),
                tuple(body["stride"]))
    if view.extent >= _MAX_ELEMENTS:
        raise CorruptCheckpointError(f"view node reaches past element 2**62: {body!r:.120}")
    return view


def unflatten(tree: JSON, resolve: Callable[[str], Any],
              resolve_view: Callable[[tuple[str | int, ...], View], Any] | None = None,
              resolve_bytes: Callable[[str, str], Any] | None = None) -> Any:
    """Rebuild the saved structure; `resolve(name)` supplies each tensor and global
    (DTensor) one, `resolve_view(path, view)` each view (default: the view of
    `resolve(view.of)`, which must then be a contiguous tensor), `resolve_bytes(name, kind)`
    each "bytes" and "pickled" value (default: the raw bytes of the CPU tensor
    `resolve(name)`).

    Raises:
        CorruptCheckpointError: the tree is not well formed.
    """
    if resolve_view is None:
        def resolve_view(path: tuple[str | int, ...], view: View) -> Any:
            return view.of_tensor(resolve(view.of))
    if resolve_bytes is None:
        def resolve_bytes(name: str, kind: str) -> Any:
            return resolve(name).numpy().tobytes()

    def visit(node: JSON, path: tuple[str | int, ...]) -> Any:
        if node is None or isinstance(node, (bool, int, str, float)):
            return node
        if isinstance(node, dict) and len(node) == 1:
            (kind, body), = node.items()
            if kind == "tensor" and isinstance(body, str):
                return resolve(body)
            if kind in BYTES_KINDS and isinstance(body, str):
                return resolve_bytes(body, kind)
            if kind == "dtensor" and isinstance(body, dict) and isinstance(body.get("name"), str):
                return resolve(body["name"])
            if kind == "view":
                return resolve_view(path, parse_view(body))
            if kind == "float" and body in ("nan", "inf", "-inf"):
                return float(body)
            if kind == "list" and isinstance(body, list):
                return [visit(v, path + (i,)) for i, v in enumerate(body)]
            if kind == "tuple" and isinstance(body, list):
                return tuple(visit(v, path + (i,)) for i, v in enumerate(body))
            if kind == "dict" and isinstance(body, list):
                out = {}
                for item in body:
                    if (not isinstance(item, list) or len(item) != 2 or isinstance(item[0], bool)
                            or not isinstance(item[0], (str, int))):
                        raise CorruptCheckpointError(f"malformed dict item in tree: {item!r:.80}")
                    if item[0] in out:
                        raise CorruptCheckpointError(f"dict at {list(path)!r:.80} repeats the "
                                                     f"key {item[0]!r:.80}")
                    out[item[0]] = visit(item[1], path + (item[0],))
                return out
        raise CorruptCheckpointError(f"malformed tree node: {node!r:.80}")

    try:
        return visit(tree, ())
    except RecursionError:
        raise CorruptCheckpointError("tree nested too deeply") from None


def check_tree(tensors: list[tuple[str, str, tuple[int, ...]]], tree: JSON) -> dict[str, Any]:
    """Check a rank's tree against its tensor table (name, dtype, shape in stream order),
    with the rules every reader applies.

    The tree must be well formed (no dict node repeating a key), reference each listed
    tensor exactly once, and every view must lie inside a plain tensor of the rank of its
    own dtype.

    Returns:
        Each tensor name's path in the tree.
    Raises:
        CorruptCheckpointError: it breaks one of those rules.
    """
    leaves = walk(tree)
    paths = tensor_paths(tree, leaves)
    if set(paths) != {name for name, _, _ in tensors}:
        raise CorruptCheckpointError("object tree and tensor table disagree")
    unflatten(tree, lambda name: None, lambda path, view: None, lambda name, kind: None)
    plain = {body for _, kind, body in leaves if kind == "tensor"}
    specs = {name: (dtype, shape) for name, dtype, shape in tensors}
    for path, kind, body in leaves:
        if kind in BYTES_KINDS and (specs[body][0] != "U8" or len(specs[body][1]) != 1):
            raise CorruptCheckpointError(f"bytes at {list(path)!r:.80} is stored as "
                                         f"{specs[body][0]} {tuple(specs[body][1])}, not 1-D U8")
        if kind != "view":
            continue
        if body.of not in plain:
            raise CorruptCheckpointError(f"view at {list(path)!r:.80} of {body.of!r:.80}, not "
                                         "a tensor this rank saved")
        dtype, shape = specs[body.of]
        if body.dtype != dtype or body.extent > math.prod(shape):
            raise CorruptCheckpointError(
                f"view at {list(path)!r:.80} ({body.dtype} from element {body.offset}, shape "
                f"{body.shape}, stride {body.stride}) does not fit in {body.of!r:.80} "
                f"({dtype} {tuple(shape)})")
    return paths


def tensor_paths(tree: JSON, leaves: list[tuple[tuple[str | int, ...], str, Any]] | None = None
                 ) -> dict[str, tuple[str | int, ...]]:
    """Map each name in the rank's tensor table (plain tensors, and DTensor boxes this
    rank wrote) to its path of keys and indices (`leaves`: `walk(tree)`, if the caller
    has it).

    Raises:
        CorruptCheckpointError: a tensor is referenced twice.
    """
    out: dict[str, tuple[str | int, ...]] = {}
    for path, kind, body in walk(tree) if leaves is None else leaves:
        if kind == "view":
            continue
        if kind == "tensor" or kind in BYTES_KINDS:
            name = body
        else:  # a dtensor: its name, where this rank wrote a box of it, and its further boxes
            further = box_names(body)
            name = body.get("name") if body.get("offsets") is not None else None
            if name is None and further:
                raise CorruptCheckpointError(f"dtensor {body.get('name')!r:.80}: further boxes "
                                             "but no first one (offsets null)")
            for other in further:
                if other in out:
                    raise CorruptCheckpointError(f"tree references tensor {other!r:.80} twice")
                out[other] = path
        if name is None:
            continue
        if name in out:
            raise CorruptCheckpointError(f"tree references tensor {name!r:.80} twice")
        out[name] = path
    return out


def box_names(body: dict[str, Any]) -> list[str]:
    """The table names of a dtensor node's further boxes (its optional `boxes`: several
    boxes of the tensor on one rank), in order; none without the key.

    Raises:
        CorruptCheckpointError: `boxes` is not a list of objects with a str `name`.
    """
    boxes = body.get("boxes")
    if boxes is None:
        return []
    if not isinstance(boxes, list) or not all(
            isinstance(b, dict) and isinstance(b.get("name"), str) for b in boxes):
        raise CorruptCheckpointError(f"malformed dtensor boxes: {boxes!r:.80}")
    return [b["name"] for b in boxes]


def walk(tree: JSON) -> list[tuple[tuple[str | int, ...], str, Any]]:
    """Every tensor leaf of `tree` as (path, kind, node body): kind "tensor", "bytes",
    "pickled", "dtensor" or "view", and for a view its parsed `View` as the body.

    Raises:
        CorruptCheckpointError: a leaf is malformed (a tensor name not a str, a dtensor
            body not an object with a str name, a view node breaking `parse_view`).
    """
    out: list[tuple[tuple[str | int, ...], str, Any]] = []

    def visit(node: JSON, path: tuple[str | int, ...]) -> None:
        if len(path) > MAX_DEPTH:  # deeper than flatten() ever makes: a reader's stack
            raise CorruptCheckpointError(f"tree nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict) and len(node) == 1:
            (kind, body), = node.items()
            if kind == "tensor" or kind in BYTES_KINDS:
                if not isinstance(body, str):
                    raise CorruptCheckpointError(f"malformed {kind} node: {body!r:.80}")
                out.append((path, kind, body))
            elif kind == "dtensor":
                if not isinstance(body, dict) or not isinstance(body.get("name"), str):
                    raise CorruptCheckpointError(f"malformed dtensor node: {body!r:.80}")
                out.append((path, kind, body))
            elif kind == "view":
                out.append((path, kind, parse_view(body)))
            elif kind in ("list", "tuple"):
                for i, v in enumerate(body):
                    visit(v, path + (i,))
            elif kind == "dict":
                for key, v in body:
                    visit(v, path + (key,))

    try:
        visit(tree, ())
    except (RecursionError, TypeError, ValueError):
        raise CorruptCheckpointError("malformed tree") from None
    return out


