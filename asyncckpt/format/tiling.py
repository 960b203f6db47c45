"""Global (sharded) tensors: which saved boxes make each one, and the rule they obey.

Every rank's tree names the global tensors it took part in; the boxes the ranks wrote
must tile the global shape exactly: no gap, no overlap, the same dtype and shape on
every rank, each box inside the global shape and equal to its table entry. The reader
checks it before anything is read, and the writer checks it before it commits (so it
never commits a checkpoint the reader refuses), which is why this module does not
import torch: the writer process never does. Reading boxes back is sharded.py.

The rule is about every rank's boxes, so checking it reads every rank's tables: of a
step in parts, every rank's part file. A load that reads only boxes of one rank (the
same-world resume, each rank reading back the shard it saved) needs no other rank's
boxes: `rank_globals` gives one rank's, checked as far as one rank can be, and `covers`
says whether they hold a region.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import DTYPE_SIZES, TensorSpec
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import RankPart
from asyncckpt.format.tree import box_names, walk

Path = tuple[Any, ...]


@dataclass(frozen=True)
class Box:
    """One saved piece of a global tensor: rank `rank`'s table entry `spec`, at `offsets`."""

    rank: int
    spec: TensorSpec
    offsets: tuple[int, ...]


@dataclass
class GlobalTensor:
    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    placements: list[str] = field(default_factory=list)
    boxes: list[Box] = field(default_factory=list)

    @classmethod
    def whole(cls, rank: int, spec: TensorSpec, path: Path = ()) -> GlobalTensor:
        """A plain saved tensor as a global tensor of one box (rank `rank`'s entry)."""
        return cls(spec.name, path, spec.dtype, spec.shape,
                   boxes=[Box(rank, spec, (0,) * len(spec.shape))])


def global_tensors(manifest: Manifest) -> dict[str, GlobalTensor]:
    """The manifest's global tensors by name, their boxes checked to tile each exactly
    (every rank read: of a root manifest, every rank part file).

    Raises:
        CorruptCheckpointError: ranks disagree on a tensor, a box is out of bounds, does
            not match its table entry, or the boxes overlap or leave a gap.
    """
    out: dict[str, GlobalTensor] = {}
    for part in manifest.ranks:
        for name, mine in rank_globals(part, manifest.step).items():
            g = out.setdefault(name, dataclasses.replace(mine, boxes=[]))
            if (g.path, g.dtype, g.shape) != (mine.path, mine.dtype, mine.shape):
                raise CorruptCheckpointError(
                    f"global tensor {name!r:.80}: ranks disagree on its path, dtype or shape "
                    f"({g.dtype} {g.shape} at {g.path} vs {mine.dtype} {mine.shape} at "
                    f"{mine.path})", step=manifest.step, rank=part.rank)
            g.boxes += mine.boxes
    for g in out.values():
        _check_tiling(g, manifest.step)
    return out


def rank_globals(part: RankPart, step: int) -> dict[str, GlobalTensor]:
    """The global tensors rank `part` took part in, by name, each with only the boxes
    this rank saved (none where it wrote nothing): checked as far as one rank can be, each
    node well formed and each box inside the global shape and equal to its table entry.
    Whether the boxes of every rank tile the global shapes is `global_tensors`' check.

    Raises:
        CorruptCheckpointError: a dtensor node or a box of this rank breaks a rule.
    """
    out: dict[str, GlobalTensor] = {}
    specs = {s.name: s for s in part.tensors}
    for path, kind, body in walk(part.tree):
        if kind != "dtensor":
            continue
        name = body["name"]

        def bad(problem: str, name: str = name) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"global tensor {name!r:.80}: {problem}",
                                          step=step, rank=part.rank)
        dtype, shape, offsets = body.get("dtype"), body.get("shape"), body.get("offsets")
        placements = body.get("placements")
        if (not isinstance(dtype, str) or dtype not in DTYPE_SIZES or not _dims(shape)
                or not isinstance(placements, list)
                or not all(isinstance(p, str) for p in placements)):
            raise bad("bad dtype, shape or placements")
        g = out.setdefault(name, GlobalTensor(name, path, dtype, tuple(shape), placements))
        if (g.path, g.dtype, g.shape) != (path, dtype, tuple(shape)):
            raise bad(f"ranks disagree on its path, dtype or shape ({g.dtype} {g.shape} at "
                      f"{g.path} vs {dtype} {tuple(shape)} at {path})")
        further = list(zip(box_names(body), (b.get("offsets") for b in body.get("boxes") or [])))
        if offsets is None:
            if further:
                raise bad("further boxes but no first one (offsets null)")
            continue
        for box_name, box_offsets in [(name, offsets), *further]:
            spec = specs.get(box_name)
            if (spec is None or not _dims(box_offsets) or len(box_offsets) != len(shape)
                    or spec.dtype != dtype or len(spec.shape) != len(shape)
                    or any(o + n > s for o, n, s in zip(box_offsets, spec.shape, shape))):
                raise bad(f"box at {box_offsets!r:.80} does not fit the global shape "
                          f"{tuple(shape)} or its table entry {box_name!r:.80}")
            g.boxes.append(Box(part.rank, spec, tuple(box_offsets)))
    return out


def covers(g: GlobalTensor, offsets: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """One box of `g` holds all of the box `shape` at `offsets` (an empty box: always)."""
    return any(n == 0 for n in shape) or any(
        all(b <= o and o + n <= b + m for o, n, b, m in zip(offsets, shape, box.offsets,
                                                             box.spec.shape))
        for box in g.boxes)


def _dims(value: Any) -> bool:
    return (isinstance(value, list) and len(value) <= 64
            and all(type(v) is int and 0 <= v < 1 << 62 for v in value))


def _check_tiling(g: GlobalTensor, step: int) -> None:
    volume = sum(math.prod(b.spec.shape) for b in g.boxes)
    if volume != math.prod(g.shape):
        raise CorruptCheckpointError(f"global tensor {g.name!r:.80}: saved boxes hold {volume} "
                                     f"elements, its shape {g.shape} needs {math.prod(g.shape)}",
                                     step=step)
    boxes = sorted(g.boxes, key=lambda b: b.offsets)
    for i, a in enumerate(boxes):  # sweep along dim 0: only boxes starting before a ends
        for b in boxes[i + 1:]:
            if g.shape and b.offsets[0] >= a.offsets[0] + a.spec.shape[0]:
                break
            if intersect(a.offsets, a.spec.shape, b.offsets, b.spec.shape) is not None:
                raise CorruptCheckpointError(f"global tensor {g.name!r:.80}: boxes of ranks "
                                             f"{a.rank} and {b.rank} overlap", step=step)


def intersect(a_off: tuple[int, ...], a_shape: tuple[int, ...], b_off: tuple[int, ...],
               b_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offsets, shape) of the intersection of two boxes, or None if empty."""
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off))
    hi = tuple(min(a + m, b + n) for a, m, b, n in zip(a_off, a_shape, b_off, b_shape))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def runs(shape: tuple[int, ...], start: tuple[int, ...], size: tuple[int, ...],
         itemsize: int) -> list[tuple[int, int]]:
    """Byte ranges, in order, of the sub-box `start`/`size` of a row-major `shape` array."""
    if any(n == 0 for n in size):
        return []
    strides = [itemsize * math.prod(shape[i + 1:]) for i in range(len(shape))]
    k = len(shape) - 1  # the last dimension the sub-box does not span in full
    while k >= 0 and start[k] == 0 and size[k] == shape[k]:
        k -= 1
    if k < 0:
        return [(0, itemsize * math.prod(shape))]
    length = size[k] * strides[k]
    base = start[k] * strides[k]
    out = []
    for index in itertools.product(*(range(s, s + n) for s, n in zip(start[:k], size[:k]))):
        begin = base + sum(i * st for i, st in zip(index, strides))
        out.append((begin, begin + length))
    return out


