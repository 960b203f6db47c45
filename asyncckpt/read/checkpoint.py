"""One opened checkpoint: resolved, its manifest and structure checked once, then read.

`load`, `export_hf`, `verify` and the CLI all open a checkpoint here, so there is one
answer to "which directory", "is this manifest to be trusted" and "which tensors make up
this rank's state", and the checks run once per open instead of once per caller:

1. resolve the path: a checkpoint directory, a root and a step, or a root's newest step;
2. read the manifest (size-bounded, checksummed, every field validated);
3. check the directory holds exactly the manifest and the data files it names, and
   that the older steps' files its reference frames name are in the root;
4. check the global (sharded) tensors tile their shapes, and each rank's object tree
   references exactly its tensor table (views only inside their base);
5. read: `RankReader`s opened on first use and sharing one pool of frame threads, and a
   `ReadPlan` that fills any box of any tensor from the saved boxes.

Everything in 2-4 reads only the manifest and a directory listing, so it is cheap; the
data is verified frame by frame as it is read (or all of it by `verify`). torch is
imported only where a tensor is made (a dtype, a read plan), so `verify`, `ls`, `inspect`
and `copy` never import it: they start in a fraction of a second instead of two.

A root opened without a step means its newest `step-N` directory, and a newest step that
is damaged is an error, not a reason to load an older one quietly: a resume that
silently repeats hours of training is worse than one that stops. The error names the
damaged step and the newest intact one, which `Checkpointer.restore()` falls back to on
its own (with a warning). A name there is advice to load that step, so it must be one:
a step directory of the root by the reader's rule (storage/posix.py; a `step-N` linked in
from elsewhere may hold a state this root never saved), whose manifest and files check,
and which does not share the bytes that failed (with incremental saves other steps
reference the same frames; a frame's error says where its stored bytes lie). It may be newer than the damaged step: a writer still
running commits steps while a load reads, and its retention deletes older ones.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME, TensorSpec, parse_step_dir, step_dir_name
from asyncckpt.format.manifest import Manifest, Ref
from asyncckpt.format.tiling import GlobalTensor, global_tensors
from asyncckpt.format.tree import BYTES_KINDS, View, check_tree, walk
from asyncckpt.read.reader import RankReader, Readers, open_referenced, referenced_files
from asyncckpt.storage.location import (
    Location,
    ObjectPath,
    exists,
    is_dir,
    is_file,
    list_names,
    read_manifest_at,
    root_path,
    storage_for,
)

if TYPE_CHECKING:
    import torch

    from asyncckpt.read.sharded import ReadPlan

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


class Checkpoint:
    """An opened checkpoint. Use `Checkpoint.open` (or `examine`), then read; close it
    (or use `with`) to close its data files and threads.

    Attributes:
        directory: the checkpoint directory.
        manifest: its manifest, checked.
        limits: the reader limits it was opened with.
        sharded: the global (DTensor) tensors by name, their boxes checked to tile.
        root: the root it was found in when opened as "the newest step of a root" (then
            corruption found while reading names the newest intact step), else None.
        problems: what `examine` found wrong (empty for an opened checkpoint).
        storage: the root holding `directory`, where its files and the files its
            reference frames name are opened.
    """

    def __init__(self, directory: Location, manifest: Manifest, limits: ReadLimits) -> None:
        self.directory, self.manifest, self.limits = directory, manifest, limits
        self.storage = storage_for(directory.parent)
        self.root: Location | None = None
        self.problems: list[CheckpointError] = []
        self.unreadable_ranks: set[int] = set()
        self.sharded: dict[str, GlobalTensor] = {}
        self._leaves: dict[int, list[Leaf]] = {}
        self._readers: Readers | None = None
        self._scratch: Any = None  # the temporaries of plans given temp_bytes
        self._check()

    # -- opening ----------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], step: int | None = None, *,
             limits: ReadLimits | None = None) -> "Checkpoint":
        """Open the checkpoint `path` (a checkpoint directory or a root) and `step` name.

        Args:
            path: a checkpoint directory, or a root: then `step`, or its newest step.
            limits: reader limits (default `ReadLimits.from_env()`).
        Raises:
            CheckpointNotFoundError: nothing committed there, or no such step.
            CorruptCheckpointError: the manifest, the directory's files or the trees fail
                their checks; for a root's newest step, the message names the newest
                intact step (`error.detail["newest_intact"]`, or None; see the module
                docstring for what that is).
        """
        limits = limits or ReadLimits.from_env()
        for _ in range(_RESOLVE_TRIES):
            directory, root = _resolve(root_path(path), step)
            opened, problems = cls.examine(directory, limits=limits)
            if not problems or root is None or exists(directory):
                break
            # the newest step went between the listing and its manifest: a running
            # writer committed a newer one and its retention deleted or retired this one
        if problems:
            if root is not None:
                raise _damaged_newest(root, directory, problems[0], limits)
            raise problems[0]
        assert opened is not None
        opened.root = root
        return opened

    @classmethod
    def examine(cls, directory: str | os.PathLike[str], *, limits: ReadLimits | None = None
                ) -> tuple["Checkpoint | None", list[CheckpointError]]:
        """Read and check `directory` as a checkpoint, collecting every problem found.

        Returns:
            (the checkpoint, or None when its manifest cannot be used; the problems).
            A checkpoint with problems may still be read rank by rank, except the ranks
            in `unreadable_ranks`.
        """
        directory = root_path(directory)
        if not isinstance(directory, ObjectPath) and directory.is_symlink():
            # opened where it lies: its references name steps of its own root, not the link's
            directory = Path(os.path.realpath(directory))
        limits = limits or ReadLimits.from_env()
        if not exists(directory / MANIFEST_NAME):
            return None, [CorruptCheckpointError(
                f"{directory.name} has no {MANIFEST_NAME}: not a checkpoint (its manifest was "
                "deleted, or it was never committed)", step=parse_step_dir(directory.name),
                file=str(directory))]
        try:
            manifest = read_manifest_at(directory, limits)
        except CheckpointError as e:
            return None, [e]
        opened = cls(directory, manifest, limits)
        return opened, opened.problems

    def _check(self) -> None:
        step = self.manifest.step
        expected = {MANIFEST_NAME} | {p.file for p in self.manifest.ranks}
        try:
            present = list_names(self.directory)
        except OSError as e:
            present = set()
            self.problems.append(CorruptCheckpointError(f"cannot list: {e.strerror or e}", step=step,
                                                        file=str(self.directory)))
        for name in sorted(expected - present):
            self.problems.append(CorruptCheckpointError(f"missing file {name!r}", step=step,
                                                        file=str(self.directory)))
        for name in sorted(present - expected):
            self.problems.append(CorruptCheckpointError(
                f"unexpected file {name!r} in the checkpoint directory", step=step,
                file=str(self.directory)))
        self.unreadable_ranks = {p.rank for p in self.manifest.ranks if p.file not in present}
        for part in self.manifest.ranks:  # incremental: the older steps' files it references
            for step_, name in referenced_files(part):
                try:
                    open_referenced(self.storage, step_, name,
                                    lambda cause: CorruptCheckpointError(
                                        cause, step=step, rank=part.rank,
                                        file=str(self.directory))).close()
                except CorruptCheckpointError as e:
                    self.problems.append(e)
                    self.unreadable_ranks.add(part.rank)
        try:
            self.sharded = global_tensors(self.manifest)
        except CheckpointError as e:
            self.problems.append(e)
        for part in self.manifest.ranks:
            try:
                self._leaves[part.rank] = _rank_leaves(part.tensors, part.tree, self.sharded,
                                                       part.rank, step)
            except CheckpointError as e:
                self.problems.append(e)
                self.unreadable_ranks.add(part.rank)

    # -- what it holds ----------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

    def check_rank(self, rank: int) -> int:
        """`rank`, if the checkpoint has it.

        Raises:
            CheckpointNotFoundError: it does not (negative ranks included); the message
                names the valid range.
        """
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise CheckpointNotFoundError(
                f"rank {rank!r} is out of range: the checkpoint has ranks 0..{self.world_size - 1}",
                step=self.step, rank=rank if isinstance(rank, int) else None,
                file=str(self.directory))
        return rank

    def leaves(self, rank: int) -> list[Leaf]:
        """Rank `rank`'s tensor leaves, in tree order."""
        return self._leaves[self.check_rank(rank)]

    def tree(self, rank: int) -> Any:
        return self.manifest.ranks[self.check_rank(rank)].tree

    # -- reading ----------------------------------------------------------------------

    def reader(self, rank: int, prefetch: int = 0) -> RankReader:
        """Rank `rank`'s verified reader (opened, and its header checked, on first use;
        then the kernel is asked to start reading its first `prefetch` raw bytes)."""
        if self._readers is None:
            self._readers = Readers(self.directory, self.manifest,
                                    self.storage.read_threads or self.limits.read_threads,
                                    self.storage)
        return self._readers(self.check_rank(rank), prefetch)

    def plan(self, temp_bytes: int | None = None) -> ReadPlan:
        """A read plan over this checkpoint's readers; `flush()` it to read. Its
        temporaries hold `temp_bytes` at most (default `sharded.TEMP_BYTES`); given
        `temp_bytes`, plans share one buffer for them, so use one such plan at a time."""
        from asyncckpt.read.sharded import TEMP_BYTES, ReadPlan
        if temp_bytes is None:
            return ReadPlan(self.reader, TEMP_BYTES)
        import torch
        if self._scratch is None or self._scratch.numel() < temp_bytes:
            self._scratch = torch.empty(temp_bytes, dtype=torch.uint8)
        return ReadPlan(self.reader, temp_bytes, self._scratch)  # one plan at a time

    def read_full(self, g: GlobalTensor, dtype: torch.dtype | None = None,
                  temp_bytes: int | None = None) -> torch.Tensor:
        """All of tensor `g`, assembled from its boxes into a new CPU tensor of `dtype`
        (default its own; another converts piece by piece, through temporaries of
        `temp_bytes` at most, never through a whole copy in the saved dtype)."""
        import torch

        from asyncckpt.torchutil.dtypes import DTYPES
        full = torch.empty(g.shape, dtype=dtype or DTYPES[g.dtype])
        plan = self.plan(temp_bytes)
        plan.add(g, (0,) * len(g.shape), full)
        plan.flush()
        return full

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Corruption found while reading a root's newest step names the newest intact one."""
        try:
            yield
        except CorruptCheckpointError as e:
            if self.root is None:
                raise
            raise _damaged_newest(self.root, self.directory, e, self.limits) from None

    def close(self) -> None:
        if self._readers is not None:
            self._readers.close()
            self._readers = None

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve(path: Location, step: int | None) -> tuple[Location, Location | None]:
    """(the checkpoint directory, the root when it was chosen as the root's newest)."""
    named = parse_step_dir(path.name)
    if is_dir(path) and (named is not None or is_file(path / MANIFEST_NAME)):
        if step is not None and named is not None and named != step:
            raise CheckpointNotFoundError(f"{path} is step {named}, not {step}", step=step,
                                          file=str(path))
        return path, None
    if step is not None:
        if storage_for(path).has_step(step):
            return path / step_dir_name(step), None
        linked = not isinstance(path, ObjectPath) and os.path.islink(path / step_dir_name(step))
        raise CheckpointNotFoundError(
            f"no committed checkpoint for step {step} in {path}" + (
                f" ({step_dir_name(step)} is a symlink: not a step of this root; open the "
                "directory it points to instead)" if linked else f" ({_holds(path)})"),
            step=step, file=str(path))
    steps = storage_for(path).step_dirs()
    if not steps:
        raise CheckpointNotFoundError(f"no committed checkpoint in {path}", file=str(path))
    return path / step_dir_name(steps[-1]), path


def _holds(root: Location) -> str:
    """What `root` holds instead, for an error: its committed steps (the first and the
    newest few of a long list), none, or that it does not exist."""
    if not is_dir(root):
        return "it does not exist"
    steps = storage_for(root).step_dirs()
    if not steps:
        return "it holds no committed step"
    shown = [str(s) for s in steps] if len(steps) <= 8 else (
        [str(steps[0]), "..."] + [str(s) for s in steps[-6:]])
    return f"its committed steps: {', '.join(shown)}" + (
        f" ({len(steps)} in all)" if len(steps) > 8 else "")


_RESOLVE_TRIES = 3  # listings of a root whose newest step vanished before it was examined

def _damaged_newest(root: Location, directory: Location, problem: CheckpointError,
                    limits: ReadLimits) -> CorruptCheckpointError:
    """The error for a root's damaged newest step, naming the newest intact step.

    The candidates are listed now, not when the load began, so a step a running writer
    committed meanwhile is one, and steps its retention removed are not. A candidate
    must pass `examine` and, when the damage was found in a frame's stored bytes
    (`problem.detail["stored_at"]`), hold no frame stored there: with incremental saves
    older and newer steps reference the same bytes, and would fail on them too.
    """
    damaged = parse_step_dir(directory.name)
    failed: Ref | None = problem.detail.get("stored_at")
    steps = storage_for(root).step_dirs()
    newer = [s for s in steps if damaged is not None and s > damaged]
    intact = next((s for s in reversed(steps) if s != damaged
                   and _intact(root / step_dir_name(s), limits, failed)), None)
    if not exists(directory):
        state = (f"step {damaged} was the newest step of {root} when this load began and is "
                 "gone now (a running writer's retention removes steps once newer ones commit)")
    elif newer:
        state = (f"step {damaged} was the newest step of {root} when this load began (step "
                 f"{newer[-1]} is now) and it is damaged")
    else:
        state = f"step {damaged} is the newest step of {root} and it is damaged"
    checks = "its manifest and files check" + (
        ", and it does not share the bytes that failed" if failed else "")
    hint = (f"the newest intact step is {intact} ({checks}): load it with step={intact}, or "
            "let Checkpointer.restore() fall back to it" if intact is not None
            else f"no {'other' if newer else 'older'} step is intact")
    return CorruptCheckpointError(
        f"{problem.cause}; {state}: {hint}",
        step=damaged if problem.step is None else problem.step, rank=problem.rank,
        file=problem.file, newest_intact=intact)


def _intact(directory: Location, limits: ReadLimits, failed: Ref | None) -> bool:
    """`directory` passes `examine`, and none of its frames is stored at `failed`."""
    opened, problems = Checkpoint.examine(directory, limits=limits)
    if opened is None or problems:
        return False
    step = opened.step
    return failed is None or not any(
        (f.ref or Ref(step, part.file, f.stored_offset, f.stored_length)) == failed
        for part in opened.manifest.ranks for f in part.frames)


def _rank_leaves(tensors: list[TensorSpec], tree: Any, sharded: dict[str, GlobalTensor],
                 rank: int, step: int) -> list[Leaf]:
    """Check rank `rank`'s tree against its tensor table; return its leaves.

    The tree must be well formed, reference each listed tensor exactly once, and every
    view must lie inside a plain tensor of its own dtype.
    """
    def bad(cause: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(cause, step=step, rank=rank, file=MANIFEST_NAME)
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
