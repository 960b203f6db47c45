"""The storage seam on an S3-compatible object store: the manifest object is the commit.

An object store has no rename and no directories, so nothing can be written aside and
moved into place. A step's data objects are written in its attempt's own folder,
`PREFIX/step-N/attempt-<writer><random>/<file>` (storage/s3keys.py), each a multipart
upload fed by the writer's pipeline as frames arrive (parts of `part_size`, a few in
flight, each request retried with backoff), and the manifest `PREFIX/step-N/manifest.json`
is put last with `If-None-Match: *`, its metadata naming the attempt's folder: one write
that makes the step a checkpoint, refused if the step is already one. A step without its
manifest is never listed, loaded or named by `latest`; an attempt that fails deletes its
own folder, never anything else (another attempt at the step may be the committed one),
and what a dead writer left is swept (storage/s3sweep.py).

`latest` is replaced by a conditional put (`If-Match` on the ETag read just before, or
`If-None-Match` when there is none), so two writers never interleave a read and a write;
one that loses the race re-reads and keeps the newer step. Retiring a step puts a marker
object `PREFIX/step-N.retired` holding its manifest (and its metadata), then deletes the
manifest: the marker is the one write that makes it retired (a step with both is
retired). Deleting a step deletes its manifest (or marker) first, on condition that it is
the one just read, then the folder it named: what a crash leaves is garbage, never a
checkpoint with missing data.

Objects are read by ranged GETs. Endpoint and credentials come from the standard AWS
environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_REGION`, profiles); a plain-http endpoint must be allowed with `AWS_ALLOW_HTTP=true`
(credentials would cross the network in the clear). The requests themselves, the
client and the data files are storage/s3client.py.

An object store has no lock a crashed writer releases; leases (storage/lease.py) stand
in for the root's lock. A writer's storage holds its lease (`hold`), and every mutation
(a step's data, its manifest, `latest`, each delete) first passes the lease's fence: a
writer that lost its lease publishes and deletes nothing more.

Replacing a committed step (`publish(replace=True)`) needs no rename either. The new
step's data is written in a new attempt folder, as any save's; the commit is one put of
`step-N/manifest.json` with If-Match on the ETag of the manifest it replaces (read just
before, the lease's fence passed), its metadata naming the new folder and, in
`asyncckpt-replaced`, the old one. The store applies the put whole or refuses it: a
writer that raced us (another commit or retirement of the step meanwhile) makes it fail
and nothing is replaced; a writer that lost its lease never sends it. Only after the put
succeeded are the old folder and its nodes' folders (a step in parts: `nodes.json`)
deleted, never a folder the new manifest names; a crash in between leaves them as
garbage that no manifest names, which the next sweep removes even while their writer
lives (storage/s3sweep.py). A retired step (`step-N.retired`) is never published over.
There is nothing for `restore_replaced` to settle: at every instant the step is the old
one or the new one, whole, and never absent.

What a reader sees: a load opens a step by reading its manifest's HEAD once and pins that
version (its ETag and the folder it names: `S3CheckpointDir`, storage/s3view.py), so it
reads the manifest and the files of one version only, never one's manifest with the
other's files. A reader that opened the old version keeps reading the old folder until
the replacing writer deletes it, right after the commit (on POSIX the old step also
stays readable through the files a reader already holds open until the new one is
durable, and is then deleted). Past that, a read of an object that is gone fails as a
CorruptCheckpointError naming it, and the checkpoint says it was replaced (`swapped`), so
`load` opens the step again and reads the new version whole (read/loader.py
`read_retrying`). A reader that opens the step after the put reads the new one.
"""

from __future__ import annotations

import errno
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncckpt.config import MAX_FRAME_BYTES, ObjectStoreKnobs
from asyncckpt.errors import LeaseLostError, StepAlreadyCommittedError
from asyncckpt.format.layout import (
    LATEST_NAME,
    MANIFEST_NAME,
    parse_retired_dir,
    parse_step_dir,
    retired_dir_name,
    step_dir_name,
)
from asyncckpt.format.manifest import parse_manifest
from asyncckpt.runtime import faults
from asyncckpt.storage import s3keys
from asyncckpt.storage.base import CheckpointDir, HeldSteps, Storage
from asyncckpt.storage.lease import Lease
from asyncckpt.storage.paths import Location, ObjectPath
from asyncckpt.storage.s3client import ObjectStoreError, S3DataFile, client_key
from asyncckpt.storage.s3dir import S3CheckpointDir
from asyncckpt.storage.s3objects import as_object
from asyncckpt.storage.s3view import S3View

log = logging.getLogger("asyncckpt.storage")
_LATEST_MAX = 64


class S3Storage(S3View, Storage):
    """A root that is a prefix of a bucket (`s3://bucket/prefix`)."""

    root: ObjectPath
    path_type = ObjectPath
    replaces = True  # one conditional put of the manifest swaps the step's folder

    def __init__(self, root: Location, knobs: ObjectStoreKnobs | None = None) -> None:
        super().__init__(as_object(root), knobs)
        self.read_threads = self.knobs.read_threads
        self._pool: ThreadPoolExecutor | None = None  # made by the first data file
        self._pool_lock = threading.Lock()
        self._slots = threading.Semaphore(self.knobs.parts_in_flight)  # parts uploading
        self._gathered: dict[str, dict[str, str]] = {}  # attempt key -> other nodes' folders

    def __repr__(self) -> str:
        return f"S3Storage({str(self.root)!r})"

    @classmethod
    def shared_token(cls) -> str:
        """The endpoint and credentials of the environment (storage/s3client.py)."""
        return repr(client_key(ObjectStoreKnobs.from_env()))

    # -- what the root holds ---------------------------------------------------------

    def _names(self) -> tuple[set[int], set[int]]:
        """(steps with a manifest, retired steps) by one listing of the root."""
        manifests, retired = set(), set()
        for item in self._list(self._prefix):
            rest = item["Key"][len(self._prefix):]
            head, _, tail = rest.partition("/")
            if tail == MANIFEST_NAME and (step := parse_step_dir(head)) is not None:
                manifests.add(step)
            elif not tail and (step := parse_retired_dir(head)) is not None:
                retired.add(step)
        return manifests - retired, retired

    def step_dirs(self) -> list[int]:
        """Committed steps: a step's data without its manifest is not a step here (it is
        an attempt under way, or garbage), unlike a local step directory."""
        return sorted(self._names()[0])

    def committed_steps(self) -> list[int]:
        return self.step_dirs()

    def retired_steps(self) -> list[int]:
        return sorted(self._names()[1])

    def held_steps(self) -> HeldSteps:
        """One LIST for both."""
        committed, retired = self._names()
        return HeldSteps(sorted(committed), sorted(retired))

    def has_step(self, step: int, *, retired: bool = False) -> bool:
        marker = self._head(self._key(retired_dir_name(step))) is not None
        if retired:
            return marker
        return not marker and self._head(self._manifest_key(step)) is not None

    def occupied(self, step: int, *, retired: bool = False) -> bool:
        return self.has_step(step, retired=retired)

    def latest_bytes(self) -> bytes | None:
        got = self._get(self._key(LATEST_NAME), _LATEST_MAX)
        return None if got is None else got[0]

    def open_checkpoint_dir(self, directory: Location) -> CheckpointDir:
        """A step of this root (or a retired one) held at the version its manifest (or
        marker) is now (storage/s3dir.py); any other checkpoint by path."""
        where = as_object(directory)
        found = self._step_of_dir(where)
        if found is None:
            return CheckpointDir(self, where)
        return S3CheckpointDir(self, where, *found)

    # -- writing a step --------------------------------------------------------------

    def make_tmp(self, step: int, name: str | None = None) -> ObjectPath:
        """A new attempt folder of this writer in the step's prefix (`name` is ignored:
        it is a local tmp directory's name)."""
        self.fence(step)
        return self._object(self._key(f"{step_dir_name(step)}/{s3keys.attempt_name(self.owner)}"))

    def create_data_file(self, tmp: Location, name: str, window: int,
                         writeback: str = "range") -> S3DataFile:
        tmp = as_object(tmp)
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.knobs.parts_in_flight,
                                                thread_name_prefix="asyncckpt-s3")
        own = s3keys.attempt_writer(tmp.name) is not None  # a new key: nothing to clear
        return S3DataFile(self._s3, tmp / name, self.knobs, self._pool, self._slots,
                          fence=self._fence_io, clear=not own)

    def node_folder(self, tmp: ObjectPath, name: str, node_dir: str) -> ObjectPath:
        """Where the node that announced attempt folder `name` wrote node directory
        `node_dir` of the step whose attempt `tmp` commits it (remembered for `publish`).

        Raises:
            ValueError: `name` is not an attempt folder name.
        """
        if s3keys.attempt_writer(name) is None:
            raise ValueError(f"{name!r:.80} is not an attempt folder of {tmp.parent}")
        if name != tmp.name:
            self._gathered.setdefault(tmp.key, {})[node_dir] = name
        return tmp.parent / name / node_dir

    def publish(self, tmp: Location, step: int, manifest: bytes, *,
                replace: bool = False) -> ObjectPath:
        """Put the manifest naming attempt folder `tmp`: the one write that commits the
        step. Without `replace` it is conditional on there being none (If-None-Match).
        With `replace`, a committed step's manifest is read (HEAD) and the new one put with
        If-Match on its ETag, naming the replaced folder too (`asyncckpt-replaced`); only
        once that put succeeded are the replaced folder and its nodes' folders deleted
        (crash point `replaced` before: the sweep removes what a crash leaves). Nothing
        the new manifest names is ever deleted, nor anything outside `tmp` on failure.

        Raises:
            StepAlreadyCommittedError: the step has a manifest already (and not
                `replace`), is retired (its data still referenced), or another commit
                changed its manifest since it was read (the other commit stands).
            LeaseLostError: this writer no longer holds the root: nothing was replaced.
            OSError: the store failed; nothing was committed.
        """
        tmp = as_object(tmp)
        if s3keys.attempt_writer(tmp.name) is None or tmp.parent.name != step_dir_name(step):
            raise ObjectStoreError(errno.EINVAL, f"{tmp} is not an attempt folder of step {step}")
        parsed = parse_manifest(manifest, max_frame_bytes=MAX_FRAME_BYTES)
        nodes = self._gathered.pop(tmp.key, {})
        if parsed.parts is not None:  # a root: its nodes' folders hold their parts and files
            folders = {f"{e.dir}/" for e in parsed.parts}
            named = {s3keys.NODES_NAME}
        else:
            folders, named = set(), {p.file for p in parsed.ranks}
        stale = [item["Key"] for item in self._list(f"{tmp.key}/")
                 if (name := item["Key"][len(tmp.key) + 1:]) not in named
                 and name[:name.find("/") + 1] not in folders]
        if stale:  # in this attempt's own folder only: a step holds what it names
            self._delete(stale)
        if nodes:
            self.fence(step)
            self._put(f"{tmp.key}/{s3keys.NODES_NAME}", s3keys.nodes_bytes(nodes))
        final = self._object(self._manifest_key(step))
        if self._head(self._key(retired_dir_name(step))) is not None:
            raise StepAlreadyCommittedError(f"{retired_dir_name(step)} is retired (its data "
                                            "still referenced): save under another step "
                                            "number", step=step)
        old = self._head(final.key) if replace else None
        metadata = {s3keys.DATA_META: tmp.name}
        gone: list[str] = []  # the folders (prefixes) of the step replaced
        if old is not None:
            gone, replaced = self._replaced_folders(step, old, {tmp.name, *nodes.values()})
            if replaced is not None and replaced != tmp.name:
                metadata[s3keys.REPLACED_META] = replaced
        faults.io("rename", tmp)
        self.fence(step)
        try:
            put = self._put(final.key, manifest, metadata, none_match=old is None,
                            match=None if old is None else old["ETag"])
        except ObjectStoreError:
            if not self._names_folder(final.key, tmp.name):
                raise
            put = "landed"  # an answer lost after the store applied the put
        if not put and not self._names_folder(final.key, tmp.name):
            raise StepAlreadyCommittedError(
                f"{final.parent} already has a manifest; a committed step is never replaced "
                "unless asked (replace=True)" if old is None else
                f"{final.parent}: another commit changed its manifest while this save "
                "replaced it; that commit stands", step=step)
        faults.point("manifest_written")
        faults.point("step_renamed")
        if gone:
            faults.point("replaced")
            self._drop(step, gone)
            self._node_maps.pop((step, metadata.get(s3keys.REPLACED_META, "")), None)
        return final.parent

    def _names_folder(self, key: str, folder: str) -> bool:
        """The manifest (or marker) at `key` names attempt folder `folder` now: a put
        whose answer was lost, or that a retry saw refused (its own first try had
        landed), committed it. False when that cannot be read."""
        try:
            head = self._head(key)
        except OSError:
            return False
        return head is not None and head.get("Metadata", {}).get(s3keys.DATA_META) == folder

    def _replaced_folders(self, step: int, head: dict[str, Any], keep: set[str]
                          ) -> tuple[list[str], str | None]:
        """The prefixes (with their slash) of the files of committed step `step` whose
        manifest's HEAD is `head`, its nodes' attempt folders first and its own last (its
        `nodes.json`, the map to the others, goes with it), none of `keep` (the new
        step's); and its own attempt folder's name. An earlier layout's step is its files
        in the step prefix itself. Metadata or a node map that names no attempt folder
        names nothing to delete (what it left is the sweep's, by its writer's lease).

        Raises:
            ObjectStoreError: the node map cannot be read: nothing is replaced.
        """
        try:
            folder = self._folder_of(step, head)
        except ObjectStoreError:
            return [], None
        own = folder.rstrip("/").rsplit("/", 1)[-1]
        if s3keys.attempt_writer(own) is None:
            return [folder], None
        try:
            nodes = self._nodes(step, folder)
        except ObjectStoreError as e:
            if e.errno != errno.EINVAL:
                raise
            nodes = {}
        base = self._key(step_dir_name(step)) + "/"
        others = sorted({f"{base}{name}/" for name in nodes.values()
                         if name not in keep and name != own})
        return others + ([folder] if own not in keep else []), own

    def _drop(self, step: int, folders: list[str]) -> None:
        """Delete the files of a replaced step in `folders` (of `_replaced_folders`), the
        new manifest already put: in an earlier layout's step prefix only its own files
        (never the manifest, now the new step's, nor any attempt folder). Never raises:
        the step is committed, and what is left the sweep removes."""
        try:
            for folder in folders:
                if s3keys.attempt_writer(folder.rstrip("/").rsplit("/", 1)[-1]) is not None:
                    keys = sorted((item["Key"] for item in self._list(folder)),
                                  key=lambda k: k.endswith("/" + s3keys.NODES_NAME))
                else:
                    keys = [item["Key"] for item in self._list(folder)
                            if (own := s3keys.own_key(item["Key"][len(self._prefix):]))
                            is not None and own.folder is None and own.name != MANIFEST_NAME]
                self.fence(step)
                self._delete(keys)
        except (OSError, LeaseLostError) as e:
            log.warning("step %d replaced; its old files not all deleted (swept later): %s",
                        step, e)

    def discard(self, tmp: Location) -> None:
        """Delete attempt folder `tmp` (and the folders its node map names), or, for a
        step of an earlier layout (`tmp` the step's prefix), the step's own files: never
        another attempt's, nor one that the step's manifest (or marker) names (a commit
        whose answer was lost). A writer that lost its lease deletes nothing."""
        tmp = as_object(tmp)
        try:
            self.fence()
            prefix = f"{tmp.key}/"
            if s3keys.attempt_writer(tmp.name) is not None:
                step = parse_step_dir(tmp.parent.name)
                if step is not None and any(self._names_folder(k, tmp.name) for k in (
                        self._manifest_key(step), self._key(retired_dir_name(step)))):
                    log.warning("%s is committed: not deleted", tmp)
                    return
                folders = [prefix] + [f"{tmp.parent.key}/{other}/{node}/" for node, other in (
                    self._nodes(step, prefix).items() if step is not None else ())]
                keys = [item["Key"] for folder in folders for item in self._list(folder)]
            else:
                keys = [item["Key"] for item in self._list(prefix)
                        if (own := s3keys.own_key(item["Key"][len(self._prefix):])) is not None
                        and own.folder is None]
            self._delete(keys)
        except LeaseLostError as e:
            log.warning("%s: %s not deleted", e, tmp)
        except OSError as e:
            log.warning("could not delete %s: %s (swept later)", tmp, e)

    def write_latest(self, step: int | None) -> None:
        """A conditional put on the ETag just read; on a lost race, the newer of ours and
        the one now there is kept."""
        key = self._key(LATEST_NAME)
        for _ in range(10):
            got = self._get(key, _LATEST_MAX)
            self.fence(step)
            if step is None:
                if got is not None:
                    self._delete([key])
                return
            if self._put(key, f"{step_dir_name(step)}\n".encode(),
                         match=None if got is None else got[1], none_match=got is None):
                return
            now = self.read_latest()
            if now is not None and now >= step and self.has_step(now):
                return
        raise ObjectStoreError(errno.EAGAIN, "latest kept changing under us", self._where(key))

    # -- retention -------------------------------------------------------------------

    def retire(self, step: int) -> None:
        """Marker (holding the manifest and its metadata) first, then the manifest's
        deletion, on condition that it is the one copied."""
        manifest_key = self._manifest_key(step)
        got = self._get_meta(manifest_key, 1 << 40)
        if got is None:
            raise ObjectStoreError(errno.ENOENT, "no manifest to retire", self._where(manifest_key))
        self.fence(step)
        self._put(self._key(retired_dir_name(step)), got[0], got[2])
        self.fence(step)
        if not self.delete_key_if(manifest_key, got[1]):
            raise ObjectStoreError(errno.EAGAIN, "the manifest changed while it was retired",
                                   self._where(manifest_key))

    def unpublish(self, step: int, *, retired: bool = False) -> ObjectPath:
        """The manifest (and the marker) deleted first, each on condition that it is the
        one read: what is left is the folder it named, returned for `discard`, never a
        step with missing files (and never another attempt's folder)."""
        keys = [self._manifest_key(step)]
        if retired:
            keys.append(self._key(retired_dir_name(step)))
        heads = [(key, self._head(key)) for key in keys]
        named = next((h for _, h in reversed(heads) if h is not None), None)
        folder = self._key(step_dir_name(step)) + "/" if named is None \
            else self._folder_of(step, named)
        for key, head in heads:  # in order: a retired step must not become committed again
            if head is not None:
                self.fence(step)
                self.delete_key_if(key, head["ETag"])
        return self._object(folder.rstrip("/"))

    # -- recovery --------------------------------------------------------------------

    def sweep_tmp(self, older_than: float | None = None) -> list[str]:
        """Abort the unfinished uploads and delete the attempt folders that asyncckpt's
        writers left and no live writer owns (storage/s3sweep.py); keys of an earlier
        layout by age (`older_than` seconds, default `sweep_age`)."""
        from asyncckpt.storage.s3sweep import sweep
        return sweep(self, self.knobs.sweep_age if older_than is None else older_than)

    def unfinished(self) -> tuple[list[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
        """What saves left unfinished under the root, of asyncckpt's layout only:
        (multipart uploads not completed, step -> the objects that are no committed
        step's)."""
        from asyncckpt.storage.s3sweep import leftovers
        return leftovers(self)

    def restore_replaced(self) -> list[str]:
        """Nothing to settle: a replacement is one put, so the step is whole at every
        instant; the folder a crash left after it is the sweep's (`sweep_tmp`)."""
        return []

    def sweep(self, alone: bool) -> list[str]:
        """Everything abandoned when held `alone`, else only what is old enough
        (`sweep_age`) or a dead writer's."""
        return self.sweep_tmp(0 if alone else None)

    # -- the root ----------------------------------------------------------------------

    def take(self, job: str | None, *, exclusive: bool = False) -> Lease:
        """The bucket reached (a clear error now if it cannot be), then a lease on the
        root (storage/lease.py), which this storage holds from then on: every mutation
        passes its fence."""
        self.check()
        return Lease(self, job, exclusive=exclusive)

    # -- a several-node commit: nothing moves, each node wrote in its own folder -------

    def write_node_part(self, tmp: Location, files: dict[str, bytes]) -> None:
        """One PUT a file (a PUT is durable once it returns)."""
        tmp = as_object(tmp)
        for name, data in files.items():
            faults.io("write", tmp / name)
            self.put_key((tmp / name).key, data)

    def check_node_tmp(self, tmp: Location, step: int, name: str) -> str | None:
        if s3keys.is_attempt_name(name):
            return None
        return f"not an attempt folder of {tmp.parent}"

    def gather_node(self, tmp: Location, name: str, node_dir: str) -> set[str]:
        """Nothing moves: the node's folder is listed where it lies (one LIST), and
        remembered for `publish`'s node map."""
        return self.names(self.node_folder(as_object(tmp), name, node_dir))

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
