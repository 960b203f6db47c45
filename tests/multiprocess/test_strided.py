"""FSDP2 over tensor parallelism (torchtitan's 2-D layout, `_StridedShard` placements)
saved on 4 ranks through asyncckpt and through DCP, loaded bit-exact on 4 ranks in the
same layout and on 1 and 2 ranks under FSDP2 alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from worlds import run_world, saved_by_world

WORKER = str(Path(__file__).with_name("strided_worker.py"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("strided")
    return base, saved_by_world(base, 4, WORKER)


@pytest.mark.parametrize("world", [4, 1, 2])
def test_strided_shards_reshard_bit_exact(saved, world):
    out, root = saved
    run_world(world, "load", out, {"CKPT_ROOT": str(root)}, WORKER)
