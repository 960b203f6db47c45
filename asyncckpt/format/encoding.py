"""Encoding one frame: its checksums and stored bytes, with the codec of the save.

For the byte-grouped codec a frame needs an element width and phase, but frames are
packed across tensor boundaries: one ring slot may hold the tail of a bf16 tensor and
the head of an fp32 one, and a tensor need not start element-aligned in the frame. We
keep one layout per frame, taken from the tensor that covers most of its bytes, rather
than cutting frames at tensor boundaries: frames stay one slot each (no tiny frames, no
per-tensor manifest entries for models with thousands of small tensors), and the only
cost is ratio on the bytes of the minority tensors, which the split still carries
exactly (it is a permutation). With slots of 4 MiB and the tensors of a training state
(megabytes each, ordered by module, dtype runs of many tensors) that is a few frames
per save.

Which planes to compress is decided per tensor, once, by the codec's probe on the first
frame that tensor dominates (for the byte-plane codec: every plane of a sample is
compressed and planes that shrink to `max_ratio` or better are compressed from then
on). The encoder keeps those answers and hands them back with each frame's geometry;
it treats every codec alike (codec/registry.py). The writer encodes every frame here,
and `asyncckpt copy` re-encodes with it, so it lives with the format, below both.
"""

from __future__ import annotations

import bisect
import time
from typing import NamedTuple, Protocol

import xxhash

from asyncckpt.codec.registry import (
    CODECS,
    PLANE_MAX_RATIO,
    PLANE_PROBE_BYTES,
    Buffer,
    Codec,
    CodecParams,
    FrameHints,
    PlaneChoice,
    PlaneLayout,
    make_codec,
    xxh3_of,
)
from asyncckpt.format.layout import TensorSpec, element_size


class CostObserver(Protocol):
    """What codec="auto" learns from encoding (the writer's chooser): every frame's cost,
    and trial encodes with the other codecs of one frame in `trial_every`."""

    trial_every: int

    def encoded(self, codec: str, raw: int, stored: int, seconds: float) -> None: ...


class Encoded(NamedTuple):
    codec: str
    pieces: list[Buffer]       # the stored bytes, in order
    stored_length: int
    xxh3_raw: int
    xxh3_stored: int
    layout: PlaneLayout | None
    aliases_raw: bool          # pieces point into the raw buffer (keep it until written)


class FrameEncoder:
    """Encodes the frames of one rank's stream. Thread-safe: codec objects come from the
    calling thread's `context`; the probe cache is a dict (a race only probes twice)."""

    def __init__(self, codec: str, level: int, tensors: list[TensorSpec],
                 probe_bytes: int = PLANE_PROBE_BYTES, max_ratio: float = PLANE_MAX_RATIO,
                 chooser: CostObserver | None = None) -> None:
        self.codec = codec
        self.chooser = chooser  # codec="auto": told every frame's cost, plus trials
        self._frames = 0
        self._params = CodecParams(level, probe_bytes, max_ratio)
        self._tensors = tensors
        self._begins = [t.begin for t in tensors]
        # (codec, tensor index or -1 for the header) -> the codec's probe for that tensor
        self._probes: dict[tuple[str, int], PlaneChoice] = {}

    def encode(self, raw_offset: int, raw: memoryview, context: dict) -> Encoded:
        start = time.perf_counter()
        raw_hash = xxhash.xxh3_64_intdigest(raw)
        hashed = time.perf_counter()
        encoded = self._encode(self.codec, raw_offset, raw, raw_hash, context)
        if self.chooser is not None:
            self.chooser.encoded(self.codec, len(raw), encoded.stored_length,
                                 time.perf_counter() - start)
            self._frames += 1  # a race only shifts which frame is tried
            if (self._frames - 1) % self.chooser.trial_every == 0 and len(raw) >= _MIN_TRIAL:
                self._trial(raw_offset, raw, raw_hash, hashed - start, context)
        return encoded

    def _trial(self, raw_offset: int, raw: memoryview, raw_hash: int, hash_seconds: float,
               context: dict) -> None:
        """Encode the start of `raw` with the other codecs too, for the chooser only: a
        sample prices a codec as well as the whole frame does, at a fraction of the CPU
        that the save itself may need."""
        assert self.chooser is not None
        sample = raw[:_TRIAL_BYTES]
        hash_seconds *= len(sample) / len(raw)
        for codec in CODECS:
            if codec != self.codec:
                start = time.perf_counter()
                stored = self._encode(codec, raw_offset, sample, raw_hash, context).stored_length
                self.chooser.encoded(codec, len(sample), stored,
                                     hash_seconds + time.perf_counter() - start)

    def _encode(self, name: str, raw_offset: int, raw: memoryview, raw_hash: int,
                context: dict) -> Encoded:
        codec = self._codec(name, context)
        tensor, width, phase = self.geometry(raw_offset, len(raw))
        choice = self._probes.get((name, tensor))
        if choice is None:
            choice = self._probes[(name, tensor)] = codec.probe(raw, width, phase)
        stored = codec.encode(raw, FrameHints(width, phase, choice.planes, choice.rotated))
        if stored.as_is(raw):
            return Encoded(stored.codec, [raw], len(raw), raw_hash, raw_hash, None, True)
        return Encoded(stored.codec, stored.pieces, stored.length, raw_hash,
                       xxh3_of(stored.pieces), stored.layout, False)

    def geometry(self, raw_offset: int, length: int) -> tuple[int, int, int]:
        """(tensor index or -1 for the header, element width, phase) of the frame
        `raw_offset`..+`length`: those of the tensor covering most of it."""
        end = raw_offset + length
        i = max(0, bisect.bisect_right(self._begins, raw_offset) - 1)
        best, best_bytes = -1, 0
        if not self._tensors or raw_offset < self._tensors[0].begin:
            best_bytes = min(end, self._tensors[0].begin if self._tensors else end) - raw_offset
        while i < len(self._tensors) and self._tensors[i].begin < end:
            t = self._tensors[i]
            covered = min(end, t.end) - max(raw_offset, t.begin)
            if covered > best_bytes:
                best, best_bytes = i, covered
            i += 1
        if best < 0:
            return -1, 1, 0
        t = self._tensors[best]
        width = element_size(t.dtype)
        return best, width, (t.begin - raw_offset) % width

    def _codec(self, name: str, context: dict) -> Codec:
        key = ("codec", name, self._params)
        codec = context.get(key)
        if codec is None:
            codec = context[key] = make_codec(name, self._params)
        return codec


_MIN_TRIAL = 64 << 10  # frames smaller than this are not tried (timing noise, the header)
_TRIAL_BYTES = 1 << 20  # of a frame, encoded by a trial
