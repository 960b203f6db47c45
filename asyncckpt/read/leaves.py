"""A rank's tensor leaves: its object tree checked against its tensor table.

What a reader of one rank needs before a byte of data is read: where each tensor sits in
the saved structure, which saved tensor (or which boxes of a global one) holds its data,
and, for a view, its window on its base. The checks are the rules every reader applies
(docs/FORMAT.md): a well-formed tree referencing each listed tensor exactly once, views
only inside a plain tensor of the rank and of its dtype, no view of a global tensor.

A leaf of a global tensor knows the boxes its own rank saved at once; all of the
tensor's boxes (every rank's, checked to tile) may come later, on first use: of a step
in parts opened for one rank, they are every rank's part file, which a rank reading back
only the shard it saved never needs (read/loader.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
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
    of this rank, or an object's pickle, stored as a uint8 tensor), "dtensor" (a global
    tensor) or "view" (`view` of the plain tensor `tensor`, which holds the data).

    `own` is what this rank saved of it: the tensor itself, or of a global tensor the
    boxes this rank saved (name, path, dtype and global shape are those of the whole).
    `tensor` is all of it: of a global tensor every rank's boxes, checked to tile. Where
    those are not known yet (`resolve` set: a step in parts opened lazily), asking for
    `tensor` reads every rank's part file and checks the tiling, raising
    CorruptCheckpointError if that fails.
    """

    path: TreePath
    kind: str
    own: GlobalTensor
    view: View | None = None
    resolve: Callable[[], GlobalTensor] | None = field(default=None, compare=False, repr=False)

    @property
    def tensor(self) -> GlobalTensor:
        return self.own if self.resolve is None else self.resolve()

    @property
    def dtype(self) -> torch.dtype:
        from asyncckpt.torchutil.dtypes import DTYPES
        return DTYPES[self.own.dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.view.shape if self.view is not None else self.own.shape


def holds_global(tree: Any) -> bool:
    """The tree has a dtensor node (a malformed one: False, `rank_leaves` says why)."""
    try:
        return any(kind == "dtensor" for _, kind, _ in walk(tree))
    except (CheckpointError, KeyError, TypeError, ValueError, AttributeError):
        return False


def rank_leaves(tensors: list[TensorSpec], tree: Any, sharded: dict[str, GlobalTensor],
                rank: int, step: int, file: str = MANIFEST_NAME,
                whole: Callable[[str], GlobalTensor] | None = None) -> list[Leaf]:
    """Check rank `rank`'s tree (described in `file`) against its tensor table; return
    its leaves.

    The tree must be well formed, reference each listed tensor exactly once, and every
    view must lie inside a plain tensor of its own dtype.

    Args:
        sharded: the global tensors of this rank's dtensor nodes: the checkpoint's (every
            rank's boxes), or, with `whole`, this rank's (`tiling.rank_globals`).
        whole: a global tensor's every box by name, asked for when a leaf's `tensor` is.
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
                name = body["name"]
                leaves.append(Leaf(path, kind, sharded[name], resolve=None if whole is None
                                   else partial(whole, name)))
            else:
                if body.of in sharded:
                    raise bad(f"view at {list(path)!r:.80} of {body.of!r:.80}, not a tensor "
                              "this rank saved")
                leaves.append(Leaf(path, kind, GlobalTensor.whole(rank, specs[body.of],
                                                                  paths[body.of]), body))
        return leaves
    except KeyError as e:  # a dtensor node whose global tensor failed its own checks
        raise bad(f"global tensor {e.args[0]!r:.80} is not usable") from None
