"""The verl drop-in in sync mode when the node's writer skips a memory save (verl.py
`save_checkpoint`, verl_memory.py `skipped_anywhere`, 1f5c68c).

In sync mode verl writes its tracker itself once `save_checkpoint` returns, so the step
it names must be held somewhere. A memory save the node's writer skipped (its bound of
two generations per node: the newer one still arriving) is held nowhere: the ranks
agree that a node skipped it and save it durably instead. Here the writer holds the
node at 5 and a replica of the node's 6 is still arriving (a replacement's writer taking
its node's generations back from the partner, left in flight through `ReplicaIn`, the
seam the transport plugs into) when the rank saves 7: the node skips 7. A restart at 7
-- what verl's tracker names -- must load 7, bit for bit, from the root.

In process, without verl: world 1 over gloo, one writer (ASYNCCKPT_ADDRESS), a linear
model and SGD; a second writer makes the replica of 6.

Across two nodes (`test_..._on_every_rank_alike`): two rank processes (gloo, CPU), each
its node's lead with a writer of its own on the one root (verl_skip_worker.py); only
node 1's writer skips 7. Both ranks must save 7 durably (a rank that saved it durably
alone would wait for ever on a commit its peer never joins), and both load it from the
root bit for bit, each its own RNG stream too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from inprocess import InProcessWriter
from verl_memory_job import (  # noqa: F401 (a fixture)
    linear_model,
    replica_arriving,
    verl_job_fixture,
)
from world_job import run_world

from asyncckpt.integrations.verl import FSDPCheckpointManager
from asyncckpt.integrations.verl_paths import root_of
from asyncckpt.read import memory
from asyncckpt.storage.posix import PosixStorage

WORKER = Path(__file__).with_name("verl_skip_worker.py")
WORLD_TIMEOUT_S = 300  # both ranks, started on a busy machine; a rank left waiting fails
CONFIG = {"durable_interval": 10, "async_save": False,
          "save_contents": ["model", "optimizer", "extra"]}


def test_a_sync_memory_save_the_node_skipped_is_saved_durably(
        tmp_path: Path, verl_job: tuple[Path, InProcessWriter]) -> None:
    base, w = verl_job
    root = root_of(base / "global_step_1" / "actor")
    model, optim = linear_model(5.0)
    run = FSDPCheckpointManager(model=model, optimizer=optim, checkpoint_config=CONFIG)
    run.save_checkpoint(str(base / "global_step_5" / "actor"), global_step=5)
    sink, ranks = replica_arriving(tmp_path / "partner", w, 6)
    try:
        held = {g["step"]: g["whole"] for g in memory.generations(w.address)}
        assert held == {5: True, 6: False}, held  # the premise: 6 still arriving
        with torch.no_grad():
            model.weight.fill_(7.0)
        run.save_checkpoint(str(base / "global_step_7" / "actor"), global_step=7)
        assert 7 not in {g["step"] for g in memory.generations(w.address)}  # skipped
    finally:
        sink.abort()
        for _, fd, _ in ranks:
            os.close(fd)
    run.close()
    assert 7 in PosixStorage(root).committed_steps(), (
        "the node skipped memory step 7 and it was not saved durably: verl's tracker "
        f"names a step no tier holds (root: {PosixStorage(root).committed_steps()})")
    model, optim = linear_model(0.0)  # the restart at the tracker's step
    again = FSDPCheckpointManager(model=model, optimizer=optim, checkpoint_config=CONFIG)
    try:
        again.load_checkpoint(str(base / "global_step_7" / "actor"))
    finally:
        again.close()
    assert again.restored_tier == "durable" and float(model.weight[0, 0].detach()) == 7.0


def _two_nodes(out: Path) -> list[dict]:
    """verl_skip_worker.py on ranks 0 and 1, each a node of its own: each rank's RESULT."""
    ranks = run_world(WORKER, str(out), per_node=1, timeout=WORLD_TIMEOUT_S,
                      ASYNCCKPT_ADDRESS="")
    results = []
    for r, (code, text) in enumerate(ranks):
        assert code == 0 and f"OK rank {r}" in text, (
            f"rank {r} (exit {code}):\n{text[-4000:]}\n"
            + "\n".join(f"rank {o}:\n{t[-2000:]}" for o, (_, t) in enumerate(ranks) if o != r))
        line = next(x for x in text.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    return results


def test_a_sync_memory_save_one_node_skipped_is_saved_durably_on_every_rank_alike(
        tmp_path: Path) -> None:
    node0, node1 = _two_nodes(tmp_path)
    assert node0["held_after_5"] == node1["held_after_5"] == [5]
    assert node1["node_1_held"] == {"5": True, "6": False}  # the premise: 6 still arriving
    assert 7 in node0["held_after_7"] and 7 not in node1["held_after_7"]  # node 1 skipped
    for seen in (node0, node1):
        assert 7 in seen["committed"], (
            f"rank {seen['rank']}: node 1 skipped memory step 7 and it was not saved "
            f"durably: verl's tracker names a step no tier holds ({seen['committed']})")
        assert seen["restored_tier"] == "durable", seen
        assert seen["weights_equal"] and seen["rng_equal"], seen
