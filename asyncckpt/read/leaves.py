"""A rank's tensor leaves: its object tree checked against its tensor table.

What a reader of one rank needs before a byte of data is read: where each tensor sits in
the saved structure, which saved tensor (or which boxes of a global one) holds its data,
and, for a view, its window on its base. The checks are the rules every reader applies
(docs/FORMAT.md): a well-formed tree referencing each listed tensor exactly once, views
only inside a plain tensor of the rank and of its dtype, no view of a global tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncckpt.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME, TensorSpec
from asyncckpt.format.tiling import GlobalTensor
from asyncckpt.format.tree import BYTES_KINDS, View, check_tree, walk

if TYPE_CHECKING:
    import torch

TreePath = tuple[Any, ...]


@dataclass(frozen=True)
class Leaf:
    """A tensor leaf of a rank's tree: where it sits, what it is and where its data is.

    kind "tensor" (a plain tensor of this rank), "bytes" or "pickled" (a bytes value
    of this rank, or an object's pickle, stored as a uint8 tensor), "dtensor" (a global tensor, all ranks' boxes) or "view" (`view` of the plain tensor `tensor`, which holds the data).
    """

    path: TreePath
    kind: str
    tensor: GlobalTensor
    view: View | None = None

    @property
    def dtype(self) -> torch.dtype:
        from asyncckpt.torchutil.dtypes import DTYPES
        return DTYPES[self.tensor.dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.view.shape if self.view is not None else self.tensor.shape


def holds_global(tree: Any) -> bool:
    """The tree has a dtensor node (a malformed one: False, `rank_leaves` says why)."""
    try:
        return any(kind == "dtensor" for _, kind, _ in walk(tree))
    except (CheckpointError, KeyError, TypeError, ValueError, AttributeError):
        return False


def rank_leaves(tensors: list[TensorSpec], tree: Any, sharded: dict[str, GlobalTensor],
                rank: int, step: int, file: str = MANIFEST_NAME) -> list[Leaf]:
    """Check rank `rank`'s tree (described in `file`) against its tensor table; return
    its leaves.

    The tree must be well formed, reference each listed tensor exactly once, and every
    view must lie inside a plain tensor of its own dtype.

    Args:
        sharded: the checkpoint's global tensors (the boxes of this rank's dtensor nodes).
    Returns:
        The leaves, in tree order.
    Raises:
        CorruptCheckpointError: a rule broken (named in `file`), or a dtensor node whose
            global tensor is not in `sharded`.
    """
    def bad(cause: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(cause, step=step, rank=rank, file=file)
    try:
        try:
            paths = check_tree([(t.name, t.dtype, t.shape) for t in tensors], tree)
        except CorruptCheckpointError as e:
            raise bad(e.cause) from None
        specs = {t.name: t for t in tensors}
        leaves = []
        for path, kind, body in walk(tree):
            if kind == "tensor" or kind in BYTES_KINDS:
                leaves.append(Leaf(path, kind, GlobalTensor.whole(rank, specs[body], path)))
            elif kind == "dtensor":
                leaves.append(Leaf(path, kind, sharded[body["name"]]))
            else:
                if body.of in sharded:
                    raise bad(f"view at {list(path)!r:.80} of {body.of!r:.80}, not a tensor "
                              "this rank saved")
                leaves.append(Leaf(path, kind, GlobalTensor.whole(rank, specs[body.of],
                                                                  paths[body.of]), body))
        return leaves
    except KeyError as e:  # a dtensor node whose global tensor failed its own checks
        raise bad(f"global tensor {e.args[0]!r:.80} is not usable") from None
