"""The writer server's per-save bookkeeping (writer/server.py): what a save costs the
writer beyond its bytes."""

from __future__ import annotations

import logging
import time
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


def test_an_idle_writer_reads_its_memory_once_a_second_and_a_save_reports_it(tmp_path: Path):
    """The writer samples its RssAnon while saves and commits are open, and once a second
    otherwise (it used to read /proc/self/status 50 times a second, idle or not: 9 ms of
    CPU a second); a save's stats still carry the peak."""
    with inprocess_writer(tmp_path, "raw", incremental=False) as w, \
            asyncckpt.connect(w.address, rank=0, world_size=1) as client:
        handle = client.save(1, {"w": torch.ones(1 << 16)})
        handle.wait()
        assert handle.stats.writer_peak_rss_anon > 0
        time.sleep(0.2)  # the commit's retention, after the reply
        rss = w.server.rss
        before = rss.samples
        time.sleep(1.0)
        assert rss.samples - before <= 3, rss.samples - before
