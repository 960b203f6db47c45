"""Reading any box of a global (sharded) tensor -- the resharding.

The saved boxes of a global tensor tile its shape exactly (tiling.py checks that before
anything is read). A target box is filled by intersecting it with the
saved boxes; each intersection is a set of contiguous runs in the saved rank's stream
(one run when both layouts split the same leading dimension, one per row when a
`Shard(0)` save is loaded as `Shard(1)`). Runs are read straight into the destination
when it is contiguous host memory, otherwise into a bounded temporary that is then
copied; all runs of a rank's file go through one `read_ranges` pass, so frames shared by
small tensors are read and verified once per batch, not once per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from asyncckpt.format.layout import DTYPE_SIZES
from asyncckpt.format.tiling import Box, GlobalTensor, intersect, runs
from asyncckpt.read.reader import RankReader, tensor_bytes
from asyncckpt.torchutil.dtypes import DTYPES

TEMP_BYTES = 256 << 20  # a plan's temporaries, at most, before it reads what it has


class ReadPlan:
    """Box reads batched per saved rank, flushed when temporaries reach `temp_bytes`."""

    def __init__(self, open_reader: Callable[[int], RankReader],
                 temp_bytes: int = TEMP_BYTES, scratch: torch.Tensor | None = None) -> None:
        """`scratch`: a uint8 buffer of at least `temp_bytes` for the temporaries, which
        plans made one after the other may share (default: made when first needed)."""
        self._open = open_reader
        self._temp_limit = temp_bytes
        self._ranges: dict[int, list[tuple[int, int, memoryview, str | None]]] = {}
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._keep: list[torch.Tensor] = []
        self._temp = 0
        self._scratch = scratch  # the temporaries' memory, reused

    def add(self, g: GlobalTensor, offsets: tuple[int, ...], out: torch.Tensor) -> None:
        """Fill `out` (a tensor shaped like the box at `offsets`; of `g`'s dtype, or of
        another that the saved values are converted to, through temporaries) from the
        saved boxes that intersect it, when the plan is flushed."""
        same = out.dtype == DTYPES[g.dtype]
        if same and len(g.boxes) == 1 and out.device.type == "cpu" and out.is_contiguous():
            box = g.boxes[0]
            if tuple(out.shape) == box.spec.shape and not any(offsets) and not any(box.offsets):
                # a whole plain tensor into its own memory (a load's common case): one range
                spec = box.spec
                if spec.end > spec.begin:
                    self._keep.append(out)
                    self._ranges.setdefault(box.rank, []).append(
                        (spec.begin, spec.end, tensor_bytes(out), spec.name))
                return
        for box in g.boxes:
            hit = intersect(offsets, tuple(out.shape), box.offsets, box.spec.shape)
            if hit is None:
                continue
            lo, size = hit
            dest = out[tuple(slice(a - o, a - o + n) for a, o, n in zip(lo, offsets, size))]
            start = tuple(a - b for a, b in zip(lo, box.offsets))
            self._add_piece(box, start, size, dest)

    def _add_piece(self, box: Box, start: tuple[int, ...], size: tuple[int, ...],
                   dest: torch.Tensor) -> None:
        itemsize = DTYPE_SIZES[box.spec.dtype]
        row_bytes = itemsize * math.prod(size[1:])
        rows = max(1, self._temp_limit // max(1, row_bytes)) if size else 1
        for first in range(0, size[0], rows) if size else [0]:
            sub_size = (min(rows, size[0] - first),) + size[1:] if size else ()
            sub_start = (start[0] + first,) + start[1:] if size else ()
            piece = dest[first:first + sub_size[0]] if size else dest
            saved = DTYPES[box.spec.dtype]
            direct = piece.device.type == "cpu" and piece.is_contiguous() and piece.dtype == saved
            target = piece if direct else self._temporary(sub_size, saved, itemsize)
            if not direct:
                self._copies.append((piece, target))
            self._keep.append(target)
            view, pos = tensor_bytes(target), 0
            ranges = self._ranges.setdefault(box.rank, [])
            for begin, end in runs(box.spec.shape, sub_start, sub_size, itemsize):
                ranges.append((box.spec.begin + begin, box.spec.begin + end,
                               view[pos:pos + end - begin], box.spec.name))
                pos += end - begin
            if self._temp >= self._temp_limit:
                self.flush()

    def _temporary(self, shape: tuple[int, ...], dtype: torch.dtype, itemsize: int) -> torch.Tensor:
        """A temporary carved from one buffer of `temp_bytes` that every flush frees
        whole: allocating each anew lets glibc's adaptive mmap threshold keep the freed
        ones in its heap, which then grows (a converting export of 64 MiB tensors
        peaked at 6 x the largest tensor that way)."""
        need = -(-math.prod(shape) * itemsize // 64) * 64
        if need > self._temp_limit:  # one row larger than the limit: its own memory
            self._temp += need
            return torch.empty(shape, dtype=dtype)
        if self._temp + need > self._temp_limit:
            self.flush()
        if self._scratch is None:
            self._scratch = torch.empty(self._temp_limit, dtype=torch.uint8)  # touched as used
        start, self._temp = self._temp, self._temp + need
        return self._scratch[start:start + need].view(dtype)[:math.prod(shape)].view(shape)

    def flush(self) -> None:
        """Read every pending range (verified) and copy temporaries into place."""
        for rank, ranges in sorted(self._ranges.items()):
            ranges.sort(key=lambda r: r[0])
            self._open(rank).read_ranges(ranges)
        with torch.no_grad():
            for dest, temp in self._copies:
                dest.copy_(temp)
        self._ranges.clear()
        self._copies.clear()
        self._keep.clear()
        self._temp = 0
