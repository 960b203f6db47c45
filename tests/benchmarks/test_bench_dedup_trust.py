"""`make bench-dedup-trust` at a tiny size, so that it cannot rot: with the trust off
every referencing save reads all the referenced bytes; with the default none does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import dedup_trust  # noqa: E402

pytestmark = pytest.mark.process  # the benchmark runs a writer


def test_the_trust_off_reads_every_reference_and_the_default_none(tmp_path):
    state = {f"w{i}": torch.randn(64 << 10, generator=torch.Generator().manual_seed(i))
             for i in range(4)}
    nbytes = 4 * (64 << 10) * 4
    off = dedup_trust.one_run(tmp_path, state, 3, 0.0)
    on = dedup_trust.one_run(tmp_path, state, 3, 60.0)
    assert [read for read, _ in off["read"]] == [0, nbytes, nbytes]
    assert [read for read, _ in on["read"]] == [0, 0, 0]
    assert len(off["times"]) == len(on["times"]) == 3
