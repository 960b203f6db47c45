"""Starting the writer from Python: a child process, not a thread.

`start_writer` runs `python -m asyncckpt writer` as a subprocess (no fork of a process
that may hold CUDA or gloo state), waits until it listens, and returns its address.
The child watches its parent: if the trainer dies, the writer finishes the commits in
flight and exits, so nothing outlives the job and no committed checkpoint is lost.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from asyncckpt.errors import WriterLockedError, WriterUnavailableError
from asyncckpt.ipc.protocol import ADDRESS_ENV
from asyncckpt.storage.paths import Location
from asyncckpt.storage.registry import parse as root_path
from asyncckpt.storage.registry import shared_storage

READY_PREFIX = "ASYNCCKPT_READY "
FAILED_PREFIX = "ASYNCCKPT_FAILED "  # then why, on the same line, before the writer exits
JOB_ENV = "ASYNCCKPT_JOB"
log = logging.getLogger("asyncckpt")
EXIT_WAIT_S = 5.0              # for a writer that printed nothing to exit, once its start timed out
EXIT_WAIT_AFTER_LINE_S = 0.1   # ... and for one that printed why it failed


class WriterProcess:
    """A writer started by `start_writer`.

    Attributes:
        address: what clients pass to `connect()` (also exported as ASYNCCKPT_ADDRESS
            to this process's environment when started with `export`, so child ranks
            inherit it).
        root: the checkpoint root it owns.
        pid: its process id.
        log_file: where it logs (None: this process's stderr).
    """

    def __init__(self, proc: subprocess.Popen, address: str, root: Location,
                 log_file: Path | None = None, exported: bool = False) -> None:
        self._proc = proc
        self._exported = exported  # ASYNCCKPT_ADDRESS was set by us, not by the user
        self.address = address
        self.root = root
        self.pid = proc.pid
        self.log_file = log_file

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM the writer (it finishes in-flight commits), wait, return its exit code.

        Kills it if it has not exited after `timeout` seconds. ASYNCCKPT_ADDRESS goes
        too when `start_writer` exported it and it still names this writer (a value
        the user set is left alone).
        """
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._exported and os.environ.get(ADDRESS_ENV) == self.address:
            del os.environ[ADDRESS_ENV]
        self._exported = False
        return self._proc.returncode

    def __enter__(self) -> WriterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"WriterProcess(pid={self.pid}, root={str(self.root)!r}, address={self.address!r})"


def default_job() -> str | None:
    """The job id writers share a root under: ASYNCCKPT_JOB, else torchrun's run id and
    rendezvous address (the same on every node of one job, different for another job),
    else None (a writer that owns its root alone)."""
    if os.environ.get(JOB_ENV):
        return os.environ[JOB_ENV]
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port and "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun {os.environ['TORCHELASTIC_RUN_ID']} {addr}:{port}"
    return None


def default_log_file(root: str | os.PathLike[str], node: str | None = None) -> Path:
    """`<root>.writer.log` beside a local root (`<root>.writer-<node>.log` for one of
    several nodes' writers); for an object-store root, in the temporary directory."""
    location = root_path(root)
    suffix = f".writer-{node}.log" if node else ".writer.log"
    local = shared_storage(location).local_dir()
    if local is None:  # an object store's root: named by its bucket and its last segment
        name = f"asyncckpt-{location.parts[1]}-{location.name}{suffix}"
        return Path(tempfile.gettempdir()) / name
    return local.absolute().parent / f"{local.name}{suffix}"


def start_writer(root: str | os.PathLike[str], *, codec: str | None = None,
                 log_file: str | os.PathLike[str] | None = None, timeout: float = 60.0,
                 job: str | None = None, export: bool = True, **knobs: Any) -> WriterProcess:
    """Start a writer process that owns `root` and return once it accepts ranks.

    Args:
        root: the checkpoint root: a directory (created if missing), or an object-store
            prefix `s3://bucket/prefix` (endpoint and credentials from the AWS
            environment; the bucket must exist).
        codec: "auto" (default), "raw", "zstd" or "bytegroup" (see WriterKnobs.codec).
        log_file: where the writer logs (one line per commit, every failure). Default
            `default_log_file(root)`: `<root>.writer.log` beside a local root, so the
            training's stderr gets none of it (the path is logged once at INFO on
            logger "asyncckpt"); "-" inherits this process's stderr.
        job: the job id of the writers of several nodes that share `root` (default:
            `default_job()`); writers of one job share the root, others are refused.
        export: set ASYNCCKPT_ADDRESS in this process's environment to the writer's
            address (child ranks inherit it; `stop()` removes it again if unchanged).
            Writers started on the caller's behalf (a Checkpointer's, a DCP
            StorageWriter's) pass False: they hand the address to their own client
            only, so a second root in the process, or a process spawned later, never
            picks up a writer that is not its own.
        knobs: other writer knobs (zstd_level, shutdown_timeout, ...); see WriterKnobs.
    Returns:
        A WriterProcess; with `export`, its address is also ASYNCCKPT_ADDRESS.
    Raises:
        WriterLockedError: another writer holds `root`.
        WriterUnavailableError: the writer did not start within `timeout` seconds.
    """
    root = root_path(root).resolve()
    cmd = [sys.executable, "-m", "asyncckpt", "writer", "--root", str(root),
           "--parent-pid", str(os.getpid()), "--ready-line"]
    if codec is not None:
        cmd += ["--codec", codec]
    if job or default_job():
        cmd += ["--job", job or default_job()]  # type: ignore[list-item]
    for name, value in knobs.items():
        cmd += ["--knob", f"{name}={value}"]
    log_path = None if log_file == "-" else Path(log_file or default_log_file(root))
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if log_file is None:
            log.info("asyncckpt: the writer of %s logs to %s", root, log_path)
    stderr = open(log_path, "ab") if log_path is not None else None
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    finally:
        if stderr:
            stderr.close()
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        line = proc.stdout.readline() if sel.select(timeout) else ""
    if not line.startswith(READY_PREFIX):
        try:
            code = proc.wait(EXIT_WAIT_S if line == "" else EXIT_WAIT_AFTER_LINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if code == 3:
            raise WriterLockedError(f"another writer holds {root}", file=str(root))
        if line.startswith(FAILED_PREFIX):
            raise WriterUnavailableError("writer did not start: "
                                         f"{line[len(FAILED_PREFIX):].strip()}", file=str(root))
        raise WriterUnavailableError(f"writer did not start (exit code {code}); see its log"
                                     + (f", {log_path}" if log_path else ""), file=str(root))
    address = line[len(READY_PREFIX):].strip()
    if export:
        os.environ[ADDRESS_ENV] = address
    return WriterProcess(proc, address, root, log_path, exported=export)
