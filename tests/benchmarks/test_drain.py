"""The drain micro-benchmark on a tiny state, so that it cannot rot: saves back to back
through a real writer write every byte when the state changed between them and store
references when it did not (incremental saves), and the stage limits are figures."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import pytest  # noqa: E402

from benchmarks import drain  # noqa: E402


@pytest.mark.process
def test_back_to_back_changed_saves_write_everything(tmp_path: Path) -> None:
    state = drain.adamw_state(0.001, width=128)
    saves = drain.back_to_back(tmp_path / "root", state, 2, "raw", {}, changed=True)
    assert [s["codec"] for s in saves] == ["raw", "raw"]
    assert all(s["referenced_mib"] == 0 and s["new_mib"] > 0.5 for s in saves)
    assert all(s["durable"] > 0 for s in saves)


@pytest.mark.process
def test_schedule_stores_unchanged_back_to_back_saves_as_references(tmp_path: Path) -> None:
    state = drain.adamw_state(0.001, width=128)
    out = drain.framework_schedule(tmp_path / "root", state, gap=1, spaced=1, back=2)
    kinds = [s["kind"] for s in out["saves"]]
    assert kinds == ["first", "spaced", "back", "back"]
    back = out["saves"][2:]
    assert back[0]["new_mib"] > 0.5  # a step before the first back-to-back save
    assert back[1]["referenced_mib"] > 0.5 and back[1]["new_mib"] < 0.1


def test_stage_limits_are_rates(tmp_path: Path) -> None:
    limits = drain.stage_limits(drain.adamw_state(0.001, width=128), tmp_path)
    assert all(v > 0 for v in limits.values())
    assert 0.5 < limits["bytegroup_ratio"] < 1.0  # fp32 Adam state: the exponent planes shrink
