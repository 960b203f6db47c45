"""The checks an opened checkpoint's structure passes before any of its data is read.

A manifest that parses is not yet a checkpoint to read: the directory must hold exactly
the manifest and the data files it names (nothing missing, nothing extra), the older
steps' files its reference frames name must be in the root, the boxes of each global
(DTensor) tensor must tile its shape, and each rank's object tree must reference exactly
its tensor table. All of it reads only the manifest and directory listings, so it is
cheap. Of a step saved by several nodes (a root manifest, its ranks' tables in part
files), the root and its node directories are checked at open and each rank when it is
first used, so a reader of one rank opens no other rank's part.

What is found is collected, not raised at once: `verify` reports every problem, and a
checkpoint with problems may still be read rank by rank except `unreadable_ranks`.
These checks are `Checkpoint`'s (read/checkpoint.py), kept apart from opening and
reading it; they keep what they find on it.
"""

from __future__ import annotations

import functools

from asyncckpt.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME, parse_node_entry
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import RankPart
from asyncckpt.format.tiling import GlobalTensor, global_tensors, rank_globals
from asyncckpt.read.leaves import Leaf, holds_global, rank_leaves
from asyncckpt.read.reader import open_referenced, referenced_files
from asyncckpt.storage.base import CheckpointDir, Storage
from asyncckpt.storage.paths import Location

__all__ = ["StructureChecks"]


class StructureChecks:
    """The structure checks of `Checkpoint`, which sets these attributes before calling
    `_check` (a single-file manifest) or `_check_root` (a root manifest)."""

    directory: Location
    manifest: Manifest
    storage: Storage
    _files: CheckpointDir
    problems: list[CheckpointError]
    unreadable_ranks: set[int]
    _sharded: dict[str, GlobalTensor] | None
    _leaves: dict[int, list[Leaf]]
    _lazy: bool
    _rank_problems: dict[int, list[CheckpointError]]
    _nodes: dict[int, tuple[set[str], list[CheckpointError]]]

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

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
