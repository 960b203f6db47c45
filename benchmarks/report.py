"""Turning raw measurements into the table, the target verdicts, the JSON and the chart.

Every number is a median over the timed repetitions with its min–max beside it, and
every target is a ratio between two numbers of the same run (a method against a peer
or a limit measured minutes apart on the same machine), so a slower or faster machine
moves both sides together. A target whose inputs are missing (a method failed or was
not run) is reported as "n/a", never as met.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence

MiB = 1 << 20
ASYNC_FULL_RING = ("asyncckpt-raw", "asyncckpt-zstd")
BUSY = 0.10  # share of the CPUs used by other processes above which a row is flagged


def spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise_limits(raw: dict[str, Any]) -> dict[str, Any]:
    nbytes = raw["bytes"]
    out: dict[str, Any] = {"bytes": nbytes, "threads": raw.get("threads")}
    for key in ("memcpy", "memcpy_1thread", "write_fsync", "read_cold"):
        s = spread(raw.get(key, []))
        if s:
            out[key] = {**s, "GBps": nbytes / s["median"] / 1e9}
    return out


def summarise_method(raw: dict[str, Any]) -> dict[str, Any]:
    if "error" in raw:
        return {"error": raw["error"]}
    nbytes = raw["workload"]["bytes"]
    reps = raw["reps"]
    memory = raw["memory"]
    writer_self = max((r["stats"].get("writer_peak_rss_anon", 0) for r in reps), default=0)
    durable = spread([r["durable"] for r in reps])
    assert durable is not None
    disk = reps[-1]["disk_bytes"]
    out: dict[str, Any] = {
        "label": raw["label"], "synchronous": raw["synchronous"],
        "blocked": spread([r["blocked"] for r in reps]), "durable": durable,
        "GBps": nbytes / durable["median"] / 1e9,
        "train_extra_rss": memory["train_extra_rss"],
        # the writer also samples itself (every 20 ms, from inside): take the larger
        "helper_private": max(memory["helper_private"], writer_self),
        "helper_shared": memory["helper_shared"],
        "shm_extra": memory["shm_extra"],
        "disk_bytes": disk, "ratio": disk / nbytes,
        "setup_seconds": raw["setup_seconds"],
        "first_save": raw.get("warmup", {}),
        "facts": raw.get("facts", {}),
        "other_cpu_share": raw.get("cpu", {}).get("other_share", 0.0),
        "page_cache_growth": memory.get("page_cache_growth"),
        "dirty_peak": memory.get("dirty_peak"),
    }
    if "codec_report" in raw:
        out["codec_report"] = raw["codec_report"]
        out["codecs_chosen"] = [r["stats"].get("codec") for r in reps]
        autos = [r["stats"]["auto"] for r in reps if r["stats"].get("auto")]
        if autos:
            out["auto"] = autos[-1]
    if "grouped_reference" in raw:
        out["grouped_reference"] = raw["grouped_reference"]
    if "loaded" in raw:
        out["kept"] = raw["loaded"]["kept"]
        out["durable_under_load"] = raw["loaded"]["durable"]
    if raw.get("load"):
        load = spread(raw["load"]["seconds"])
        assert load is not None
        out["load"] = {**load, "GBps": nbytes / load["median"] / 1e9,
                       "loader": raw["load"]["loader"], "equal": raw["load"]["verified_equal"]}
    stages = [r["stats"] for r in reps if "encode_seconds" in r["stats"]]
    if stages:
        out["stages"] = {
            "staging (rank copy into ring)": statistics.median(s["staging_seconds"] for s in stages),
            "xxh3 + encode (writer)": statistics.median(s["encode_seconds"] for s in stages),
            "write + fsync (writer)": statistics.median(s["write_seconds"] for s in stages),
            "first begin -> commit (writer)": statistics.median(s["seconds"] for s in stages),
        }
    return out


def targets(summary: dict[str, Any], lim: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each a same-run ratio with its verdict."""
    out: list[dict[str, Any]] = []

    def add(target: str, method: str, measured: float | None, bound: float | None,
            unit: str, basis: str, higher_is_better: bool = False) -> None:
        met = None
        if measured is not None and bound is not None:
            met = measured >= bound if higher_is_better else measured <= bound
        out.append({"target": target, "method": method, "measured": measured, "bound": bound,
                    "unit": unit, "basis": basis, "met": met})

    def get(name: str, *path: str) -> float | None:
        node: Any = summary.get(name)
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    dcp_blocked = get("dcp.async-thread", "blocked", "median")
    memcpy = lim.get("memcpy", {}).get("median")
    write = lim.get("write_fsync", {}).get("median")
    st_load = get("safetensors", "load", "GBps")
    for name in ASYNC_FULL_RING:
        if name not in summary:
            continue
        blocked = get(name, "blocked", "median")
        add("blocked <= 0.5 x DCP async_save (default stager)", name, blocked,
            None if dcp_blocked is None else 0.5 * dcp_blocked, "s", "dcp.async-thread blocked")
        add("blocked <= 2 x memcpy of the same bytes", name, blocked,
            None if memcpy is None else 2 * memcpy, "s", "memcpy limit")
        ring = get(name, "facts", "ring_bytes")
        add("trainer peak extra RSS <= ring + 64 MiB", name, get(name, "train_extra_rss"),
            None if ring is None else ring + 64 * MiB, "B", "ring size")
    for name in [n for n in summary if n.startswith("asyncckpt")]:
        add("writer peak private RSS <= 256 MiB", name, get(name, "helper_private"),
            256 * MiB, "B", "constant")
    if "asyncckpt-raw" in summary:
        add("time to durable (raw) <= 1.25 x write+fsync", "asyncckpt-raw",
            get("asyncckpt-raw", "durable", "median"), None if write is None else 1.25 * write,
            "s", "write+fsync limit")
    _codec_targets(summary, get, add)
    for name in ASYNC_FULL_RING:
        if name in summary:
            add("verified load >= 0.8 x safetensors.load_file throughput", name,
                get(name, "load", "GBps"), None if st_load is None else 0.8 * st_load,
                "GB/s", "safetensors load", higher_is_better=True)
    return out


def _codec_targets(summary: dict[str, Any], get: Any, add: Any) -> None:
    """Issue 6: float-aware compression and the parallel writer."""
    bg = "asyncckpt-bytegroup"
    if bg in summary:
        ref = get(bg, "grouped_reference", "all")
        # the real-weights workload is all fp32; the synthetic one mixes bf16 and fp32
        minilm = ref is not None and "bfloat16" not in summary[bg]["grouped_reference"]
        if not minilm:
            add("bytes on disk (bf16 weights + fp32 Adam) <= 0.82 x raw", bg,
                get(bg, "ratio"), 0.82, "x", "constant")
            add("bytes on disk of the bf16 weights <= 0.70 x raw", bg,
                get(bg, "codec_report", "by_dtype", "BF16"), 0.70, "x", "constant")
        elif ref is not None:
            add("real weights: ratio within 2% of byte-grouped zstd-1 on whole planes", bg,
                get(bg, "ratio"), 1.02 * ref, "x", f"whole planes {ref:.4f}")
        raw_d = get("asyncckpt-raw", "durable", "median")
        add("time to durable, bytegroup <= raw (2 encoder threads)", bg,
            get(bg, "durable", "median"), raw_d, "s", "asyncckpt-raw durable")
        add("verified load of bytegroup >= 1 GB/s", bg, get(bg, "load", "GBps"), 1.0,
            "GB/s", "constant", higher_is_better=True)
        auto_d = get("asyncckpt-auto", "durable", "median")
        bg_d = get(bg, "durable", "median")
        if auto_d is not None and raw_d is not None and bg_d is not None:
            add("time to durable, auto <= 1.1 x min(raw, bytegroup)", "asyncckpt-auto", auto_d,
                1.1 * min(raw_d, bg_d), "s", "better of raw and bytegroup")
    for name in [n for n in summary if n.startswith("asyncckpt")]:
        growth = get(name, "page_cache_growth")
        if growth is not None:
            add("page cache growth during saves <= 256 MiB", name, growth, 256 * MiB, "B",
                "constant (machine-wide Cached - Shmem)")


def _codec_md(summary: dict[str, Any]) -> list[str]:
    rows = {n: s for n, s in summary.items() if "codec_report" in s}
    if not rows:
        return []
    lines = ["", "asyncckpt codecs (last timed save): stored/raw per dtype, frames per codec, "
             "codec per save (auto: the choice and its predicted seconds per GB), page cache:", "",
             "| method | ratio | per dtype | frames | codec per save | auto predicted s/GB | "
             "page cache growth / dirty peak MiB | whole-plane reference |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in rows.items():
        rep = s["codec_report"]
        dtypes = ", ".join(f"{d} {r:.3f}" for d, r in sorted(rep["by_dtype"].items()))
        frames = ", ".join(f"{c} {f['count']}" + (f" {f['planes']}" if "planes" in f else "")
                           for c, f in sorted(rep["frames"].items()))
        auto = (s.get("auto") or {}).get("predicted_s_per_gb", "")
        auto_text = ", ".join(f"{k} {v:.2f}" for k, v in auto.items()) if auto else "—"
        ref = s.get("grouped_reference")
        ref_text = ", ".join(f"{k} {v:.3f}" for k, v in ref.items()) if ref else "—"
        lines.append(f"| {name} | {rep['ratio']:.3f} | {dtypes} | {frames} | "
                     f"{'/'.join(str(c) for c in s.get('codecs_chosen', []))} | {auto_text} | "
                     f"{_mib(s.get('page_cache_growth'))} / {_mib(s.get('dirty_peak'))} | {ref_text} |")
    return lines


# -- markdown ------------------------------------------------------------------------------

def _s(x: dict[str, float] | None, digits: int = 2) -> str:
    if not x:
        return "—"
    f = f"{{:.{digits}f}}"
    if x["max"] - x["min"] < 0.5 * 10 ** -digits:
        return f.format(x["median"])
    return f"{f.format(x['median'])} ({f.format(x['min'])}–{f.format(x['max'])})"


def _mib(b: float | None) -> str:
    return "—" if b is None else f"{b / MiB:,.0f}"


def _value(v: float | None, unit: str) -> str:
    if v is None:
        return "n/a"
    if unit == "B":
        return f"{v / MiB:,.0f} MiB"
    if unit == "s":
        return f"{v:.3f} s"
    if unit == "x":
        return f"{v:.3f} x"
    return f"{v:.2f} {unit}"


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [f"# asyncckpt benchmark ({meta['mode']})", "",
             f"Command: `{meta['command']}` — {meta['machine']['summary']}; "
             f"checkpoints in `{meta['workdir']}` ({meta['machine']['workdir_fs']}). "
             f"Run took {meta['wall_seconds'] / 60:.1f} min on {meta['date']}.", ""]
    for wl in result["workloads"]:
        lines += _workload_md(wl)
    lines += ["## Notes", "",
              "- **blocked**: wall time the training loop cannot proceed: the call's return, plus for "
              "asyncckpt `save()` + `handle.wait_staged()` and for DCP with a background stager "
              "`staging_completion` (the next optimizer step may not run before). Synchronous "
              "methods are blocked until durable.",
              "- **durable**: from the call until the bytes are fsynced and, for DCP and asyncckpt, "
              "committed (DCP: `.metadata` written by `save`/the upload future; asyncckpt: "
              "`handle.wait()`, after the atomic rename). torch.save and safetensors get an explicit "
              "fsync of the file and its directory. GB/s = state bytes / durable.",
              "- **trainer +RSS**: peak VmRSS of the training process above its RSS after the state "
              "was built (VmHWM reset through /proc/self/clear_refs), over the warm-up and timed saves. "
              "It includes asyncckpt's ring (shared memory, counted once, here).",
              "- **helper private / shared**: peak RssAnon / RssShmem summed over the trainer's child "
              "processes (asyncckpt writer, DCP checkpoint daemon), sampled every 10 ms; for the "
              "writer the larger of that and its own RssAnon sampler. Shared memory is the same "
              "pages as the trainer's ring, not extra.",
              "- **/dev/shm**: peak size of the /dev/shm files (unlinked ones included) mapped by the "
              "trainer or its helpers during the saves, from /proc/PID/maps.",
              "- **kept**: rate of a single-thread matmul loop on the main thread while the save "
              "runs in the background (after the caller is released, until durable), over its idle "
              "rate just before; one extra save. Synchronous methods have no background phase (—).",
              "- **load**: cold (every file dropped from the page cache with fadvise DONTNEED first), "
              "into memory: asyncckpt.load verifies every frame's xxh3; safetensors.load_file maps "
              "the file, so every page is then touched; dcp.load fills preallocated tensors; "
              "torch.load reads eagerly. `=` marks a bit-exact comparison with the source state.",
              "- Each method runs in a fresh process that builds the same seeded state; each save "
              "writes a new step, measured outputs are deleted. Medians over the timed repetitions "
              "(min–max in brackets), after one warm-up save (first-save figures are in the JSON).",
              ""]
    return "\n".join(lines)


def _workload_md(wl: dict[str, Any]) -> list[str]:
    info, lim, summary = wl["info"], wl["limits"], wl["summary"]
    nbytes = info.get("bytes", 0)
    head = f"## {info['name']}: {nbytes / 1e9:.2f} GB in {info.get('tensors', '?')} tensors"
    dtypes = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in info.get("bytes_by_dtype", {}).items())
    lines = [head, "", f"{dtypes}; {wl['reps']} timed saves per method.", "",
             "| method | blocked s | durable s | GB/s | trainer +RSS MiB | helper private / shared MiB "
             "| /dev/shm MiB | on disk MiB (ratio) | kept | load s (GB/s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        if "error" in s:
            lines.append(f"| {name} | failed: {s['error'][:120]} |||||||||")
            continue
        load = s.get("load")
        load_txt = "—" if not load else (f"{_s(load)} ({load['GBps']:.2f})"
                                         f"{' =' if load.get('equal') else ' ≠!'}")
        kept = "—" if "kept" not in s else f"{s['kept']:.2f}"
        busy = " ⚠" if s["other_cpu_share"] > BUSY else ""
        lines.append(
            f"| {s['label']}{busy} | {_s(s['blocked'], 3)} | {_s(s['durable'])} | {s['GBps']:.2f} | "
            f"{_mib(s['train_extra_rss'])} | {_mib(s['helper_private'])} / {_mib(s['helper_shared'])} | "
            f"{_mib(s['shm_extra'])} | {_mib(s['disk_bytes'])} ({s['ratio']:.3f}) | {kept} | {load_txt} |")
    busy = {n: s["other_cpu_share"] for n, s in summary.items() if s.get("other_cpu_share", 0) > BUSY}
    if busy:
        lines += ["", "⚠ other processes used the CPUs while these ran: " + ", ".join(
            f"{n} {share:.0%}" for n, share in busy.items()) + " (of all cores, on average)."]
    lines += ["", "Limits of this machine, same run, same bytes:", "",
              "| limit | seconds | GB/s |", "|---|---|---|"]
    names = {"memcpy": f"memcpy into touched memory ({lim.get('threads')} threads)",
             "memcpy_1thread": "memcpy into touched memory (1 thread)",
             "write_fsync": "sequential write + fsync, 8 MiB blocks, same directory",
             "read_cold": "sequential read, cold cache"}
    for key, text in names.items():
        if key in lim:
            lines.append(f"| {text} | {_s(lim[key], 3)} | {lim[key]['GBps']:.2f} |")
    lines += ["", "| target | method | measured | bound | met |", "|---|---|---|---|---|"]
    for t in wl["targets"]:
        verdict = {True: "**met**", False: "**MISSED**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} | {t['method']} | {_value(t['measured'], t['unit'])} | "
                     f"{_value(t['bound'], t['unit'])} ({t['basis']}) | {verdict} |")
    lines += _codec_md(summary)
    staged = {n: s["stages"] for n, s in summary.items() if "stages" in s}
    if staged:
        keys = list(next(iter(staged.values())))
        lines += ["", "asyncckpt pipeline stages (median seconds per save; they overlap, the "
                  "slowest bounds the pipeline):", "",
                  "| method | " + " | ".join(keys) + " | slowest |", "|---" * (len(keys) + 2) + "|"]
        for name, st in staged.items():
            work = {k: v for k, v in st.items() if "->" not in k}
            slowest = max(work, key=work.__getitem__)
            lines.append(f"| {name} | " + " | ".join(
                f"{v:.3f} ({nbytes / v / 1e9:.2f} GB/s)" if v else "0" for v in st.values())
                + f" | {slowest.split(' (')[0]} |")
    return lines + [""]


# -- chart ---------------------------------------------------------------------------------

def chart(result: dict[str, Any], path: Path) -> None:
    """Blocked time, time to durable and peak memory per method, one row per workload."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["workloads"]
    fig, axes = plt.subplots(len(rows), 3, figsize=(16, 3.2 + 0.42 * 9 * len(rows) / 1.5),
                             squeeze=False)
    for row, wl in zip(axes, rows):
        summary = {n: s for n, s in wl["summary"].items() if "error" not in s}
        names = list(summary)
        y = list(range(len(names)))
        colors = ["tab:orange" if n.startswith("asyncckpt") else "tab:gray" for n in names]
        for ax, key, title, limit_key in ((row[0], "blocked", "blocked (s)", "memcpy"),
                                          (row[1], "durable", "time to durable (s)", "write_fsync")):
            med = [summary[n][key]["median"] for n in names]
            err = [[m - summary[n][key]["min"] for n, m in zip(names, med)],
                   [summary[n][key]["max"] - m for n, m in zip(names, med)]]
            ax.barh(y, med, xerr=err, color=colors, capsize=3)
            if limit_key in wl["limits"]:
                ax.axvline(wl["limits"][limit_key]["median"], color="tab:blue", ls="--",
                           label={"memcpy": "memcpy", "write_fsync": "write+fsync"}[limit_key])
                ax.legend(loc="lower right", fontsize=8)
            ax.set_title(f"{wl['info']['name']}: {title}", fontsize=10)
        trainer = [summary[n]["train_extra_rss"] / MiB for n in names]
        helper = [summary[n]["helper_private"] / MiB for n in names]
        row[2].barh(y, trainer, color=colors, label="trainer +RSS")
        row[2].barh(y, helper, left=trainer, color="tab:green", label="helper private")
        row[2].axvline(wl["info"]["bytes"] / MiB, color="tab:blue", ls="--", label="state size")
        row[2].legend(loc="lower right", fontsize=8)
        row[2].set_title(f"{wl['info']['name']}: peak extra memory (MiB)", fontsize=10)
        for ax in row:
            ax.set_yticks(y)
            ax.set_yticklabels(names if ax is row[0] else [""] * len(names), fontsize=8)
            ax.invert_yaxis()
            ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"asyncckpt vs peers — {result['meta']['machine']['summary']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
