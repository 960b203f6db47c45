"""Several nodes, simulated on one machine (issue 12): one torchrun per node, each node
with its own writer and runtime directory, one shared root, FSDP2 on gloo.

* 2 nodes x 2 ranks save model + optimizer; the result loads bit-exact at 1 x 3 and
  2 x 1, verifies, and is laid out exactly as a 1 x 4 checkpoint of the same steps;
* a node whose writer serves another directory fails the first save on every node,
  promptly, naming the node and both paths, and nothing is committed;
* a whole node SIGKILLed mid-save fails the step on the other node within
  ASYNCCKPT_NODE_TIMEOUT; the previous step stays newest and verifies;
* the leader's writer killed between "all parts gathered" and the rename fails the
  step on every rank; after a restart of both nodes the next save commits and the tmp
  directory it left is swept.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multinode import Cluster, ring_mapping_pids, wait_for

from asyncckpt.format.layout import tmp_step_of
from asyncckpt.storage.local import read_manifest
from asyncckpt.storage.location import root_path, storage_for
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.posix_lock import RootLock

WORKER = Path(__file__).with_name("multinode_worker.py")
LAUNCH_TIMEOUT = 150


def launch(out: Path, tag: str, nodes: int, per_node: int, mode: str, root: Path,
           env: dict[str, str] | None = None, node_env: dict[int, dict[str, str]] | None = None,
           ) -> Cluster:
    out.mkdir(parents=True, exist_ok=True)
    base_env = {"MN_ROOT": str(root), "MN_OUT": str(out), "MN_TAG": tag,
                "ASYNCCKPT_NODE_TIMEOUT": "20", **(env or {})}
    return Cluster(out / f"logs-{tag}", nodes, per_node, WORKER, [mode], env=base_env,
                   node_env=node_env).start()


def run(out: Path, tag: str, nodes: int, per_node: int, mode: str, root: Path, **kw) -> Cluster:
    """Launch, wait for every node, require exit code 0 everywhere and no leftovers."""
    cluster = launch(out, tag, nodes, per_node, mode, root, **kw)
    try:
        codes = cluster.wait(LAUNCH_TIMEOUT)
        assert codes == [0] * nodes, f"{tag}: exit codes {codes}\n{cluster.outputs()}"
        assert_no_leftovers(cluster)
    finally:
        cluster.close()
    return cluster


def assert_no_leftovers(cluster: Cluster) -> None:
    """Once every node is gone, none of its processes (a writer) lives or maps a ring."""
    wait_for(lambda: not cluster.leftover_pids(), 30, "the job's processes exiting")
    assert ring_mapping_pids(cluster.leftover_pids()) == {}


def results(out: Path, tag: str, world: int) -> dict[int, dict]:
    found = {}
    for r in range(world):
        path = out / f"result-{tag}-rank{r}.json"
        if path.exists():
            found[r] = json.loads(path.read_text())
    return found


def verify_exit(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncckpt", "verify", str(root)],
                          capture_output=True, text=True, timeout=120)


def manifest(step_dir: Path) -> dict:
    return json.loads((step_dir / "manifest.json").read_text())["manifest"]


def tmp_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name) if root.exists() else []


STEPS = "2,5"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same training saved by 2 nodes x 2 ranks and by 1 node x 4 ranks."""
    base = tmp_path_factory.mktemp("multinode")
    multi, single = base / "multi", base / "single"
    env = {"MN_STEPS": STEPS, "ASYNCCKPT_CODEC": "zstd"}
    run(multi, "save", 2, 2, "save", multi / "ckpt", env=env)
    run(single, "save", 1, 4, "save", single / "ckpt", env=env)
    return {"multi": multi, "single": single}


def test_two_nodes_commit_every_step_on_every_rank(saved):
    out = saved["multi"]
    res = results(out, "save", 4)
    assert sorted(res) == [0, 1, 2, 3]
    assert sorted({r["node"] for r in res.values()}) == [0, 1]
    for rank, r in res.items():
        for step in STEPS.split(","):
            entry = r["steps"][step]
            assert entry["ok"], f"rank {rank} step {step}: {entry}"
            assert entry["path"] == str(out / "ckpt" / f"step-{int(step):08d}")
        assert r.get("writer_exit", 0) == 0
    root = out / "ckpt"
    assert PosixStorage(root).committed_steps() == [2, 5]
    assert PosixStorage(root).read_latest() == 5
    assert tmp_dirs(root) == []
    check = verify_exit(root)
    assert check.returncode == 0, check.stdout + check.stderr


def test_two_node_steps_hold_what_single_node_steps_hold(saved):
    """The same training at the same world size: the same steps, and per rank the same
    tensors, bytes and tree; two nodes keep each node's files in a folder of its own and
    a root manifest that lists the node parts."""
    multi, single = saved["multi"] / "ckpt", saved["single"] / "ckpt"
    assert sorted(p.name for p in multi.iterdir() if not p.name.startswith(".")) == \
        sorted(p.name for p in single.iterdir() if not p.name.startswith("."))
    for step in (2, 5):
        a, b = multi / f"step-{step:08d}", single / f"step-{step:08d}"
        assert sorted(p.name for p in a.iterdir()) == ["manifest.json", "node-00000", "node-00002"]
        root = manifest(a)
        assert root["world_size"] == 4 and "ranks" not in root
        assert [(p["first"], p["count"]) for p in root["parts"]] == [(0, 2), (2, 2)]
        ma, mb = read_manifest(a), read_manifest(b)
        for ra, rb in zip(ma.ranks, mb.ranks):
            assert ra.file == f"node-{ra.rank // 2 * 2:05d}/{rb.file}"
            assert (ra.tensors, ra.raw_size, ra.tree) == (rb.tensors, rb.raw_size, rb.tree)
            assert [f.xxh3_raw for f in ra.frames] == [f.xxh3_raw for f in rb.frames]


@pytest.mark.parametrize("nodes,per_node", [(1, 3), (2, 1)])
def test_two_node_checkpoint_loads_bit_exact_at_other_layouts(saved, nodes, per_node):
    out = saved["multi"]
    tag = f"load-{nodes}x{per_node}"
    run(out, tag, nodes, per_node, "load", out / "ckpt")
    res = results(out, tag, nodes * per_node)
    assert len(res) == nodes * per_node
    for r in res.values():
        assert r["checked"] == [2, 5] and r["world"] == nodes * per_node


def test_two_nodes_save_through_dcp_and_load_at_another_layout(tmp_path):
    """dcp.save with asyncckpt's StorageWriter on 2 nodes x 2 ranks commits through the
    job's store like any save; dcp.load at 1 x 3 reads it back bit-exact."""
    root = tmp_path / "ckpt"
    run(tmp_path, "dcp-save", 2, 2, "save", root,
        env={"MN_STEPS": "3", "MN_VIA": "dcp", "ASYNCCKPT_CODEC": "zstd"})
    res = results(tmp_path, "dcp-save", 4)
    assert sorted(res) == [0, 1, 2, 3] and all(r["steps"]["3"]["ok"] for r in res.values()), res
    assert PosixStorage(root).committed_steps() == [3] and tmp_dirs(root) == []
    assert manifest(root / "step-00000003")["world_size"] == 4
    run(tmp_path, "dcp-load", 1, 3, "load", root, env={"MN_VIA": "dcp"})
    assert all(r["checked"] == [3] for r in results(tmp_path, "dcp-load", 3).values())


def test_node_on_another_root_fails_first_save_everywhere(tmp_path):
    root, other = tmp_path / "shared", tmp_path / "node-local"
    started = time.monotonic()
    cluster = launch(tmp_path, "roots", 2, 2, "save", root,
                     env={"MN_STEPS": "2", "ASYNCCKPT_NODE_TIMEOUT": "60"},
                     node_env={1: {"MN_ROOT": str(other)}})
    try:
        codes = cluster.wait(LAUNCH_TIMEOUT)
        elapsed = time.monotonic() - started
        assert codes == [0, 0], cluster.outputs()
        assert_no_leftovers(cluster)
    finally:
        cluster.close()
    res = results(tmp_path, "roots", 4)
    assert sorted(res) == [0, 1, 2, 3], cluster.outputs()
    for rank, r in res.items():
        entry = r["steps"]["2"]
        assert not entry["ok"], f"rank {rank} committed on a split root: {entry}"
        assert entry["error"] == "SaveFailedError" or "Root" in entry["error"], entry
        message = entry["message"]
        assert str(root) in message and str(other) in message, message
        assert re.search(r"node\s*1\b", message, re.I), message
        # promptly: far from the 60 s node timeout a hang would take
        assert entry["t_done"] - entry["t_save"] < 15, entry
    assert elapsed < 60 + 30
    for r in (root, other):
        assert PosixStorage(r).committed_steps() == [] and PosixStorage(r).read_latest() is None
        assert not any(p.name.startswith("step-") and ".tmp-" not in p.name
                       for p in r.iterdir()) if r.exists() else True


NODE_TIMEOUT = 5


def test_whole_node_killed_mid_save_fails_the_step_on_the_other_node(tmp_path):
    root = tmp_path / "ckpt"
    # rank 3 never saves step 4 (it holds); rank 2 does: node 1's writer has rank 2's
    # files of step 4 in flight when node 1 dies, and the leader still waits for rank 3
    cluster = launch(tmp_path, "nodekill", 2, 2, "save", root,
                     env={"MN_STEPS": "2,4", "MN_HOLD": "4:3",
                          "ASYNCCKPT_NODE_TIMEOUT": str(NODE_TIMEOUT)})
    try:
        wait_for(lambda: (tmp_path / "hold-4-rank3").exists()
                 and (tmp_path / "saving-4-rank2").exists(), 120, "node 1 mid-save",
                 )
        killed_at = cluster.nodes[1].kill()
        cluster.nodes[0].wait_ranks(NODE_TIMEOUT * 3 + 30)
        cluster.nodes[0].kill()  # its agent waits for node 1's in torchrun's exit barrier
        assert_no_leftovers(cluster)
    finally:
        cluster.close()
    res = results(tmp_path, "nodekill", 4)
    for rank in (0, 1):
        assert res[rank]["steps"]["2"]["ok"], res[rank]
        entry = res[rank]["steps"]["4"]
        assert not entry["ok"], f"rank {rank}: step 4 committed without node 1: {entry}"
        assert entry["error"] in ("SaveFailedError", "WriterUnavailableError"), entry
        assert re.search(r"rank\s*3\b|node\s*1\b", entry["message"], re.I), entry["message"]
        assert entry["t_done"] - killed_at < NODE_TIMEOUT + 10, (entry, killed_at)
    assert PosixStorage(root).committed_steps() == [2]
    assert PosixStorage(root).read_latest() == 2
    assert not (root / "step-00000004").exists()
    check = verify_exit(root)
    assert check.returncode == 0, check.stdout + check.stderr


def test_leader_writer_killed_between_gather_and_rename(tmp_path):
    root = tmp_path / "ckpt"
    env = {"MN_STEPS": "2,4", "ASYNCCKPT_NODE_TIMEOUT": str(NODE_TIMEOUT)}
    crash = launch(tmp_path, "crash", 2, 2, "save", root, env=env,
                   node_env={0: {"ASYNCCKPT_CRASH_AT": "parts_gathered:2"}})
    try:
        codes = crash.wait(LAUNCH_TIMEOUT)
        assert codes == [0, 0], crash.outputs()
        assert_no_leftovers(crash)
    finally:
        crash.close()
    res = results(tmp_path, "crash", 4)
    assert sorted(res) == [0, 1, 2, 3], crash.outputs()
    for rank, r in res.items():
        assert r["steps"]["2"]["ok"], (rank, r)
        entry = r["steps"]["4"]
        assert not entry["ok"], f"rank {rank}: step 4 committed though the leader died: {entry}"
        assert entry["t_done"] - entry["t_save"] < NODE_TIMEOUT + 15, (rank, entry)
    assert PosixStorage(root).committed_steps() == [2] and PosixStorage(root).read_latest() == 2
    # the dead leader's tmp dir of step 4 goes when node 1's writer, which lives, hears
    # of the failure before the job ends (owners.py), else at the restart below
    assert all(tmp_step_of(name) == 4 for name in tmp_dirs(root)), tmp_dirs(root)
    check = verify_exit(root)
    assert check.returncode == 0, check.stdout + check.stderr

    run(tmp_path, "restart", 2, 2, "save", root, env={**env, "MN_STEPS": "6"})
    res = results(tmp_path, "restart", 4)
    assert all(r["steps"]["6"]["ok"] for r in res.values()), res
    assert PosixStorage(root).committed_steps() == [2, 6] and PosixStorage(root).read_latest() == 6
    assert tmp_dirs(root) == [], "the new leader did not sweep the dead leader's tmp dir"
    check = verify_exit(root)
    assert check.returncode == 0, check.stdout + check.stderr


def test_second_writer_of_a_job_joins_while_the_first_downgrades_its_lock(tmp_path):
    """Two nodes' writers of one job start at the same moment (torture_multinode saw one
    refused in 2 of 8 rounds on a loaded machine): the first takes the root's lock
    exclusively, writes the job id and only then downgrades to shared. A second writer
    arriving in between must wait for the downgrade, not be refused."""
    import fcntl
    import os
    import threading

    from asyncckpt.errors import WriterLockedError
    from asyncckpt.format.layout import LOCK_NAME

    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the first writer, descheduled before its downgrade
        os.pwrite(fd, b"job J\n", 0)
        downgrade = threading.Timer(0.2, fcntl.flock, (fd, fcntl.LOCK_SH))
        downgrade.start()
        try:
            lock = RootLock(tmp_path, job="J")
        except WriterLockedError as e:
            pytest.fail(f"the job's second writer was refused: {e}")
        finally:
            downgrade.join()
        assert not lock.first
        lock.release()
    finally:
        os.close(fd)


@pytest.mark.parametrize("via", ["checkpointer", "dcp"])
def test_two_nodes_commit_one_step_to_one_bucket(tmp_path, s3_root, via):
    """2 nodes x 2 ranks, each node's writer on the same s3:// prefix: every node's data
    objects are written under the step's prefix, in a folder per node, and the leader
    puts the root manifest; nothing but the manifest, the parts and the data files is
    left, and the step loads bit-exact at another layout."""
    env = {"MN_STEPS": "2,5", "ASYNCCKPT_CODEC": "zstd",
           **({"MN_VIA": "dcp"} if via == "dcp" else {})}
    run(tmp_path, "s3-save", 2, 2, "save", s3_root, env=env)
    res = results(tmp_path, "s3-save", 4)
    assert sorted(res) == [0, 1, 2, 3] and all(
        r["steps"][s]["ok"] for r in res.values() for s in ("2", "5")), res
    storage = storage_for(s3_root)
    assert storage.committed_steps() == [2, 5] and storage.read_latest() == 5
    for step in (2, 5):
        step_dir = root_path(s3_root) / f"step-{step:08d}"
        assert storage.names(step_dir) == {"manifest.json"}
        for first in (0, 2):  # each node's folder: its ranks' parts and data, nothing else
            names = storage.names(step_dir / f"node-{first:05d}")
            assert names == {f"rank-{r:05d}{suffix}" for r in (first, first + 1)
                             for suffix in (".json", ".safetensors.zst")}, names
    check = verify_exit(s3_root)
    assert check.returncode == 0, check.stdout + check.stderr
    run(tmp_path, "s3-load", 1, 3, "load", s3_root, env={"MN_VIA": "dcp"} if via == "dcp" else {})
    assert all(r["checked"] == [2, 5] for r in results(tmp_path, "s3-load", 3).values())


def test_two_nodes_restore_an_older_step_and_begin_one_timeline(tmp_path):
    """2 nodes x 2 ranks save 2, 4, 6; a second launch restores 2 on every rank and saves
    3 and 4: every rank carries the one timeline rank 0 drew, the leader writes one
    timeline file, the old 4 is replaced without replace=True, the newest is the new 4
    and 6 is abandoned."""
    from asyncckpt.read.resolve import current_timeline
    from asyncckpt.storage.timeline import newest_live
    root = tmp_path / "ckpt"
    run(tmp_path, "first", 2, 2, "save", root, env={"MN_STEPS": "2,4,6"})
    old_four = manifest(root / "step-00000004")["created"]
    run(tmp_path, "again", 2, 2, "save", root, env={"MN_STEPS": "3,4", "MN_RESTORE": "2"})
    found = results(tmp_path, "again", 4)
    starts = {json.dumps(r["timeline"]) for r in found.values()}
    assert len(found) == 4 and len(starts) == 1, starts
    ident, at, based_on = json.loads(starts.pop())
    assert (at, based_on) == (2, 0)
    assert all(s["ok"] for r in found.values() for s in r["steps"].values())
    record = current_timeline(root)
    assert (record.id, record.gen, record.lineage) == (ident, 1, (("", 2),))
    assert [manifest(root / f"step-{s:08d}").get("timeline", {}).get("id", "")
            for s in (2, 3, 4, 6)] == ["", ident, ident, ""]
    assert manifest(root / "step-00000004")["created"] != old_four
    assert newest_live(PosixStorage(root)) == 4
    assert verify_exit(root).returncode == 0
