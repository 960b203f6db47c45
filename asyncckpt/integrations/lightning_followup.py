"""The Lightning plugin's follow-up thread: what happens to a save once it commits.

`save_checkpoint` returns as soon as the state is handed over; the files Lightning
knows must then follow the step on disk: the save's final marker once its step is
committed (and the steps its file named before retired), or, when Lightning removed the
file meanwhile, the step's retirement. One thread does that for every save, in the order
of the calls, off the training loop (a listing, a manifest read and fsyncs per save),
and outlives any failure of one: a failure is raised by the next save, never lost.
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path

from asyncckpt.errors import CheckpointError, SaveFailedError
from asyncckpt.integrations.lightning_marker import write_marker
from asyncckpt.integrations.retire import retire_committed
from asyncckpt.rank.handle import SaveHandle
from asyncckpt.storage.location import storage_for

__all__ = ["FollowUp", "PendingSave", "Retirement"]
log = logging.getLogger("asyncckpt.lightning")


class PendingSave:
    """A save in flight and the marker it will become; `before`: the steps of this root
    that `path` named before it (retired once it is committed)."""

    def __init__(self, path: Path, step: int, handle: SaveHandle, before: set[int]) -> None:
        self.path, self.step, self.handle, self.before = path, step, handle, before
        self.removed = False  # remove_checkpoint came first: retire it, write no marker
        self.written = False  # its pending marker is on disk
        self.done = threading.Event()


class Retirement:
    """The steps a marker Lightning removed named: retired on the follow-up thread, after
    the saves made before (not on the loop: a listing, a manifest read and fsyncs)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps
        self.done = threading.Event()


class FollowUp:
    """The follow-up thread's half of `AsyncckptCheckpointIO` (a base class of it: the
    attributes below are the plugin's, made in its `__init__`)."""

    root: Path | None
    _lock: threading.Lock
    _pending: list[PendingSave]
    _failures: list[str]
    _retiring: list[Retirement]
    _queue: queue.Queue[PendingSave | Retirement]
    _thread: threading.Thread | None
    _deferred: set[int]
    _restored: tuple[Path, int] | None
    _committed_any: bool

    def _enqueue(self, item: PendingSave | Retirement) -> None:
        """Hand `item` to the follow-up thread (started at the first)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._follow_all, daemon=True,
                                                name="asyncckpt-lightning")
                self._thread.start()
        self._queue.put(item)

    def _follow_all(self) -> None:
        """The saves in the order they were made (a path saved twice ends naming the
        later step), each once committed: its marker, or its retirement; and the steps
        whose markers Lightning removed, in turn."""
        while True:
            item = self._queue.get()
            if isinstance(item, PendingSave):
                self._follow(item)
                continue
            try:
                for step in sorted(item.steps):
                    self._retire(step)  # best effort: warns, never raises
            finally:
                with self._lock:
                    self._retiring.remove(item)
                item.done.set()

    def _follow(self, pending: PendingSave) -> None:
        """`pending`'s marker once committed (retiring the step the path named before,
        as Lightning overwrites `last.ckpt`), or, removed meanwhile, its retirement."""
        retire: set[int] = set()
        try:
            pending.handle.wait()
        except CheckpointError as e:
            with self._lock:
                self._failures.append(f"step {pending.step} for {pending.path}: {e}")
            log.error("asyncckpt: the save of %s (step %d) failed: %s", pending.path,
                      pending.step, e)
        else:
            try:
                with self._lock:
                    self._committed_any = True
                    retire = ({pending.step} | pending.before if pending.removed
                              else self._name(pending))
                    forked, self._deferred = self._deferred, set()  # the timeline is current
                    self._restored = None
                for step in sorted(retire) + sorted(forked):
                    self._retire(step)
            except Exception as e:  # the thread outlives it: raised by the next save
                with self._lock:
                    self._failures.append(f"step {pending.step} for {pending.path}: {e}")
        finally:
            with self._lock:
                self._pending.remove(pending)
            pending.done.set()

    def _name(self, pending: PendingSave) -> set[int]:
        """Write `pending`'s final marker; the steps of this root the path named before
        it (to retire). A later save to the same path still in flight that has written
        its pending marker over it (naming this step among those before): nothing is
        written (that save names the path), and the steps before this one go. A failure
        is raised by the next save."""
        if any(p.path == pending.path and p.step > pending.step and p.written
               and not p.removed for p in self._pending):
            return pending.before - {pending.step}
        try:
            write_marker(pending.path, self._root_or_fail(), pending.step)
        except OSError as e:
            self._failures.append(f"step {pending.step} is committed but its marker "
                                  f"{pending.path} was not written: {e}")
            return set()
        return pending.before - {pending.step}

    def _root_or_fail(self) -> Path:
        assert self.root is not None  # set by the save that made a pending
        return self.root

    def _raise_failures(self) -> None:
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            raise SaveFailedError("; ".join(failures))

    def _retire(self, step: int) -> None:
        """Retire committed `step` (its bytes stay while a kept step references them;
        the writer deletes them at a later commit) and point `latest` anew."""
        with self._lock:
            if self._restored == (self.root, step):  # a save's timeline forks there: not
                self._deferred.add(step)             # before that save has committed
                return
        try:  # best effort, on the follow-up thread: it must outlive any failure
            retire_committed(storage_for(self._root_or_fail()), step)
        except Exception as e:
            log.warning("asyncckpt: could not retire step %d: %s", step, e)
