"""DCP usage that DCP's own storage allows, on two ranks (gloo) through asyncckpt
(tests/multiprocess/dcp_conformance_worker.py): a checkpoint_id re-saved with
`overwrite=True` on every rank, `async_save` given only a checkpoint_id, and the cached
plan when only rank 1's structure changes (rank 0's part still names every tensor)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import running_writer
from worlds import run_world, saved_by_world

import asyncckpt
from asyncckpt.format.layout import step_dir_name

WORKER = str(Path(__file__).with_name("dcp_conformance_worker.py"))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_by_world(tmp_path_factory.mktemp("conformance"), 2, WORKER)


def test_overwrite_replaced_the_step_on_every_rank(root):
    assert asyncckpt.verify(root / step_dir_name(1)).ok
    for rank in (0, 1):
        got = asyncckpt.load(root, step=1, rank=rank)
        assert torch.equal(got["w0"], torch.full((2, 3), 3.0))
        assert torch.equal(got["w1"], torch.full((2, 3), 4.0))
    assert asyncckpt.load(root, step=1, rank=0)["step"] == 3


def test_async_save_given_only_a_checkpoint_id(root):
    got = asyncckpt.load(root, step=4)
    assert torch.equal(got["shared"], torch.full((4,), 4.0)) and got["step"] == 4


def test_a_structure_changed_on_one_rank_is_in_every_ranks_part(root):
    for step in (5, 6, 7, 8):
        got = asyncckpt.load(root, step=step, rank=0)
        assert torch.equal(got["w1"], torch.full((2, 3), step + 1.0)), step
        assert got["step"] == step
    for rank in (0, 1):
        got = asyncckpt.load(root, step=8, rank=rank)
        assert torch.equal(got["late"], torch.full((5,), 8.0)), rank
    assert "late" not in asyncckpt.load(root, step=7, rank=0)


def test_a_restore_of_an_older_step_on_every_rank_resumes_from_it(tmp_path):
    """Every rank's dcp.load of step 8 records the restore; the coordinator draws the
    timeline id in its plan, so both ranks' saves of 10 carry the same one (else the
    step fails): the new 10 and 11 are newest, the abandoned 12 never again."""
    with running_writer(tmp_path, codec="zstd") as w:
        run_world(2, "timeline", tmp_path, {"ASYNCCKPT_ADDRESS": w.address,
                                            "CKPT_ROOT": str(w.root)}, WORKER)
    root = w.root
    newest = asyncckpt.load(root)
    assert newest["step"] == 111 and torch.equal(newest["shared"], torch.full((4,), 111.0))
    assert asyncckpt.load(root, step=10)["step"] == 110
    assert asyncckpt.verify(root / step_dir_name(10)).ok
