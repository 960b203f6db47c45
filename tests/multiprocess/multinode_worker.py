"""One FSDP2 rank (gloo, CPU) of a simulated multi-node job, run under torchrun.

    torchrun ... multinode_worker.py save      train, save model + optimizer at MN_STEPS
                                               through a Checkpointer; rank 0 writes the
                                               full reference state of each step
    torchrun ... multinode_worker.py load      fresh model at this layout; load each
                                               reference step with asyncckpt.load(into=
                                               get_state_dict(...)) + set_state_dict and
                                               compare the full state bit for bit

Environment:
    MN_ROOT     this node's checkpoint root (the same on every node, unless a test gives
                one node another directory on purpose)
    MN_OUT      shared directory for references, markers and results
    MN_TAG      names this launch's result files (result-<tag>-rank<R>.json)
    MN_STEPS    comma-separated steps to save (save mode), e.g. "2,4"
    MN_HOLD     "STEP:RANK,RANK": those ranks do not save STEP; they write the marker
                hold-<STEP>-rank<R> and sleep until killed (a node that never announces)
    MN_KEEP_LAST  retention passed to the Checkpointer (default: keep all)
    MN_RESTORE  save mode: the Checkpointer first restores this step (a new timeline)
    MN_VIA      "dcp": save through dcp.save with asyncckpt's StorageWriter and load through
                dcp.load with its StorageReader, instead of the Checkpointer / asyncckpt.load

Local rank 0 of each node starts the node's writer (its own ASYNCCKPT_RUNTIME_DIR comes
from the launcher) and publishes the address under a per-node key of the job's store.
After a failed save a rank records it and leaves without a collective (its peers may be
dead); a rank that saves every step finishes with a barrier. Each rank's result file is a
JSON document: {"rank", "node", "steps": {step: {"ok", "path" | "error", "message",
"t_save", "t_done"}}, "writer_pid"}; times are time.time().
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_worker import _assert_same, build, full_state, leave, train  # noqa: E402

import asyncckpt  # noqa: E402
from asyncckpt.dcp import StorageReader, StorageWriter  # noqa: E402
from asyncckpt.storage.location import exists, root_path  # noqa: E402


def write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def start_node_writer(root: Path, out: Path) -> asyncckpt.WriterProcess | None:
    node = int(os.environ["GROUP_RANK"])
    store = dist.distributed_c10d._get_default_store()
    key = f"mn-writer-address-node{node}"
    writer = None
    if int(os.environ["LOCAL_RANK"]) == 0:
        deadline = time.monotonic() + 60
        while True:  # the writers of the launch before may still be releasing the root
            try:
                writer = asyncckpt.start_writer(root, log_file=out / f"writer-node{node}.log")
                break
            except asyncckpt.WriterLockedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        store.set(key, writer.address)
    os.environ["ASYNCCKPT_ADDRESS"] = store.get(key).decode()
    return writer


def outlive_local_peers(out: Path, prefix: str, step: int, timeout: float = 30.0) -> None:
    """After a failed save there is no closing barrier (a peer may be dead), but the rank
    that started this node's writer must not stop it while a local peer still waits for
    that save's result from it: wait (bounded) until every local peer has recorded how
    the save ended for it, or is held (it never saves)."""
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    first = int(os.environ["GROUP_RANK"]) * local
    peers = [r for r in range(first, first + local) if r != dist.get_rank()]
    deadline = time.monotonic() + timeout

    def ended(rank: int) -> bool:
        if (out / f"hold-{step}-rank{rank}").exists():
            return True  # it sleeps until its node is killed
        try:
            doc = json.loads((out / f"{prefix}-rank{rank}.json").read_text())
        except (OSError, ValueError):
            return False
        return str(step) in doc["steps"]

    while not all(ended(r) for r in peers) and time.monotonic() < deadline:
        time.sleep(0.05)


def hold(step: int) -> set[int]:
    spec = os.environ.get("MN_HOLD", "")
    if not spec:
        return set()
    held_step, ranks = spec.split(":")
    return {int(r) for r in ranks.split(",")} if int(held_step) == step else set()


def save(out: Path) -> int:
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    root = root_path(os.environ["MN_ROOT"])  # a directory, or s3://bucket/prefix
    steps = [int(s) for s in os.environ["MN_STEPS"].split(",")]
    keep_last = int(os.environ["MN_KEEP_LAST"]) if os.environ.get("MN_KEEP_LAST") else None
    result_path = out / f"result-{os.environ.get('MN_TAG', 'save')}-rank{rank}.json"
    writer = start_node_writer(root, out)
    result: dict = {"rank": rank, "node": node, "steps": {},
                    "writer_pid": writer.pid if writer else None}
    model, optim = build(seed=0)
    ckpt = asyncckpt.Checkpointer(root, model=model, optimizer=optim,
                                  options=asyncckpt.CheckpointerOptions(keep_last=keep_last))
    done, failed = 0, False
    if os.environ.get("MN_RESTORE"):
        done = int(os.environ["MN_RESTORE"])
        assert ckpt.restore(step=done) == done
        result["timeline"] = ckpt.timeline.to_json() if ckpt.timeline else None
    for step in steps:
        train(model, optim, range(done, step))
        done = step
        reference = full_state(model, optim)  # a collective: before any rank may stop
        if rank == 0:
            torch.save(reference, out / f"reference-{step}.pt")
        if rank in hold(step):
            (out / f"hold-{step}-rank{rank}").touch()
            time.sleep(3600)  # until its node is killed
        t_save = time.time()
        try:
            if os.environ.get("MN_VIA") == "dcp":
                model_sd, optim_sd = get_state_dict(model, optim)
                dcp.save({"step": step, "model": model_sd, "optimizer": optim_sd},
                         storage_writer=StorageWriter(root, step))
                path = root / f"step-{step:08d}"
            else:
                handle = ckpt.save(step, force=True)
                handle.wait_staged(60)
                (out / f"saving-{step}-rank{rank}").touch()
                path = handle.wait(300)
            result["steps"][step] = {"ok": True, "path": str(path), "t_save": t_save,
                                     "t_done": time.time()}
        except (asyncckpt.CheckpointError, TimeoutError, CheckpointException) as e:
            result["steps"][step] = {"ok": False, "error": type(e).__name__, "message": str(e),
                                     "t_save": t_save, "t_done": time.time()}
            failed = True
        write_json(result_path, result)
        if failed:
            break
    try:
        ckpt.close()
    except asyncckpt.CheckpointError:
        pass  # the failure raised again; it is recorded above
    if not failed:
        dist.barrier()
    if writer is not None:
        if failed:
            outlive_local_peers(out, result_path.name.rsplit("-rank", 1)[0], step)
        result["writer_exit"] = writer.stop(timeout=60)
        write_json(result_path, result)
    print(f"OK rank {rank} node {node}: " + " ".join(
        f"{s}:{'ok' if r['ok'] else r['error']}" for s, r in result["steps"].items()), flush=True)
    leave()


def load(out: Path) -> int:
    rank = dist.get_rank()
    root = root_path(os.environ["MN_ROOT"])  # a directory, or s3://bucket/prefix
    checked = []
    for ref in sorted(out.glob("reference-*.pt"), key=lambda p: int(p.stem.split("-")[1])):
        step = int(ref.stem.split("-")[1])
        directory = root / f"step-{step:08d}"
        if not exists(directory / "manifest.json"):
            continue
        model, optim = build(seed=1)  # other values: everything must come from the load
        model_sd, optim_sd = get_state_dict(model, optim)
        loaded = {"step": 0, "model": model_sd, "optimizer": optim_sd}
        if os.environ.get("MN_VIA") == "dcp":
            dcp.load(loaded, storage_reader=StorageReader(directory))
        else:
            loaded = asyncckpt.load(directory, into=loaded)
        assert loaded["step"] == step, (loaded["step"], step)
        set_state_dict(model, optim, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optimizer"])
        state = full_state(model, optim)
        if rank == 0:
            _assert_same(state, torch.load(ref), f"step {step}")
        checked.append(step)
    write_json(out / f"result-{os.environ.get('MN_TAG', 'load')}-rank{rank}.json",
               {"rank": rank, "world": dist.get_world_size(), "checked": checked})
    print(f"OK loaded steps {checked} at world size {dist.get_world_size()}", flush=True)
    dist.barrier()
    leave()


def main() -> int:
    mode, out = sys.argv[1], Path(os.environ["MN_OUT"])
    # a rank still running near the launch's bound shows where every thread stands
    faulthandler.dump_traceback_later(float(os.environ.get("MN_STACKS_AFTER", "120")))
    dist.init_process_group("gloo")
    return save(out) if mode == "save" else load(out)


if __name__ == "__main__":
    sys.exit(main())
