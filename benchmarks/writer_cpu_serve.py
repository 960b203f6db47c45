"""The writer under cProfile, every thread profiled (benchmarks/writer_cpu.py --profile).

    ASYNCCKPT_BENCH_PROFILE=/tmp/w.prof python -m benchmarks.writer_cpu_serve writer ...

Runs `asyncckpt writer ...` as `python -m asyncckpt` does, with a profiler per thread
(each thread's `run` wrapped, the main thread too) timed by the thread's CPU time
(`time.thread_time`: a blocked thread costs nothing); at exit the threads' profiles are
merged and written to the path in ASYNCCKPT_BENCH_PROFILE. Without that variable nothing
is profiled: each thread only gets its Python name as its name in /proc (the first 15
characters), so that `writer_cpu.py --threads` can tell the writer's CPU per thread.
"""

from __future__ import annotations

import cProfile
import ctypes
import os
import pstats
import sys
import threading
import time

_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()
_run = threading.Thread.run


def _name_thread(name: str) -> None:
    """Give the calling thread `name` in /proc/<pid>/task/<tid>/comm (prctl PR_SET_NAME)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(15, name.encode()[:15], 0, 0, 0)


def _named_run(self: threading.Thread) -> None:
    _name_thread(self.name.removeprefix("asyncckpt-"))
    _run(self)


def _profiled_run(self: threading.Thread) -> None:
    _name_thread(self.name.removeprefix("asyncckpt-"))
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
    path = os.environ.get("ASYNCCKPT_BENCH_PROFILE")
    if not path:
        threading.Thread.run = _named_run  # type: ignore[method-assign]
        return cli_main(sys.argv[1:])
    threading.Thread.run = _profiled_run  # type: ignore[method-assign]
    main_profile = cProfile.Profile(time.thread_time)
    _profiles.append(main_profile)
    main_profile.enable()
    try:
        return cli_main(sys.argv[1:])
    finally:
        main_profile.disable()
        _dump(path)


if __name__ == "__main__":
    sys.exit(main())
