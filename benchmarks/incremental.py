"""Incremental saves on a real fine-tune: bytes written, referenced and time to durable.

    python -m benchmarks.incremental [--hidden 512] [--layers 4] [--saves 5]
    (make bench-incremental)

A causal LM (transformers' Llama, built from a config: nothing is downloaded) is trained
on CPU with random tokens, and saved (model + optimizer state) every `--every` steps,
two ways, each in the same run on the same state:

- LoRA: `peft` adapters on the attention projections; the base model is frozen, so from
  the second save on almost every byte is one a committed step already holds;
- full fine-tune: every parameter trained (AdamW on all): nothing to dedup, so this
  measures what hashing and lookup cost.

Each save is made, one after the other (rotating which asyncckpt writer goes first) and
each waited for until durable, by a writer with `incremental` on, by the same with a
client whose `skip_unchanged` is on (tensors unchanged since its last save are not even
copied into the ring), by one with `incremental` off (full saves of the same state), and
by DCP `save` (torch.distributed.checkpoint, single process). Per save: bytes written (data
files, plus the manifest), raw bytes referenced, time to durable; and the writer's
thread time on frames, which shows the cost of hashing and lookup without the noise
of the disk. The LoRA budget the
issue sets is 1.05 x (trainable parameters + their optimizer state + non-tensor state);
the non-tensor state is the size of the manifest's object trees. "written" counts the
data files and the manifest (which also lists every frozen tensor and frame, so it
grows with the model's tensor count, not with what changed); "data" the files only.
Retention (keep_last=2) runs on the incremental root, so the last saves are also read
back after the steps
they reference were retired, and every step left is verified and loaded bit-exact.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import asyncckpt
from asyncckpt.read.verification import verify
from asyncckpt.storage.local import read_manifest
from asyncckpt.storage.posix import PosixStorage

MiB = 1 << 20


def build(hidden: int, layers: int, lora: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=hidden, num_hidden_layers=layers,
                                      num_attention_heads=max(1, hidden // 64),
                                      intermediate_size=hidden * 8 // 3 // 64 * 64,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            lora_dropout=0.0))
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-4)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        ids = torch.randint(0, 8192, (2, 64))
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()


def state_of(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def budget(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    """Trainable parameters plus their optimizer state, in bytes."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    opt = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values()
              if isinstance(t, torch.Tensor))
    return trainable + opt


def tree_bytes(directory: Path) -> int:
    return sum(len(json.dumps(p.tree)) for p in read_manifest(directory).ranks)


def dir_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def save_asyncckpt(client: asyncckpt.Client, root: Path, step: int, state: dict) -> dict:
    started = time.perf_counter()
    handle = client.save(step, state)
    path = handle.wait(600)
    seconds = time.perf_counter() - started
    s = handle.stats
    manifest = (path / "manifest.json").stat().st_size
    return {"seconds": seconds, "written": s.stored_bytes + manifest, "data": s.stored_bytes,
            "staged": s.staged_bytes,
            "manifest": manifest, "new_raw": s.new_bytes, "referenced": s.referenced_bytes,
            "raw": s.raw_bytes, "trees": tree_bytes(path), "encode": s.encode_seconds}


def save_dcp(root: Path, step: int, state: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    directory = root / f"step-{step:08d}"
    started = time.perf_counter()
    try:
        dcp.save(state, checkpoint_id=str(directory))
    except Exception as e:  # noqa: BLE001 -- reported in the table
        return {"seconds": float("nan"), "written": 0, "error": f"{type(e).__name__}: {e}"[:120]}
    seconds = time.perf_counter() - started
    written = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    return {"seconds": seconds, "written": written}


def run(kind: str, args: argparse.Namespace, work: Path) -> dict:
    """One workload: train, and save every `every` steps with the three methods."""
    model, optim = build(args.hidden, args.layers, lora=(kind == "lora"))
    ours = ("incremental", "skip", "full")
    roots = {m: work / kind / m for m in (*ours, "dcp")}
    writers = {m: asyncckpt.start_writer(roots[m], incremental=(m != "full"), keep_last=2,
                                         codec=args.codec, log_file=work / f"{kind}-{m}.log")
               for m in ours}
    clients = {m: asyncckpt.connect(w.address, rank=0, world_size=1, ring_size=args.ring_mib * MiB,
                                    skip_unchanged=(m == "skip"))
               for m, w in writers.items()}
    rows, states = [], {}
    try:
        for save in range(1, args.saves + 1):
            train(model, optim, args.every)
            step = save * args.every
            state = state_of(model, optim)
            states[step] = {"model": {k: v.clone() for k, v in state["model"].items()}}
            order = [ours[(save + i) % 3] for i in range(3)]
            row: dict[str, Any] = {"save": save, "step": step, "budget": budget(model, optim)}
            for method in order:
                row[method] = save_asyncckpt(clients[method], roots[method], step, state)
            row["dcp"] = save_dcp(roots["dcp"], step, state)
            if save > 2:
                shutil.rmtree(roots["dcp"] / f"step-{(save - 2) * args.every:08d}",
                              ignore_errors=True)
            rows.append(row)
            print(f"{kind} save {save}: " + ", ".join(
                f"{m} {row[m]['written'] / MiB:.2f} MiB {row[m]['seconds']:.2f} s"
                for m in (*ours, "dcp")), file=sys.stderr, flush=True)
    finally:
        for c in clients.values():
            c.close(timeout=60)
        for w in writers.values():
            w.stop(timeout=60)
    checked = {}
    for method in ("incremental", "skip"):
        root = roots[method]
        kept = PosixStorage(root).committed_steps()
        checked[method] = {
            "verified": verify(root).ok, "kept": kept,
            "bit_exact": all(all(torch.equal(asyncckpt.load(root, step=s)["model"][k], v)
                                 for k, v in states[s]["model"].items()) for s in kept),
            "retired": sorted(p.name for p in root.iterdir() if p.name.endswith(".retired"))}
    return {"kind": kind, "rows": rows, "checked": checked,
            "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def table(result: dict) -> str:
    kind, rows = result["kind"], result["rows"]
    lines = [f"### {kind}: model {result['model_bytes'] / MiB:.1f} MiB, budget (trainable + "
             f"optimizer state) {rows[-1]['budget'] / MiB:.2f} MiB",
             "",
             "| save | incr. written MiB | incr. referenced MiB | incr. s | skip: staged MiB | "
             "skip s | full written MiB | full s | DCP written MiB | DCP s | data / budget | "
             "written / (budget + trees) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "|"]
    for r in rows:
        i, k, f, d = r["incremental"], r["skip"], r["full"], r["dcp"]
        ratio = i["written"] / (r["budget"] + i["trees"])
        lines.append(f"| {r['save']} | {i['written'] / MiB:.2f} | {i['referenced'] / MiB:.2f} | "
                     f"{i['seconds']:.3f} | {k['staged'] / MiB:.2f} | {k['seconds']:.3f} | "
                     f"{f['written'] / MiB:.2f} | {f['seconds']:.3f} | "
                     f"{d['written'] / MiB:.2f} | {d['seconds']:.3f} | "
                     f"{i['data'] / r['budget']:.3f} | {ratio:.3f} |")
    later = rows[1:] or rows
    inc = statistics.median(r["incremental"]["seconds"] for r in later)
    skip = statistics.median(r["skip"]["seconds"] for r in later)
    full = statistics.median(r["full"]["seconds"] for r in later)
    bytes_ratio = statistics.median(r["incremental"]["new_raw"] / r["full"]["new_raw"]
                                    for r in later)
    enc_inc = statistics.median(r["incremental"]["encode"] for r in later)
    enc_full = statistics.median(r["full"]["encode"] for r in later)
    worst = max(r["incremental"]["written"] / (r["budget"] + r["incremental"]["trees"])
                for r in later)
    lines += ["", f"From save 2 on: median time to durable incremental {inc:.3f} s vs full "
                  f"{full:.3f} s (x{inc / full:.3f}), with skip_unchanged {skip:.3f} s "
                  f"(x{skip / full:.3f}), for x{bytes_ratio:.3f} of the bytes; the writer's thread "
                  f"time on frames (hash, encode, lookups) {enc_inc:.3f} s vs {enc_full:.3f} s; "
                  f"worst written / budget {worst:.3f}. "
                  + "; ".join(f"{m}: kept {c['kept']}, retired {c['retired']}, verify "
                              f"{'OK' if c['verified'] else 'FAILED'}, loads "
                              f"{'bit-exact' if c['bit_exact'] else 'DIFFER'}"
                              for m, c in result["checked"].items()) + "."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--every", type=int, default=2, help="training steps between saves")
    parser.add_argument("--ring-mib", type=int, default=64)
    parser.add_argument("--codec", default="raw", help="writer codec of both asyncckpt writers "
                        "(raw: the cheapest encode, so hashing weighs most)")
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    with tempfile.TemporaryDirectory(prefix="asyncckpt-incr-",
                                     dir=args.out and Path(args.out).parent) as tmp:
        results = [run(kind, args, Path(tmp)) for kind in ("lora", "full")]
    text = (f"hidden {args.hidden}, {args.layers} layers, {args.saves} saves every {args.every} "
            f"steps, codec {args.codec}\n\n" + "\n\n".join(table(r) for r in results))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
