"""Several nodes in one process: two writers on one root, four clients coordinating each
commit through a TCPStore (the store torchrun runs), as two nodes of two ranks would."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import assert_same
from torch.distributed import TCPStore

import asyncckpt
from asyncckpt.storage.local import read_manifest
from asyncckpt.storage.posix import PosixStorage

WORLD, PER_NODE = 4, 2


def state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"w": torch.randn(3000 + rank, generator=g), "opt": {0: torch.randn(17, generator=g)},
            "rank": rank, "step": step}


@contextlib.contextmanager
def nodes(tmp_path: Path, roots: list[Path] | None = None, crash_at: str | None = None,
          job: str = "job-a", leader_env: dict[str, str] | None = None,
          **knobs) -> Iterator[list[asyncckpt.WriterProcess]]:
    """Two writers (nodes) of one job, each with its own runtime dir; `crash_at` and
    `leader_env` arm the leader's (node 0's) writer."""
    roots = roots or [tmp_path / "ckpt"] * 2
    writers = []
    try:
        for node, root in enumerate(roots):
            env = {"ASYNCCKPT_RUNTIME_DIR": str(tmp_path / f"rt{node}{root.name}")}
            if node == 0:
                env.update(leader_env or {})
            if crash_at and node == 0:
                env["ASYNCCKPT_CRASH_AT"] = crash_at
            with _env(env):
                writers.append(asyncckpt.start_writer(root, codec="zstd", job=job,
                                                      log_file=tmp_path / f"w{node}.log", **knobs))
        yield writers
    finally:
        for w in writers:
            w.stop(timeout=30)


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(name="store")
def store_fixture() -> Iterator[TCPStore]:
    """The job's store, served by the test process as rank 0 serves it (other test
    modules take it by import: `from test_coordination import store_fixture`)."""
    yield TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@contextlib.contextmanager
def ranks(writers, store, node_timeout: float = 20, stores: dict | None = None,
          env: list[dict[str, str]] | None = None) -> Iterator[list[asyncckpt.Client]]:
    """WORLD clients, PER_NODE on each writer, each with its own store client (or the
    one `stores` gives for its rank), node n's made under `env[n]` too if given (the
    variables torchrun's agent of that node sets)."""
    clients = []
    for r in range(WORLD):
        with _env({"LOCAL_RANK": str(r % PER_NODE), "LOCAL_WORLD_SIZE": str(PER_NODE),
                   **(env[r // PER_NODE] if env else {})}):
            clients.append(asyncckpt.connect(
                writers[r // PER_NODE].address, rank=r, world_size=WORLD,
                store=(stores or {}).get(r) or TCPStore("127.0.0.1", store.port, is_master=False),
                node_timeout=node_timeout, slot_size=4096, ring_size=16384))
    try:
        yield clients
    finally:
        for c in clients:
            c.close(timeout=30)


def save_and_commit(clients, root: Path, steps) -> None:
    """Every client saves each of `steps`; each must commit in `root`."""
    for step in steps:
        done = outcomes([c.save(step, state(c.rank, step)) for c in clients])
        assert done == [root / f"step-{step:08d}"] * WORLD, done


def assert_holds(root: Path, step: int) -> None:
    """`root` verifies and its newest step is every rank's state of `step`."""
    assert asyncckpt.verify(root).ok
    for r in range(WORLD):
        assert_same(state(r, step), asyncckpt.load(root, rank=r))


def wait_until(condition, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def outcomes(handles) -> list:
    out = []
    for h in handles:
        try:
            out.append(h.wait(60))
        except asyncckpt.CheckpointError as e:
            out.append(e)
    return out


def test_two_nodes_commit_one_checkpoint_whose_parts_equal_a_single_node_ones(tmp_path, store):
    root = tmp_path / "ckpt"
    with nodes(tmp_path) as writers, ranks(writers, store) as clients:
        save_and_commit(clients, root, (1, 2))
    assert_holds(root, 2)
    step = root / "step-00000002"
    assert sorted(os.listdir(step)) == ["manifest.json", "node-00000", "node-00002"]
    for first in (0, 2):
        assert sorted(os.listdir(step / f"node-{first:05d}")) == sorted(
            [f"rank-{r:05d}.json" for r in (first, first + 1)]
            + [f"rank-{r:05d}.safetensors.zst" for r in (first, first + 1)])
    assert [p.name for p in root.iterdir() if ".tmp-" in p.name] == []
    # the root lists the parts, not the ranks' tables
    root_doc = json.loads((step / "manifest.json").read_bytes())["manifest"]
    assert root_doc["format_version"] == 3 and "ranks" not in root_doc
    assert [(p["dir"], p["first"], p["count"]) for p in root_doc["parts"]] == [
        ("node-00000", 0, 2), ("node-00002", 2, 2)]
    # the same world on one node writes the same ranks' tables (their files at the top)
    single = tmp_path / "single"
    with asyncckpt.start_writer(single, codec="zstd") as w:
        one = [asyncckpt.connect(w.address, rank=r, world_size=WORLD, slot_size=4096,
                                 ring_size=16384) for r in range(WORLD)]
        outcomes([c.save(2, state(c.rank, 2)) for c in one])
        for c in one:
            c.close()
    multi, solo = read_manifest(step), read_manifest(single / "step-00000002")
    for m, s in zip(multi.ranks, solo.ranks):
        assert m.file == f"node-{m.rank // PER_NODE * PER_NODE:05d}/{s.file}"
        assert {**m.to_json(), "file": s.file} == s.to_json()
    for r in range(WORLD):
        assert (step / multi.ranks[r].file).read_bytes() == \
            (single / "step-00000002" / solo.ranks[r].file).read_bytes()


def test_a_node_on_another_root_fails_the_first_save_everywhere_naming_both(tmp_path, store):
    other = tmp_path / "node-local"
    with nodes(tmp_path, [tmp_path / "ckpt", other]) as writers, ranks(writers, store) as clients:
        started = time.monotonic()
        done = outcomes([c.save(1, state(c.rank, 1)) for c in clients])
        assert time.monotonic() - started < 10  # not the node timeout (20 s)
    assert all(isinstance(e, asyncckpt.SaveFailedError) for e in done), done
    message = str(done[1])
    assert str(other) in message and str(tmp_path / "ckpt") in message and "rank 2" in message
    assert PosixStorage(tmp_path / "ckpt").committed_steps() == [] \
        == PosixStorage(other).committed_steps()
    # each writer discards its files when told the outcome; one stopped before its ranks
    # told it leaves a tmp directory, which the next writer to take the root sweeps
    for root in (tmp_path / "ckpt", other):
        with asyncckpt.start_writer(root, log_file=tmp_path / "again.log"):
            assert not [p for p in root.iterdir() if ".tmp-" in p.name]


def test_a_rank_that_never_saves_fails_the_step_on_every_node_after_the_timeout(tmp_path, store):
    """Rank 3 lives (its node's lead beats) but skips the save: its writer fails the step
    after absent_rank_timeout, and every node hears of it."""
    root = tmp_path / "ckpt"
    with nodes(tmp_path, absent_rank_timeout=2) as writers, \
            ranks(writers, store, node_timeout=2) as clients:
        assert outcomes([c.save(1, state(c.rank, 1)) for c in clients])[0] == root / "step-00000001"
        started = time.monotonic()
        done = outcomes([c.save(2, state(c.rank, 2)) for c in clients[:3]])  # rank 3 hangs
        assert 1.5 < time.monotonic() - started < 15
        assert all("rank 3 of this node did not begin the step" in str(e) for e in done), done
    assert PosixStorage(root).committed_steps() == [1] and PosixStorage(root).read_latest() == 1
    assert asyncckpt.verify(root).ok


def test_a_local_failure_on_one_node_fails_every_rank_at_once(tmp_path, store):
    root = tmp_path / "ckpt"
    with nodes(tmp_path) as writers, ranks(writers, store) as clients:
        bad = state(3, 1)
        bad["w"] = torch.randn(200_000)  # rank 3 tears its tensor while it is staged
        handles = [c.save(1, state(c.rank, 1)) for c in clients[:3]]
        h3 = clients[3].save(1, bad)
        bad["w"].add_(1)
        started = time.monotonic()
        done = outcomes(handles + [h3])
        if all(isinstance(p, Path) for p in done):
            pytest.skip("staging won the race against the in-place change")
        assert time.monotonic() - started < 10
        assert all(isinstance(e, asyncckpt.SaveFailedError) for e in done), done
        # the next step commits
        assert outcomes([c.save(2, state(c.rank, 2)) for c in clients]) \
            == [root / "step-00000002"] * 4
    assert PosixStorage(root).committed_steps() == [2]
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]


def test_the_leader_writer_killed_before_the_rename_leaves_nothing_visible(tmp_path, store):
    root = tmp_path / "ckpt"
    with nodes(tmp_path, crash_at="parts_gathered:2") as writers, ranks(writers, store) as clients:
        assert outcomes([c.save(1, state(c.rank, 1)) for c in clients])[0] == root / "step-00000001"
        started = time.monotonic()
        done = outcomes([c.save(2, state(c.rank, 2)) for c in clients])
        assert time.monotonic() - started < 10
        assert all(isinstance(e, asyncckpt.CheckpointError) for e in done), done
        writers[0]._proc.wait(10)  # killed at its crash point; reaped shortly
        # the writer that lives sweeps what the dead one left, once its ranks tell it (30 s:
        # 10 s ran out once beside other work on 2 busy cores; alone it takes under 1 s)
        assert wait_until(lambda: not [p for p in root.iterdir() if ".tmp-" in p.name], 30)
    assert PosixStorage(root).committed_steps() == [1] and asyncckpt.verify(root).ok
    with nodes(tmp_path) as writers:  # a restarted job
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        with ranks(writers, store) as clients:
            assert outcomes([c.save(3, state(c.rank, 3)) for c in clients])[0] \
                == root / "step-00000003"
    assert PosixStorage(root).committed_steps() == [1, 3]


def test_writers_of_another_job_and_gc_are_refused_while_a_job_holds_the_root(tmp_path):
    root = tmp_path / "ckpt"
    with nodes(tmp_path):
        with pytest.raises(asyncckpt.WriterLockedError):
            asyncckpt.start_writer(root, job="job-b", log_file=tmp_path / "b.log")
        with pytest.raises(asyncckpt.WriterLockedError):
            asyncckpt.start_writer(root, log_file=tmp_path / "c.log")  # no job: exclusive
        from asyncckpt.cli import main
        assert main(["gc", str(root), "--keep-last", "1"]) == 3
    with asyncckpt.start_writer(root, job="job-b", log_file=tmp_path / "b.log"):
        pass  # once the job is gone, another may take the root


def test_the_store_does_not_grow_with_the_saves(tmp_path, store):
    root = tmp_path / "ckpt"
    with nodes(tmp_path) as writers, ranks(writers, store) as clients:
        outcomes([c.save(1, state(c.rank, 1)) for c in clients])
        after_one = stored(store)
        for step in range(2, 7):
            assert outcomes([c.save(step, state(c.rank, step)) for c in clients]) == \
                [root / f"step-{step:08d}"] * WORLD
        # every save's keys go once every node announced the next one (at most one more
        # key: the leader's heartbeat may tick the newest save's wake as it is claimed)
        assert stored(store) <= after_one + 1


def stored(store: TCPStore) -> int:
    """The keys in `store`, but the heartbeats' (the nodes append to it, the leader
    reads and deletes it: it comes and goes whatever the saves)."""
    beats = sum(store.check([f"asyncckpt/0/c{k}/beats"]) for k in range(2))
    return store.num_keys() - beats


def test_outcomes_a_stale_store_holds_are_never_believed(tmp_path, store):
    """A persistent or reused store keeps the keys of earlier runs: outcomes under every
    name an earlier run could have used, a stale hello and its answer."""
    root = tmp_path / "ckpt"
    lie = json.dumps({"ok": True, "path": str(tmp_path / "nowhere")})
    for key in ("asyncckpt/0/1.1/outcome", "asyncckpt/0/c0/welcome/feed",
                "asyncckpt/stale/1.1/outcome", "asyncckpt/stale/1.1/final"):
        store.set(key, lie if "outcome" in key or "final" in key else "stale")
    for rank in range(1, WORLD):
        store.set(f"asyncckpt/0/c0/hello/{rank}", "feed")
    with nodes(tmp_path) as writers, ranks(writers, store) as clients:
        save_and_commit(clients, root, (1, 2))
    assert_holds(root, 2)


def test_two_roots_in_one_job_commit_independently(tmp_path, store):
    """An actor and a critic (or a model and its EMA): two roots, each with a writer per
    node, every rank a client of both, saving at the same time through one store."""
    actor, critic = tmp_path / "actor", tmp_path / "critic"
    with nodes(tmp_path, [actor, actor], job="a") as a, \
            nodes(tmp_path, [critic, critic], job="c") as c:
        with ranks(a, store) as actors, ranks(c, store) as critics:
            for step in (1, 2):
                handles = [x.save(step, state(x.rank, step)) for x in actors] + \
                          [x.save(step, state(x.rank, 100 + step)) for x in critics]
                assert outcomes(handles) == [actor / f"step-{step:08d}"] * WORLD + \
                                            [critic / f"step-{step:08d}"] * WORLD
    for root, seed in ((actor, 2), (critic, 102)):
        assert asyncckpt.verify(root).ok
        for r in range(WORLD):
            assert_same(state(r, seed), asyncckpt.load(root, rank=r))


def test_a_leader_whose_commit_outlasts_the_others_patience_is_not_contradicted(tmp_path, store):
    """The leader's writer takes 3.5 s to gather the parts (a shared file system under a
    large world), longer than the others wait for an outcome (2 x node_timeout = 2 s):
    every rank still reports what happened on disk, a committed step."""
    root = tmp_path / "ckpt"
    with nodes(tmp_path, leader_env={"ASYNCCKPT_SLOW_AT": "parts_gathered:3.5"}) as writers, \
            ranks(writers, store, node_timeout=1) as clients:
        done = outcomes([c.save(1, state(c.rank, 1)) for c in clients])
        assert done == [root / "step-00000001"] * WORLD, done
    assert PosixStorage(root).committed_steps() == [1] and asyncckpt.verify(root).ok


@pytest.mark.parametrize("node", [0, 1])
def test_a_failed_step_leaves_no_key_in_the_store_and_nothing_in_the_root(tmp_path, store, node):
    """A node's writer is killed in the middle of a save (the leader's or the other's):
    every handle fails, and the store and the root are as clean as after a commit."""
    root = tmp_path / "ckpt"
    with nodes(tmp_path) as writers, ranks(writers, store, node_timeout=5) as clients:
        assert outcomes([c.save(1, state(c.rank, 1)) for c in clients])[0] == root / "step-00000001"
        time.sleep(0.5)  # the last rank done with the save deletes its keys
        clean = stored(store)
        big = {"w": torch.randn(4_000_000)}
        handles = [c.save(2, big if c.rank // PER_NODE == node else state(c.rank, 2))
                   for c in clients]
        assert wait_until(lambda: any(".tmp-" in p.name for p in root.iterdir()))
        writers[node]._proc.kill()
        done = outcomes(handles)
        assert all(isinstance(e, asyncckpt.CheckpointError) for e in done), done
        # the save's keys are gone once every node is done with it
        assert wait_until(lambda: stored(store) <= clean), (stored(store), clean)
        if node == 1:  # the leader's writer lives: it sweeps what the dead one left
            assert wait_until(lambda: not [p for p in root.iterdir() if ".tmp-" in p.name])
    assert PosixStorage(root).committed_steps() == [1] and asyncckpt.verify(root).ok



def test_a_node_that_starts_its_save_late_is_waited_for_while_it_beats(tmp_path, store):
    """node_timeout bounds a node's silence, not its slowness: node 1 begins the save
    two and a half node_timeouts after node 0 and the step still commits."""
    root = tmp_path / "ckpt"
    with nodes(tmp_path) as writers, ranks(writers, store, node_timeout=2) as clients:
        save_and_commit(clients, root, (1,))
        early = [c.save(2, state(c.rank, 2)) for c in clients[:PER_NODE]]
        time.sleep(5)
        late = [c.save(2, state(c.rank, 2)) for c in clients[PER_NODE:]]
        assert outcomes(early + late) == [root / "step-00000002"] * WORLD
    assert_holds(root, 2)


class SlowReader:
    """A store client whose reads of a save's outcome come `delay` seconds late (a node
    descheduled between the store's wake-up and its read)."""

    def __init__(self, store: TCPStore, delay: float) -> None:
        self._store, self._delay = store, delay

    def _late(self, key: str) -> None:
        if key.endswith("/final"):
            time.sleep(self._delay)

    def get(self, key: str):
        self._late(key)
        return self._store.get(key)

    def compare_set(self, key: str, expected, desired):
        self._late(key)
        return self._store.compare_set(key, expected, desired)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def test_a_leader_that_leaves_after_a_failed_commit_keeps_the_outcome_until_all_read_it(
        tmp_path, store):
    """The leader's writer dies in its commit; the leader publishes the failure and its
    process closes its client at once, while node 1's lead is slow to read the outcome.
    The leader's node must count as done with the save once (it once counted at the
    failure and again at close, deleted the keys, and node 1 then waited out the store's
    timeout in a `get` of the deleted outcome)."""
    root = tmp_path / "ckpt"
    slow = SlowReader(TCPStore("127.0.0.1", store.port, is_master=False), delay=1.5)
    with nodes(tmp_path, crash_at="parts_gathered:1") as writers, \
            ranks(writers, store, node_timeout=5, stores={PER_NODE: slow}) as clients:
        handles = [c.save(1, state(c.rank, 1)) for c in clients]
        leaders = outcomes(handles[:PER_NODE])
        assert all(isinstance(e, asyncckpt.CheckpointError) for e in leaders), leaders
        started = time.monotonic()
        for c in clients[:PER_NODE]:
            c.close(timeout=30)
        others = outcomes(handles[PER_NODE:])
        assert time.monotonic() - started < 10
        assert all(isinstance(e, asyncckpt.CheckpointError) for e in others), others
        assert not any("deleted" in str(e) for e in others), others
        # node 1 counted last: the save's keys are gone
        prefix = f"asyncckpt/{clients[0]._agreement.coordinator.session}/1.1"
        assert wait_until(lambda: not store.check([f"{prefix}/final"]))
    assert PosixStorage(root).committed_steps() == []



def test_a_node_waiting_on_a_silent_leader_fails_without_store_wait_timeouts(
        tmp_path, store, capfd):
    """The leader claimed the commit, then went silent (its heartbeat stopped) while its
    writer takes 6 s to gather. Node 1's heartbeat thread notices the silence after
    2 x node_timeout and publishes that the step may have landed; node 1's wait for the
    outcome never timed out in the store (each timed-out wait prints c10d warnings). The
    leader lives, and its commit lands: its own handle says so."""
    root = tmp_path / "ckpt"
    with nodes(tmp_path, leader_env={"ASYNCCKPT_SLOW_AT": "parts_gathered:6"}) as writers, \
            ranks(writers, store, node_timeout=1) as clients:
        handles = [c.save(1, state(c.rank, 1)) for c in clients]
        claim = f"asyncckpt/{clients[0]._agreement.coordinator.session}/1.1/outcome"
        assert wait_until(lambda: store.check([claim]))  # the leader claimed the commit
        clients[0]._agreement._stop.set()  # its heartbeat stops: silent from now on
        started = time.monotonic()
        others = outcomes(handles[PER_NODE:])
        assert time.monotonic() - started < 5, others
        assert all(isinstance(e, asyncckpt.CheckpointError) and "may have landed" in str(e)
                   for e in others), others
        assert outcomes(handles[:PER_NODE]) == [root / "step-00000001"] * PER_NODE
    assert PosixStorage(root).committed_steps() == [1] and asyncckpt.verify(root).ok
    assert "waitForInput" not in capfd.readouterr().err
