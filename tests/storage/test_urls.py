"""A URL is never taken for a local root: `s3://bucket/run` as a path would be a relative
directory `s3:/bucket/run` written in the working directory, every save reported as
committed. Every entry point that takes a root or a step refuses it, and writes nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import asyncckpt
from asyncckpt.dcp import StorageReader, StorageWriter
from asyncckpt.storage.posix import local_path

URLS = ["s3://bucket/run1", "gs://bucket/run1", "file:///tmp/run1", "az://c/run"]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yield
    assert list(tmp_path.iterdir()) == [], "a URL became a local directory"


@pytest.mark.parametrize("url", URLS)
def test_local_path_refuses_urls_naming_the_scheme(url):
    with pytest.raises(asyncckpt.CheckpointError, match=f"is a {url.split(':')[0]}:// URL"):
        local_path(url)
    assert local_path("runs/s3:/odd") == local_path("runs/s3:/odd")  # a colon alone is a path


@pytest.mark.parametrize("use", [
    lambda url: asyncckpt.start_writer(url),
    lambda url: asyncckpt.load(url),
    lambda url: asyncckpt.verify(url),
    lambda url: asyncckpt.copy_step(url, "out"),
    lambda url: asyncckpt.export_hf(url, "out"),
    lambda url: asyncckpt.Checkpointer(url, model=torch.nn.Linear(2, 2)),
    lambda url: StorageWriter(url, 1),
    lambda url: StorageReader(url),
    lambda url: StorageWriter().reset(f"{url}/step-3"),
], ids=["start_writer", "load", "verify", "copy_step", "export_hf", "Checkpointer",
        "StorageWriter", "StorageReader", "checkpoint_id"])
def test_every_entry_point_refuses_an_s3_root(use):
    with pytest.raises(asyncckpt.CheckpointError, match="s3:// URL"):
        use("s3://bucket/run1")


@pytest.mark.parametrize("args", [["writer", "--root"], ["ls"], ["verify"], ["inspect"], ["gc"]])
def test_the_cli_refuses_an_s3_root(args):
    done = subprocess.run([sys.executable, "-m", "asyncckpt", *args, "s3://bucket/run1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "s3:// URL" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
