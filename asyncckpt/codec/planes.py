"""Byte planes: splitting a frame's elements into one stream per byte position, and back.

Float bytes are not alike: the exponent takes few values, the mantissa bytes look
random. Interleaved, they hide the exponent's redundancy from zstd, which then shrinks
float weights and Adam moments little. Separated, the exponent plane compresses well
and the mantissa planes mostly stay raw.

Byte planes cut a bf16 / fp32 element between the sign and exponent (bits 15 / 31 and
14..7 / 30..23), so the top byte holds the sign and seven exponent bits, and the eighth
exponent bit sits in the next byte, among random mantissa bits. `rotated` splits with
the element's top nine bits rotated left by one: the top plane is the whole exponent
and the sign moves to bit 7 of the plane below, which is random anyway (ZipNN groups
bf16 and fp32 bytes this way). On all-MiniLM-L6-v2 that stores bf16 and fp32 weights
smaller, the planes compressed alike. Encoding costs nothing more (the rotated split
runs on whole words, shifts and truncating casts, faster than the strided copies);
decoding does: the merge puts sign, exponent and low bits back with three shifts and
ors instead of one, and whole frames decode slower. It is a choice per tensor (the
codec's probe): integers lose by it, their sign-extended top byte would spread over two
planes.

A frame is the bytes `raw`; its elements are `width` bytes wide and the first whole
element starts `phase` bytes in (frames are packed across tensor boundaries, so a
tensor need not start element-aligned in a frame). The split is exact for any width
and phase, whatever the bytes are: the `phase` head bytes and the tail bytes that do
not fill an element are kept as they are, plane `i` is byte `i` of every whole element
(little-endian: the last plane holds the sign and exponent). A wrong width or phase
(the part of a frame that belongs to a tensor of another dtype) only costs ratio.

numpy does the work: its strided copies, casts and shifts release the GIL, so encoder
threads scale (pure-Python extended slicing of a `bytearray` splits about as fast but
holds the GIL, and encoder threads then scaled poorly). A transpose
(`reshape(-1, w).T.copy()`, or torch's `.t().contiguous()`) is avoided: it is several
times slower. The measurements: docs/design/codec.md.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

Buffer = bytes | bytearray | memoryview
ROTATABLE = (2, 4, 8)  # widths whose elements may be split with the sign rotated (floats)


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


def split(raw: Buffer, width: int, phase: int, rotated: bool = False) -> Split:
    """Split `raw` into its head, `width` planes and tail (copies; `raw` may be released
    once this returns). `rotated` (widths in ROTATABLE only): the element's top nine bits
    are rotated left by one first, so plane `width-1` is the exponent byte of a bf16 /
    fp32 (the top 8 of fp64's 11 exponent bits) and the sign is bit 7 of plane `width-2`.

    Raises:
        ValueError: bad width / phase, or `rotated` with a width not in ROTATABLE.
    """
    view = memoryview(raw).cast("B")
    head, count, tail = geometry(len(view), width, phase)
    if rotated and width not in ROTATABLE:
        raise ValueError(f"no sign rotation for width {width}")
    body = np.frombuffer(view, np.uint8, count * width, head)
    if rotated:  # shifts and truncating casts of whole words: faster than strided copies
        words = body.view(f"<u{width}")
        bits = 8 * width
        planes = [(words >> (8 * i)).astype(np.uint8) for i in range(width - 2)]
        low = (words >> (bits - 16)).astype(np.uint8)
        low &= 0x7F
        low |= (words >> (bits - 8)).astype(np.uint8) & 0x80
        planes += [low, (words >> (bits - 9)).astype(np.uint8)]
    elif width in (4, 8):  # plane 0 by truncating cast, the others by strided copies
        planes = [body.view(f"<u{width}").astype(np.uint8)]
        planes += [body[i::width].copy() for i in range(1, width)]
    else:  # strided copies for width 2 (shift-and-cast is no faster and noisier)
        planes = [body[i::width].copy() for i in range(width)]
    return Split(view[:head], planes, view[head + count * width:])


def unrotate(planes: list[np.ndarray]) -> list[np.ndarray]:
    """The byte planes that `planes`, split with `rotated`, stand for (new arrays for
    the top two, the others as they are)."""
    low, top = np.frombuffer(planes[-2], np.uint8), np.frombuffer(planes[-1], np.uint8)
    sign = low & 0x80
    plain_top = top >> 1
    plain_top |= sign
    plain_low = np.left_shift(top, 7)
    np.bitwise_xor(low, sign, out=sign)  # low & 0x7F
    plain_low |= sign
    return [*planes[:-2], plain_low, plain_top]


def merge_into(head: Buffer, planes: list[Buffer], tail: Buffer, width: int, phase: int,
               outs: list[memoryview], rotated: bool = False) -> None:
    """Interleave `head`, `planes` and `tail` back into `outs`: consecutive views that
    hold the frame's raw bytes in all (the tensors it spans), written in place.
    `rotated`: the planes were split with `rotated` (the sign goes back to the top).

    Raises:
        ValueError: the pieces do not add up to the views' total length.
    """
    total = sum(len(o) for o in outs)
    h, count, t = geometry(total, width, phase)
    if (len(head) != h or len(tail) != t or len(planes) != width
            or any(len(p) != count for p in planes)):
        raise ValueError(f"planes do not fill {total} bytes as width {width} / phase {phase}")
    if rotated and width not in ROTATABLE:
        raise ValueError(f"no sign rotation for width {width}")
    sources = [np.frombuffer(p, np.uint8) for p in planes]
    plain: list[np.ndarray] | None = None if rotated else sources
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
            whole = (e_lo - h) % width == 0 and (e_hi - h) % width == 0 and e_hi - e_lo >= 64
            if width == 1:
                dest[e_lo - lo:e_hi - lo] = sources[0][e_lo - h:e_hi - h]
            elif width in ROTATABLE and whole:  # 16-bit halves of whole elements
                j0, j1 = (e_lo - h) // width, (e_hi - h) // width
                halves = dest[e_lo - lo:e_hi - lo].view("<u2").reshape(-1, width // 2)
                for k in range(width // 2):
                    top = rotated and k == width // 2 - 1
                    pair = sources[2 * k][j0:j1], sources[2 * k + 1][j0:j1]
                    if width == 2:
                        _merge16(*pair, top, halves.reshape(-1))
                    else:  # one strided u16 store per pair beats a strided u8 store per plane
                        halves[:, k] = _merge16(*pair, top, np.empty(j1 - j0, np.uint16))
            else:
                if plain is None:
                    plain = [np.frombuffer(p, np.uint8) for p in unrotate(sources)]
                for i in range(width):
                    first = h + i  # frame offset of plane i's first byte
                    # first element whose byte i lies at or after e_lo
                    j0 = max(0, -(-(e_lo - first) // width))
                    j1 = max(j0, -(-(e_hi - first) // width))
                    if j1 > j0:
                        start = first + j0 * width - lo
                        dest[start:start + (j1 - j0 - 1) * width + 1:width] = plain[i][j0:j1]
        pos = hi


def _merge16(low: np.ndarray, high: np.ndarray, rotated: bool, out: np.ndarray) -> np.ndarray:
    """`out` (uint16) = `high` << 8 | `low`, or for `rotated` planes the bf16 they stand
    for: sign (bit 7 of `low`) << 15 | exponent (`high`) << 7 | the low 7 bits of `low`
    (the rotated merge is the slower; docs/design/codec.md)."""
    if rotated:
        np.left_shift(low >> 7, 15, out=out, dtype=np.uint16)
        out |= np.left_shift(high, 7, dtype=np.uint16)
        out |= low & 0x7F
    else:
        np.left_shift(high, 8, out=out, dtype=np.uint16)
        out |= low
    return out
