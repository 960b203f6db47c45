"""One rank of a verl drop-in job of two nodes, one rank each (gloo, CPU), for
test_verl_memory_sync_skip.py: every rank is its node's lead, with a writer of its own
(of job "skip", in this process) on the one root, so a durable step is committed
through the job's store, as across real nodes.

    python verl_skip_worker.py OUT        (RANK, WORLD_SIZE 2, MASTER_ADDR, MASTER_PORT)

Sync mode, durable_interval 10: both ranks save step 5 to their writers' memory. Then
rank 1's writer gets a partner's replica of node 1's generation 6 that stays arriving,
so node 1 is held at 5 and 6 (busy) and its writer skips step 7 (the bound of two
generations per node) while node 0's writer holds it. The ranks must agree that a node
skipped it and both save 7 durably; a restart at 7 loads it on both ranks from the root,
bit for bit: the weights and each rank's own RNG stream. A rank that disagrees waits on
a save or a collective its peer never joins: the process group's timeout (and the
test's) bounds that.

Prints `RESULT <json>` (what this rank saw) and `OK rank <r>` once all held.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from verl_memory_job import linear_model, replica_arriving

from asyncckpt.config import WriterKnobs
from asyncckpt.integrations.verl import FSDPCheckpointManager
from asyncckpt.integrations.verl_paths import root_of
from asyncckpt.read import memory
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer.server import WriterServer

CONFIG = {"durable_interval": 10, "async_save": False,
          "save_contents": ["model", "optimizer", "extra"]}
COLLECTIVE_TIMEOUT_S = 120  # a rank left alone in a collective fails after this, not never
JOB = "skip"


class NodeWriter:
    """This node's writer (of job JOB, sharing the root with the other node's), served
    from a thread of this rank's process (its memory tier reachable as `server.memory`)."""

    def __init__(self, root: Path) -> None:
        self.server = WriterServer(root, WriterKnobs.from_env(codec="raw"), job=JOB)
        self.address = self.server.address
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.stop()
        self._thread.join(30)


def weights(step: int) -> dict[str, torch.Tensor]:
    """Step `step`'s weights, the same on every rank (a replicated model)."""
    g = torch.Generator().manual_seed(step)
    return {"weight": torch.randn(4, 8, generator=g), "bias": torch.randn(4, generator=g)}


def main() -> int:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank()
    base = out / "ckpts"
    root = root_of(base / "global_step_1" / "actor")
    root.mkdir(parents=True, exist_ok=True)
    writer = None
    for starting in range(2):  # node 0's writer makes the root's identity first
        if rank == starting:
            writer = NodeWriter(root)
        dist.barrier()
    assert writer is not None
    os.environ["ASYNCCKPT_ADDRESS"] = writer.address
    seen: dict = {"rank": rank}

    model, optim = linear_model(5.0)
    run = FSDPCheckpointManager(model=model, optimizer=optim, checkpoint_config=CONFIG)
    run.save_checkpoint(str(base / "global_step_5" / "actor"), global_step=5)
    seen["held_after_5"] = sorted(g["step"] for g in memory.generations(writer.address))
    sink, ranks = None, []
    if rank == 1:
        sink, ranks = replica_arriving(out / "partner", writer, 6, rank=1, world_size=2)
        seen["node_1_held"] = {str(g["step"]): g["whole"]
                               for g in memory.generations(writer.address)}
    dist.barrier()  # node 1 is held at 5 and 6 (still arriving) before step 7 begins
    try:
        with torch.no_grad():
            for name, value in weights(7).items():
                getattr(model, name).copy_(value)
        torch.manual_seed(70 + rank)  # each rank's own stream, saved in its `extra`
        run.save_checkpoint(str(base / "global_step_7" / "actor"), global_step=7)
        after_save = torch.rand(4)
        seen["held_after_7"] = sorted(g["step"] for g in memory.generations(writer.address))
    finally:
        if sink is not None:
            sink.abort()
        for _, fd, _ in ranks:
            os.close(fd)
    run.close()
    seen["committed"] = PosixStorage(root).committed_steps()

    model, optim = linear_model(0.0)  # the restart at the step verl's tracker names
    again = FSDPCheckpointManager(model=model, optimizer=optim, checkpoint_config=CONFIG)
    again.load_checkpoint(str(base / "global_step_7" / "actor"))
    seen["restored_tier"] = again.restored_tier
    seen["weights_equal"] = all(torch.equal(getattr(model, n).detach(), v)
                                for n, v in weights(7).items())
    seen["rng_equal"] = torch.equal(torch.rand(4), after_save)
    again.close()
    print("RESULT " + json.dumps(seen), flush=True)
    dist.barrier()  # no destroy_process_group: gloo's teardown can abort a rank
    writer.stop()
    print(f"OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
