"""Corruption sweep: damage a checkpoint at random, thousands of ways; nothing slips by.

    python scripts/faults/corruption.py --cases 1000

Each case copies a committed 2-rank checkpoint (zstd, raw or bytegroup codec) and applies one
damage: a flipped bit in a data file or in the manifest, a truncation, appended bytes, a
deleted data file or manifest, an extra file, two frames swapped, or a manifest field
edited *and re-signed* (plane layouts too; so only the field rules, the header check and the data
checksums can catch it). `verify` must report every case, `load` must raise
CorruptCheckpointError for the damaged rank, and any rank that loads must load the
original values exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

import asyncckpt
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import MANIFEST_NAME
from asyncckpt.read.verification import verify_checkpoint

Damage = Callable[[Path, random.Random], tuple[str, int | None]]


def rank_state(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {"w": torch.randn(60_000, generator=g).bfloat16(), "b": torch.randn(20_000, generator=g),
            "ids": torch.randint(0, 1000, (5000,), generator=g),
            "mask": torch.rand(3000, generator=g) > 0.5,
            "opt": {0: {"step": torch.tensor(7.0)}}, "meta": {"rank": rank}}


def make_checkpoints(workdir: Path) -> dict[str, Path]:
    """One committed 2-rank step per codec."""
    out = {}
    for codec in ("zstd", "raw", "bytegroup"):
        root = workdir / codec
        writer = asyncckpt.start_writer(root, codec=codec, log_file=workdir / f"{codec}.log")
        try:
            clients = [asyncckpt.connect(writer.address, rank=r, world_size=2,
                                         slot_size=64 << 10, ring_size=256 << 10) for r in (0, 1)]
            handles = [c.save(1, rank_state(r)) for r, c in enumerate(clients)]
            out[codec] = handles[0].wait(60)
            handles[1].wait(60)
            for c in clients:
                c.close()
        finally:
            writer.stop()
    return out


def _manifest(d: Path) -> dict:
    envelope = len('{"xxh3":"0123456789abcdef","manifest":')
    return json.loads((d / MANIFEST_NAME).read_bytes()[envelope:-2])


def _resign(d: Path, body: dict) -> None:
    raw = json.dumps(body, separators=(",", ":")).encode()
    (d / MANIFEST_NAME).write_bytes(b'{"xxh3":"%016x","manifest":' % xxhash.xxh3_64_intdigest(raw)
                                    + raw + b"}\n")


def _data(d: Path, rng: random.Random) -> tuple[Path, int]:
    rank = rng.randrange(2)
    return next(d.glob(f"rank-{rank:05d}.*")), rank


def _flip_bit(path: Path, rng: random.Random) -> int:
    data = bytearray(path.read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(data)
    return at


def flip_data(d: Path, rng: random.Random) -> tuple[str, int | None]:
    path, rank = _data(d, rng)
    return f"bit flip in {path.name} at {_flip_bit(path, rng)}", rank


def flip_manifest(d: Path, rng: random.Random) -> tuple[str, int | None]:
    return f"bit flip in manifest at {_flip_bit(d / MANIFEST_NAME, rng)}", None


def truncate(d: Path, rng: random.Random) -> tuple[str, int | None]:
    path, rank = _data(d, rng)
    size = rng.randrange(path.stat().st_size)
    os.truncate(path, size)
    return f"{path.name} truncated to {size}", rank


def append(d: Path, rng: random.Random) -> tuple[str, int | None]:
    path, rank = _data(d, rng)
    with open(path, "ab") as f:
        f.write(rng.randbytes(rng.randint(1, 100)))
    return f"bytes appended to {path.name}", rank


def delete_data(d: Path, rng: random.Random) -> tuple[str, int | None]:
    path, rank = _data(d, rng)
    path.unlink()
    return f"{path.name} deleted", rank


def delete_manifest(d: Path, rng: random.Random) -> tuple[str, int | None]:
    (d / MANIFEST_NAME).unlink()
    return "manifest deleted", None


def extra_file(d: Path, rng: random.Random) -> tuple[str, int | None]:
    name = rng.choice(["rank-00002.safetensors", "rank-00002.safetensors.zst", "notes.txt",
                       ".hidden", "manifest.json.bak"])
    (d / name).write_bytes(rng.randbytes(10))
    return f"extra file {name}", None


def swap_frames(d: Path, rng: random.Random) -> tuple[str, int | None]:
    path, rank = _data(d, rng)
    frames = _manifest(d)["ranks"][rank]["frames"]
    data = path.read_bytes()
    pieces = [data[f["stored"][0]:f["stored"][0] + f["stored"][1]] for f in frames]
    for _ in range(20):
        i, j = rng.sample(range(len(pieces)), 2)
        if pieces[i] != pieces[j]:
            break
    else:
        return flip_data(d, rng)
    pieces[i], pieces[j] = pieces[j], pieces[i]
    path.write_bytes(b"".join(pieces))
    return f"frames {i} and {j} of {path.name} swapped", rank


def resigned_edit(d: Path, rng: random.Random) -> tuple[str, int | None]:
    body = _manifest(d)
    rank = rng.randrange(2)
    part = body["ranks"][rank]
    frame = rng.choice(part["frames"])
    tensor = rng.choice(part["tensors"])
    same_size = {"BF16": "F16", "F16": "BF16", "F32": "I32", "I32": "F32", "I64": "F64",
                 "F64": "I64", "BOOL": "U8", "U8": "I8"}
    edits = {
        "frame raw hash": lambda: frame.__setitem__(
            "xxh3_raw", f"{int(frame['xxh3_raw'], 16) ^ 1:016x}"),
        "frame stored hash": lambda: frame.__setitem__(
            "xxh3_stored", f"{int(frame['xxh3_stored'], 16) ^ 4:016x}"),
        "frame stored length": lambda: frame["stored"].__setitem__(1, frame["stored"][1] + 1),
        "frame raw offset": lambda: frame["raw"].__setitem__(0, frame["raw"][0] + 8),
        "tensor dtype": lambda: tensor.__setitem__("dtype", same_size.get(tensor["dtype"], "U8")),
        "tensor shape": lambda: tensor.__setitem__("shape", [2, tensor["shape"][0] // 2]
                                                   if tensor["shape"]
                                                   and tensor["shape"][0] % 2 == 0
                                                   else tensor["shape"] + [1]),
        "tensor name": lambda: tensor.__setitem__("name", tensor["name"] + "x"),
        "tensor range": lambda: tensor["range"].__setitem__(1, tensor["range"][1] + 2),
        "codec": lambda: part.__setitem__("codec", "raw" if part["codec"] == "zstd" else "zstd"),
        "plane layout": lambda: _edit_planes(rng, part["frames"]),
        "world size": lambda: body.__setitem__("world_size", 3),
        "rank order": lambda: body["ranks"].reverse(),
        "file name": lambda: part.__setitem__("file", "../" + part["file"]),
        "step": lambda: body.__setitem__("step", body["step"] + 1),
    }
    what = rng.choice(sorted(edits))
    edits[what]()
    _resign(d, body)
    return f"re-signed manifest edit: {what} (rank {rank})", rank


def _edit_planes(rng: random.Random, frames: list[dict]) -> None:
    """A bytegroup frame's plane layout: another width or phase, or a plane's codec or
    stored length changed (for other codecs, a layout where none belongs)."""
    frame = rng.choice(frames)
    planes = frame.get("planes")
    if planes is None:
        frame["planes"] = {"width": 2, "phase": 0, "stored": [["raw", frame["stored"][1]]]}
        return
    choice = rng.randrange(4)
    if choice == 0:
        planes["width"] = 4 if planes["width"] == 2 else 2
    elif choice == 1:
        planes["phase"] = (planes["phase"] + 1) % planes["width"]
    else:
        plane = rng.choice(planes["stored"])
        if choice == 2:
            plane[0] = "raw" if plane[0] == "zstd" else "zstd"
        else:
            plane[1] += rng.choice((-1, 1))


DAMAGES: list[tuple[Damage, int]] = [
    (flip_data, 30), (flip_manifest, 10), (truncate, 8), (append, 5), (delete_data, 4),
    (delete_manifest, 3), (extra_file, 5), (swap_frames, 10), (resigned_edit, 25)]


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a,
                        b.view(torch.uint8) if b.dtype == torch.bool else b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def sweep(cases: int, seed: int, workdir: Path) -> dict:
    rng = random.Random(seed)
    bases = make_checkpoints(workdir)
    originals = [rank_state(r) for r in (0, 1)]
    stats = {"cases": 0, "verify_detected": 0, "load_detected": 0, "wrong_values": 0, "kinds": {}}
    missed = []
    for case in range(cases):
        codec = rng.choice(sorted(bases))
        target = workdir / f"case-{case}" / "step-00000001"
        shutil.copytree(bases[codec], target)
        damage = rng.choices([d for d, _ in DAMAGES], weights=[w for _, w in DAMAGES])[0]
        what, rank = damage(target, rng)
        stats["cases"] += 1
        stats["kinds"][damage.__name__] = stats["kinds"].get(damage.__name__, 0) + 1
        if not verify_checkpoint(target).ok:
            stats["verify_detected"] += 1
        else:
            missed.append(f"verify missed ({codec}): {what}")
        raised = []
        for r in (0, 1):
            try:
                loaded = asyncckpt.load(target, rank=r)
            except CorruptCheckpointError:
                raised.append(r)
                continue
            if not same(originals[r], loaded):
                stats["wrong_values"] += 1
                missed.append(f"WRONG VALUES for rank {r} ({codec}): {what}")
        if (rank is None and raised == [0, 1]) or (rank is not None and rank in raised):
            stats["load_detected"] += 1
        else:
            missed.append(f"load missed ({codec}): {what}; raised for ranks {raised}")
        shutil.rmtree(target.parent)
    stats["missed"] = missed
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="asyncckpt-corrupt-") as tmp:
        s = sweep(args.cases, args.seed, Path(tmp))
    print(f"corruption sweep: {s['cases']} cases; verify detected {s['verify_detected']}, "
          f"load detected {s['load_detected']}, wrong values returned {s['wrong_values']}")
    print("by kind:", json.dumps(s["kinds"]))
    for line in s["missed"]:
        print("  ", line)
    sys.exit(0 if not s["missed"] else 1)


if __name__ == "__main__":
    main()
