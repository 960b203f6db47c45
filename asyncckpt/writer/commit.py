"""Commit protocol: a checkpoint becomes visible in one atomic step.

Everything is written into a step's tmp area and made durable, then `Storage.publish`
writes the manifest and makes the step committed in one atomic operation (on POSIX: the
manifest's own tmp file, fsync, rename, then the directory's rename and the root's
fsync: storage/posix.py), and only then is `latest` replaced. A crash at any point
leaves either the previous checkpoint or the new one, never a mix: a step without the
manifest is never a checkpoint, and tmp areas are swept when a writer next takes the
root. `latest` is derived from what is on disk, never from memory, so it cannot name a
step that is not there.

Object stores have no atomic directory rename; their `publish` writes the manifest last
as the commit marker instead (docs/FORMAT.md). For several nodes the same sequence runs
once, by the leader, after every node's part has arrived: each node's files sit in a
folder of its own, which the node moves into the save's shared tmp directory
(`place_node`, shared.py), so the leader lists that directory once and renames it once,
and writes a root manifest that lists the node parts instead of every rank's tables
(`gather_nodes`): its file-system work does not grow with nodes (a node whose folder is
elsewhere costs it one rename), and a reader reads only the parts it needs.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncckpt.config import ReadLimits
from asyncckpt.errors import (
    CorruptCheckpointError,
    DiskFullError,
    SaveFailedError,
)
from asyncckpt.format.layout import (
    LATEST_NAME,
    parse_node_entry,
    step_dir_name,
)
from asyncckpt.format.parts import PartEntry, node_part, parse_rank_part
from asyncckpt.format.records import RankPart
from asyncckpt.format.timeline import Timeline
from asyncckpt.ipc.messages import NodePart
from asyncckpt.runtime import faults
from asyncckpt.storage.base import HeldSteps, Storage
from asyncckpt.storage.paths import Location
from asyncckpt.storage.timeline import is_live, read_current
from asyncckpt.writer import shared
from asyncckpt.writer.owners import OwnerMark

log = logging.getLogger("asyncckpt.writer")


def make_tmp_dir(storage: Storage, step: int, owner: OwnerMark | None = None) -> Location:
    """A new tmp area for `step`, named for its `owner` writer if given."""
    return storage.make_tmp(step, owner.tmp_name(step_dir_name(step)) if owner else None)


def publish(storage: Storage, tmp_dir: Location, step: int, manifest: bytes, *,
            replace: bool = False) -> Location:
    """Make `tmp_dir`, with `manifest`, the committed step `step`; then point `latest`
    at the newest committed step (`publish_listed`, which says more)."""
    return publish_listed(storage, tmp_dir, step, manifest, replace=replace)[0]


def publish_listed(storage: Storage, tmp_dir: Location, step: int, manifest: bytes, *,
                   replace: bool = False, current: Timeline | None = None
                   ) -> tuple[Location, HeldSteps | None]:
    """Make `tmp_dir`, with `manifest`, the committed step `step`; then point `latest`
    at the newest committed step. Returns the step's location and the root's steps as
    `latest` was decided from (one listing, after the publish: the committer's
    retention works from it), or None where `latest` was not updated.

    Every data file in `tmp_dir` must already be durable. With `replace`, a committed
    step of this number is swapped out in the same atomic step (the caller has made sure
    nothing references it) and then deleted: a crash leaves the old step or the new one,
    never neither. `current`: the root's timeline as the commit settled it (None: read
    it).

    Raises:
        SaveFailedError: the step is already committed (and not `replace`), or an I/O
            error (DiskFullError when the disk is full); the tmp directory is then left
            for the caller to discard and nothing new becomes visible.
    """
    try:
        final = storage.publish(tmp_dir, step, manifest, replace=replace)
    except OSError as e:
        raise io_error(e, step=step, file=str(e.filename or storage.root / step_dir_name(step))
                       ) from e
    held = None
    try:  # its manifest was checked before it was written
        held = update_latest(storage, trusted=step, current=current)
    except OSError as e:  # the step is committed; `latest` is redone at the next commit or start
        log.warning("step %d committed but %s not updated: %s", step, LATEST_NAME, e)
    return final, held


def write_node_part(storage: Storage, tmp_dir: Location, step: int,
                    parts: list[RankPart]) -> dict[str, Any]:
    """Write the part files of a node's ranks `parts` (consecutive, their data files
    already fsynced in the node's folder), one a rank (`node-00008/rank-00009.json`),
    and return the root manifest's entry for the node, as JSON, for the node's lead rank
    to announce.

    Each file is parsed back with the reader's rules first, so a node never announces
    what `load` would refuse. They are made durable (each fsynced, then the node's
    folder): the leader does not read them, it only lists them, and their sizes and
    checksums go into the root manifest, which is made durable before the step is visible.

    Raises:
        CorruptCheckpointError: a rank's part breaks a reader's rule.
        OSError: they cannot be written.
    """
    entry, files = node_part(step, parts)
    limits = ReadLimits.from_env()
    for part, (name, data) in zip(parts, files.items()):
        if len(data) > limits.max_manifest_bytes:
            raise CorruptCheckpointError(f"{name} would be {len(data)} bytes, over the "
                                         f"{limits.max_manifest_bytes} bytes a reader accepts "
                                         "(max_manifest_bytes)", step=step, rank=part.rank)
        parse_rank_part(data, step=step, entry=entry, rank=part.rank,
                        max_frame_bytes=limits.max_frame_bytes)
    storage.write_node_part(tmp_dir, files)
    return entry.to_json()


def place_node(storage: Storage, tmp_dir: Location, step: int, entry: dict[str, Any],
               shared_dir: str | None) -> str:
    """A node's side, once its part is durable (`write_node_part` returned `entry`):
    check its folder as the leader used to (one listing, on the node), then move it into
    the save's shared tmp directory `shared_dir` (shared.place). Returns the name its
    lead announces: `shared_dir`, or `tmp_dir`'s own where nothing is shared.

    Raises:
        SaveFailedError: the folder does not hold what its part says, or shared.place's.
        OSError: the folder cannot be listed or moved.
    """
    if shared_dir is None or storage.local_dir() is None:
        return tmp_dir.name
    part = PartEntry.from_json(entry, step=step,
                               max_size=ReadLimits.from_env().max_manifest_bytes)
    _check_node_folder(part, storage.names(tmp_dir / part.dir), step, tmp_dir)
    return shared.place(storage, tmp_dir, step, part.dir, shared_dir)


def commit_dir(storage: Storage, tmp_dir: Location, nodes: tuple[NodePart, ...]) -> Location:
    """The directory the leader commits from: the shared tmp directory its own node (the
    one of rank 0) announced, else its own tmp directory `tmp_dir`. The leader's writer
    has checked that its node's announcement is where it put its folder
    (`SeveralNodes.commit_nodes`)."""
    lead = next((node.tmp for node in nodes if node.first == 0), None)
    return storage.root / lead if lead is not None and shared.is_shared(lead) else tmp_dir


def gather_nodes(storage: Storage, tmp_dir: Location, step: int, world_size: int,
                 nodes: tuple[NodePart, ...]) -> list[PartEntry]:
    """The leader's half of a several-node commit: check that the announced nodes tile
    the world, and gather every node's folder in `tmp_dir`. Where `tmp_dir` is the
    save's shared tmp directory (`commit_dir`), the nodes that announced it put their
    folders there themselves and checked them (`place_node`): it is listed once, and
    must hold exactly the announced nodes' folders. Any other node's folder is moved in
    (one rename a node; the nodes share the file system; each node's writer removes its
    emptied tmp directory once it hears the outcome, `drop_own_tmp`, off the commit's
    path) and listed once, to check that it holds a part file and one data file for each
    of its ranks and nothing else. A node's part files are not read: their sizes and
    checksums go into the root manifest, which the reader checks each file against. On an object
    store every node wrote in its own attempt folder of the step, so nothing moves: the
    folder's listing is one LIST request, and the committing attempt's folder maps each node
    to its folder (storage/s3keys.py).

    Args:
        nodes: per node (first rank, count, its tmp directory's name, its part entry).
    Returns:
        The root manifest's part entries, in rank order.
    Raises:
        SaveFailedError: nodes that do not tile the world, a name that is not a tmp
            directory of `step` (on an object store: not the step's prefix), an entry
            that is not its node's, a node folder missing or not holding its ranks'
            files, or an I/O error.
    """
    plan, end = [], 0
    limit = ReadLimits.from_env().max_manifest_bytes
    checked: set[str] = set()  # names found good (the nodes of a shared directory: one)
    try:
        for first, count, name, doc in sorted(nodes, key=lambda node: node[0]):
            entry = PartEntry.from_json(doc, step=step, max_size=limit)
            if first != end or entry.first != first or entry.count != count or count < 1:
                raise SaveFailedError(f"the nodes do not tile ranks 0..{world_size - 1}: node "
                                      f"[{first}, {count}] (its part says [{entry.first}, "
                                      f"{entry.count}]) after rank {end - 1}", step=step,
                                      rank=first)
            end = first + count
            problem = None if name in checked else storage.check_node_tmp(tmp_dir, step, name)
            if problem is not None:  # every node's tmp area (on an object store: its folder)
                raise SaveFailedError(f"node of rank {first} announced {name!r:.80}, {problem}",
                                      step=step, rank=first)
            checked.add(name)  # a name, not a node: checked once however many share it
            plan.append((entry, name))
        if end != world_size:
            raise SaveFailedError(f"the nodes cover ranks 0..{end - 1} of {world_size}",
                                  step=step)

        def move_and_list(item: tuple[PartEntry, str]) -> set[str]:
            entry, name = item
            return storage.gather_node(tmp_dir, name, entry.dir)

        placed = shared.is_shared(tmp_dir.name, step)  # its nodes put their folders there
        moved = [item for item in plan if not (placed and item[1] == tmp_dir.name)]
        if moved:  # one node's two calls wait on the file system (a network round trip
            # each on NFS or Lustre), not on us: a few nodes at a time
            with ThreadPoolExecutor(min(16, len(moved)),
                                    thread_name_prefix="asyncckpt-gather") as pool:
                listings = list(pool.map(move_and_list, moved))
            for (entry, _), names in zip(moved, listings):
                _check_node_folder(entry, names, step, tmp_dir)
        if placed:
            shared.check_listing(storage.names(tmp_dir), {entry.dir for entry, _ in plan},
                                 step, tmp_dir)
    except FileNotFoundError as e:
        raise SaveFailedError(f"a node's folder is missing: {e}", step=step,
                              file=str(tmp_dir)) from None
    except OSError as e:
        raise io_error(e, step=step, file=str(e.filename or tmp_dir)) from e
    except CorruptCheckpointError as e:
        raise SaveFailedError(f"a node's part entry is unusable: {e.cause}", step=step) from None
    faults.point("parts_gathered")
    return [entry for entry, _ in plan]


def drop_emptied(storage: Storage, tmp_dir: Location, nodes: tuple[NodePart, ...]) -> None:
    """After the commit: remove the other nodes' tmp directories that `gather_nodes`
    emptied, all at once (a tool's or a test's cleanup: the writers each drop their own,
    `drop_own_tmp`). One that is not empty (or gone) stays for the sweep."""
    storage.drop_node_tmps(tmp_dir, {node[2] for node in nodes})


def drop_own_tmp(storage: Storage, step: int, tmp_dir: Location,
                 also: Collection[str] = ()) -> None:
    """A node's writer, once it heard that coordinated `step` committed: remove its tmp
    directory `tmp_dir`, which its `place_node` or the leader's `gather_nodes` emptied,
    and the shared directories `also` its folder went through (gone: it became the step;
    emptied: the leader took the folder from there). One rmdir each on each
    node, after its ranks were told, so that the leader's commit waits on no
    file-system work a node. A directory that is not empty (its folder was not taken)
    or is gone (the leader's own: it became the step) is left as it is; a crash before
    this leaves an empty tmp directory, never part of a step, which the next writer to
    take the root first sweeps (owners.py for the dead writers' ones)."""
    storage.drop_node_tmps(storage.root / step_dir_name(step), {tmp_dir.name, *also})


def _check_node_folder(entry: PartEntry, names: set[str], step: int,
                       tmp_dir: Location) -> None:
    """A node's folder holds, for each of its ranks, its part file and one data file,
    and nothing else (what a reader accepts: it checks each file's size, checksum and
    codec).

    Raises:
        SaveFailedError: it does not.
    """
    parts, data, other = set(), {r: 0 for r in entry.ranks}, []
    for name in names:
        parsed = parse_node_entry(name)
        if parsed is None or parsed[0] not in data:
            other.append(name)
        elif parsed[1]:
            parts.add(parsed[0])
        else:
            data[parsed[0]] += 1
    missing = [r for r in entry.ranks if r not in parts or data[r] != 1]
    if missing or other:
        rank = missing[0] if missing else entry.first
        raise SaveFailedError(
            f"{entry.dir} does not hold a part file and one data file for each of ranks "
            f"{entry.first}..{entry.first + entry.count - 1} and nothing else"
            + (f": rank {rank} has {'a' if rank in parts else 'no'} part file and "
               f"{data[rank]} data files" if missing else "")
            + (f"; it holds {sorted(other)[:5]!r}" if other else ""),
            step=step, rank=rank, file=str(tmp_dir / entry.dir))


def update_latest(storage: Storage, trusted: int | None = None, *,
                  current: Timeline | None = None) -> HeldSteps | None:
    """Point `latest` at the newest committed live step on disk whose manifest parses (a
    planted or damaged newer directory, or a step of an abandoned timeline, is passed
    over), or remove it if there is none. Step `trusted` (one just committed) is taken
    without parsing its manifest again; `current`, the root's timeline, without reading
    it again. Returns the root's steps as listed for it (one listing).

    A damaged root timeline file leaves `latest` as it is (a hint: readers decide from
    the disk, and report the file), with a warning, and returns None.

    Raises:
        OSError: `latest` could not be replaced.
    """
    try:
        current = read_current(storage) if current is None else current
    except CorruptCheckpointError as e:
        log.warning("%s not updated: %s", LATEST_NAME, e)
        return None
    held = storage.held_steps()
    steps = list(held.committed)
    while steps and steps[-1] != trusted and (not _manifest_parses(
            storage, storage.root / step_dir_name(steps[-1]))
            or is_live(storage, steps[-1], current) is False):
        steps.pop()
    if not steps:
        storage.write_latest(None)
    elif storage.read_latest() != steps[-1]:
        storage.write_latest(steps[-1])
    return held


def _manifest_parses(storage: Storage, directory: Location) -> bool:
    try:
        storage.read_manifest(directory)
    except CorruptCheckpointError:
        return False
    return True


def io_error(e: OSError, **where: object) -> SaveFailedError:
    """Turn an OSError into the SaveFailedError the caller sees."""
    cls = DiskFullError if e.errno in (errno.ENOSPC, errno.EDQUOT) else SaveFailedError
    what = "disk full" if cls is DiskFullError else "I/O error"
    return cls(f"{what}: {e.strerror or e}", **where)  # type: ignore[arg-type]
