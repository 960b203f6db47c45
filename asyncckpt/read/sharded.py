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
from typing import Callable

import torch

from asyncckpt.format.layout import DTYPE_SIZES
from asyncckpt.format.tiling import Box, GlobalTensor, intersect, runs
from asyncckpt.read.reader import RankReader, tensor_bytes

TEMP_BYTES = 256 << 20  # a plan's temporaries, at most, before it reads what it has


class ReadPlan:
    """Box reads batched per saved rank, flushed when temporaries reach `temp_bytes`."""

    def __init__(self, open_reader: Callable[[int], RankReader],
                 temp_bytes: int = TEMP_BYTES) -> None:
        self._open = open_reader
        self._temp_limit = temp_bytes
        self._ranges: dict[int, list[tuple[int, int, memoryview, str | None]]] = {}
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._keep: list[torch.Tensor] = []
        self._temp = 0

    def add(self, g: GlobalTensor, offsets: tuple[int, ...], out: torch.Tensor) -> None:
        """Fill `out` (a tensor of `g`'s dtype shaped like the box at `offsets`) from the
        saved boxes that intersect it, when the plan is flushed."""
        if len(g.boxes) == 1 and out.device.type == "cpu" and out.is_contiguous():
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
            direct = piece.device.type == "cpu" and piece.is_contiguous()
            target = piece if direct else torch.empty(sub_size, dtype=piece.dtype)
            if not direct:
                self._copies.append((piece, target))
                self._temp += target.numel() * itemsize
            self._keep.append(target)
            view, pos = tensor_bytes(target), 0
            ranges = self._ranges.setdefault(box.rank, [])
            for begin, end in runs(box.spec.shape, sub_start, sub_size, itemsize):
                ranges.append((box.spec.begin + begin, box.spec.begin + end,
                               view[pos:pos + end - begin], box.spec.name))
                pos += end - begin
            if self._temp >= self._temp_limit:
                self.flush()

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
