"""One run of a PyTorch DCP job on an asyncckpt root (`dcp.save` / `dcp.load` with
asyncckpt's StorageWriter and StorageReader; no process group), for
test_dcp_timeline_faults.py. Its state holds a value per (history, step): `old` for the
run later abandoned, `new` for the one resumed from an older step.

    python dcp_timeline_job.py ROOT old                save 1..4
    python dcp_timeline_job.py ROOT resume KILL        load 2, save 3.. of the new
                                                       history; SIGKILLed after step KILL
    python dcp_timeline_job.py ROOT newest             load the root's newest, save the
                                                       new history up to 4, load it again

ASYNCCKPT_CRASH_AT arms the job's writer (a child it starts). Prints `LOADED <step>
<history>` for what each load gave (checked bit for bit against both histories).
"""

from __future__ import annotations

import os
import signal
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp

import asyncckpt
from asyncckpt.dcp import StorageReader, StorageWriter

LAST = 4
warnings.filterwarnings("ignore", "torch.distributed is disabled")


def state(history: str, step: int) -> dict:
    g = torch.Generator().manual_seed((1000 if history == "new" else 0) + step)
    return {"w": torch.randn(64, 64, generator=g), "step": torch.tensor(step)}


def load(root: str, step: int | None) -> tuple[int, str]:
    target = {"w": torch.zeros(64, 64), "step": torch.tensor(-1)}
    dcp.load(target, storage_reader=StorageReader(root, step))
    got = int(target["step"])
    history = next((h for h in ("old", "new") if torch.equal(state(h, got)["w"], target["w"])),
                   "neither")
    print("LOADED", got, history, flush=True)
    return got, history


def main() -> None:
    root, phase = sys.argv[1], sys.argv[2]
    writer = asyncckpt.start_writer(root, log_file=os.path.join(os.path.dirname(root), "w.log"))
    os.environ.pop("ASYNCCKPT_CRASH_AT", None)  # armed the writer only
    client = asyncckpt.connect(writer.address, rank=0, world_size=1)
    at, history = 0, "old"
    if phase != "old":
        at, _ = load(root, 2 if phase == "resume" else None)
        history = "new"
    kill = int(sys.argv[3]) if phase == "resume" else None
    for step in range(at + 1, LAST + 1):
        dcp.save(state(history, step), storage_writer=StorageWriter(root, step, client=client))
        if step == kill:
            os.kill(os.getpid(), signal.SIGKILL)
    if phase == "newest":
        assert load(root, None) == (LAST, "new")
    client.close()
    assert writer.stop() == 0
    print("OK", phase, flush=True)


if __name__ == "__main__":
    main()
