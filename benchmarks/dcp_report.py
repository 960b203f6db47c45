"""bench-dcp's report: the table per state, the four done-criteria as PASS/MISS lines,
how it was measured. Kept apart from the harness (benchmarks/dcp.py) so either reads alone."""

from __future__ import annotations

from typing import Any

MiB = 1 << 20
ASYNCCKPT = ("asyncckpt.save", "asyncckpt.async")


def checks(summary: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """The four done-criteria of the DCP issue: (name, met, the numbers behind it). A
    missing input is a miss."""
    m, state = summary["methods"], summary["bytes"]
    ours, dcp = m.get("asyncckpt.async", {}), m.get("dcp.async", {})

    def num(row: dict[str, Any], key: str) -> float | None:
        return None if "error" in row else row.get(key)

    out = []
    a, b = num(ours, "blocked"), num(dcp, "blocked")
    out.append(("asyncckpt async_save blocked <= DCP async_save (default stager) blocked",
                a is not None and b is not None and a <= b, f"{_s(a)} vs {_s(b)}"))
    a, b = num(ours, "durable"), num(dcp, "durable")
    out.append(("asyncckpt async_save time to durable <= DCP async_save (default stager)",
                a is not None and b is not None and a <= b, f"{_s(a)} vs {_s(b)}"))
    rows = [m.get(name, {}) for name in ASYNCCKPT]
    privs = [num(r, "private_extra") for r in rows]
    dcp_priv = num(dcp, "private_extra")
    met = all(p is not None and p < 0.5 * state for p in privs)
    out.append(("asyncckpt extra private RSS of the rank < 0.5x state (both rows)", met,
                ", ".join(f"{_x(p, state)}" for p in privs)
                + f" of the state; DCP default stager {_x(dcp_priv, state)}"))
    flips = [r.get("flip") if "error" not in r else None for r in rows]
    dcp_flips = [m[n].get("flip") for n in m if n not in ASYNCCKPT and "error" not in m[n]]
    met = all(f is not None and f["caught"] for f in flips)
    out.append(("flipped byte caught on load by asyncckpt (both rows)", met,
                "asyncckpt " + "/".join(_caught(f) for f in flips) + "; others "
                + "/".join(_caught(f) for f in dcp_flips)))
    return out


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f} s"


def _x(b: float | None, state: int) -> str:
    return "n/a" if b is None else f"{b / state:.2f}x"


def _mib(b: float | None) -> str:
    return "n/a" if b is None else f"{b / MiB:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}"


def _caught(flip: dict[str, Any] | None) -> str:
    if flip is None:
        return "n/a"
    if flip["caught"]:
        return "yes"
    return "no (silently wrong data)" if flip.get("loaded_differs") else "no (data unaffected)"


COLUMNS = ("method", "blocked s", "x memcpy", "durable s", "x write+fsync",
           "rank extra private MiB", "private x state", "shm MiB", "helper private MiB",
           "helper peak RSS MiB", "disk MiB", "disk x state", "cold load s", "x cold read",
           "flipped byte caught")


def table(summary: dict[str, Any]) -> list[str]:
    lim, state = summary["limits"], summary["bytes"]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for name, row in summary["methods"].items():
        if "error" in row:
            lines.append(f"| {name} | not measured: {row['error'][:300]} |"
                         + " |" * (len(COLUMNS) - 2))
            continue
        cells = [name, f"{row['blocked']:.3f}", _ratio(row["blocked"], lim.get("memcpy")),
                 f"{row['durable']:.3f}", _ratio(row["durable"], lim.get("write_fsync")),
                 _mib(row["private_extra"]), _ratio(row["private_extra"], state),
                 _mib(row["shm_extra"]), _mib(row["helper_private"]), _mib(row["helper_hwm"]),
                 _mib(row["disk_bytes"]), _ratio(row["disk_bytes"], state),
                 f"{row['load']:.3f}" + ("" if row["load_equal"] else " (NOT EQUAL)"),
                 _ratio(row["load"], lim.get("read_cold")), _caught(row["flip"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def size_md(summary: dict[str, Any]) -> list[str]:
    lim, state = summary["limits"], summary["bytes"]
    ranks = summary.get("ranks", 1)
    out = [f"## {state / MiB:.0f} MiB state" if ranks == 1 else
           f"## FSDP2 model and AdamW state on {ranks} ranks, {state / MiB:.0f} MiB per rank", ""]
    if ranks > 1:
        out += [f"Per rank: each figure is the worst rank's; memory, disk and the limits are "
                f"relative to one rank's share ({state / MiB:.0f} MiB; on disk both ranks' "
                "shares). torch-checkpointing is not measured here (its multi-rank save needs "
                "CUDA); DCP's shared-memory stager neither.", ""]
    if "error" in lim:
        out += [f"Limits not measured: {lim['error']}", ""]
    else:
        out += [f"Limits, same run: memcpy {lim['memcpy']:.3f} s "
                f"({state / lim['memcpy'] / 1e9:.2f} GB/s; one thread "
                f"{lim['memcpy_1thread']:.3f} s), write + fsync {lim['write_fsync']:.3f} s "
                f"({state / lim['write_fsync'] / 1e9:.2f} GB/s), cold sequential read "
                f"{lim['read_cold']:.3f} s.", ""]
    out += table(summary) + [""]
    out += [f"- {'PASS' if met else 'MISS'}: {name} ({why})" for name, met, why in checks(summary)]
    out += [""] + [f"- {name}: fsync by {row['fsyncs']}; load verifies: {row['checksum']}"
                   + (f"; {len(row['failed_reps'])} failed rep(s): {row['failed_reps'][0][:200]}"
                      if row["failed_reps"] else "")
                   for name, row in summary["methods"].items() if "error" not in row]
    return out + [""]


HOW = """How measured. Each method and repetition runs in a fresh process (`python -m benchmarks.dcp
--worker`), methods interleaved in a rotating order within each repetition, the machine's limits
(benchmarks.limits: memcpy of the same bytes between touched buffers, a sequential write + fsync of
them to the same disk, a cold sequential read) one more entry of the rotation; figures are medians
over repetitions. A worker builds the state (a transformer-like state dict: bf16 weights, fp32
Adam moments, non-tensor optimizer fields; benchmarks.workloads), a touched load target, imports
DCP, takes its memory baseline, sets the method up, saves once to warm it and once timed. Single
process, no torch.distributed init (DCP runs no_dist). "Blocked" is until the call returns
(torch-checkpointing: until `manager.lock()` can be entered, i.e. staging done); "durable" until the
call or its future completes (DCP fsyncs its files but not the directory; asyncckpt fsyncs data,
manifest and directory and commits; torch-checkpointing does not fsync). "Rank extra private" is
the peak RssAnon of the saving process over the baseline (sampled every 10 ms, warm-up and timed
save), "shm" the shared memory (ring, shared-memory stager) the process and its helpers mapped,
"helper" the summed RssAnon and the largest VmHWM of its helper processes (asyncckpt's writer,
torch-checkpointing's subprocess). The cold load drops the checkpoint's files from the page cache
(posix_fadvise DONTNEED) and loads into the preallocated target: dcp.load with FileSystemReader,
with asyncckpt's StorageReader, or CheckpointManager.load(into=). The flipped byte (XOR 0xFF in the
middle of the checkpoint's largest file) is tested once per method, in the last repetition.
Ratios: blocked / memcpy (torch copy_, default threads), durable / write + fsync, cold load /
cold sequential read, memory and disk / the state's tensor bytes. asyncckpt's writer runs on its
defaults (codec auto) except incremental=False, so the timed save writes every byte as the
others do. torch-checkpointing is measured single-rank only (a multi-rank save on CPU fails on a
hard-coded device="cuda" in its metadata_manager.py), with use_direct_io=False (its O_DIRECT
default fails on ext4)."""


def markdown(result: dict[str, Any]) -> str:
    lines = ["# asyncckpt as DCP's storage layer, next to DCP's FileSystemWriter and "
             "torch-checkpointing",
             "", f"`{result['command']}`; {result['reps']} repetitions; torch {result['torch']}; "
             f"{result['cpus']} CPUs; load average {result['loadavg_before']} before, "
             f"{result['loadavg_after']} after.", ""]
    for summary in result["sizes"]:
        lines += size_md(summary)
    return "\n".join(lines + [HOW, ""])
