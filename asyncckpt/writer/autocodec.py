"""codec="auto": per save, the codec that makes the checkpoint durable soonest.

Compression is worth it only when the disk, not the CPU, is the bottleneck: on a fast
NVMe with busy cores raw wins; on a network filesystem or with idle cores the
byte-grouped codec writes markedly fewer bytes at more than disk speed. Which case holds
depends on the machine, on what training does with the cores meanwhile, and on the
data, so it is measured, not configured.

The writer's frames pipeline overlaps encoding and writing, so the time to durable of
`R` raw bytes with codec `c` is about the slowest of the two stages and of the cores
that must do both:

    t(c) = R * max(encode_cost(c) / threads, ratio(c) / disk_bandwidth,
                   (encode_cost(c) + ratio(c) / disk_bandwidth) / cores)

The last term counts the time in write and fsync calls as busy CPU. That is right for
buffered writes on a fast device (the kernel copies every byte into the page cache,
which keeps a core busy for much of a raw save on the 2-core development VM) and
pessimistic where those calls only wait for the device; either way it biases the
choice toward raw when cores are few, which is the safe side: without it the chooser
picked the byte-grouped codec for a large state on 2 cores and was slower than raw.

`encode_cost` (thread-seconds per raw byte, GIL waits and CPU contention included) and
`ratio` come from the frames each save actually encoded with its codec, and for the
other codecs from trial encodes of the first MiB of one frame in `trial_every` (on the
frame thread; trying whole frames cost auto noticeably more time to durable against
raw on 2 cores than trying the first MiB does); `disk_bandwidth` from the time spent in
write and fsync calls. Estimates decay by half per save so they follow a change of
machine load. Before any measurement each codec's prior from the registry (codec/registry.py)
stands in, worth 8 MiB of evidence, and the disk is assumed to take `_PRIOR_DISK` (what
write + fsync, flushed every 64 MiB, reached on a 2-core VM's virtio ext4 disk). The
measurements: docs/design/autocodec.md.

A save is decided when it begins (the data file's name depends on its codec), so a
change takes effect on the next save. Users who want the smallest files choose
codec="bytegroup" directly.

Saves too small to measure change nothing: a save of under `MIN_MEASURED` bytes times
fsync latency, not bandwidth (a tiny save "measured" the disk a hundred times slower
than it is and flipped the codec every save), so it neither adds disk evidence nor
decays the old.
And the choice moves off the current codec only when another is predicted at least
`SWITCH_MARGIN` faster: estimates within noise of each other keep the current one.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from asyncckpt.codec.registry import CODECS, REGISTRY

# (ratio, encode thread-seconds per byte) before anything is measured
_PRIORS = {name: (spec.prior[0], 1 / spec.prior[1]) for name, spec in REGISTRY.items()}
TRIAL_EVERY = 32  # frames per trial encode with the other codecs (of their first MiB)
_PRIOR_DISK = 1.3e9  # bytes/s
_PRIOR_WEIGHT = 8 << 20  # priors count as this many bytes of evidence
MIN_MEASURED = 16 << 20  # a save below this (bytes written) measures latency, not the disk
SWITCH_MARGIN = 0.1  # another codec must be predicted this much faster to replace the current


@dataclass
class _Evidence:
    raw: float = 0.0
    stored: float = 0.0
    seconds: float = 0.0

    def add(self, raw: float, stored: float, seconds: float) -> None:
        self.raw += raw
        self.stored += stored
        self.seconds += seconds

    def decay(self, factor: float) -> None:
        self.raw *= factor
        self.stored *= factor
        self.seconds *= factor


@dataclass
class Choice:
    codec: str
    predicted: dict[str, float]  # seconds per GB of raw data, per candidate
    ratio: dict[str, float]
    encode_gbps: dict[str, float]  # per thread
    disk_gbps: float
    threads: int

    def to_json(self) -> dict:
        r = lambda x: round(x, 4)  # noqa: E731
        return {"codec": self.codec, "threads": self.threads, "disk_gbps": r(self.disk_gbps),
                "predicted_s_per_gb": {k: r(v) for k, v in self.predicted.items()},
                "ratio": {k: r(v) for k, v in self.ratio.items()},
                "encode_gbps_per_thread": {k: r(v) for k, v in self.encode_gbps.items()}}


@dataclass
class CodecChooser:
    """Thread-safe estimates for one writer (all its ranks share disk and cores)."""

    threads: int
    trial_every: int = TRIAL_EVERY
    cores: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    _codecs: dict[str, _Evidence] = field(default_factory=lambda: {
        c: _Evidence(_PRIOR_WEIGHT, _PRIOR_WEIGHT * r, _PRIOR_WEIGHT * s)
        for c, (r, s) in _PRIORS.items()})
    _disk: _Evidence = field(default_factory=lambda: _Evidence(
        0, _PRIOR_WEIGHT, _PRIOR_WEIGHT / _PRIOR_DISK))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _current: str | None = None

    def choose(self) -> Choice:
        with self._lock:
            disk = self._disk.stored / self._disk.seconds
            ratio = {c: e.stored / e.raw for c, e in self._codecs.items()}
            cost = {c: e.seconds / e.raw for c, e in self._codecs.items()}
        predicted = {c: 1e9 * max(cost[c] / self.threads, ratio[c] / disk,
                                  (cost[c] + ratio[c] / disk) / self.cores) for c in CODECS}
        best = min(CODECS, key=lambda c: (predicted[c], ratio[c]))
        with self._lock:
            current = self._current
            if current is not None and predicted[best] > (1 - SWITCH_MARGIN) * predicted[current]:
                best = current  # not clearly better: keep the codec in use
            self._current = best
        return Choice(best, predicted, ratio, {c: 1e-9 / cost[c] for c in CODECS},
                      disk / 1e9, self.threads)

    def encoded(self, codec: str, raw: int, stored: int, seconds: float) -> None:
        """A frame (or a trial) of `raw` bytes took `seconds` to encode to `stored`."""
        with self._lock:
            self._codecs[codec].add(raw, stored, seconds)

    def written(self, stored: int, seconds: float) -> None:
        """A save wrote and synced `stored` bytes in `seconds` of write/fsync calls
        (ignored under `MIN_MEASURED`)."""
        if seconds > 0 and stored >= MIN_MEASURED:
            with self._lock:
                self._disk.add(0, stored, seconds)

    def save_done(self, raw: int | None = None) -> None:
        """Halve the weight of what was measured so far, unless the save (`raw` bytes)
        was too small to have measured anything."""
        if raw is not None and raw < MIN_MEASURED:
            return
        with self._lock:
            for e in (*self._codecs.values(), self._disk):
                e.decay(0.5)
