"""One opened checkpoint: resolved, its manifest and structure checked once, then read.

`load`, `export_hf`, `verify` and the CLI all open a checkpoint here, so there is one
answer to "which directory", "is this manifest to be trusted" and "which tensors make up
this rank's state", and the checks run once per open instead of once per caller:

1. resolve the path: a checkpoint directory, a root and a step, or a root's newest step,
   and hold the directory open (`Storage.open_checkpoint_dir`);
2. read the manifest (size-bounded, checksummed, every field validated);
3. check the directory holds exactly the manifest and the data files it names, and
   that the older steps' files its reference frames name are in the root;
4. check the global (sharded) tensors tile their shapes, and each rank's object tree
   references exactly its tensor table (views only inside their base);
5. read: `RankReader`s opened on first use and sharing one pool of frame threads, and a
   `ReadPlan` that fills any box of any tensor from the saved boxes.

Steps 3-4 are read/checks.py's. Everything in 2-4 reads only the manifest and a
directory listing, so it is cheap; the data is verified frame by frame as it is read (or
all of it by `verify`). Of a step saved by several nodes (a root manifest, its ranks'
tables in part files: format/parts.py), opening checks the root and lists its node
directories, and 3-4 run for a rank when it is first used: loading one rank reads its
own part file and opens no other rank's. Every rank's boxes of a global (DTensor)
tensor, and the tiling check, are read only when a box the rank did not save is needed
(never by the same-world resume: read/loader.py); `examine` (what `verify` uses) checks
every rank part at once. torch is imported only where a tensor is made, so `verify`,
`ls`, `inspect` and `copy` start in a fraction of a second.

A root opened without a step means its newest `step-N` directory; a damaged newest step
is an error naming the newest intact one (read/resolve.py says why and which).

Every read of 2-5 goes through the one directory handle of 1, never by path again: a
save with `replace=True` exchanges a step's directory under its name while loads may be
reading it, and a load must read one version of it whole (storage/posix_read.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME, parse_step_dir
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.tiling import GlobalTensor
from asyncckpt.read.checks import StructureChecks
from asyncckpt.read.leaves import Leaf
from asyncckpt.read.reader import RankReader, Readers
from asyncckpt.read.resolve import RESOLVE_TRIES, damaged_newest, resolve
from asyncckpt.storage.base import CheckpointDir
from asyncckpt.storage.paths import Location
from asyncckpt.storage.registry import hold_checkpoint_dir, parse, storage_at

if TYPE_CHECKING:
    import torch

    from asyncckpt.read.sharded import ReadPlan


class Checkpoint(StructureChecks):
    """An opened checkpoint. Use `Checkpoint.open` (or `examine`), then read; close it
    (or use `with`) to close its data files and threads.

    Attributes:
        directory: the checkpoint directory.
        manifest: its manifest, checked.
        limits: the reader limits it was opened with.
        sharded: the global (DTensor) tensors by name, their boxes checked to tile.
        root: the root it was found in when opened as "the newest step of a root" (then
            corruption found while reading names the newest intact step), else None.
        problems: what `examine` found wrong (empty for an opened checkpoint; of a
            manifest in parts opened lazily, what the ranks checked so far found).
        storage: the root holding `directory`, where its files and the files its
            reference frames name are opened.
    """

    def __init__(self, directory: Location, manifest: Manifest, limits: ReadLimits, *,
                 whole: bool = True, files: CheckpointDir | None = None) -> None:
        """Check `manifest`'s checkpoint `directory`; of a manifest in parts, only the
        root and the step directory unless `whole` (each rank is checked on first use).
        `files`: the directory as the manifest was read from it (default: opened now);
        the checkpoint closes it."""
        self.directory, self.manifest, self.limits = directory, manifest, limits
        self._files = files or storage_at(directory).open_checkpoint_dir(directory)
        self.storage = self._files.storage
        self.root: Location | None = None
        self.problems: list[CheckpointError] = []
        self.unreadable_ranks: set[int] = set()
        self._sharded: dict[str, GlobalTensor] | None = None
        self._leaves: dict[int, list[Leaf]] = {}
        self._readers: Readers | None = None
        self._scratch: Any = None  # the temporaries of plans given temp_bytes
        self._lazy = manifest.parts is not None and not whole
        self._rank_problems: dict[int, list[CheckpointError]] = {}  # ranks of a root checked
        # node directories (by part index) listed: the names in it, what is wrong there
        self._nodes: dict[int, tuple[set[str], list[CheckpointError]]] = {}
        if manifest.parts is None:
            self._check()
        else:
            self._check_root(whole)

    # -- opening ----------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], step: int | None = None, *,
             limits: ReadLimits | None = None) -> Checkpoint:
        """Open the checkpoint `path` (a checkpoint directory or a root) and `step` name.

        Args:
            path: a checkpoint directory, or a root: then `step`, or its newest step.
            limits: reader limits (default `ReadLimits.from_env()`).
        Raises:
            CheckpointNotFoundError: nothing committed there, or no such step.
            CorruptCheckpointError: the manifest, the directory's files or the trees fail
                their checks; for a root's newest step, the message names the newest
                intact step (`error.detail["newest_intact"]`, or None: read/resolve.py).
        """
        limits = limits or ReadLimits.from_env()
        for _ in range(RESOLVE_TRIES):
            directory, root = resolve(parse(path), step)
            opened, problems, replaced = cls._examine(directory, limits, whole=False)
            # again if a replacing save swapped (or set aside) what was read, or the newest
            # step went since it was listed (a running writer's retention took it)
            if not problems or not (replaced or root is not None
                                    and not storage_at(directory).exists(directory)):
                break
            if opened is not None:
                opened.close()
        if problems:
            if opened is not None:
                opened.close()
            if root is not None:
                raise damaged_newest(root, directory, problems[0], limits, cls.examine)
            raise problems[0]
        assert opened is not None
        opened.root = root
        return opened

    @classmethod
    def examine(cls, directory: str | os.PathLike[str], *, limits: ReadLimits | None = None,
                whole: bool = True) -> tuple[Checkpoint | None, list[CheckpointError]]:
        """Read and check `directory` as a checkpoint, collecting every problem found.

        Args:
            whole: check every rank part of a manifest in parts now (else each rank
                when it is first used, raising what it finds then).
        Returns:
            (the checkpoint, or None when its manifest cannot be used; the problems).
            A checkpoint with problems may still be read rank by rank, except the ranks
            in `unreadable_ranks`. Close it after use.
        """
        opened, problems, _ = cls._examine(directory, limits or ReadLimits.from_env(), whole)
        return opened, problems

    @classmethod
    def _examine(cls, directory: str | os.PathLike[str], limits: ReadLimits, whole: bool
                 ) -> tuple[Checkpoint | None, list[CheckpointError], bool]:
        """`examine`, and whether a replacing save swapped the directory while it was
        read (so that its problems may be that, not damage)."""
        directory, files, back = hold_checkpoint_dir(parse(directory))
        try:
            if files is None or not files.has(MANIFEST_NAME):
                return None, [CorruptCheckpointError(
                    f"{directory.name} has no {MANIFEST_NAME}: not a checkpoint (its manifest "
                    "was deleted, or it was never committed)",
                    step=parse_step_dir(directory.name), file=str(directory))], (
                        files.replaced() if files is not None else back)
            manifest = files.read_manifest(limits)
            opened = cls(directory, manifest, limits, whole=whole, files=files)
        except CheckpointError as e:
            return None, [e], files is not None and files.replaced()
        finally:
            if files is not None and "opened" not in locals():
                files.close()
        return opened, opened.problems, bool(opened.problems) and files.replaced()

    # -- what it holds ----------------------------------------------------------------

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
        """Rank `rank`'s tensor leaves, in tree order (a global tensor's: this rank's
        boxes at once, `Leaf.tensor` every rank's, read and checked to tile if they are
        not yet: see `Leaf`)."""
        return self._leaves[self._ready(self.check_rank(rank))]

    def tree(self, rank: int) -> Any:
        return self.manifest.ranks[self._ready(self.check_rank(rank))].tree

    # -- reading ----------------------------------------------------------------------

    def reader(self, rank: int, prefetch: int = 0) -> RankReader:
        """Rank `rank`'s verified reader (opened, and its header checked, on first use;
        then the kernel is asked to start reading its first `prefetch` raw bytes)."""
        if self._readers is None:
            self._readers = Readers(self.directory, self.manifest,
                                    self.storage.read_threads or self.limits.read_threads,
                                    self.storage, self._files)
        return self._readers(self._ready(self.check_rank(rank)), prefetch)

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

    def swapped(self) -> bool:
        """Another version of the step is at its name now than the one this checkpoint
        holds (a replacing save committed meanwhile), or none: what failed reading it
        may succeed on a new open (`read_retrying`)."""
        return self._files.replaced()

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Corruption found while reading a root's newest step names the newest intact one
        (unless the step was swapped meanwhile: see `read_retrying`)."""
        try:
            yield
        except CorruptCheckpointError as e:
            if self.root is None or self.swapped():
                raise
            raise damaged_newest(self.root, self.directory, e, self.limits,
                                 self.examine) from None

    def close(self) -> None:
        """Close its data files, threads and directory (idempotent). A root manifest's
        rank parts not read by then are read by path if asked for later."""
        if self._readers is not None:
            self._readers.close()
            self._readers = None
        self._files.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

