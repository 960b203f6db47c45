"""tests/inprocess.py: the in-process writer writes what the writer process writes, starts no
process, and gives its root and address back when it stops."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import SMALL_RING, assert_same
from inprocess import InProcessWriter
from tiers import ProcessGuard

import asyncckpt
from asyncckpt.ipc.protocol import ADDRESS_ENV


def states() -> dict[int, dict]:
    """Two steps: a frozen tensor (the second step references its frames) and a small one
    that changes, over several 64 KiB frames."""
    g = torch.Generator().manual_seed(5)
    frozen = torch.randn(300, 100, generator=g)
    return {step: {"model": {"frozen": frozen, "w": torch.randn(50, 64, generator=g).bfloat16()},
                   "step": step, "note": [step, None]} for step in (1, 2)}


def save(writer: asyncckpt.WriterProcess | InProcessWriter, saving: dict[int, dict]) -> None:
    with asyncckpt.connect(writer.address, rank=0, world_size=1, **SMALL_RING) as client:
        for step, state in saving.items():
            client.save(step, state).wait(60)


def step_files(root: Path) -> dict[str, bytes]:
    """Every file of every step under `root`; the manifest without its creation time."""
    files = {}
    for path in sorted(root.glob("step-*/*")):
        data = path.read_bytes()
        if path.name == "manifest.json":
            doc = json.loads(data)["manifest"]
            doc.pop("created")
            data = json.dumps(doc, sort_keys=True).encode()
        files[f"{path.parent.name}/{path.name}"] = data
    return files


@pytest.mark.process  # the writer process, to compare with
@pytest.mark.parametrize("codec", ["zstd", "raw", "bytegroup"])
def test_the_in_process_writer_writes_the_bytes_the_writer_process_writes(tmp_path, codec):
    saving = states()
    with InProcessWriter(tmp_path / "inproc", codec=codec, export=False) as w:
        save(w, saving)
    with asyncckpt.start_writer(tmp_path / "process", codec=codec, export=False,
                                log_file=tmp_path / "writer.log") as w:
        save(w, saving)
    ours, theirs = step_files(tmp_path / "inproc"), step_files(tmp_path / "process")
    assert sorted(ours) == sorted(theirs) and len(ours) == 4  # two steps: manifest, data
    for name in ours:
        assert ours[name] == theirs[name], name
    assert (tmp_path / "inproc" / "latest").read_bytes() == (tmp_path / "process" / "latest"
                                                             ).read_bytes()
    assert_same(saving[2], asyncckpt.load(tmp_path / "inproc"))


def test_an_in_process_writer_starts_no_process(tmp_path):
    guard = ProcessGuard()
    guard.install()
    try:
        with InProcessWriter(tmp_path / "ckpt", codec="zstd") as w:
            save(w, states())
    finally:
        guard.uninstall()
    assert guard.started == 0
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == [
        "step-00000001", "step-00000002"]


def test_stop_gives_back_the_address_and_the_root(tmp_path, monkeypatch):
    """As `start_writer` with export: ASYNCCKPT_ADDRESS names it while it runs and goes when
    it stops; its socket is gone; another writer takes the root and loads what it saved."""
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    first = InProcessWriter(tmp_path / "ckpt", codec="raw")
    assert first.alive() and os.environ[ADDRESS_ENV] == first.address
    save(first, {1: {"x": torch.arange(5)}})
    assert first.stop() == 0
    assert not first.alive() and ADDRESS_ENV not in os.environ
    assert not Path(first.address).exists()
    with pytest.raises(asyncckpt.WriterUnavailableError):
        asyncckpt.connect(first.address, rank=0, world_size=1, **SMALL_RING)
    with InProcessWriter(tmp_path / "ckpt", codec="raw", export=False) as second:
        save(second, {2: {"x": torch.arange(6)}})
    assert torch.equal(asyncckpt.load(tmp_path / "ckpt", step=1)["x"], torch.arange(5))
    assert torch.equal(asyncckpt.load(tmp_path / "ckpt")["x"], torch.arange(6))
