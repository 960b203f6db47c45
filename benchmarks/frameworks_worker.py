"""One rank of bench-frameworks: imports the frameworks once, then forks a fresh child per
case (method x state), so that no case pays the framework's import (tens of seconds on a
loaded 2-core machine) and no case inherits another's memory high-water marks, helper
processes or allocator pools. The parent runs no torch code before it forks.

    python -m benchmarks.frameworks_worker SPEC.json RANK

SPEC: {"cases": [{"framework", "name", "method", "world", "width", "layers", "port",
"plan": {...}, "work", "out", "profile"?}]}: the frameworks of one venv, imported first.
With "profile" (a path prefix), the save calls but the first are run under cProfile and
its stats written to "profile" + "-r<RANK>.prof". A case with
world 1 runs on rank 0 only. Each child writes its result (or its error and traceback)
to the case's "out" + "-r<RANK>.json".
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import frameworks_drivers as drivers
from benchmarks.frameworks_loop import Bench, Plan

CASE_TIMEOUT = 900  # s: a case's child is killed past it (a peer rank that died hangs it)
POLL_SECONDS = 0.5  # how often the parent looks whether its child is done


def run_case(framework: str, case: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch
    # two ranks on two cores: a thread each (as torchrun sets OMP_NUM_THREADS=1); one rank:
    # every core. The parent ran no torch code, so the thread pool is made here.
    torch.set_num_threads(1 if case["world"] > 1 else os.cpu_count() or 1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(case["port"]),
                       "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(case["world"]), "LOCAL_WORLD_SIZE": str(case["world"])})
    work = Path(case["work"])  # shared by the ranks, as a job's output directory is
    work.mkdir(parents=True, exist_ok=True)
    bench = Bench(Plan(**case["plan"]), save=lambda n: drivers.Saved())
    if case.get("profile"):  # the save calls on the loop's thread (--profile)
        import cProfile
        bench.profile = cProfile.Profile()
    started = time.perf_counter()
    drivers.run(framework, case["method"], case["width"], case["layers"], work, bench)
    if bench.profile is not None:
        bench.profile.dump_stats(f"{case['profile']}-r{rank}.prof")
    return {**bench.result(), "rank": rank, "wall": time.perf_counter() - started,
            "loadavg": list(os.getloadavg())}


def child(framework: str, case: dict[str, Any], rank: int) -> None:
    out = Path(f"{case['out']}-r{rank}.json")
    try:
        result = run_case(framework, case, rank)
    except BaseException as e:  # noqa: BLE001 - reported in the table, never hidden
        result = {"rank": rank, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()[-4000:]}
    out.write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def wait_child(pid: int, timeout: float) -> int:
    """The child's wait status, killing it past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            return os.waitpid(pid, 0)[1]
        time.sleep(POLL_SECONDS)


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    for framework in dict.fromkeys(c["framework"] for c in spec["cases"]):
        drivers.preload(framework)
    for case in spec["cases"]:
        if rank >= case["world"]:
            continue
        framework = case["framework"]
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            child(framework, case, rank)
        status = wait_child(pid, CASE_TIMEOUT)
        out = Path(f"{case['out']}-r{rank}.json")
        if not out.exists():
            out.write_text(json.dumps({"rank": rank, "error": f"child exited with wait "
                                       f"status {status} and wrote no result"}))
        print(f"rank {rank} {framework} {case['name']}: {time.perf_counter() - started:.0f} s",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
