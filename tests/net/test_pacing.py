"""Pacing (net/pacing.py): a sender held to replica_mbps over a whole transfer --
computed against a fake clock, and measured on a real transfer over loopback."""

from __future__ import annotations

import time

from netkit import CHUNK, SECRET, knobs, replica

from asyncckpt.net.pacing import Pacer
from asyncckpt.net.replica import MemoryStore
from asyncckpt.net.tcp import TcpTransport


def test_the_pacer_holds_the_rate_over_the_transfer() -> None:
    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s
    pacer = Pacer(1e6, clock=lambda: now[0], sleep=sleep)
    for _ in range(10):
        pacer.wait(100_000)
    assert abs(now[0] - 101.0) < 1e-9  # 1 MB at 1 MB/s: one second
    count = len(slept)
    now[0] += 0.5  # a long pause is not made up by a burst: one chunk ahead at most
    pacer.wait(100_000)
    pacer.wait(100_000)
    assert sum(slept[count:]) < 1e-9
    pacer.wait(100_000)
    assert abs(now[0] - 101.6) < 1e-9
    unpaced = Pacer(0, clock=lambda: now[0], sleep=sleep)
    count = len(slept)
    unpaced.wait(1 << 40)
    assert len(slept) == count


def test_a_paced_put_takes_the_time_the_knob_says() -> None:
    """1 MiB at replica_mbps=4 takes >= 0.26 s (the knob's rate, measured over the
    transfer); unpaced, the same replica takes a fraction of that."""
    size = 1 << 20
    with TcpTransport(SECRET, knobs(), name="b").serve(MemoryStore()) as srv:
        for mbps, check in ((4.0, lambda s: size / s <= 4.0e6 * 1.02 and s < 3.0),
                            (0.0, lambda s: s < size / 4.0e6 / 2)):
            rep, _ = replica([size], step=5 + int(mbps))
            started = time.perf_counter()
            assert TcpTransport(SECRET, knobs(replica_mbps=mbps, replica_chunk_bytes=CHUNK),
                                name="a").put(srv.address, rep)
            seconds = time.perf_counter() - started
            assert check(seconds), (mbps, seconds)
