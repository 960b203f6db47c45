"""A URL is never taken for a local path: `gs://bucket/run` as a path would be a relative
directory `gs:/bucket/run` written in the working directory, every save reported as
committed. A scheme we do not support is refused by every entry point; `s3://` is a root
where object-store roots are supported (tests/storage/test_s3.py) and refused where a
local directory is meant (an export's or copy's output). Nothing is ever written locally."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import asyncckpt
from asyncckpt.dcp import StorageReader, StorageWriter
from asyncckpt.storage.paths import local_path

URLS = ["s3://bucket/run1", "gs://bucket/run1", "file:///tmp/run1", "az://c/run"]
UNSUPPORTED = URLS[1:]


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


@pytest.mark.parametrize("url", UNSUPPORTED)
@pytest.mark.parametrize("use", [
    lambda url: asyncckpt.start_writer(url),
    lambda url: asyncckpt.load(url),
    lambda url: asyncckpt.verify(url),
    lambda url: asyncckpt.copy_step(url, "out"),
    lambda url: asyncckpt.export_hf(url, "out"),
    lambda url: asyncckpt.Checkpointer(url, model=torch.nn.Linear(2, 2)),
], ids=["start_writer", "load", "verify", "copy_step", "export_hf", "Checkpointer"])
def test_every_entry_point_refuses_an_unsupported_scheme(use, url):
    with pytest.raises(asyncckpt.CheckpointError, match="roots are not supported"):
        use(url)


# DCP's checkpoint ids take file:// URLs of this machine (DCP's own storage does):
# the URL's absolute path, never a relative directory made of the URL
@pytest.mark.parametrize("url", [u for u in UNSUPPORTED if not u.startswith("file:")])
@pytest.mark.parametrize("use", [
    lambda url: StorageWriter(url, 1),
    lambda url: StorageReader(url),
    lambda url: StorageWriter().reset(f"{url}/step-3"),
], ids=["StorageWriter", "StorageReader", "checkpoint_id"])
def test_every_dcp_entry_point_refuses_an_unsupported_scheme(use, url):
    with pytest.raises(asyncckpt.CheckpointError, match="roots are not supported"):
        use(url)


def test_a_dcp_file_url_is_its_absolute_path():
    from pathlib import Path
    assert StorageWriter("file:///tmp/run1", 1).root == Path("/tmp/run1")
    assert StorageReader("file:///tmp/run1").root == Path("/tmp/run1")
    for foreign in ("file://otherhost/tmp/run1", "file://host:22/tmp/run1"):
        with pytest.raises(asyncckpt.CheckpointError, match="file:// URL of this machine"):
            StorageWriter(foreign, 1)


@pytest.mark.parametrize("use", [
    lambda tmp: asyncckpt.copy_step(tmp, "s3://bucket/out"),
    lambda tmp: asyncckpt.export_hf(tmp, "s3://bucket/out"),
], ids=["copy_step out", "export_hf out"])
def test_s3_is_refused_where_a_local_directory_is_meant(use, tmp_path):
    with pytest.raises(asyncckpt.CheckpointError, match="s3:// URL"):
        use(tmp_path)


@pytest.mark.process  # runs the CLI
@pytest.mark.process  # runs the command
@pytest.mark.parametrize("args", [["writer", "--root"], ["ls"], ["verify"], ["inspect"], ["gc"]])
def test_the_cli_refuses_an_unsupported_scheme(args):
    done = subprocess.run([sys.executable, "-m", "asyncckpt", *args, "gs://bucket/run1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "gs:// roots are not supported" in done.stderr \
        or "gs:// URL" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr

