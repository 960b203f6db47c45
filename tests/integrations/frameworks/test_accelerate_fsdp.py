"""asyncckpt's Accelerator with Accelerate's FSDP plugin (FSDP2, `fully_shard`) on 2 gloo
ranks: each rank saves its own DTensor shards, asynchronously, with `total_limit`; a run
resumed from an older step saves over the newer ones and ends bit for bit where the
uninterrupted run did (weights, optimizer, scheduler, RNG, losses after).

Accelerate 1.16 ignores the FSDP plugin on CPU (it sets `DistributedType.FSDP` for GPU
types only, and runs DDP); the worker sets `distributed_type` after construction, after
which Accelerate's own FSDP2 `prepare` runs on CPU. The SIGKILL case is
test_accelerate.py's (the same save path)."""

from __future__ import annotations

from frameworks_venv import full_only, needs_frameworks
from test_accelerate import finish, launch, steps_of  # type: ignore[import-not-found]  # rootdir

pytestmark = [needs_frameworks, full_only]  # two more launches of 2 ranks


def test_fsdp2_saves_shards_rotates_and_resumes_bit_exact(tmp_path):
    ref = finish(launch(tmp_path, "ref", "--fsdp"), tmp_path, "ref")
    assert ref[0]["dtensor"] and ref[1]["dtensor"]  # fully_shard ran: DTensor parameters
    root = tmp_path / "project" / "checkpoints"
    assert steps_of(root) == ([3, 4, 5], 5)
    older = finish(launch(tmp_path, "older", "--fsdp", "--resume", "3"), tmp_path, "older")
    for r in range(2):
        assert older[r]["restored"] == 3 and older[r]["from"] == 8
        assert older[r]["losses"] == {k: v for k, v in ref[r]["losses"].items() if int(k) > 8}
        assert older[r]["final"] == ref[r]["final"]
    assert steps_of(root) == ([3, 4, 5], 5)
