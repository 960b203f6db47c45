"""FSDP2 over tensor parallelism (torchtitan's 2-D layout, `_StridedShard` placements)
saved on 4 ranks through asyncckpt and through DCP, loaded bit-exact on 4 ranks in the
same layout and on 1 and 2 ranks under FSDP2 alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import running_writer
from test_fsdp import run_world

WORKER = str(Path(__file__).with_name("strided_worker.py"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("strided")
    with running_writer(base, codec="zstd") as w:
        run_world(4, "save", base, {"ASYNCCKPT_ADDRESS": w.address, "CKPT_ROOT": str(w.root)},
                  worker=WORKER)
    return base, w.root


@pytest.mark.parametrize("world", [4, 1, 2])
def test_strided_shards_reshard_bit_exact(saved, world):
    out, root = saved
    run_world(world, "load", out, {"CKPT_ROOT": str(root)}, worker=WORKER)
