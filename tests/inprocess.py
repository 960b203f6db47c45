"""A writer in a thread of the test process, for tests that need checkpoints, not a process.

`start_writer` runs `python -m asyncckpt writer`: a second of imports and a handshake on a
busy machine, before a test has saved anything, and the test joins the `process` tier that
`make test-fast` leaves out. The read side needs committed checkpoints, not that process.
So this runs the writer's own server (`WriterServer`: its sessions, frame pipeline, steps
and commit, built from `WriterKnobs` as the process builds them) on a thread, behind the
same authenticated socket, and the test saves through the public `connect()`/`Client`
API as a rank does: the bytes on disk are the writer's, through the code path every save
takes. What it leaves out is the process boundary: the writer's own death, its signals,
its parent watch, its log file and its memory bound. Tests about those start a real
writer (`running_writer`, the `writer` fixture) and are in the `process` tier.

Hazards: the writer's threads share this interpreter's GIL with the test; a second
in-process writer on a root this process already holds is not refused as a second
process would be (the root's lock is per process), so a test that needs that refusal
starts a real writer.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncckpt.config import WriterKnobs
from asyncckpt.ipc.protocol import ADDRESS_ENV
from asyncckpt.writer.server import WriterServer

STOP_TIMEOUT = 30.0  # seconds `stop()` waits for the serving thread once the server closed


class InProcessWriter:
    """A `WriterServer` on `root` serving from a daemon thread; shaped as `WriterProcess`
    (address, root, pid, log_file, alive, stop, a context manager) so that helpers written
    for one take the other.

    Args:
        root: the checkpoint root (a directory, created if missing).
        codec: the codec knob (None: ASYNCCKPT_CODEC or the default, as the process).
        export: set ASYNCCKPT_ADDRESS to this writer's address, as `start_writer` does;
            `stop()` removes it again if it still names this writer.
        knobs: other writer knobs (keep_last, incremental, ...), as `start_writer`'s.
    Raises:
        WriterLockedError: another process's writer holds `root`.
        ValueError: a knob that is unknown or breaks its rule.
    """

    def __init__(self, root: str | os.PathLike[str], *, codec: str | None = None,
                 export: bool = True, **knobs: Any) -> None:
        self.server = WriterServer(Path(root), WriterKnobs.from_env(codec=codec, **knobs))
        self.address = self.server.address
        self.root = self.server.root
        self.pid = os.getpid()
        self.log_file: Path | None = None  # its records go to the "asyncckpt.writer" logger
        self._exported = export
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                        name=f"asyncckpt-inprocess-writer {self.root.name}")
        self._thread.start()
        if export:
            os.environ[ADDRESS_ENV] = self.address

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """Stop as the process does on SIGTERM: commit what is in flight (up to the
        shutdown_timeout knob), hang up on every rank, release the root. Returns 0, the
        exit code of a writer process that stopped cleanly."""
        self.server.stop()
        self._thread.join(timeout)
        if self._exported and os.environ.get(ADDRESS_ENV) == self.address:
            del os.environ[ADDRESS_ENV]
        self._exported = False
        return 0

    def __enter__(self) -> InProcessWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"InProcessWriter(root={str(self.root)!r}, address={self.address!r})"


@contextlib.contextmanager
def inprocess_writer(base: Path, codec: str = "zstd", **knobs: Any) -> Iterator[InProcessWriter]:
    """An in-process writer on `base/ckpt`, stopped afterwards (as `running_writer`)."""
    with InProcessWriter(base / "ckpt", codec=codec, **knobs) as w:
        yield w
