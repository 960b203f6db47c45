"""Making a completed step visible, on one thread, one step at a time.

The commit (manifest, rename, `latest`, retention) runs on one committer thread, not on
the session thread of whichever rank ended last: that rank's connection keeps serving
(its next save's chunks, its slot credits) while the step is made visible and old steps
are deleted, and commits happen one at a time in the order steps completed. `latest`
and retention work from one listing of the root, taken right after the publish. Before
anything is published the manifest is parsed back with the reader's own rules, so the
writer never commits a checkpoint that `load` or `verify` would reject, and retention
never deletes a good step on the strength of a bad one. Any exception in that sequence
fails the step for all its ranks and discards its files, exactly as a failure before
the commit does (`abandon`, shared with the step table).

With incremental saves the committer keeps the writer's dedup index in step: a step is
checked before publishing for references to steps that are gone, is added to the index
once committed, and is released once it ends either way; retention asks the index which
steps kept ones reference. Only the writer that commits a coordinated step sweeps what
dead writers left: housekeeping happens once, on the leader.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from asyncckpt.config import MAX_FRAME_BYTES
from asyncckpt.errors import CheckpointError, SaveFailedError
from asyncckpt.format.manifest import Manifest
from asyncckpt.runtime import faults
from asyncckpt.storage.base import HeldSteps, Storage
from asyncckpt.storage.timeline import write_current
from asyncckpt.writer import commit, owners, shared
from asyncckpt.writer.dedup import DedupIndex
from asyncckpt.writer.retention import check_references, check_replaceable, prune
from asyncckpt.writer.timelines import settle

if TYPE_CHECKING:
    from asyncckpt.storage.paths import Location
    from asyncckpt.writer.step import Notify, Step

log = logging.getLogger("asyncckpt.writer")

# check(manifest bytes, manifest): raises CheckpointError if a reader would refuse it
Check = Callable[[bytes, Manifest], None]
# busy(): held around each commit (the writer's memory sampler: runtime/procstat.py)
Busy = Callable[[], "contextlib.AbstractContextManager[object]"]


def abandon(storage: Storage, current: Step, error: CheckpointError, tell: Iterable[Notify],
            index: DedupIndex | None) -> None:
    """End a failed step: release its dedup pins, discard its files, tell `tell`; a
    coordinated one's, then what dead writers and abandoned saves left (a save's shared
    tmp directory that no live writer's tmp directory of its step is left for)."""
    release(current.number, index)
    storage.discard(current.tmp_dir)
    for notify in list(tell):
        notify(error, None, {})
    if current.coordinated:
        sweep_dead(storage)


def release(step: int, index: DedupIndex | None) -> None:
    """Unpin the steps `step`'s lookups referenced (it ended, either way)."""
    if index is not None:
        index.release(step)


def sweep_dead(storage: Storage) -> None:
    """Remove what writers that are gone left in `storage`'s root (a local directory: an
    object store's writers hold no owner files, their leftovers are swept by age)."""
    directory = storage.local_dir()
    if directory is None:
        return
    for name in owners.sweep_dead(directory):
        log.info("removed %s, left by a writer that is gone", name)


class Committer:
    """The committer thread of one writer: `submit` a completed step, `stop` at the end.

    `done(step)` is called on the thread after each step, committed or not.
    """

    def __init__(self, storage: Storage, retention: tuple[int, int], *, done: Callable[[int], None],
                 check: Check | None = None,
                 on_commit: Callable[[Manifest, Step], None] | None = None,
                 max_frame_bytes: int = MAX_FRAME_BYTES,
                 index: DedupIndex | None = None,
                 busy: Busy = contextlib.nullcontext
                 ) -> None:
        self.storage = storage
        self.root = storage.root
        self.retention = retention  # (keep_last, keep_every) unless a save names its own
        self._done = done
        self._check = check
        self._on_commit = on_commit
        self._max_frame_bytes = max_frame_bytes
        self._index = index
        self._busy = busy  # held around each commit
        self._ready: queue.SimpleQueue[Step | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="asyncckpt-commit")
        self._thread.start()

    def submit(self, current: Step) -> None:
        """Queue `current`, whose parts are all durable, for commit."""
        self._ready.put(current)

    def stop(self, timeout: float) -> None:
        """Commit what is queued, then stop the thread (waiting up to `timeout` + 1 s)."""
        self._ready.put(None)
        self._thread.join(max(0.0, timeout) + 1)

    def _loop(self) -> None:
        while (current := self._ready.get()) is not None:
            try:
                with self._busy():
                    self._commit(current)
            except Exception:  # the thread must outlive any bug, or every later step hangs
                log.exception("committer: step %d", current.number)
            finally:
                self._done(current.number)

    def _commit(self, current: Step) -> None:
        tell = [current.requester] if current.requester else list(current.waiting.values())
        try:
            manifest, path, held = self._publish(current)
        except Exception as e:  # whatever it is, every rank of the step must hear of it
            error = e if isinstance(e, CheckpointError) else SaveFailedError(
                f"commit failed: {type(e).__name__}: {e}", step=current.number)
            log.warning("step %d failed at commit: %s", current.number, error)
            if current.nodes is not None:  # the nodes' shared directory: nobody commits it
                shared.drop(self.storage, current.number,
                            commit.commit_dir(self.storage, current.tmp_dir, current.nodes).name)
            abandon(self.storage, current, error, tell, self._index)
            return
        if self._index is not None and manifest.parts is None:  # a root's: read at refresh
            self._index.add(manifest)
        release(current.number, self._index)
        self._prune(current, held)
        if self._on_commit:
            try:
                self._on_commit(manifest, current)
            except Exception:
                log.exception("commit hook failed")
        self._tell_committed(current, manifest, path)
        if current.nodes is not None:  # what writers that are gone left: after the word,
            sweep_dead(self.storage)   # which waits on no file-system work a node

    def _publish(self, current: Step) -> tuple[Manifest, Location, HeldSteps | None]:
        """Gather the parts, settle the step's timeline (writer/timelines.py), check the
        manifest as a reader would, write the root's timeline file if the step begins a
        timeline, and publish the step."""
        settled = settle(self.storage, current.number, current.timeline, current.replace)
        source = current.tmp_dir
        if current.nodes is not None:  # from the nodes' shared directory (shared.py)
            source = commit.commit_dir(self.storage, current.tmp_dir, current.nodes)
            entries = commit.gather_nodes(self.storage, source, current.number,
                                          current.world_size, current.nodes)
            manifest = Manifest(step=current.number, world_size=current.world_size, ranks=[],
                                parts=entries, timeline=settled.record)
        else:
            manifest = Manifest(step=current.number, world_size=current.world_size,
                                ranks=[current.parts[r] for r in range(current.world_size)],
                                timeline=settled.record)
        data = manifest.to_bytes()
        if self._check is not None:
            self._check(data, manifest)
        check_references(self.storage, manifest)
        if settled.replace:
            check_replaceable(self.storage, current.number, self._index)
        if settled.new:  # durable before the manifest: the rolled-back steps are abandoned
            try:
                write_current(self.storage, settled.record)
            except OSError as e:
                raise commit.io_error(e, step=current.number,
                                      file=str(e.filename or self.root)) from e
            log.info("step %d begins %s, forked from step %s", current.number,
                     settled.record.describe(),
                     settled.record.lineage[-1][1] if settled.record.lineage else "-")
            faults.point("timeline_written")
        path, held = commit.publish_listed(self.storage, source, current.number, data,
                                           replace=settled.replace, current=settled.record)
        # the nodes' emptied tmp directories: each node's writer removes its own once it
        # hears the outcome (nodes.py), so the leader's commit does no work a node
        return manifest, path, held

    @staticmethod
    def _tell_committed(current: Step, manifest: Manifest, path: Location) -> None:
        stats = {"raw_bytes": manifest.raw_size, "stored_bytes": manifest.stored_size,
                 "new_bytes": manifest.raw_size - manifest.referenced_size,
                 "referenced_bytes": manifest.referenced_size,
                 "seconds": time.monotonic() - current.started}
        if current.requester is not None:
            current.requester(None, path, {**stats, **current.stats.get(0, {})})
            return
        for rank, notify in current.waiting.items():
            notify(None, path, {**stats, **current.stats.get(rank, {})})

    def _prune(self, current: Step, held: HeldSteps | None) -> None:
        """Retention after `current`'s commit (`held`: the root's steps as listed for
        `latest`, or None to list them)."""
        keep_last, keep_every = current.retention or self.retention
        try:
            done = prune(self.storage, keep_last, keep_every, newest=current.number,
                         keep_from=current.keep_from, keep_steps=current.keep_steps,
                         index=self._index, held=held)
        except Exception as e:  # retention is best effort; the new step is already durable
            log.warning("retention failed: %s: %s", type(e).__name__, e)
            return
        if done.deleted or done.retired or done.reclaimed:
            log.info("retention (keep_last=%d, keep_every=%d) deleted steps %s, retired %s "
                     "(still referenced), reclaimed retired %s", keep_last, keep_every,
                     done.deleted, done.retired, done.reclaimed)
