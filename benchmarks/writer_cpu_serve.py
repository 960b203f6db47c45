"""The writer under cProfile, every thread profiled (benchmarks/writer_cpu.py --profile).

    ASYNCCKPT_BENCH_PROFILE=/tmp/w.prof python -m benchmarks.writer_cpu_serve writer ...

Runs `asyncckpt writer ...` as `python -m asyncckpt` does, with a profiler per thread
(each thread's `run` wrapped, the main thread too) timed by the thread's CPU time
(`time.thread_time`: a blocked thread costs nothing); at exit the threads' profiles are
merged and written to the path in ASYNCCKPT_BENCH_PROFILE.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import threading
import time

_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()
_run = threading.Thread.run


def _profiled_run(self: threading.Thread) -> None:
    profile = cProfile.Profile(time.thread_time)
    with _lock:
        _profiles.append(profile)
    profile.enable()
    try:
        _run(self)
    finally:
        profile.disable()


def _dump(path: str) -> None:
    stats = None
    with _lock:
        profiles = list(_profiles)
    for profile in profiles:
        try:
            if stats is None:
                stats = pstats.Stats(profile)
            else:
                stats.add(profile)
        except TypeError:  # a thread that never ran a profiled call
            continue
    if stats is not None:
        stats.dump_stats(path)


def main() -> int:
    from asyncckpt.cli import main as cli_main
    threading.Thread.run = _profiled_run  # type: ignore[method-assign]
    main_profile = cProfile.Profile(time.thread_time)
    _profiles.append(main_profile)
    main_profile.enable()
    try:
        return cli_main(sys.argv[1:])
    finally:
        main_profile.disable()
        _dump(os.environ["ASYNCCKPT_BENCH_PROFILE"])


if __name__ == "__main__":
    sys.exit(main())
