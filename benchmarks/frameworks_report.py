"""bench-frameworks' summary and report: per case, medians over the saves of each method,
ratios of asyncckpt's figures to the framework's default and to its async mode, and the
misses (a case where asyncckpt blocks the loop longer, or takes longer to durable, or
costs more host memory, than a method it is compared with), listed, never hidden.

Pure functions of the raw results (no framework imported), so its test runs on
synthetic numbers.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.frameworks_loop import blocked

MiB = 1 << 20
OURS = "asyncckpt"
PEERS = ("default", "async")  # what asyncckpt is compared with, where the framework has it


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise_rank(raw: dict[str, Any]) -> dict[str, Any]:
    """One rank's figures for one method: medians over its saves, by kind."""
    if "error" in raw:
        return {"error": raw["error"].splitlines()[0][:300]}
    saves, base = raw["saves"], raw.get("base_step")
    errors = [s["error"] for s in saves if s.get("error")]
    by = {k: [s for s in saves if s["kind"] == k] for k in ("first", "spaced", "back")}
    memory = raw.get("memory", {})
    extra = memory.get("train_extra_rss", 0) + memory.get("helper_private", 0)
    return {
        "first": _median([blocked(s, base) for s in by["first"]]),
        "spaced": _median([blocked(s, base) for s in by["spaced"]]),
        "spaced_call": _median([s["call"] for s in by["spaced"]]),
        "back": _median([blocked(s, base) for s in by["back"]]),
        # a queued save's wait moves to the step after the last one: the median of the
        # back-to-back saves misses it, their sum does not
        "back_total": sum(blocked(s, base) for s in by["back"]) if by["back"] else None,
        "durable": _median([s["durable"] for s in by["spaced"] if s.get("durable") is not None]),
        "durable_back": _median([s["durable"] for s in by["back"]
                                 if s.get("durable") is not None]),
        "extra_memory": extra,
        "helper_private": memory.get("helper_private", 0),
        "base_step": base, "errors": errors, "loadavg": raw.get("loadavg"),
    }


def summarise_method(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A method over its ranks: the worst rank's figure (the loop waits for the slowest)."""
    per = [summarise_rank(r) for r in ranks]
    failed = [p["error"] for p in per if "error" in p]
    if failed:
        return {"error": "; ".join(failed)}
    out: dict[str, Any] = {}
    for key in ("first", "spaced", "spaced_call", "back", "back_total", "durable", "durable_back",
                "extra_memory", "helper_private", "base_step"):
        values = [p[key] for p in per if p[key] is not None]
        out[key] = max(values) if values else None
    out["errors"] = [e for p in per for e in p["errors"]]
    out["loadavg"] = per[0]["loadavg"]
    return out


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """theirs / ours: how many times less asyncckpt takes (above 1 is better)."""
    if ours is None or theirs is None or ours <= 0:
        return None
    return theirs / ours


COMPARED = (("spaced", "blocked per save, spaced"), ("back", "blocked per save, back to back"),
            ("back_total", "blocked in all, back to back"),
            ("durable", "time to durable"), ("extra_memory", "extra host memory"))


def misses(case: dict[str, Any]) -> list[str]:
    """Where asyncckpt does worse than a peer on a compared figure (or failed, or a peer
    figure is missing while ours exists): one line each."""
    methods = case["methods"]
    ours = methods.get(OURS)
    label = f"{case['framework']} {case['state']}"
    if ours is None or "error" in ours:
        return [f"{label}: asyncckpt failed: {(ours or {}).get('error', 'not run')}"]
    out = []
    for peer in PEERS:
        theirs = methods.get(peer)
        if theirs is None:
            continue
        if "error" in theirs:
            out.append(f"{label}: {peer} failed ({theirs['error'][:120]}); not compared")
            continue
        for key, what in COMPARED:
            a, b = ours.get(key), theirs.get(key)
            if a is None or b is None:
                continue
            if a > b:
                unit = _mib(a) + " vs " + _mib(b) + " MiB" if key == "extra_memory" else \
                    f"{a:.3f} s vs {b:.3f} s"
                out.append(f"{label}: {what}: asyncckpt {unit} ({peer}) -- MISS")
    return out


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _mib(b: float | None) -> str:
    return "n/a" if b is None else f"{b / MiB:.0f}"


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def case_md(case: dict[str, Any], labels: dict[str, str]) -> list[str]:
    methods = case["methods"]
    ours = methods.get(OURS, {})
    lines = [f"### {case['framework']}: {case['state']}", "",
             "| method | blocked/save spaced (s) | of which the call (s) | back to back (s) | "
             "back to back, in all (s) | first save (s) | durable (s) | extra host memory "
             "(MiB) | spaced: default/ours | spaced: async/ours | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in methods.items():
        label = labels.get(name, name)
        if "error" in m:
            lines.append(f"| {label} | failed: {m['error'][:200]} | | | | | | | | | |")
            continue
        r_def = ratio(ours.get("spaced"), methods.get("default", {}).get("spaced")) \
            if name == OURS else None
        r_async = ratio(ours.get("spaced"), methods.get("async", {}).get("spaced")) \
            if name == OURS else None
        load = m.get("loadavg")
        lines.append(
            f"| {label} | {_s(m['spaced'])} | {_s(m['spaced_call'])} | {_s(m['back'])} | "
            f"{_s(m.get('back_total'))} | {_s(m['first'])} | "
            f"{_s(m['durable'])} | {_mib(m['extra_memory'])} | {_x(r_def)} | {_x(r_async)} | "
            f"{'n/a' if not load else f'{load[0]:.1f}'} |")
    limits = case.get("limits")
    if limits:
        one = _s(limits.get("memcpy_1thread"))
        lines += ["", f"Limits measured in this run for {_mib(limits['bytes'])} MiB: memcpy "
                  f"{_s(limits.get('memcpy'))} s (one thread {one} s), "
                  f"sequential write + fsync {_s(limits.get('write_fsync'))} s."]
    lines.append("")
    return lines


def _spacing(result: dict[str, Any]) -> str:
    plans = result.get("plans")
    if not plans:  # a run before the plans were per state
        return f"{result['plan']['gap']} training steps between saves"
    return "; ".join(f"{state}: {p['spaced']} saves, {p['gap']} training steps between them "
                     f"(median step without saves over {p['baseline']})"
                     for state, p in plans.items())


def markdown(result: dict[str, Any]) -> str:
    """The report (results/frameworks.md)."""
    lines = ["# bench-frameworks: each framework's checkpoint path against asyncckpt's", "",
             f"`{result['command']}` on {result['cpus']} cores, torch {result.get('torch', '?')}; "
             f"load average (1/5/15 min) before {result['loadavg_before']}, after "
             f"{result['loadavg_after']}; {result.get('wall_s', 0):.0f} s in all. The machine is "
             "shared with other jobs: times move with the load (the `load` column, 1-min "
             "average at the end of each case), memory does not.", "",
             "Each method runs in a fresh process forked from one that imported the "
             "framework; a training loop of the framework (its optimizer step, its "
             "backward; Lightning's own `fit`) on a stack of bias-free `Linear` layers "
             "with AdamW (weights + 2 moments) saves through the method. `blocked/save`: "
             "the save call plus what the next training step took beyond the median "
             "step without saves (a fence holding `optimizer.step()`, a background writer "
             "competing for the cores), median over the saves (`of which the call`: the save "
             "call alone, median); `spaced`: "
             f"{_spacing(result)}; `back to back`: saves "
             "with no step between (each waits for what the previous one still holds; the "
             "next step after the last one only), the median per save and, `in all`, the "
             "sum over them (a save that returns at once and leaves its wait to the next "
             "step's fence shows there). `first save`: the first one (a writer "
             "started, a ring or thread pool made). `durable`: from the call to the bytes "
             "being durable: asyncckpt's commit (fsynced, renamed); for methods that never "
             "fsync (torch.save, DCP with sync_files=False) their files written plus an "
             "fsync of them that the bench adds. `extra host memory`: peak RSS over the "
             "no-checkpoint baseline (VmHWM reset after the warm-up steps) plus the private "
             "memory of helper processes (asyncckpt's writer); a ring is shared memory "
             "already in the trainer's RSS. At 2 ranks each figure is the worse rank's. "
             "Ratios: the peer's figure over asyncckpt's (above 1: asyncckpt blocks less).",
             ""]
    labels = result.get("labels", {})
    for case in result["cases"]:
        lines += case_md(case, labels.get(case["framework"], {}))
    found = [m for case in result["cases"] for m in misses(case)]
    lines += ["## Misses", ""]
    lines += [f"- {m}" for m in found] if found else ["- none in this run"]
    notes = [*result.get("run_notes", []), *result.get("notes", [])]  # this run's, then the code's
    lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
