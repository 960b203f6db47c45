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

Everything in 2-4 reads only the manifest and a directory listing, so it is cheap; the
data is verified frame by frame as it is read (or all of it by `verify`). Of a step saved
by several nodes (a root manifest, its ranks' tables in part files: format/parts.py),
opening checks the root and lists its node directories, and 3-4 run for a rank when it
is first used: loading one rank reads its own part file and opens no other rank's. Every
rank's boxes of a global (DTensor) tensor, and the tiling check, are read only when a
box the rank did not save is needed (never by the same-world resume: read/loader.py);
`examine` (what `verify` uses) checks every rank part at once. torch is imported only
where a tensor is made, so `verify`, `ls`, `inspect` and `copy` start in a fraction of
a second.

A root opened without a step means its newest `step-N` directory; a damaged newest step
is an error naming the newest intact one (read/resolve.py says why and which).

Every read of 2-5 goes through the one directory handle of 1, never by path again: a
save with `replace=True` exchanges a step's directory under its name while loads may be
reading it, and a load must read one version of it whole (storage/posix_read.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME, parse_node_entry, parse_step_dir
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import RankPart
from asyncckpt.format.tiling import GlobalTensor, global_tensors, rank_globals
from asyncckpt.read.leaves import Leaf, holds_global, rank_leaves
from asyncckpt.read.reader import RankReader, Readers, open_referenced, referenced_files
from asyncckpt.read.resolve import RESOLVE_TRIES, damaged_newest, resolve
from asyncckpt.storage.base import CheckpointDir
from asyncckpt.storage.paths import Location
from asyncckpt.storage.registry import hold_checkpoint_dir, parse, storage_at

if TYPE_CHECKING:
    import torch

    from asyncckpt.read.sharded import ReadPlan


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

    def _check(self) -> None:
        """A single-file manifest's checks, all at once."""
        ranks = list(self.manifest.ranks)
        self.problems += self._check_files(self.directory, {MANIFEST_NAME}, ranks, "")
        self.problems += self._check_refs(ranks)
        try:
            self._sharded = global_tensors(self.manifest)
        except CheckpointError as e:
            self.problems.append(e)
            self._sharded = {}
        self.problems += self._check_leaves(ranks, MANIFEST_NAME)

    def _check_root(self, whole: bool) -> None:
        """A root manifest's checks: the step directory holds exactly it and its node
        directories; with `whole`, every rank's checks (`_check_rank`) and every
        node's sums too."""
        parts = self.manifest.parts or []
        expected = {MANIFEST_NAME} | {e.dir for e in parts}
        try:
            present = self._files.entries()
        except OSError as e:
            present = set(expected)
            self.problems.append(CorruptCheckpointError(f"cannot list: {e.strerror or e}",
                                                        step=self.step, file=str(self.directory)))
        self.problems += self._unexpected(expected, present, self.directory)
        for index, entry in enumerate(parts):
            if entry.dir not in present:
                missing = CorruptCheckpointError(
                    f"missing node directory {entry.dir!r} (ranks {entry.first}.."
                    f"{entry.first + entry.count - 1})", step=self.step, file=str(self.directory))
                self.problems.append(missing)
                self._nodes[index] = (set(), [missing])
                self.unreadable_ranks.update(entry.ranks)
        if not whole:
            return
        ranks = self.manifest.ranks
        for index, entry in enumerate(parts):
            if index in self._nodes:
                continue  # missing
            self._node(index)
            for rank in entry.ranks:
                try:
                    ranks[rank]
                except CheckpointError as e:
                    self.problems.append(e)
                    self._rank_problems[rank] = [e]
                    self.unreadable_ranks.add(rank)
            if not self.unreadable_ranks.intersection(entry.ranks):
                try:
                    ranks.load(index)  # type: ignore[attr-defined]  # the node's sums
                except CheckpointError as e:
                    self.problems.append(e)
        self._sharded = {}
        if not self.unreadable_ranks:
            try:  # of the ranks read (a node whose sums fail still has them)
                self._sharded = global_tensors(Manifest(self.step, self.world_size, [
                    ranks[r] for r in range(self.world_size)]))
            except CheckpointError as e:
                self.problems.append(e)
        for rank in range(self.world_size):
            self._check_rank(rank)

    def _node(self, index: int) -> tuple[set[str], list[CheckpointError]]:
        """Node directory `index` listed, once: the names in it, and what is wrong there
        (a name that is none of its ranks' part and data files, a rank with several data
        files). Each rank's own files are its own check (`_check_rank`): together they
        make the rule that a node directory holds exactly its ranks' part and data files,
        while a reader of one rank looks at no other rank's file."""
        known = self._nodes.get(index)
        if known is not None:
            return known
        entry = self.manifest.parts[index]  # type: ignore[index]
        directory = self.directory / entry.dir
        problems: list[CheckpointError] = []
        try:
            names = self._files.names(entry.dir)
        except OSError as e:
            names = set()
            problems.append(CorruptCheckpointError(
                "a symlink, not a directory of the step" if self.storage.is_link(directory)
                else f"cannot list: {e.strerror or e}", step=self.step, file=str(directory)))
        data: dict[int, list[str]] = {}
        plausible = set()
        for name in names:
            parsed = parse_node_entry(name)
            if parsed is not None and parsed[0] in entry.ranks:
                plausible.add(name)
                if not parsed[1]:
                    data.setdefault(parsed[0], []).append(name)
        problems += self._unexpected(plausible, names, directory)
        for rank, files in sorted(data.items()):
            if len(files) > 1:
                problems.append(CorruptCheckpointError(
                    f"unexpected file: rank {rank} has {len(files)} data files in the checkpoint "
                    f"directory ({', '.join(repr(f) for f in sorted(files))}), one a rank",
                    step=self.step, file=str(directory)))
        self.problems += problems
        self._nodes[index] = (names, problems)
        return names, problems

    def _check_rank(self, rank: int) -> None:
        """Rank `rank`'s checks (of a root), once: its node directory's (`_node`), its
        part file (read and checked against the root), its data file in its node
        directory, the files its reference frames name, its tree."""
        if rank in self._rank_problems:
            return
        index = self.manifest.ranks.part_of(rank)  # type: ignore[attr-defined]
        entry = self.manifest.parts[index]  # type: ignore[index]
        names, problems = self._node(index)
        problems = list(problems)
        self._rank_problems[rank] = problems
        if not names and problems:  # its node directory is missing, or cannot be listed
            self.unreadable_ranks.add(rank)
            return
        try:
            part = self.manifest.ranks[rank]
        except CheckpointError as e:
            problems.append(e)
            self.problems.append(e)
            self.unreadable_ranks.add(rank)
            return
        own = self._check_files(self.directory / entry.dir, set(), [part], entry.dir + "/", names)
        own += self._check_refs([part])
        own += self._check_leaves([part], entry.name(rank))
        problems += own
        self.problems += own

    def _check_files(self, directory: Location, others: set[str], ranks: list[RankPart],
                     prefix: str, present: set[str] | None = None) -> list[CheckpointError]:
        """`directory` holds exactly `others` and the data files of `ranks` (named
        `prefix` + the file's name in it); a rank whose file is missing is unreadable.
        Given `present` (what a node directory holds, listed and checked by `_node`),
        only that `ranks`' data files are among it."""
        step, listed, problems = self.step, present is not None, list[CheckpointError]()
        if present is None:  # the checkpoint directory itself
            try:
                present = self._files.names()
            except OSError as e:
                present = set()
                problems.append(CorruptCheckpointError(f"cannot list: {e.strerror or e}",
                                                       step=step, file=str(directory)))
        for part in ranks:
            if part.file.removeprefix(prefix) not in present:
                problems.append(CorruptCheckpointError(f"missing file {part.file!r}", step=step,
                                                       rank=part.rank, file=str(directory)))
                self.unreadable_ranks.add(part.rank)
        if listed:
            return problems
        for name in sorted(others - present):
            problems.append(CorruptCheckpointError(f"missing file {prefix + name!r}", step=step,
                                                   file=str(directory)))
        expected = others | {p.file.removeprefix(prefix) for p in ranks}
        return problems + self._unexpected(expected, present, directory)

    def _unexpected(self, expected: set[str], present: set[str],
                    directory: Location) -> list[CheckpointError]:
        return [CorruptCheckpointError(f"unexpected file {name!r} in the checkpoint directory",
                                       step=self.step, file=str(directory))
                for name in sorted(present - expected)]

    def _check_refs(self, ranks: list[RankPart]) -> list[CheckpointError]:
        """Incremental saves: the older steps' files `ranks` reference are in the root."""
        problems: list[CheckpointError] = []
        for part in ranks:
            for step_, name in referenced_files(part):
                try:
                    open_referenced(self.storage, step_, name, functools.partial(
                        CorruptCheckpointError, step=self.step, rank=part.rank,
                        file=str(self.directory))).close()
                except CorruptCheckpointError as e:
                    problems.append(e)
                    self.unreadable_ranks.add(part.rank)
        return problems

    def _check_leaves(self, ranks: list[RankPart], file: str) -> list[CheckpointError]:
        """Each rank's tree against its tensor table, its leaves kept. Those of a global
        tensor hold every rank's boxes if `sharded` is known, else (a root opened
        lazily) this rank's, and ask for every rank's (`sharded`) when used whole."""
        problems = []
        for part in ranks:
            try:
                sharded, whole = self._sharded, None
                if sharded is None:
                    sharded = rank_globals(part, self.step) if holds_global(part.tree) else {}
                    whole = self._every_box
                self._leaves[part.rank] = rank_leaves(part.tensors, part.tree, sharded,
                                                       part.rank, self.step, file, whole)
            except CheckpointError as e:
                problems.append(e if e.file is not None else CorruptCheckpointError(
                    e.cause, step=self.step, rank=part.rank, file=file))
                self.unreadable_ranks.add(part.rank)
        return problems

    def _every_box(self, name: str) -> GlobalTensor:
        return self.sharded[name]

    def _ready(self, rank: int) -> int:
        """`rank`, checked (of a root opened lazily: raising the first problem found,
        one of this rank's if any)."""
        if self.manifest.parts is not None:
            self._check_rank(rank)
            problems = self._rank_problems[rank]
            if self._lazy and problems:
                raise next((p for p in problems if p.rank == rank), problems[0])
        return rank

    @property
    def sharded(self) -> dict[str, GlobalTensor]:
        """The global (DTensor) tensors by name, their boxes checked to tile (of a root
        opened lazily: computed on first use, reading every rank's part file).

        Raises:
            CorruptCheckpointError: (a root opened lazily) a part file or the tiling fails.
        """
        if self._sharded is None:
            self._sharded = global_tensors(self.manifest)
        return self._sharded

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

