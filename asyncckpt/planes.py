"""Byte planes: splitting a frame's elements into one stream per byte position, and back.

Float bytes are not alike: the top byte of a bf16/fp16/fp32 element (sign and most of
the exponent) takes few values, the mantissa bytes look random. Interleaved, they hide
the exponent's redundancy from zstd: zstd level 1 stores bf16 weights N(0, 0.02) at 0.78
of their size and fp32 weights and Adam moments at 0.92-0.94. Separated, the exponent
plane compresses to ~0.34 of its size and the mantissa planes are stored raw: bf16 at
0.68, fp32 at 0.82-0.85 (real trained MiniLM weights: 0.685 and 0.83), compressing
only a quarter to half of the bytes.

A frame is the bytes `raw`; its elements are `width` bytes wide and the first whole
element starts `phase` bytes in (frames are packed across tensor boundaries, so a
tensor need not start element-aligned in a frame). The split is exact for any width
and phase, whatever the bytes are: the `phase` head bytes and the tail bytes that do
not fill an element are kept as they are, plane `i` is byte `i` of every whole element
(little-endian: the last plane holds the sign and exponent). A wrong width or phase
(the part of a frame that belongs to a tensor of another dtype) only costs ratio.

numpy does the work: its strided copies, casts and shifts run at 2-6 GB/s and release
the GIL, so encoder threads scale (measured on this machine: pure-Python extended
slicing of a `bytearray` splits at ~2.6 GB/s but holds the GIL, and 2 threads encoding
bf16 then reached 1.4x instead of 2x). A transpose (`reshape(-1, w).T.copy()`, or
torch's `.t().contiguous()`) is avoided: it runs at 0.4 GB/s.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

Buffer = bytes | bytearray | memoryview


class Split(NamedTuple):
    head: memoryview      # the `phase` bytes before the first whole element
    planes: list[np.ndarray]  # `width` uint8 arrays of `count` bytes each
    tail: memoryview      # bytes after the last whole element


def geometry(length: int, width: int, phase: int) -> tuple[int, int, int]:
    """(head bytes, elements, tail bytes) of a `length`-byte frame.

    Raises:
        ValueError: width not in 1..8 or phase not in 0..width-1.
    """
    if not 1 <= width <= 8 or not 0 <= phase < width:
        raise ValueError(f"plane width {width} / phase {phase} out of range")
    head = min(phase, length)
    count = (length - head) // width
    return head, count, length - head - count * width


def split(raw: Buffer, width: int, phase: int) -> Split:
    """Split `raw` into its head, `width` planes and tail (copies; `raw` may be released
    once this returns)."""
    view = memoryview(raw).cast("B")
    head, count, tail = geometry(len(view), width, phase)
    body = np.frombuffer(view, np.uint8, count * width, head)
    if width in (4, 8):  # plane 0 by truncating cast, the others by strided copies
        planes = [body.view(f"<u{width}").astype(np.uint8)]
        planes += [body[i::width].copy() for i in range(1, width)]
    else:  # strided copies: 2.3-2.8 GB/s for width 2 (shift-and-cast: 1.1-4 GB/s, noisier)
        planes = [body[i::width].copy() for i in range(width)]
    return Split(view[:head], planes, view[head + count * width:])


def merge_into(head: Buffer, planes: list[Buffer], tail: Buffer, width: int, phase: int,
               outs: list[memoryview]) -> None:
    """Interleave `head`, `planes` and `tail` back into `outs`: consecutive views that
    hold the frame's raw bytes in all (the tensors it spans), written in place.

    Raises:
        ValueError: the pieces do not add up to the views' total length.
    """
    total = sum(len(o) for o in outs)
    h, count, t = geometry(total, width, phase)
    if len(head) != h or len(tail) != t or len(planes) != width or any(len(p) != count for p in planes):
        raise ValueError(f"planes do not fill {total} bytes as width {width} / phase {phase}")
    sources = [np.frombuffer(p, np.uint8) for p in planes]
    pos = 0  # frame offset of the current view
    for out in outs:
        n = len(out)
        if not n:
            continue
        dest = np.frombuffer(out, np.uint8)
        lo, hi = pos, pos + n
        # the head and tail bytes that fall in this view
        for start, data in ((0, head), (h + count * width, tail)):
            a, b = max(lo, start), min(hi, start + len(data))
            if a < b:
                dest[a - lo:b - lo] = np.frombuffer(data, np.uint8)[a - start:b - start]
        # elements: byte i of element j sits at h + j*width + i
        e_lo, e_hi = max(lo, h), min(hi, h + count * width)
        if e_lo < e_hi:
            if width == 1:
                dest[e_lo - lo:e_hi - lo] = sources[0][e_lo - h:e_hi - h]
            elif width == 2 and (e_lo - h) % 2 == 0 and (e_hi - h) % 2 == 0 and e_hi - e_lo >= 64:
                # whole elements only: shift-and-merge at ~6 GB/s
                j0, j1 = (e_lo - h) // 2, (e_hi - h) // 2
                words = dest[e_lo - lo:e_hi - lo].view("<u2")
                np.left_shift(sources[1][j0:j1], 8, out=words, dtype=np.uint16)
                words |= sources[0][j0:j1]
            else:
                for i in range(width):
                    first = h + i  # frame offset of plane i's first byte
                    # first element whose byte i lies at or after e_lo
                    j0 = max(0, -(-(e_lo - first) // width))
                    j1 = max(j0, -(-(e_hi - first) // width))
                    if j1 > j0:
                        start = first + j0 * width - lo
                        dest[start:start + (j1 - j0 - 1) * width + 1:width] = sources[i][j0:j1]
        pos = hi
