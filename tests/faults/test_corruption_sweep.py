"""200 random damages to committed checkpoints: every one detected, no wrong value."""

from __future__ import annotations

import pytest
from corruption import sweep

pytestmark = pytest.mark.process  # the sweep runs the corruption tool's writer


def test_every_damage_is_detected(tmp_path):
    stats = sweep(cases=200, seed=7, workdir=tmp_path)
    print({k: v for k, v in stats.items() if k != "missed"})
    assert stats["missed"] == []
    assert stats["verify_detected"] == stats["load_detected"] == stats["cases"] == 200
    assert stats["wrong_values"] == 0
    assert len(stats["kinds"]) == 9  # every kind of damage was drawn
