"""A writer killed during an emergency flush of its memory generation (SIGTERM's flush,
and `asyncckpt flush`): nothing half-made is ever restored.

One rank (a Checkpointer in the test process, every step to memory, every 2nd durable)
and its node's writer process, armed with a crash point that only the flush reaches
(the n-th commit of the writer's life: step 2's is the first). Killed before its step
is in, the flush leaves durable step 2 newest: a restore falls back to it, bit-exact,
and says so. Killed after the step was renamed in (before `latest`), the flushed step
is whole and is what a restore takes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import asyncckpt

pytestmark = pytest.mark.process  # writers killed
WAIT_S = 60.0
POLL_S = 0.05


def _model(step: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(step)
    model = torch.nn.Linear(64, 32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _options() -> asyncckpt.CheckpointerOptions:
    return asyncckpt.CheckpointerOptions(memory_interval=1, save_interval=2)


def _save_three(root: Path, w: asyncckpt.WriterProcess) -> None:
    """Steps 1..3: durable 2, memory 3 (held by `w` only)."""
    model = _model(0)
    ckpt = asyncckpt.Checkpointer(root, model=model, options=_options(), address=w.address,
                                  fence=False)
    for step in (1, 2, 3):
        model.load_state_dict(_model(step).state_dict())
        ckpt.save(step).wait(WAIT_S)
    ckpt.close()


def _died(w: asyncckpt.WriterProcess) -> int:
    deadline = time.monotonic() + WAIT_S
    while w.alive() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return w.stop(timeout=1)


def _restore(root: Path, caplog: pytest.LogCaptureFixture) -> tuple[int | None, str | None,
                                                                      torch.nn.Module]:
    model = _model(0)
    with asyncckpt.start_writer(root, codec="raw", export=False) as w, \
            caplog.at_level(logging.WARNING, logger="asyncckpt.checkpointer"):
        ckpt = asyncckpt.Checkpointer(root, model=model, options=_options(),
                                      address=w.address, fence=False)
        step = ckpt.restore()
        tier = ckpt.restored_tier
        ckpt.close()
    return step, tier, model


def _same(model: torch.nn.Module, step: int) -> None:
    want = _model(step).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize(("how", "point"), [("sigterm", "data_fsynced"),
                                            ("cli", "manifest_written")])
def test_a_flush_killed_before_its_step_is_in_leaves_the_durable_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        how: str, point: str) -> None:
    root = tmp_path / "ckpt"
    monkeypatch.setenv("ASYNCCKPT_CRASH_AT", f"{point}:2")  # the flush's, after step 2's
    w = asyncckpt.start_writer(root, codec="raw", export=False)
    monkeypatch.delenv("ASYNCCKPT_CRASH_AT")
    try:
        _save_three(root, w)
        if how == "sigterm":
            os.kill(w.pid, signal.SIGTERM)
        else:
            cli = subprocess.run([sys.executable, "-m", "asyncckpt", "flush", "--address",
                                  w.address], capture_output=True, text=True, timeout=WAIT_S)
            assert cli.returncode != 0 and "during the flush" in cli.stderr, cli
        assert _died(w) == -signal.SIGKILL
    finally:
        w.stop(timeout=1)
    # the flush's tmp directory may stay (the next writer's sweep takes it): never a step
    assert sorted(p.name for p in root.glob("step-*") if p.name[5:].isdigit()) == [
        "step-00000002"]
    step, tier, model = _restore(root, caplog)
    assert (step, tier) == (2, "durable")
    _same(model, 2)
    assert "restoring from the durable tier" in caplog.text


def test_a_flush_killed_after_its_step_is_renamed_in_is_restored_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ckpt"
    monkeypatch.setenv("ASYNCCKPT_CRASH_AT", "step_renamed:2")
    w = asyncckpt.start_writer(root, codec="raw", export=False)
    monkeypatch.delenv("ASYNCCKPT_CRASH_AT")
    try:
        _save_three(root, w)
        os.kill(w.pid, signal.SIGTERM)
        assert _died(w) == -signal.SIGKILL
    finally:
        w.stop(timeout=1)
    assert asyncckpt.verify(root / "step-00000003").ok
    step, tier, model = _restore(root, caplog)
    assert (step, tier) == (3, "durable")
    _same(model, 3)
