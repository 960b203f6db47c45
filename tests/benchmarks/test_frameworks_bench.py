"""bench-frameworks' schedule, timing and report logic on synthetic numbers (no framework
is imported): the saves run when the plan says, blocked time adds the step after a save
beyond the baseline step, durable waits for the method and the bench's fsync, the worst
rank is reported, and every case where asyncckpt does worse than a peer is a MISS line
in the report, while a missing or failed figure is never counted as a win."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import frameworks_report as report  # noqa: E402
from benchmarks.frameworks_loop import Bench, Plan, Saved, blocked  # noqa: E402


def test_plan_schedules_first_spaced_then_back_to_back_saves() -> None:
    plan = Plan(warm=2, baseline=3, gap=2, spaced=3, back=4)
    actions = plan.actions()
    assert actions == {5: ["first"], 7: ["spaced"], 9: ["spaced"], 11: ["spaced"],
                       13: ["back"] * 4}
    assert plan.steps() == 15  # a gap of steps after the back-to-back saves


def test_bench_times_saves_links_the_next_step_and_waits_for_durable(tmp_path: Path) -> None:
    plan = Plan(warm=1, baseline=2, gap=1, spaced=2, back=2)
    released = threading.Event()
    made: list[int] = []

    def save(n: int) -> Saved:
        made.append(n)
        path = tmp_path / f"save-{n}"
        path.write_bytes(b"x" * 10)
        if n % 2:  # synchronous: the bench fsyncs before stamping durable
            return Saved(fsync=path)
        return Saved(wait=released.wait, fsync=path)  # async: durable once released

    bench = Bench(plan, save=save)
    steps = [0.1] * plan.steps()
    steps[plan.warm + plan.baseline] = 0.5  # the step after the first save is slow
    done = [bench.on_step(s) for s in steps[:-1]]
    assert not any(done) and made == [1, 2, 3, 4, 5]
    released.set()
    assert bench.on_step(steps[-1])
    result = bench.result()
    assert result["base_step"] == 0.1 and result["steps"] == plan.steps()
    kinds = [s["kind"] for s in result["saves"]]
    assert kinds == ["first", "spaced", "spaced", "back", "back"]
    first, _, _, back1, back2 = result["saves"]
    assert first["next_step"] == 0.5
    assert back1["next_step"] is None and back2["next_step"] == 0.1  # nothing between
    assert all(s["durable"] is not None and s["durable"] >= s["call"] and s["error"] is None
               for s in result["saves"])
    assert "train_extra_rss" in result["memory"]
    assert abs(blocked(first, result["base_step"]) - (first["call"] + 0.4)) < 1e-9


def test_blocked_is_never_below_the_call() -> None:
    assert blocked({"call": 0.2, "next_step": 0.05}, 0.1) == 0.2
    assert blocked({"call": 0.2, "next_step": None}, 0.1) == 0.2
    assert blocked({"call": 0.2, "next_step": 0.3}, None) == 0.2


def _rank(call: float, durable: float, memory: int, rank: int = 0) -> dict[str, Any]:
    saves = [{"kind": k, "call": call, "started": 0.0, "next_step": 0.1, "durable": durable,
              "error": None} for k in ("first", "spaced", "spaced", "spaced", "back", "back")]
    return {"rank": rank, "base_step": 0.1, "saves": saves, "loadavg": [3.0, 2.0, 1.0],
            "memory": {"train_extra_rss": memory, "helper_private": memory // 2}}


def _case(ours: float, default: float, asynchronous: float | None) -> dict[str, Any]:
    methods = {"default": report.summarise_method([_rank(default, 2 * default, 1 << 20)]),
               "asyncckpt": report.summarise_method([_rank(ours, 1.0, 4 << 20),
                                                     _rank(ours / 2, 0.5, 1 << 20, 1)])}
    if asynchronous is not None:
        methods["async"] = report.summarise_method([_rank(asynchronous, 3.0, 8 << 20)])
    return {"framework": "lightning", "state": "tiny", "methods": methods}


def test_summary_takes_the_worse_rank_and_counts_helper_memory() -> None:
    m = _case(0.2, 1.0, None)["methods"]["asyncckpt"]
    assert m["spaced"] == 0.2 and m["back"] == 0.2 and m["durable"] == 1.0
    assert m["extra_memory"] == (4 << 20) + (2 << 20)  # trainer peak + writer's private
    failed = report.summarise_method([_rank(0.1, 0.1, 0), {"rank": 1, "error": "Boom"}])
    assert failed == {"error": "Boom"}


def test_misses_name_every_figure_where_asyncckpt_does_worse() -> None:
    case = _case(0.2, 1.0, 0.1)  # faster than the default, slower than async
    found = report.misses(case)
    assert any("async" in m and "blocked per save, spaced" in m and "MISS" in m for m in found)
    assert any("extra host memory" in m and "(default)" in m for m in found)  # 6 vs 1 MiB
    assert not any("(default)" in m and "blocked" in m for m in found)
    assert not any("time to durable" in m for m in found)  # 1.0 s beats 2.0 and 3.0


def test_a_failed_peer_or_asyncckpt_is_reported_not_counted_as_a_win() -> None:
    case = _case(0.2, 1.0, None)
    case["methods"]["default"] = {"error": "OSError: disk full"}
    assert report.misses(case) == ["lightning tiny: default failed (OSError: disk full); "
                                   "not compared"]
    case["methods"]["asyncckpt"] = {"error": "SaveFailedError: x"}
    assert report.misses(case) == ["lightning tiny: asyncckpt failed: SaveFailedError: x"]


def test_markdown_has_each_method_ratios_and_the_misses() -> None:
    case = _case(0.25, 1.0, 0.5)
    result = {"command": "python -m benchmarks.frameworks", "cpus": 2, "torch": "x",
              "loadavg_before": [1, 1, 1], "loadavg_after": [2, 2, 2], "wall_s": 10,
              "plan": {"gap": 3}, "cases": [case], "notes": ["a note"],
              "run_notes": ["rerun at a lower load"],
              "labels": {"lightning": {"default": "TorchCheckpointIO", "async": "Async",
                                       "asyncckpt": "Ours"}}}
    text = report.markdown(result)
    row = next(line for line in text.splitlines() if line.startswith("| Ours |"))
    assert "| 4.00x | 2.00x |" in row  # default/ours, async/ours on blocked spaced
    assert "| TorchCheckpointIO | 1.000 |" in text and "| Async | 0.500 |" in text
    assert "## Misses" in text and "extra host memory" in text and "MISS" in text
    assert "- rerun at a lower load\n- a note" in text


def test_results_are_written_and_rendered_again_from_their_json(tmp_path: Path) -> None:
    from benchmarks import frameworks
    result = {"command": "python -m benchmarks.frameworks", "cpus": 2, "torch": "x",
              "loadavg_before": [1, 1, 1], "plan": {"gap": 3}, "notes": [],
              "cases": [_case(0.25, 1.0, 0.5)], "labels": {}}
    out = tmp_path / "frameworks.md"
    text = frameworks.write(result, out, 0.0)
    assert out.read_text() == text and "MISS" in text
    assert frameworks.main(["--render", str(out.with_suffix(".json")),
                            "--out", str(tmp_path / "again.md")]) == 0
    again = (tmp_path / "again.md").read_text()
    assert again.split("## Notes")[0] == text.split("## Notes")[0]
    assert frameworks.NOTES[0] in again  # the notes are today's


def test_back_to_back_in_all_counts_the_wait_a_queued_save_leaves_to_the_next_step() -> None:
    """Three back-to-back saves that return at once while the step after the last one
    waits 2 s for their copies (the fence): the median per save hides that wait, the
    sum does not, and a peer whose three calls took 0.5 s each (1.5 s in all) is
    reported as blocking less in all."""
    def ranked(calls: list[float], last_step: float) -> dict[str, Any]:
        saves = [{"kind": "back", "call": c, "started": 0.0, "next_step": None,
                  "durable": 3.0, "error": None} for c in calls]
        saves[-1]["next_step"] = last_step
        return {"rank": 0, "base_step": 0.1, "saves": saves, "loadavg": [1.0, 1.0, 1.0],
                "memory": {}}
    ours = report.summarise_method([ranked([0.01, 0.01, 0.01], 2.1)])
    theirs = report.summarise_method([ranked([0.5, 0.5, 0.5], 0.1)])
    assert ours["back"] == 0.01 and abs(ours["back_total"] - 2.03) < 1e-9
    assert abs(theirs["back_total"] - 1.5) < 1e-9
    case = {"framework": "torchtune", "state": "mid", "methods": {"asyncckpt": ours,
                                                                  "async": theirs}}
    found = report.misses(case)
    assert any("blocked in all, back to back" in m and "(async)" in m for m in found)
    assert not any("blocked per save, back to back" in m for m in found)


def test_profile_covers_the_save_calls_but_the_first_and_stats_are_read_once_durable() -> None:
    """--profile: the save calls after the first run under the profiler (the first pays
    one-time costs); a method's own figures (asyncckpt's handle stats) are recorded
    with the save once it is durable, and the driver's run figures with the result."""
    import cProfile
    import pstats

    plan = Plan(warm=1, baseline=1, gap=1, spaced=2, back=1)
    calls: list[int] = []

    def marked_save_call(n: int) -> None:
        calls.append(n)

    def save(n: int) -> Saved:
        marked_save_call(n)
        return Saved(wait=lambda: None, stats=lambda: {"staging_seconds": 0.5 * n})

    bench = Bench(plan, save=save, profile=cProfile.Profile())
    bench.extra["fence_blocked_seconds"] = 1.5
    for _ in range(plan.steps()):
        bench.on_step(0.1)
    result = bench.result()
    assert calls == [1, 2, 3, 4]
    assert [s["stats"] for s in result["saves"]] == [{"staging_seconds": 0.5 * n}
                                                     for n in (1, 2, 3, 4)]
    assert result["extra"] == {"fence_blocked_seconds": 1.5}
    assert result["step_times"] == [0.1] * plan.steps()
    profiled = {name: counts[0] for (_, _, name), counts in
                pstats.Stats(bench.profile).stats.items()}  # type: ignore[attr-defined]
    assert profiled["marked_save_call"] == 3  # saves 2, 3, 4
