"""PyTorch DCP through asyncckpt under real process groups (gloo, CPU): two FSDP2 ranks
save through `dcp.save`, `dcp.async_save` (THREAD, the weights changing meanwhile) and
`dcp.async_save` (PROCESS) into one node's writer; the steps load bit-exact through
`dcp.load` at world sizes 1 and 3, and through `asyncckpt.load` in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import small_tmpfs
from worlds import run_world, saved_by_world

import asyncckpt
from asyncckpt.format.layout import step_dir_name

WORKER = str(Path(__file__).with_name("dcp_worker.py"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("dcp")
    return base, saved_by_world(base, 2, WORKER)


@pytest.mark.parametrize("world", [1, 3])
def test_dcp_saves_load_through_dcp_at_world_size(saved, world):
    out, root = saved
    run_world(world, "load", out, {"CKPT_ROOT": str(root)}, WORKER)


@pytest.mark.parametrize("step", [3, 4, 5])
def test_dcp_saves_are_asyncckpt_checkpoints(saved, step):
    """Verified by `asyncckpt verify`, and `asyncckpt.load` rebuilds every tensor (each
    rank's part names all of them) keyed by DCP's flattened names."""
    out, root = saved
    assert asyncckpt.verify(root / step_dir_name(step)).ok
    want = torch.load(out / f"ref-{step}.pt", weights_only=False)["model"]
    for rank in (0, 1):
        got = asyncckpt.load(root, step=step, rank=rank)
        for name, tensor in want.items():
            assert torch.equal(got[f"model.{name}"], tensor), (step, rank, name)
    objects = asyncckpt.load(root, step=step, rank=0)  # the lowest rank holding each object
    assert ((objects["extra.step"], objects["extra.tag"], objects["extra.shape"])
            == (step, b"rank-0", (3, 4)))


def test_dcp_ranks_given_no_writer_start_their_nodes_own(tmp_path):
    """No address anywhere: the first `dcp.save` starts the node's writer (its log
    beside the root), the async saves after it reuse it, and every step is whole."""
    root = tmp_path / "ckpt"
    run_world(2, "save", tmp_path, {"ASYNCCKPT_ADDRESS": "", "CKPT_ROOT": str(root)}, WORKER)
    assert sorted(p.name for p in root.glob("step-*")) == [step_dir_name(s) for s in (3, 4, 5)]
    log = (tmp_path / "ckpt.writer.log").read_text()
    assert all(f"committed step {s}" in log for s in (3, 4, 5)), log[-2000:]
    assert log.count(" serving ") == 1  # one writer for the node, not one per save
    for step in (3, 4, 5):
        assert asyncckpt.verify(root / step_dir_name(step)).ok
        want = torch.load(tmp_path / f"ref-{step}.pt", weights_only=False)["model"]
        got = asyncckpt.load(root, step=step)
        for name, tensor in want.items():
            assert torch.equal(got[f"model.{name}"], tensor), (step, name)


def test_async_save_in_process_mode_keeps_the_error_type(tmp_path):
    """DCP's PROCESS mode waits for the commit in a helper process: a DiskFullError
    arrived as SaveFailedError("DiskFullError: ...")."""
    with small_tmpfs(tmp_path, "12m") as mount:
        writer = asyncckpt.start_writer(mount / "ckpt", codec="raw",
                                        log_file=tmp_path / "writer.log")
        try:
            out = run_world(1, "diskfull", tmp_path, {"ASYNCCKPT_ADDRESS": writer.address,
                                                      "CKPT_ROOT": str(writer.root)}, WORKER)
        finally:
            writer.stop(timeout=30)
    assert "caught ['DiskFullError: step 7" in out[0], out[0][-2000:]
