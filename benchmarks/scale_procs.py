"""`benchmarks.scale --procs P`: the simulated nodes' leads spread over P processes.

On a cluster each node's lead rank and writer run on a node of their own, in parallel;
in one interpreter every lead's announcement, wake-up and relay take their turn at one
GIL, beside thousands of threads, and the latency charges that serially. With P
processes the main one keeps the store, the leader (node 0: its lead, its writer's
gather and publish, measured as in one process) and the first share of the nodes; each
other process holds a share of its own: its leads' real StoreCoordinator and Agreement
(with their clients of the one TCPStore), its nodes' files and folders, its ranks'
handles. The main process drives them over a pipe, one save at a time, in the same
phases it runs its own share (`World.prepare`, `tell`, `wait`): all write, then every
process tells its leads at once, and the save's clock runs from the last lead told to
the last handle done in any process (perf_counter is the system's monotonic clock,
one across processes). A process started here is `spawn`ed: a fork of an interpreter
running thousands of threads is not safe.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import threading
import traceback
from pathlib import Path
from typing import Any

JOIN_SECONDS = 600  # a process's leads meeting the leader (thousands of clients connect)


def shares(nodes: int, procs: int) -> list[range]:
    """Nodes 0..nodes-1 in `procs` consecutive shares as even as can be (fewer if there
    are fewer nodes), the first (node 0's, the leader's) in the main process."""
    procs = max(1, min(procs, nodes))
    bounds = [nodes * i // procs for i in range(procs + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class Remote:
    """A process holding the nodes `local` of a World whose store listens on `port`."""

    def __init__(self, local: range, *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.local = local
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(child, local, *args), daemon=True,
                                 name=f"asyncckpt-scale-{local.start}")
        self._proc.start()
        child.close()

    def send(self, *message: Any) -> None:
        self._conn.send(message)

    def recv(self, seconds: float = 3600) -> Any:
        """Its answer; raises RuntimeError if it failed, died or went silent."""
        if not self._conn.poll(seconds):
            raise RuntimeError(f"nodes {self.local.start}..{self.local.stop - 1}: no answer "
                               f"in {seconds:.0f} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"nodes {self.local.start}..{self.local.stop - 1}: the process "
                               f"ended (exit code {self._proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"nodes {self.local.start}..{self.local.stop - 1}: {value}")
        return value

    def close(self) -> None:
        try:
            self.send("close")
            self.recv(60)
        except (RuntimeError, OSError):
            pass
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()


def start(local: list[range], work: Path, nodes: int, per_node: int, part: Any, data: bytes,
          timeout: float, own_tmp: bool, port: int) -> list[Remote]:
    """One process for each share `local`, started at once; each answers once its
    leads have met the leader (`Remote.recv`)."""
    return [Remote(share, work, nodes, per_node, part, data, timeout, own_tmp, port)
            for share in local]


def serve(conn: multiprocessing.connection.Connection, local: range, work: Path, nodes: int,
          per_node: int, part: Any, data: bytes, timeout: float, own_tmp: bool,
          port: int) -> None:
    """A share's process: its nodes of the World, each message of the main process
    answered in turn, until "close"."""
    from benchmarks import scale  # the main process imports this module first

    threading.stack_size(256 << 10)
    world = None
    try:
        world = scale.World(work, nodes, per_node, part, data, timeout, own_tmp, port=port,
                            local=local)
        world.joined(JOIN_SECONDS)
        conn.send(("ok", None))
        wake = None
        while True:
            kind, *args = conn.recv()
            if kind == "prepare":
                conn.send(("ok", world.prepare(*args)))
            elif kind == "tell":
                told = world.tell()
                done, failed, error = world.wait()
                conn.send(("ok", (told, done, failed, error, dict(world.marks))))
            elif kind == "finish":  # after the clock: the writers' rmdirs, the counts
                world.run_later()
                requests, nbytes = world.counts.take()
                beats, _ = world.beats.take()
                conn.send(("ok", (requests, nbytes, beats)))
            elif kind == "wake-arm":
                wake = scale.Wake(world)
                wake.arm()
                conn.send(("ok", None))
            elif kind == "wake-ends":
                assert wake is not None
                conn.send(("ok", wake.ends()))
            elif kind == "close":
                world.close()
                world = None
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown message {kind!r}")
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()[-2000:]))
        except OSError:
            pass
    finally:
        if world is not None:
            world.close()
        conn.close()
