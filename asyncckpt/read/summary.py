"""A checkpoint summarised: per tensor, per dtype and per codec, from its manifest alone.

What `asyncckpt inspect` prints (and `--json` returns) and what the benchmarks report
as a codec's ratios. Everything here reads the manifest, never a data file: a tensor's
stored bytes are its share of the frames it overlaps, so the figures cost nothing to
compute and need no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import RankPart

if TYPE_CHECKING:
    from asyncckpt.read.checkpoint import Checkpoint


def inspect_summary(ckpt: Checkpoint) -> dict:
    """What `inspect --json` prints for an open Checkpoint (the text form shows the same)."""
    m, globals_ = ckpt.manifest, ckpt.sharded
    views = sum(leaf.view is not None for r in range(m.world_size) for leaf in ckpt.leaves(r))
    tensors, by_dtype = tensor_rows(m, globals_)
    return {"path": str(ckpt.directory), "step": m.step, "world_size": m.world_size,
            "format_version": m.format_version, **incremental(m),
            "codecs": sorted({p.codec for p in m.ranks}), "frames": codec_summary(m)["frames"],
            "raw_bytes": m.raw_size,
            "stored_bytes": m.stored_size, "ratio": round(m.stored_size / max(m.raw_size, 1), 4),
            "writer_version": m.writer_version, "by_dtype": by_dtype, "tensors": tensors,
            "views": views,
            "sharded": [{"name": g.name, "dtype": g.dtype, "shape": list(g.shape),
                         "placements": g.placements, "boxes": len(g.boxes)}
                        for g in globals_.values()]}


def tensor_rows(m: Manifest, globals_: dict) -> tuple[list[dict], dict[str, dict]]:
    """One row per saved tensor (with its offsets in a sharded tensor, if it is a box of
    one), and the totals and stored/raw ratio per dtype."""
    offsets = {(b.rank, g.name): list(b.offsets) for g in globals_.values() for b in g.boxes}
    tensors: list[dict] = []
    by_dtype: dict[str, dict] = {}
    for part in m.ranks:
        stored = _stored_per_tensor(part)
        for t in part.tensors:
            tensors.append({"rank": part.rank, "name": t.name, "dtype": t.dtype,
                            "shape": list(t.shape), "bytes": t.end - t.begin,
                            "stored_bytes": round(stored[t.name]),
                            "offsets": offsets.get((part.rank, t.name))})
            row = by_dtype.setdefault(t.dtype, {"tensors": 0, "bytes": 0, "stored_bytes": 0})
            row["tensors"] += 1
            row["bytes"] += t.end - t.begin
            row["stored_bytes"] += round(stored[t.name])
    for row in by_dtype.values():
        row["ratio"] = round(row["stored_bytes"] / max(row["bytes"], 1), 4)
    return tensors, by_dtype


def incremental(m: Manifest) -> dict:
    """How much of the step is new, and how much it references from earlier steps."""
    referenced = m.referenced_size
    return {"new_bytes": m.raw_size - referenced, "referenced_bytes": referenced,
            "referenced_stored_bytes": sum(f.encoded_length for p in m.ranks
                                           for f in p.frames if f.ref is not None),
            "referenced_steps": sorted(m.referenced_steps)}


def codec_summary(m: Manifest) -> dict:
    """Frames per codec (count, raw and stored bytes, ratio; for bytegroup frames how
    often each plane was compressed) and stored/raw per dtype, over all ranks."""
    frames: dict[str, dict] = {}
    by_dtype: dict[str, list[float]] = {}
    for part in m.ranks:
        for f in part.frames:
            row = frames.setdefault(f.codec, {"count": 0, "bytes": 0, "stored_bytes": 0})
            row["count"] += 1
            row["bytes"] += f.raw_length
            row["stored_bytes"] += f.encoded_length
            if f.layout is not None:
                key = f"width {f.layout.width}: " + "".join(
                    "z" if c == "zstd" else "-" for c, _ in f.layout.planes)
                planes = row.setdefault("planes", {})
                planes[key] = planes.get(key, 0) + 1
        stored = _stored_per_tensor(part)
        for t in part.tensors:
            acc = by_dtype.setdefault(t.dtype, [0, 0])
            acc[0] += t.end - t.begin
            acc[1] += stored[t.name]
    for row in frames.values():
        row["ratio"] = round(row["stored_bytes"] / max(row["bytes"], 1), 4)
    return {"frames": frames,
            "by_dtype": {d: round(s / max(b, 1), 4) for d, (b, s) in by_dtype.items()},
            "codecs": sorted({p.codec for p in m.ranks}),
            "ratio": round(m.stored_size / max(m.raw_size, 1), 4)}


def _stored_per_tensor(part: RankPart) -> dict[str, float]:
    """Each tensor's share of the stored bytes of the frames it overlaps."""
    out = {t.name: 0.0 for t in part.tensors}
    frames = iter(part.frames)
    frame = next(frames, None)
    for t in part.tensors:
        pos = t.begin
        while frame is not None and pos < t.end:
            f_end = frame.raw_offset + frame.raw_length
            overlap = min(t.end, f_end) - pos
            out[t.name] += frame.encoded_length * overlap / frame.raw_length
            pos += overlap
            if pos >= f_end:
                frame = next(frames, None)
    return out


def summary_text(summary: dict) -> str:
    """`inspect_summary`'s result as `asyncckpt inspect` prints it: an overview line, then
    tables per codec, per dtype, per sharded tensor and per tensor. Long names are cut
    with an ellipsis (the JSON form has them whole)."""
    out: list[str] = []
    _overview(summary, out)
    _frames(summary["frames"], out)
    _dtypes(summary["by_dtype"], out)
    _sharded(summary["sharded"], out)
    _tensors(summary["tensors"], out)
    return "\n".join(out)


def _cut(name: str, width: int) -> str:
    """`name` in `width` characters, an ellipsis saying when it was cut."""
    return name if len(name) <= width else name[:width - 1] + "…"


def _overview(summary: dict, out: list[str]) -> None:
    views, referenced = summary["views"], summary["referenced_bytes"]
    out.append(f"{summary['path']}: step {summary['step']}, {summary['world_size']} rank(s), "
          f"codec {'/'.join(summary['codecs'])}, {summary['raw_bytes'] / 2**20:.1f} MiB -> "
          f"{summary['stored_bytes'] / 2**20:.1f} MiB (ratio {summary['ratio']:.3f})"
          + (f", {views} view(s) of saved tensors (tied, stored once)" if views else ""))
    if referenced:
        out.append(f"incremental: {summary['new_bytes'] / 2**20:.1f} MiB new in this step, "
              f"{referenced / 2**20:.1f} MiB referenced "
              f"({summary['referenced_stored_bytes'] / 2**20:.1f} MiB stored) from steps "
              f"{summary['referenced_steps']}")


def _frames(frames: dict[str, dict], out: list[str]) -> None:
    out.append(f"\n{'FRAMES':12} {'COUNT':>8} {'MiB':>10} {'STORED':>10} {'RATIO':>6}  PLANES")
    for codec, row in sorted(frames.items()):
        out.append(f"{codec:12} {row['count']:>8} {row['bytes'] / 2**20:>10.2f} "
              f"{row['stored_bytes'] / 2**20:>10.2f} {row['ratio']:>6.3f}  {row.get('planes', '')}")


def _dtypes(by_dtype: dict[str, dict], out: list[str]) -> None:
    out.append(f"\n{'DTYPE':12} {'TENSORS':>8} {'MiB':>10} {'STORED':>10} {'RATIO':>6}")
    for dtype, row in sorted(by_dtype.items()):
        out.append(f"{dtype:12} {row['tensors']:>8} {row['bytes'] / 2**20:>10.2f} "
              f"{row['stored_bytes'] / 2**20:>10.2f} {row['ratio']:>6.3f}")


def _sharded(sharded: list[dict], out: list[str]) -> None:
    if not sharded:
        return
    out.append(f"\n{'SHARDED TENSOR':40} {'DTYPE':8} {'GLOBAL SHAPE':>18} {'BOXES':>6}  PLACEMENTS")
    for g in sharded:
        out.append(f"{_cut(g['name'], 40):40} {g['dtype']:8} {str(tuple(g['shape'])):>18} "
              f"{g['boxes']:>6}  {','.join(g['placements'])}")


def _tensors(tensors: list[dict], out: list[str]) -> None:
    out.append(f"\n{'RANK':>4} {'TENSOR':40} {'DTYPE':8} {'SHAPE':>18} {'BYTES':>12}  AT")
    for t in tensors:
        at = str(tuple(t["offsets"])) if t["offsets"] is not None else ""
        out.append(f"{t['rank']:>4} {_cut(t['name'], 40):40} {t['dtype']:8} "
              f"{str(tuple(t['shape'])):>18} {t['bytes']:>12}  {at}")
