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
folder of its own, so the leader moves one folder a node, never a file a rank, and
writes a root manifest that lists the node parts instead of every rank's tables
(`gather_nodes`): its work grows with nodes, and a reader reads only the parts it needs.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from asyncckpt.config import ReadLimits
from asyncckpt.errors import (
    CorruptCheckpointError,
    DiskFullError,
    SaveFailedError,
    WriterLockedError,
)
from asyncckpt.format.layout import (
    LATEST_NAME,
    LOCK_NAME,
    ROOT_ID_NAME,
    is_tmp_dir,
    parse_node_entry,
    step_dir_name,
    tmp_step_of,
)
from asyncckpt.format.parts import PartEntry, node_part, parse_rank_part
from asyncckpt.format.records import RankPart
from asyncckpt.ipc.messages import NodePart
from asyncckpt.runtime import faults
from asyncckpt.storage.base import Storage
from asyncckpt.storage.durable import fsync_path
from asyncckpt.storage.location import read_manifest_at
from asyncckpt.storage.posix import read_small_file
from asyncckpt.storage.s3 import S3Storage
from asyncckpt.storage.s3keys import is_attempt_name
from asyncckpt.writer.owners import OwnerMark

log = logging.getLogger("asyncckpt.writer")


def make_tmp_dir(storage: Storage, step: int, owner: OwnerMark | None = None) -> Path:
    """A new tmp area for `step`, named for its `owner` writer if given."""
    return storage.make_tmp(step, owner.tmp_name(step_dir_name(step)) if owner else None)


def publish(storage: Storage, tmp_dir: Path, step: int, manifest: bytes, *,
            replace: bool = False) -> Path:
    """Make `tmp_dir`, with `manifest`, the committed step `step`; then point `latest`
    at the newest committed step.

    Every data file in `tmp_dir` must already be durable. With `replace`, a committed
    step of this number is swapped out in the same atomic step (the caller has made sure
    nothing references it) and then deleted: a crash leaves the old step or the new one,
    never neither.

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
    try:
        update_latest(storage, trusted=step)  # its manifest was checked before it was written
    except OSError as e:  # the step is committed; `latest` is redone at the next commit or start
        log.warning("step %d committed but %s not updated: %s", step, LATEST_NAME, e)
    return final


def write_node_part(storage: Storage, tmp_dir: Path, step: int,
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
    for name, data in files.items():
        faults.io("write", tmp_dir / name)
        if isinstance(storage, S3Storage):
            storage.put_key((tmp_dir / name).key, data)
        else:
            _write_new(tmp_dir / name, data)
    if not isinstance(storage, S3Storage):
        fsync_path(tmp_dir / entry.dir)
    return entry.to_json()


def _write_new(path: Path, data: bytes) -> None:
    """Create `path` (it must not exist: a node's folder is new for each save) holding
    `data`, fsynced (its directory is fsynced by the caller, once for all its files)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        faults.io("fsync", path)
        os.fsync(fd)
    finally:
        os.close(fd)


def gather_nodes(storage: Storage, tmp_dir: Path, step: int, world_size: int,
                 nodes: tuple[NodePart, ...]) -> list[PartEntry]:
    """The leader's half of a several-node commit: check that the announced nodes tile
    the world, and move each other node's folder into `tmp_dir` (one rename a node; the
    nodes share the file system; `drop_emptied` removes their emptied tmp directories
    after the commit, off its critical path). A node's part files
    are not read: its folder is listed once, to check that it holds a part file and one
    data file for each of its ranks and nothing else, and their sizes and checksums go
    into the root manifest, which the reader checks each file against. On an object
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
    try:
        for first, count, name, doc in sorted(nodes, key=lambda node: node[0]):
            entry = PartEntry.from_json(doc, step=step, max_size=limit)
            if first != end or entry.first != first or entry.count != count or count < 1:
                raise SaveFailedError(f"the nodes do not tile ranks 0..{world_size - 1}: node "
                                      f"[{first}, {count}] (its part says [{entry.first}, "
                                      f"{entry.count}]) after rank {end - 1}", step=step,
                                      rank=first)
            end = first + count
            if isinstance(storage, S3Storage):  # every node's "tmp": its attempt folder
                if not is_attempt_name(name):
                    raise SaveFailedError(f"node of rank {first} announced {name!r:.80}, not "
                                          f"an attempt folder of {tmp_dir.parent}", step=step,
                                          rank=first)
            elif not is_tmp_dir(name) or tmp_step_of(name) != step:
                raise SaveFailedError(f"node of rank {first} announced {name!r:.80}, not a tmp "
                                      f"directory of step {step}", step=step, rank=first)
            plan.append((entry, name))
        if end != world_size:
            raise SaveFailedError(f"the nodes cover ranks 0..{end - 1} of {world_size}",
                                  step=step)

        def move_and_list(item: tuple[PartEntry, str]) -> set[str]:
            entry, name = item
            folder = tmp_dir / entry.dir
            if isinstance(storage, S3Storage):
                return storage.names(storage.node_folder(tmp_dir, name, entry.dir))
            if name != tmp_dir.name:
                faults.io("rename", folder)
                os.rename(storage.root / name / entry.dir, folder)
            return set(os.listdir(folder))

        # one node's two calls wait on the file system (a network round trip each on NFS
        # or Lustre), not on us: a few nodes at a time
        with ThreadPoolExecutor(min(16, len(plan)), thread_name_prefix="asyncckpt-gather") as pool:
            listings = list(pool.map(move_and_list, plan))
        for (entry, _), names in zip(plan, listings):
            _check_node_folder(entry, names, step, tmp_dir)
    except FileNotFoundError as e:
        raise SaveFailedError(f"a node's folder is missing: {e}", step=step,
                              file=str(tmp_dir)) from None
    except OSError as e:
        raise io_error(e, step=step, file=str(e.filename or tmp_dir)) from e
    except CorruptCheckpointError as e:
        raise SaveFailedError(f"a node's part entry is unusable: {e.cause}", step=step) from None
    faults.point("parts_gathered")
    return [entry for entry, _ in plan]


def drop_emptied(storage: Storage, tmp_dir: Path, nodes: tuple[NodePart, ...]) -> None:
    """After the commit (off its critical path): remove the other nodes' tmp directories
    that `gather_nodes` emptied. One that is not empty (or gone) stays for the sweep."""
    if isinstance(storage, S3Storage):
        return
    for name in {node[2] for node in nodes} - {tmp_dir.name}:
        if is_tmp_dir(name):
            try:
                os.rmdir(storage.root / name)
            except OSError:
                pass


def _check_node_folder(entry: PartEntry, names: set[str], step: int, tmp_dir: Path) -> None:
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


def update_latest(storage: Storage, trusted: int | None = None) -> None:
    """Point `latest` at the newest committed step on disk whose manifest parses (a
    planted or damaged newer directory is passed over), or remove it if there is none.
    Step `trusted` (one just committed) is taken without parsing its manifest again."""
    steps = storage.committed_steps()
    while steps and steps[-1] != trusted and not _manifest_parses(
            storage.root / step_dir_name(steps[-1])):
        steps.pop()
    if not steps:
        storage.write_latest(None)
    elif storage.read_latest() != steps[-1]:
        storage.write_latest(steps[-1])


def _manifest_parses(directory: Path) -> bool:
    try:
        read_manifest_at(directory)
    except CorruptCheckpointError:
        return False
    return True


class RootLock:
    """A flock on `ROOT/.asyncckpt.lock`, released by the kernel on exit.

    Without `job` the lock is exclusive: one writer (or `asyncckpt gc`) owns the root.
    With `job`, the writers of that job -- one per node, sharing the root -- hold it
    shared, and the job id is written in the file by the first of them: a writer of
    another job, or an exclusive user, is refused while any of them runs. (flock turns
    the first writer's exclusive lock into a shared one in two steps; a writer of another
    job starting in that microsecond could slip in. NFS clients map flock to whole-file
    POSIX locks, which other nodes see.)

    The file is opened with O_NOFOLLOW and must be a regular file: a symlink planted
    there is refused, never followed (the holder is written into the file, which would
    otherwise overwrite the link's target).

    Attributes:
        first: this process took the lock when no one held it (then, and only then, it
            may sweep what earlier holders left behind).
    Raises:
        WriterLockedError: another process holds the lock (another job, or exclusively).
        SaveFailedError: the lock path is not a regular file we can open.
        ValueError: a job id that is not one line of printable text.
    """

    def __init__(self, root: Path, job: str | None = None) -> None:
        if job is not None and (not job.isprintable() or not 0 < len(job) <= 200):
            raise ValueError(f"job id must be 1..200 printable characters; got {job!r:.80}")
        self.path = root / LOCK_NAME
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                               | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise SaveFailedError(f"cannot open the root lock {self.path}: {e.strerror} "
                                  "(a symlink or special file there is refused)",
                                  file=str(root)) from None
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(self._fd)
            raise SaveFailedError(f"the root lock {self.path} is not a regular file with one "
                                  "link (a hard link there would have us write into another "
                                  "file)", file=str(root))
        self.first = True
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.first = False
            if job is None or not self._join(job):
                holder = os.pread(self._fd, 256, 0).decode(errors="replace").strip()
                os.close(self._fd)
                raise WriterLockedError(f"another writer holds {self.path} "
                                        f"({holder or 'holder unknown'})", file=str(root)) from None
            return
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (f"job {job}\n" if job else f"pid {os.getpid()}\n").encode(), 0)
        if job is not None:
            fcntl.flock(self._fd, fcntl.LOCK_SH)  # the job's other writers may now join

    def _join(self, job: str) -> bool:
        deadline = time.monotonic() + 2.0  # the job's first writer may be downgrading
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
        if os.pread(self._fd, 256, 0).decode(errors="replace").strip() == f"job {job}":
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def root_id(root: Path) -> str:
    """The root's identity: random hex in `ROOT/.asyncckpt.root`, made by the first
    writer (O_EXCL, so writers racing on one shared directory agree). Writers on
    different directories -- a node-local disk where a shared one was meant -- get
    different ids, which is how a several-node commit tells them apart.

    Raises:
        SaveFailedError: the file cannot be made or is not ours (a symlink, not hex).
    """
    path = root / ROOT_ID_NAME
    for _ in range(50):
        token = secrets.token_hex(8)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            text = read_small_file(path, 64)
            if text is not None and len(text.strip()) == 16:
                try:
                    int(text, 16)
                    return text.strip().decode()
                except ValueError:
                    pass
            time.sleep(0.01)  # its maker may not have written it yet
            continue
        except OSError as e:
            raise SaveFailedError(f"cannot make {path}: {e.strerror}", file=str(root)) from None
        try:
            os.write(fd, f"{token}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return token
    raise SaveFailedError(f"{path} is not a root id (16 hex digits); remove it", file=str(root))


def io_error(e: OSError, **where: object) -> SaveFailedError:
    """Turn an OSError into the SaveFailedError the caller sees."""
    cls = DiskFullError if e.errno in (errno.ENOSPC, errno.EDQUOT) else SaveFailedError
    what = "disk full" if cls is DiskFullError else "I/O error"
    return cls(f"{what}: {e.strerror or e}", **where)  # type: ignore[arg-type]
