"""Rank processes for the simulated nodes, forked warm from a clean process.

Importing torch takes seconds (tens on a loaded 2-core machine), so a launch forks its
ranks from a process that has imported it once instead of starting an interpreter per
rank. That process is not the driver. A driver inside pytest has run hundreds of tests
before, and a fork inherits all of it: file descriptors, the native state of torch's
libraries, objects whose finalizers close descriptors, the signal handlers. Ranks forked
from it ran on that; in whole `make test` runs a 3-node job's rank lost its store
connection mid-job ("Broken pipe") where the same test alone passed. A rank forked from
a process that has done nothing but import torch and asyncckpt starts as a fresh
interpreter would, only sooner.

The forker (`python -m benchmarks.rank_forker EXITS`) answers one JSON request per line
on stdin, each with one line on stdout:
  {"fork": {"env": {...}, "log": path}}  -> the child's pid; the child runs
      `benchmarks.memory_nodes.rank_main` under exactly `env`, its output to `log`;
  {"signal": pid, "number": n}           -> "ok"; only a child not yet reaped is
      signalled, so a pid the system may have reused is never;
and reaps its children, writing each one's exit code to `EXITS/<pid>`. When its stdin
closes (the driver gone or done) it SIGKILLs the children it still has and exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.02  # how often the forker reaps (and the driver looks for an exit code)


class Forker:
    """The driver's side: one forker process for a job's launches."""

    def __init__(self, exits: Path) -> None:
        self.exits = exits
        exits.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self._proc = subprocess.Popen([sys.executable, "-m", "benchmarks.rank_forker",
                                       str(exits)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
        if self._read() != "ready":
            raise RuntimeError(f"the rank forker did not start (exit {self._proc.poll()})")

    def _read(self) -> str:
        assert self._proc.stdout is not None
        return self._proc.stdout.readline().strip()

    def _ask(self, request: dict[str, Any]) -> str:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        answer = self._read()
        if not answer:
            raise RuntimeError(f"the rank forker exited ({self._proc.poll()})")
        return answer

    def fork(self, env: dict[str, str], log: Path) -> ForkedRank:
        """A rank running `rank_main` under `env`, its stdout and stderr to `log`."""
        pid = int(self._ask({"fork": {"env": env, "log": str(log)}}))
        return ForkedRank(self, pid)

    def signal(self, pid: int, number: int) -> None:
        self._ask({"signal": pid, "number": number})

    def close(self) -> None:
        """Stop the forker; the ranks it still has are SIGKILLed."""
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class ForkedRank:
    """A rank the forker started, as a Popen-alike (poll, wait, send_signal)."""

    def __init__(self, forker: Forker, pid: int) -> None:
        self.forker, self.pid = forker, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(FileNotFoundError, ValueError):
                self.returncode = int((self.forker.exits / str(self.pid)).read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(POLL_S)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            self.forker.signal(self.pid, number)


# -- the forker process -----------------------------------------------------------------


def _child(env: dict[str, str], log: str) -> None:
    """In the forked child: become the rank; never returns."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)  # not the forker's request pipe
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        import logging
        logging.root.handlers = [logging.StreamHandler()]  # to the log
        import faulthandler
        faulthandler.register(signal.SIGUSR1)  # a stuck rank's stacks, on demand
        import random

        import torch
        torch.set_num_threads(1)  # the forker's OpenMP pool does not survive a fork
        random.seed()
        from benchmarks.memory_nodes import rank_main
        code = rank_main()
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(children: set[int], exits: Path) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        children.discard(pid)
        tmp = exits / f".{pid}"
        tmp.write_text(str(os.waitstatus_to_exitcode(status)))
        tmp.replace(exits / str(pid))


def main(exits: Path) -> int:
    import torch  # noqa: F401 (imported once, before any fork: the children start warm)
    import torch.distributed  # noqa: F401

    import asyncckpt  # noqa: F401
    import benchmarks.memory_nodes  # noqa: F401
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides; stdin EOF ends us
    children: set[int] = set()
    print("ready", flush=True)
    try:
        while True:
            readable, _, _ = select.select([sys.stdin], [], [], POLL_S)
            _reap(children, exits)
            if not readable:
                continue
            line = sys.stdin.readline()
            if not line:
                return 0
            request = json.loads(line)
            if "fork" in request:
                sys.stdout.flush()
                pid = os.fork()
                if not pid:
                    _child(request["fork"]["env"], request["fork"]["log"])
                children.add(pid)
                answer = str(pid)
            else:
                if request["signal"] in children:
                    os.kill(request["signal"], request["number"])
                answer = "ok"
            print(answer, flush=True)
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while children:
            _reap(children, exits)
            time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
