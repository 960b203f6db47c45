"""The threads that append data files, kept from one save to the next.

Each rank's data file (pipeline.py) needs a thread of its own while it is open: it waits
for the frames in stream order and writes them, and a thread blocked in a write or an
fsync must hold up no other file. Starting one per file per save cost, on tiny saves, a
thread start and exit each time (a clone, an 8 MiB stack mapped and dropped, a new
interpreter thread state) and showed in the writer's CPU per save. Here a thread that
finished its file waits up to `IDLE_S` for the next one, so back-to-back saves reuse the
same threads. There are never more threads than files open at once (the sessions bound
those), and an idle writer's threads go away.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("asyncckpt.writer")

# an appender thread with no file for this long exits: saves closer than this reuse it (a
# thread start costs ~0.1 ms: nothing at a save every few seconds), and a writer's threads
# are back to its baseline seconds after its last save
IDLE_S = 2.0

Job = Callable[[], None]


class Appenders:
    """Runs each job given to `run` on a thread of its own, reusing idle threads.

    A job is a file's whole append loop: it runs until its file is closed, so the pool
    has no bound of its own (a job left waiting for a thread would stall its file); the
    callers bound how many files are open at once.
    """

    def __init__(self, idle_s: float = IDLE_S, name: str = "asyncckpt-append") -> None:
        self.idle_s = idle_s
        self._name = name
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Job]] = []  # each idle thread's inbox
        self._started = 0

    @property
    def started(self) -> int:
        """Threads started so far (a test's measure of reuse)."""
        return self._started

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def run(self, job: Job) -> None:
        """Start `job` on an idle thread, or on a new one if none is idle."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                self._started += 1
                number = self._started
        if inbox is not None:
            inbox.put(job)
            return
        threading.Thread(target=self._loop, args=(job,), daemon=True,
                         name=f"{self._name}-{number}").start()

    def _loop(self, job: Job) -> None:
        inbox: queue.SimpleQueue[Job] = queue.SimpleQueue()
        while True:
            try:
                job()
            except Exception:  # jobs handle their own errors; never lose the thread
                log.exception("appender job failed")
            del job  # drop the finished file before waiting
            with self._lock:
                self._idle.append(inbox)
            try:
                job = inbox.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # nobody took this thread meanwhile: exit
                        self._idle.remove(inbox)
                        return
                job = inbox.get()  # taken just now: its job is on the way


APPENDERS = Appenders()  # the process's: every data file a writer appends
