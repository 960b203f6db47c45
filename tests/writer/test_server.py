"""The writer server's per-save bookkeeping (writer/server.py): what a save costs the
writer beyond its bytes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from inprocess import inprocess_writer

import asyncckpt


def test_codec_auto_logs_its_choice_when_it_changes_not_at_every_step(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="asyncckpt.writer")
    with inprocess_writer(tmp_path, "auto", incremental=False) as w, \
            asyncckpt.connect(w.address, rank=0, world_size=1) as client:
        for step in range(1, 7):
            client.save(step, {"w": torch.full((256,), float(step))}).wait()
        chosen = [r for r in caplog.records if r.getMessage().startswith("codec auto chose")]
        committed = [r for r in caplog.records if r.getMessage().startswith("committed step")]
        assert len(committed) == 6  # still one line per commit
        assert len(chosen) == 1, [r.getMessage() for r in chosen]
        for step in (1, 6):  # the saves themselves are unchanged
            got = asyncckpt.load(tmp_path / "ckpt", step=step)
            assert torch.equal(got["w"], torch.full((256,), float(step)))
