"""Simulated nodes on one machine: one `torchrun` per node, all on loopback.

A multi-node job is launched as N separate `torchrun --nnodes N --node-rank i` processes
with the static rendezvous on 127.0.0.1 (node 0's agent hosts the TCPStore), as a
scheduler would start them on N machines. What makes each one a "node" here:

* its own ASYNCCKPT_RUNTIME_DIR (the writer's socket directory is node-local on real
  machines, so a rank can only reach its own node's writer), inherited by its ranks and
  by the writer its local rank 0 starts;
* its own log file (the agent's and its ranks' output);
* it dies as a whole: `Node.kill()` SIGKILLs the agent, every rank and the node's writer
  at once. torchrun starts each rank in a new session and `start_writer` starts the
  writer in another one, so no single process group holds a node: the tree under the
  agent is frozen with SIGSTOP (nothing forks or reaps while we look), walked again
  until it stops growing, then killed. Writers whose parent died earlier are found by
  their socket in the node's runtime directory.

Every wait is bounded; a node still running at `close()` is killed. Gloo is pinned to
the loopback interface (GLOO_SOCKET_IFNAME=lo) and the store to 127.0.0.1.

    python tests/multiprocess/multinode.py demo [--dir multinode-ckpt]

runs examples/train_fsdp.py as 2 nodes x 2 ranks, lets it kill node 1 mid-run, restarts
both nodes and checks that the resumed run is bit-identical (`make multinode-demo`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
REPO = Path(__file__).resolve().parents[2]
_WRITER_SOCK = re.compile(r"writer-(\d+)-[0-9a-f]+\.sock$")
# the example's own lines, and the error that ended a rank (not torch's tracebacks)
_DEMO_LINE = re.compile(r"(attempt \d|trained to|\d+ logged|  step|OK |CORRUPT|RESUME)"
                        r"|\[rank\d+\]: [\w.]*(Error|Exception): ")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the store binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pids: Iterable[int]) -> set[int]:
    """Every live process whose parent is in `pids` (one /proc scan)."""
    wanted, out = set(pids), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid in wanted:
                out.add(int(entry))
    return out


def descendants(pid: int) -> set[int]:
    """`pid` and every live process below it."""
    found, frontier = {pid}, {pid}
    while frontier:
        frontier = children_of(frontier) - found
        found |= frontier
    return found


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def processes_with_env(name: str, value: str) -> list[int]:
    """Live (non-zombie) processes of ours whose environment has name=value."""
    needle, out = f"{name}={value}".encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if needle in env and not is_zombie(int(entry)):
            out.append(int(entry))
    return out


def ring_mapping_pids(pids: Iterable[int]) -> dict[int, int]:
    """{pid: rings it maps} for the processes of `pids` that map any asyncckpt ring."""
    from asyncckpt.runtime.procstat import ring_mappings
    return {p: n for p in pids if (n := ring_mappings(p))}


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


class Node:
    """One simulated node: a torchrun agent, its ranks and (through local rank 0) its writer."""

    def __init__(self, index: int, proc: subprocess.Popen, runtime_dir: Path, log: Path) -> None:
        self.index = index
        self.proc = proc
        self.runtime_dir = runtime_dir
        self.log = log

    def writer_pids(self) -> set[int]:
        """Live writers serving this node (found by their socket in its runtime dir)."""
        out = set()
        for entry in self.runtime_dir.iterdir() if self.runtime_dir.exists() else ():
            m = _WRITER_SOCK.match(entry.name)
            if m and not is_zombie(pid := int(m.group(1))):
                args = cmdline(pid)
                if "asyncckpt" in args and "writer" in args:
                    out.add(pid)
        return out

    def rank_pids(self) -> list[int]:
        """The agent's worker processes, oldest (lowest local rank) first."""
        return sorted(p for p in children_of([self.proc.pid]) if not is_zombie(p))

    def pids(self) -> set[int]:
        """Every live process of this node: the agent, its tree, its writers and theirs."""
        roots = {self.proc.pid} | self.writer_pids()
        out: set[int] = set()
        for r in roots:
            out |= descendants(r)
        return {p for p in out if not is_zombie(p)} | (
            {self.proc.pid} if self.proc.poll() is None else set())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> float:
        """SIGKILL the whole node at once (agent, ranks, writer); returns the kill time
        (time.time()). Waits for the agent; the others are reaped by whoever adopts them."""
        frozen: set[int] = set()
        for _ in range(20):
            new = self.pids() - frozen
            if not new:
                break
            _signal_all(new, signal.SIGSTOP)
            frozen |= new
        killed_at = time.time()
        _signal_all(frozen, signal.SIGKILL)
        self.proc.wait(30)
        return killed_at

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def wait_ranks(self, timeout: float) -> None:
        """Wait until none of the agent's ranks lives. After another node died, an agent
        whose ranks all succeeded waits in torchrun's exit barrier (minutes) for the dead
        node's agent: callers kill it once its ranks are gone."""
        wait_for(lambda: not self.rank_pids(), timeout, f"node {self.index}'s ranks exiting")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Cluster:
    """N simulated nodes of `per_node` ranks running `script` under torchrun.

    Args:
        base: where logs go (node-<i>.log, appended to across launches).
        nodes, per_node: the layout.
        script, args: what torchrun runs on every rank.
        env: extra environment for every node; node_env: extra per node index.
        runtime_dirs: one per node (default: fresh private dirs under /tmp, short enough
            for a unix socket path, removed by close()).
    """

    def __init__(self, base: Path, nodes: int, per_node: int, script: str | Path,
                 args: Sequence[str] = (), env: dict[str, str] | None = None,
                 node_env: dict[int, dict[str, str]] | None = None,
                 runtime_dirs: Sequence[Path] | None = None) -> None:
        self.base, self.n, self.per_node = Path(base), nodes, per_node
        self.script, self.args = str(script), list(args)
        self.env = dict(env or {})
        self.node_env = node_env or {}
        self._own_dirs = runtime_dirs is None
        self.runtime_dirs = list(runtime_dirs) if runtime_dirs else [
            Path(tempfile.mkdtemp(prefix=f"mn{i}-")) for i in range(nodes)]
        self.nodes: list[Node] = []
        self.port = 0

    def start(self) -> Cluster:
        self.base.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        for i in range(self.n):
            self.runtime_dirs[i].mkdir(mode=0o700, parents=True, exist_ok=True)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                               os.environ.get("PYTHONPATH")])),
                   **self.env, **self.node_env.get(i, {}),
                   "ASYNCCKPT_RUNTIME_DIR": str(self.runtime_dirs[i])}
            env.pop("ASYNCCKPT_ADDRESS", None)
            log = self.base / f"node-{i}.log"
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    [TORCHRUN, "--nnodes", str(self.n), "--node-rank", str(i),
                     "--nproc-per-node", str(self.per_node), "--master-addr", "127.0.0.1",
                     "--master-port", str(self.port), "--max-restarts", "0",
                     "--monitor-interval", "0.1", self.script, *self.args],
                    env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True)
            self.nodes.append(Node(i, proc, self.runtime_dirs[i], log))
        return self

    def wait(self, timeout: float) -> list[int]:
        """Every node's exit code; kills the whole job and raises TimeoutError if any node
        is still running after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        codes = []
        for node in self.nodes:
            try:
                codes.append(node.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise TimeoutError(f"nodes still running after {timeout} s:\n"
                                   f"{self.outputs()}") from None
        return codes

    def kill(self) -> None:
        """SIGKILL every node (agents, ranks, writers)."""
        for node in self.nodes:
            if node.pids():
                node.kill()

    def leftover_pids(self) -> list[int]:
        """Live processes that carry one of this job's runtime dirs in their environment."""
        return sorted({p for d in self.runtime_dirs
                       for p in processes_with_env("ASYNCCKPT_RUNTIME_DIR", str(d))})

    def outputs(self) -> str:
        return "\n".join(f"===== node {n.index} =====\n{n.output()[-4000:]}" for n in self.nodes)

    def close(self) -> None:
        self.kill()
        if self._own_dirs:
            for d in self.runtime_dirs:
                shutil.rmtree(d, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start() if not self.nodes else self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll `predicate` until true; TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not seen within {timeout} s")
        time.sleep(interval)


# -- make multinode-demo ---------------------------------------------------------------

def demo(directory: Path, steps: int, kill_at: int, timeout: float) -> int:
    """examples/train_fsdp.py as 2 nodes x 2 ranks: node 1 dies at `kill_at`, both nodes
    are restarted, the run resumes from the newest committed step; exit 0 iff exact."""
    example = REPO / "examples" / "train_fsdp.py"
    directory = directory.resolve()
    for p in [directory, *directory.parent.glob(directory.name + ".*")]:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    logs = directory.parent / f"{directory.name}.nodes"
    args = ["--dir", str(directory), "--steps", str(steps)]
    runtime = [Path(tempfile.mkdtemp(prefix=f"mn{i}-")) for i in range(2)]
    try:
        for attempt, extra in enumerate([["--kill-at", str(kill_at)], ["--kill-at", "0"]]):
            cluster = Cluster(logs / f"attempt-{attempt}", 2, 2, example, args + extra,
                              runtime_dirs=runtime).start()
            try:
                codes = cluster.wait(timeout)
            finally:
                cluster.kill()
            what = (f"node 1 kills itself (writer, ranks, torchrun) at step {kill_at}"
                    if attempt == 0 else "both nodes restarted")
            print(f"--- attempt {attempt} ({what}): node exit codes {codes}")
            for node in cluster.nodes:
                for line in node.output().splitlines():
                    if _DEMO_LINE.match(line):
                        print(f"node {node.index}: {line}")
        exact = codes == [0, 0] and "RESUME EXACT" in cluster.nodes[0].output()
        print("multinode-demo: " + ("resumed exactly after losing a node" if exact else "FAILED"))
        return 0 if exact else 1
    finally:
        for d in runtime:
            shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="examples/train_fsdp.py on 2 simulated nodes, one killed")
    d.add_argument("--dir", type=Path, default=Path("multinode-ckpt"))
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--kill-at", type=int, default=35)
    d.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    return demo(args.dir, args.steps, args.kill_at, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
