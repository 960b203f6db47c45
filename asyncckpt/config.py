"""Tuning knobs, in one place.

Every knob has a default that suits a training node, an environment variable that
overrides it (so a job can be tuned without code changes), and a keyword argument that
overrides both. Values are validated when the `Knobs` is built, with a message that
names the knob, the rule and the value received.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

MiB = 1 << 20
from .codec import SETTINGS as CODECS  # noqa: E402  (the writer knob: stored codecs + "auto")


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Settings of the rank client and the writer.

    Attributes:
        slot_size: bytes per ring slot, which is also the raw size of one frame on disk.
        ring_size: bytes of one rank's shared-memory ring (a multiple of slot_size).
        codec: "auto" (the default: per save, whichever of the three below the measured
            disk bandwidth and encode throughput say is durable soonest, see
            autocodec.py), "raw", "zstd" (level `zstd_level`, one frame per slot) or
            "bytegroup" (byte planes, the sign/exponent planes zstd-compressed: the
            smallest files for floats, see codec.py). Plain zstd saves 8-22 % on floats
            at the lowest throughput; it stays for states that are not floats.
        encode_threads: the writer's frame threads (hash, encode, write), shared by all
            the ranks it serves; also the threads of a parallel load.
        frames_in_flight: frames submitted to those threads and not yet written, at
            most (writer memory: this many encoded frames); at least encode_threads.
        plane_probe_bytes: bytes of a tensor's first frame compressed plane by plane to
            decide which of its byte planes the bytegroup codec compresses.
        plane_max_ratio: a plane is compressed when the probe shrinks it to this
            fraction of its size or less.
        auto_trial_every: with codec "auto", one frame in this many is also encoded
            with the other codecs to keep their estimates current.
        flush_bytes: the writer fdatasyncs each data file and drops it from the page
            cache every this many bytes (0: only the final fsync).
        zstd_level: zstd compression level; 1 is the measured sweet spot for floats.
        connect_timeout: seconds a client waits for the writer to accept and authenticate.
        shutdown_timeout: seconds a stopping writer waits for in-flight steps to commit.
        keep_last: the writer keeps this many newest committed steps and deletes older
            ones after each commit (0: keep all). Derived from the disk.
        keep_every: with keep_last, steps that are multiples of this are kept too.
        absent_rank_timeout: a step fails when one of its ranks has had no connection
            to the writer for this long after the step began (it died before saving).
        max_manifest_bytes: the reader refuses larger manifests (hostile-input bound).
        max_frame_bytes: the reader refuses frames with a larger raw size.
    """

    slot_size: int = 4 * MiB
    ring_size: int = 64 * MiB
    codec: str = "auto"
    zstd_level: int = 1
    encode_threads: int = 2
    frames_in_flight: int = 8
    plane_probe_bytes: int = 256 << 10
    plane_max_ratio: float = 0.97
    auto_trial_every: int = 32
    flush_bytes: int = 64 * MiB
    connect_timeout: float = 30.0
    shutdown_timeout: float = 120.0
    absent_rank_timeout: float = 60.0
    keep_last: int = 0
    keep_every: int = 0
    max_manifest_bytes: int = 512 * MiB
    max_frame_bytes: int = 256 * MiB

    def __post_init__(self) -> None:
        _require(self.slot_size >= 4096 and self.slot_size % 4096 == 0, "slot_size",
                 "a multiple of 4096 bytes, at least 4096", self.slot_size)
        _require(self.slot_size <= self.max_frame_bytes, "slot_size",
                 f"at most max_frame_bytes ({self.max_frame_bytes})", self.slot_size)
        _require(self.ring_size >= self.slot_size and self.ring_size % self.slot_size == 0,
                 "ring_size", f"a positive multiple of slot_size ({self.slot_size})",
                 self.ring_size)
        _require(self.codec in CODECS, "codec", f"one of {CODECS}", self.codec)
        _require(self.flush_bytes >= 0, "flush_bytes", "0 or more", self.flush_bytes)
        _require(1 <= self.encode_threads <= 256, "encode_threads", "between 1 and 256",
                 self.encode_threads)
        _require(self.frames_in_flight >= self.encode_threads, "frames_in_flight",
                 f"at least encode_threads ({self.encode_threads})", self.frames_in_flight)
        _require(self.plane_probe_bytes >= 4096, "plane_probe_bytes", "at least 4096",
                 self.plane_probe_bytes)
        _require(0 < self.plane_max_ratio <= 1, "plane_max_ratio", "in (0, 1]",
                 self.plane_max_ratio)
        _require(self.auto_trial_every >= 1, "auto_trial_every", "at least 1",
                 self.auto_trial_every)
        _require(-7 <= self.zstd_level <= 22, "zstd_level", "between -7 and 22",
                 self.zstd_level)
        _require(self.keep_last >= 0, "keep_last", "0 (keep all) or more", self.keep_last)
        _require(self.keep_every >= 0, "keep_every", "0 (none) or more", self.keep_every)
        for name in ("connect_timeout", "shutdown_timeout", "absent_rank_timeout"):
            _require(getattr(self, name) > 0, name, "positive", getattr(self, name))

    @property
    def ring_slots(self) -> int:
        return self.ring_size // self.slot_size

    @classmethod
    def from_env(cls, **overrides: Any) -> "Knobs":
        """Defaults, then `ASYNCCKPT_<NAME>` environment variables, then `overrides`.

        Raises:
            ValueError: an unknown knob, or a value that breaks a knob's rule.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name, field in fields.items():
            raw = os.environ.get(f"ASYNCCKPT_{name.upper()}")
            if raw is not None:
                try:
                    values[name] = parse_knob(name, raw)
                except ValueError:
                    raise ValueError(f"ASYNCCKPT_{name.upper()}={raw!r} is not a valid "
                                     f"{type(field.default).__name__}") from None
        unknown = set(overrides) - set(fields)
        if unknown:
            raise ValueError(f"unknown knob(s) {sorted(unknown)}; known: {sorted(fields)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def parse_knob(name: str, text: str) -> Any:
    """Parse a knob's value from text (sizes accept "4MiB"; timeouts are seconds).

    Raises:
        ValueError: unknown knob, or text that is not a value of its type.
    """
    field = Knobs.__dataclass_fields__.get(name)
    if field is None:
        raise ValueError(f"unknown knob {name!r}; known: {sorted(Knobs.__dataclass_fields__)}")
    kind = type(field.default)
    try:
        if kind is int:
            return parse_size(text) if name.endswith(("_size", "_bytes")) else int(text)
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a valid {kind.__name__}") from None


def parse_size(text: str) -> int:
    """Parse a byte count such as "4194304", "4MiB", "4M" or "1GiB".

    Raises:
        ValueError: not a non-negative size.
    """
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = 1
    if s and s[-1] in units:
        scale, s = units[s[-1]], s[:-1]
    value = int(s) * scale
    if value < 0:
        raise ValueError(f"negative size {text!r}")
    return value


def _require(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}; got {value!r}")


@dataclasses.dataclass(frozen=True)
class ReadLimits:
    """What a reader allows itself: the bounds it applies to untrusted checkpoints and
    the threads it reads with. Pass one to `load(..., limits=)` / `Checkpoint.open`;
    the default, `ReadLimits.from_env()`, is the one place the environment is read.

    Attributes:
        max_manifest_bytes: larger manifests are refused unread (hostile-input bound).
        max_frame_bytes: manifests declaring a frame with a larger raw size are refused,
            so no frame buffer is ever larger than this.
        read_threads: threads that read, verify and decode frames in parallel (1: none).
    """

    max_manifest_bytes: int = 512 * MiB
    max_frame_bytes: int = 256 * MiB
    read_threads: int = 2

    def __post_init__(self) -> None:
        _require(self.max_manifest_bytes >= 64, "max_manifest_bytes", "at least 64",
                 self.max_manifest_bytes)
        _require(self.max_frame_bytes >= 1, "max_frame_bytes", "at least 1", self.max_frame_bytes)
        _require(1 <= self.read_threads <= 256, "read_threads", "between 1 and 256",
                 self.read_threads)

    @classmethod
    def from_env(cls, **overrides: Any) -> "ReadLimits":
        """Defaults, then ASYNCCKPT_MAX_MANIFEST_BYTES, ASYNCCKPT_MAX_FRAME_BYTES and
        ASYNCCKPT_READ_THREADS, then `overrides` (None: not overridden).

        Raises:
            ValueError: an unknown field, or a value that breaks its rule.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = set(overrides) - set(names)
        if unknown:
            raise ValueError(f"unknown read limit(s) {sorted(unknown)}; known: {names}")
        values: dict[str, Any] = {}
        for name in names:
            raw = os.environ.get(f"ASYNCCKPT_{name.upper()}")
            if raw is not None:
                try:
                    values[name] = parse_size(raw) if name.endswith("_bytes") else int(raw)
                except ValueError:
                    raise ValueError(f"ASYNCCKPT_{name.upper()}={raw!r} is not a valid "
                                     f"{'size' if name.endswith('_bytes') else 'int'}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
