"""Turning raw measurements into the table, the target verdicts, the JSON and the chart.

Every number is a median over the timed repetitions with its min–max beside it, and
every target is a ratio between two numbers of the same run (a method against a peer
or a limit measured minutes apart on the same machine), so a slower or faster machine
moves both sides together. A target whose inputs are missing (a method failed or was
not run) is reported as "n/a", never as met.

The targets are those of the open performance issue (staging at memory speed, durable
at disk speed, verified load at disk speed, compression at least as good as ZipNN,
page cache bounded for every codec) plus the standing memory bounds and the auto codec's
promise. Where the worker timed a reference in the same process, interleaved with the
method (a one-thread copy of the same tensors, a write + fsync of the same bytes,
safetensors.load_file and a cold read of the same state), the target uses it rather
than the limits process. Each verdict carries the load average of the worker that
measured it, since the machine is shared.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MiB = 1 << 20
ASYNC_FULL_RING = ("asyncckpt-raw", "asyncckpt-zstd", "asyncckpt-bytegroup")
STAGING = ("asyncckpt-raw",)  # staging is the same copy for every codec: timed once
BUSY = 0.10  # share of the CPUs used by other processes above which a row is flagged
NOT_COLD = 0.05  # share of a checkpoint's bytes still cached before a load: not cold
PAGE_CACHE_BOUND = 256 * MiB
MIXED = "bf16 weights + fp32 Adam moments"  # the contest case the speed targets use


def write_results(out: Path, text: str, data: Any) -> None:
    """A benchmark's report `out` (Markdown) and its figures beside it (`.json`); the
    report is printed too."""
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    print(text)


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
        "page_cache_files_peak": memory.get("page_cache_files_peak"),
    }
    if "codec_report" in raw:
        out["codec_report"] = raw["codec_report"]
        out["codecs_chosen"] = [r["stats"].get("codec") for r in reps]
        autos = [r["stats"]["auto"] for r in reps if r["stats"].get("auto")]
        if autos:
            out["auto"] = autos[-1]
    if "grouped_reference" in raw:
        out["grouped_reference"] = raw["grouped_reference"]
    if "loadavg" in raw:
        out["loadavg"] = raw["loadavg"]
    refs = {key: spread([r[key] for r in reps if key in r])
            for key in ("ref_copy_1thread", "ref_write_fsync")}
    if any(refs.values()):
        out["refs"] = {k: v for k, v in refs.items() if v}
    if "loaded" in raw:
        out["kept"] = raw["loaded"]["kept"]
        out["durable_under_load"] = raw["loaded"]["durable"]
    if raw.get("load"):
        load = spread(raw["load"]["seconds"])
        assert load is not None
        out["load"] = {**load, "GBps": nbytes / load["median"] / 1e9,
                       "loader": raw["load"]["loader"], "equal": raw["load"]["verified_equal"]}
        resident = raw["load"].get("resident_before")
        if resident:
            out["load"]["resident_before_max"] = max(resident)
        peer = spread(raw["load"].get("safetensors_seconds", []))
        read = spread(raw["load"].get("read_cold_seconds", []))
        if peer and read:
            out["load_peers"] = {
                "safetensors": {**peer, "GBps": nbytes / peer["median"] / 1e9,
                                "equal": raw["load"].get("safetensors_equal")},
                "read_cold": {**read,
                              "GBps": raw["load"]["read_cold_bytes"] / read["median"] / 1e9},
                "interleaved": len(raw["load"]["seconds"])}
    stages = [r["stats"] for r in reps if "encode_seconds" in r["stats"]]
    if stages:
        out["stages"] = {
            "staging (rank copy into ring)":
                statistics.median(s["staging_seconds"] for s in stages),
            "xxh3 + encode (writer)": statistics.median(s["encode_seconds"] for s in stages),
            "write + fsync (writer)": statistics.median(s["write_seconds"] for s in stages),
            "first begin -> commit (writer)": statistics.median(s["seconds"] for s in stages),
        }
    return out


def _adder(out: list[dict[str, Any]], workload: str = "") -> Any:
    def add(target: str, method: str, measured: float | None, bound: float | None,
            unit: str, basis: str, higher_is_better: bool = False,
            loadavg: list[float] | None = None, group: str = "issue 14") -> None:
        met = None
        if measured is not None and bound is not None:
            met = measured >= bound if higher_is_better else measured <= bound
        out.append({"target": target, "method": method, "measured": measured, "bound": bound,
                    "unit": unit, "basis": basis, "met": met, "group": group,
                    "workload": workload, "loadavg": loadavg})
    return add


def targets(summary: dict[str, Any], lim: dict[str, Any],
            workload: str = "") -> list[dict[str, Any]]:
    """The targets of one workload, each a same-run ratio with its verdict (None: an input
    is missing; a load that was not cold is never met)."""
    out: list[dict[str, Any]] = []
    base_add = _adder(out, workload)

    def get(name: str, *path: str) -> Any:
        node: Any = summary.get(name)
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    def add(target: str, method: str, *args: Any, **kwargs: Any) -> None:
        base_add(target, method, *args, loadavg=(get(method, "loadavg") or {}).get("start"),
                 **kwargs)

    def times(factor: float, value: float | None) -> float | None:
        return None if value is None else factor * value

    stager = get("dcp.async-stager", "blocked", "median")
    for name in STAGING:
        if name not in summary or "error" in summary[name]:
            continue
        blocked = get(name, "blocked", "median")
        add("staging (save + wait_staged, ring = state) <= 1.1 x one-thread copy of the same "
            "tensors", name, blocked, times(1.1, get(name, "refs", "ref_copy_1thread", "median")),
            "s", "copy, same process, interleaved")
        add("staging (save + wait_staged, ring = state) <= DCP async_save's reused background "
            "stager", name, blocked, stager, "s", "dcp.async-stager, same run")
    raw = "asyncckpt-raw"
    if raw in summary and "error" not in summary[raw]:
        add("time to durable (raw) <= 1.1 x sequential write + fsync of the same bytes", raw,
            get(raw, "durable", "median"),
            times(1.1, get(raw, "refs", "ref_write_fsync", "median")), "s",
            "write + fsync, same process, interleaved")
        cold = get(raw, "load", "resident_before_max")
        warm = cold is not None and cold > NOT_COLD
        note = f"; NOT COLD: {cold:.0%} cached" if warm else ""
        for target, ref, factor in (
                ("verified cold load (raw) >= 1.0 x safetensors.load_file", "safetensors", 1.0),
                ("verified cold load (raw) >= 0.9 x cold sequential read", "read_cold", 0.9)):
            bound = times(factor, get(raw, "load_peers", ref, "GBps"))
            add(target, raw, get(raw, "load", "GBps"), None if warm else bound, "GB/s",
                f"{ref.replace('_', ' ')}, same process, interleaved{note}", higher_is_better=True)
    for name in [n for n in summary if n.startswith("asyncckpt")]:
        growth, files = get(name, "page_cache_growth"), get(name, "page_cache_files_peak")
        if files is not None:
            add("page cache held by the checkpoint's files during saves <= 256 MiB", name, files,
                PAGE_CACHE_BOUND, "B", f"constant; mincore peak; machine-wide growth "
                f"{value(growth, 'B')}, other processes' I/O included")
        elif growth is not None:
            add("page cache growth during saves <= 256 MiB", name, growth, PAGE_CACHE_BOUND, "B",
                "constant (machine-wide Cached - Shmem)")
    for name in ASYNC_FULL_RING:
        if name in summary and "error" not in summary[name]:
            ring = get(name, "facts", "ring_bytes")
            add("trainer peak extra RSS <= ring + 64 MiB", name, get(name, "train_extra_rss"),
                None if ring is None else ring + 64 * MiB, "B", "ring size", group="standing")
    for name in [n for n in summary if n.startswith("asyncckpt") and "error" not in summary[n]]:
        add("writer peak private RSS <= 256 MiB", name, get(name, "helper_private"),
            256 * MiB, "B", "constant", group="standing")
    plain = "asyncckpt-defaults"
    if plain in summary and "error" not in summary[plain]:
        add("plain client, default knobs: staging (save + wait_staged) < 0.5 x its time to "
            "durable", plain, get(plain, "blocked", "median"),
            times(0.5, get(plain, "durable", "median")), "s", "its own durable, same saves")
    auto_d = get("asyncckpt-auto", "durable", "median")
    raw_d = get(raw, "durable", "median")
    bg_d = get("asyncckpt-bytegroup", "durable", "median")
    if auto_d is not None and raw_d is not None and bg_d is not None:
        add("time to durable, auto <= 1.1 x min(raw, bytegroup)", "asyncckpt-auto", auto_d,
            1.1 * min(raw_d, bg_d), "s", "better of raw and bytegroup", group="standing")
    return out


def export_targets(export: dict[str, Any]) -> list[dict[str, Any]]:
    """Export time over a plain cold read + write + fsync of the same data files."""
    out: list[dict[str, Any]] = []
    if "error" in export:
        return out
    add = _adder(out, f"export, {export['bytes'] / 2**30:.0f} GiB fp32")
    median = export["median"]
    add("asyncckpt export <= 1.3 x a plain cold read + write + fsync of the same bytes",
        "asyncckpt export", median["export"], 1.3 * median["plain"], "s",
        "plain copy, same run, interleaved", loadavg=export.get("loadavg"), group="issue 25")
    return out


def contest_targets(contest: dict[str, Any]) -> list[dict[str, Any]]:
    """ZipNN's ratio per case, and the per-thread speeds on the mixed training state, for
    every float-aware (plane layout) codec of the registry."""
    from . import peers
    out: list[dict[str, Any]] = []
    add = _adder(out, f"codec contest ({(contest.get('source') or {}).get('source', '?')})")
    loadavg = (contest.get("loadavg") or {}).get("start")
    cases = contest.get("cases") or {}
    names = peers.plane_codecs()
    for name in names:
        for case, entry in cases.items():
            ours = entry["codecs"].get(name) or {}
            zipnn = entry["codecs"].get(peers.ZIPNN) or {}
            exact = ours.get("exact") is not False
            add(f"stored/raw <= ZipNN's, {case}", name, ours.get("ratio"),
                zipnn.get("ratio") if exact else None, "x",
                "ZipNN, same tensors" + ("" if exact else "; NOT BIT-EXACT"), loadavg=loadavg)
        mixed = (cases.get(MIXED) or {}).get("codecs", {}).get(name) or {}
        for key, bound in (("encode", 1.0), ("decode", 2.0)):
            add(f"{key} >= {bound:.0f} GB/s per thread ({MIXED})", name,
                (mixed.get(key) or {}).get("median"), bound, "GB/s", "constant, one thread",
                higher_is_better=True, loadavg=loadavg)
    return out


def _codec_md(summary: dict[str, Any]) -> list[str]:
    rows = {n: s for n, s in summary.items() if "codec_report" in s}
    if not rows:
        return []
    lines = ["", "asyncckpt codecs (last timed save): stored/raw per dtype, frames per codec, "
             "codec per save (auto: the choice and its predicted seconds per GB), page cache:", "",
             "| method | ratio | per dtype | frames | codec per save | auto predicted s/GB | "
             "page cache: own files peak / machine-wide growth / dirty peak MiB | "
             "whole-plane reference |",
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
                     f"{_mib(s.get('page_cache_files_peak'))} / {_mib(s.get('page_cache_growth'))} "
                     f"/ {_mib(s.get('dirty_peak'))} | {ref_text} |")
    return lines


# -- markdown ------------------------------------------------------------------------------

VERDICT = {True: "**met**", False: "**MISSED**", None: "n/a"}


def all_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of a result, workloads first, then the codec contest's; targets of
    results written before targets named their workload get it from the workload."""
    out = []
    for wl in result.get("workloads", []):
        out += [{**t, "workload": t.get("workload") or wl["info"]["name"]}
                for t in wl.get("targets", [])]
    return out + list(result.get("contest_targets", [])) + list(result.get("export_targets", []))


def _load(values: list[float] | None) -> str:
    return "—" if not values else f"{values[0]:.2f}"


def targets_md(rows: list[dict[str, Any]]) -> list[str]:
    """The targets table: one row per (target, method, workload) with its verdict."""
    met = sum(t["met"] is True for t in rows)
    missed = sum(t["met"] is False for t in rows)
    lines = ["## Targets", "",
             f"{met} met, {missed} missed, {len(rows) - met - missed} n/a (an input missing "
             "or not comparable).", "",
             "| target | method | workload | measured | bound (basis) | met | load avg |",
             "|---|---|---|---|---|---|---|"]
    for t in rows:
        lines.append(f"| {t['target']} | {t['method']} | {t.get('workload', '')} | "
                     f"{value(t['measured'], t['unit'])} | {value(t['bound'], t['unit'])} "
                     f"({t['basis']}) | {VERDICT[t['met']]} | {_load(t.get('loadavg'))} |")
    return lines + [""]


def _references_md(summary: dict[str, Any], nbytes: int) -> list[str]:
    """asyncckpt against what it was timed next to, in its own process."""
    lines: list[str] = []
    refs = {n: s for n, s in summary.items() if "refs" in s}
    if refs:
        lines += ["", "asyncckpt against references timed in the same process, interleaved "
                  "(medians; the ratio is what the targets bound):", "",
                  "| method | staging s | one-thread copy s | ratio | durable s | "
                  "write + fsync s | ratio | load avg |", "|---|---|---|---|---|---|---|---|"]
        for name, s in refs.items():
            copy, write = s["refs"].get("ref_copy_1thread"), s["refs"].get("ref_write_fsync")
            lines.append(
                f"| {name} | {_s(s['blocked'], 3)} | {_s(copy, 3)} | "
                f"{_ratio(s['blocked'], copy)} | {_s(s['durable'])} | {_s(write)} | "
                f"{_ratio(s['durable'], write)} | {_load((s.get('loadavg') or {}).get('start'))} |")
    peers_ = {n: s for n, s in summary.items() if "load_peers" in s}
    if peers_:
        lines += ["", "Verified cold loads per codec, interleaved in one process with "
                  "safetensors.load_file of the same state and a cold sequential read of that "
                  "file (GB/s of state bytes; resident before: largest cached share of the files "
                  "before a timed read, by mincore):", "",
                  "| method | asyncckpt.load GB/s | safetensors.load_file GB/s | cold read GB/s | "
                  "vs safetensors | vs cold read | resident before | loads |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, s in peers_.items():
            load, st, rd = s["load"], s["load_peers"]["safetensors"], s["load_peers"]["read_cold"]
            lines.append(f"| {name} | {load['GBps']:.2f} | {st['GBps']:.2f} | {rd['GBps']:.2f} | "
                         f"{load['GBps'] / st['GBps']:.2f} x | {load['GBps'] / rd['GBps']:.2f} x | "
                         f"{load.get('resident_before_max', 0):.1%} | "
                         f"{s['load_peers']['interleaved']} each |")
    return lines


def _ratio(a: dict[str, float] | None, b: dict[str, float] | None) -> str:
    return "—" if not a or not b else f"{a['median'] / b['median']:.2f} x"


def _contest_md(contest: dict[str, Any] | None) -> list[str]:
    if not contest:
        return []
    if "error" in contest:
        return ["## Codec contest", "", f"failed: {contest['error'][:300]}", ""]
    source = contest.get("source") or {}
    what = ("real MiniLM weights, Adam moments after "
            f"{source.get('adam_steps')} steps of a contrastive loss"
            if source.get("source") == "minilm" else "synthetic weights and moments")
    lines = ["## Codec contest", "",
             f"ZipNN {contest.get('zipnn')} against asyncckpt's registry codecs on the same "
             f"tensors ({what}; {source.get('parameters')} parameters), one thread, medians of "
             "the interleaved repetitions; load average "
             f"{_load((contest.get('loadavg') or {}).get('start'))}.", "",
             "| case | codec | stored/raw | encode GB/s per thread | decode GB/s per thread | "
             "bit-exact |", "|---|---|---|---|---|---|"]
    for case, entry in contest.get("cases", {}).items():
        for name, c in entry["codecs"].items():
            lines.append(f"| {case} ({entry['bytes'] / MiB:.0f} MiB) | {name} | "
                         f"{c.get('ratio', float('nan')):.4f} | {_s(c.get('encode'))} | "
                         f"{_s(c.get('decode'))} | {'yes' if c.get('exact') else 'NO'} |")
    return lines + [""]

def _s(x: dict[str, float] | None, digits: int = 2) -> str:
    if not x:
        return "—"
    f = f"{{:.{digits}f}}"
    if x["max"] - x["min"] < 0.5 * 10 ** -digits:
        return f.format(x["median"])
    return f"{f.format(x['median'])} ({f.format(x['min'])}–{f.format(x['max'])})"


def _mib(b: float | None) -> str:
    return "—" if b is None else f"{b / MiB:,.0f}"


def value(v: float | None, unit: str) -> str:
    if v is None:
        return "n/a"
    if unit == "B":
        return f"{v / MiB:,.0f} MiB"
    if unit == "s":
        return f"{v:.3f} s"
    if unit == "x":
        return f"{v:.4f} x"  # stored/raw: contenders differ in the 4th decimal
    return f"{v:.2f} {unit}"


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [f"# asyncckpt benchmark ({meta['mode']})", "",
             f"Command: `{meta['command']}` — {meta['machine']['summary']}; "
             f"checkpoints in `{meta['workdir']}` ({meta['machine']['workdir_fs']}). "
             f"Run took {meta['wall_seconds'] / 60:.1f} min on {meta['date']}"
             + (f"; load average {_load(meta.get('loadavg_start'))} at the start, "
                f"{_load(meta.get('loadavg_end'))} at the end" if meta.get("loadavg_start") else "")
             + ".", ""]
    lines += targets_md(all_targets(result))
    for wl in result["workloads"]:
        lines += _workload_md(wl)
    lines += _contest_md(result.get("codec_contest"))
    if result.get("export") and "markdown" in result["export"]:
        lines += result["export"]["markdown"].splitlines() + [""]
    lines += ["## Notes", "",
              "- **blocked**: wall time the training loop cannot proceed: the call's return, plus "
              "for asyncckpt `save()` + `handle.wait_staged()` and for DCP with a background "
              "stager `staging_completion` (the next optimizer step may not run before). "
              "Synchronous methods are blocked until durable.",
              "- **durable**: from the call until the bytes are fsynced and, for DCP and "
              "asyncckpt, committed (DCP: `.metadata` written by `save`/the upload future; "
              "asyncckpt: `handle.wait()`, after the atomic rename). torch.save and safetensors "
              "get an explicit fsync of the file and its directory. GB/s = state bytes / durable.",
              "- **trainer +RSS**: peak VmRSS of the training process above its RSS after the "
              "state was built (VmHWM reset through /proc/self/clear_refs), over the warm-up and "
              "timed saves. It includes asyncckpt's ring (shared memory, counted once, here).",
              "- **helper private / shared**: peak RssAnon / RssShmem summed over the trainer's "
              "child processes (asyncckpt writer, DCP checkpoint daemon), sampled every 10 ms; for "
              "the writer the larger of that and its own RssAnon sampler. Shared memory is the "
              "same pages as the trainer's ring, not extra.",
              "- **/dev/shm**: peak size of the /dev/shm files (unlinked ones included) mapped by "
              "the trainer or its helpers during the saves, from /proc/PID/maps.",
              "- **kept**: rate of a single-thread matmul loop on the main thread while the save "
              "runs in the background (after the caller is released, until durable), over its idle "
              "rate just before; one extra save. Synchronous methods have no background phase (—).",
              "- **load**: cold (every file dropped from the page cache with fadvise DONTNEED "
              "first), into memory: asyncckpt.load verifies every frame's xxh3; "
              "safetensors.load_file maps the file, so every page is then touched; dcp.load fills "
              "preallocated tensors; torch.load reads eagerly. `=` marks a bit-exact comparison "
              "with the source state.",
              "- Each method runs in a fresh process that builds the same seeded state; each save "
              "writes a new step, measured outputs are deleted. Medians over the timed repetitions "
              "(min–max in brackets), after one warm-up save (first-save figures are in the JSON).",
              "- **same-process references**: asyncckpt raw times, before each timed save, a "
              "one-thread numpy.copyto of the same tensors into a touched buffer, and after it, "
              "with the memory probe paused, a sequential write + fsync of the same bytes, "
              "dropped from the cache before the next save; raw, zstd and bytegroup rotate "
              "their loads, asyncckpt.load, "
              "safetensors.load_file of the same state (pages touched) and a cold 8 MiB-block "
              "read of that file, each after the same drop, with the cached share checked by "
              "mincore (resident before).",
              "- **codec contest**: one thread; ZipNN compresses a clone of each tensor (it "
              "reorders its input in place) and decodes into tensors it allocates; the registry's "
              "codecs get 4 MiB frames per tensor, probed once per tensor, and decode into a "
              "preallocated buffer; every decode is checked bit-exact once.",
              "- **load average**: `os.getloadavg()` when the worker that measured the row "
              "started (1 min); the machine is shared, so read ratios, not seconds.",
              ""]
    return "\n".join(lines)


def _workload_md(wl: dict[str, Any]) -> list[str]:
    info, lim, summary = wl["info"], wl["limits"], wl["summary"]
    nbytes = info.get("bytes", 0)
    head = f"## {info['name']}: {nbytes / 1e9:.2f} GB in {info.get('tensors', '?')} tensors"
    dtypes = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in info.get("bytes_by_dtype", {}).items())
    lines = [head, "", f"{dtypes}; {wl['reps']} timed saves per method.", "",
             "| method | blocked s | durable s | GB/s | trainer +RSS MiB | helper private / shared "
             "MiB | /dev/shm MiB | on disk MiB (ratio) | kept | load s (GB/s) |",
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
            f"| {s['label']}{busy} | {_s(s['blocked'], 3)} | {_s(s['durable'])} | {s['GBps']:.2f} "
            f"| {_mib(s['train_extra_rss'])} | {_mib(s['helper_private'])} / "
            f"{_mib(s['helper_shared'])} | {_mib(s['shm_extra'])} | {_mib(s['disk_bytes'])} "
            f"({s['ratio']:.3f}) | {kept} | {load_txt} |")
    busy = {n: s["other_cpu_share"] for n, s in summary.items()
            if s.get("other_cpu_share", 0) > BUSY}
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
    lines += _references_md(summary, nbytes)
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
        for ax, key, title, limit_key in (
                (row[0], "blocked", "blocked (s)", "memcpy"),
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
