"""A several-node save's shared tmp directory (writer/shared.py), in-process: writers of
one root, each with its node's ranks begun, ended and durable, as their sessions do.

The leader's file-system work per commit does not grow with nodes (one listing and one
rename of one directory, whatever the count); the committed step is laid out as before;
and at each new step of the protocol a crash, a failure or a late node leaves either
the step whole or nothing, with every leftover swept, and never a sweep that reaches a
live save's directory."""

from __future__ import annotations

import collections
import os

import pytest
from test_nodes import Told, tmp_dirs  # the same party stand-in

from asyncckpt.errors import SaveFailedError
from asyncckpt.format.layout import is_tmp_dir, tmp_step_of
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import RankPart
from asyncckpt.ipc.messages import NodePart, NodeRanks
from asyncckpt.storage.location import read_manifest_at
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer import commit, shared
from asyncckpt.writer.committer import sweep_dead
from asyncckpt.writer.nodes import NodeJoin
from asyncckpt.writer.owners import OwnerMark
from asyncckpt.writer.steps import Steps

STEP, PER_NODE = 5, 2


class Job:
    """`nodes` writers of one root (each with an owner mark), the first the leader's.
    `begin(save)` begins save `save` of STEP on every node's ranks (node `n`'s begin
    names the shared directory of save `saves[n]` if given, none for None)."""

    def __init__(self, root, nodes: int) -> None:
        root.mkdir(exist_ok=True)
        self.root, self.count = root, nodes
        self.world = nodes * PER_NODE
        self.marks = [OwnerMark(root) for _ in range(nodes)]
        self.writers = [Steps(root, storage=PosixStorage(root), owner=mark)
                        for mark in self.marks]
        self.announced: dict[int, NodePart] = {}
        self.told = {r: Told() for r in range(self.world)}

    def begin(self, save: int, nodes=None, saves=None) -> None:
        for n in nodes if nodes is not None else range(self.count):
            steps, first = self.writers[n], n * PER_NODE
            name = None if saves is not None and saves[n] is None else shared.shared_name(
                STEP, save if saves is None else saves[n], self.world)

            def durable(tmp, entry, first=first):
                self.announced[first] = NodePart(first, PER_NODE, tmp, entry)
            for rank in range(first, first + PER_NODE):
                steps.rank_joined(rank)
                steps.begin(STEP, rank, self.world, self.told[rank],
                            join=NodeJoin(NodeRanks(first, PER_NODE), durable, name))

    def end(self, nodes=None) -> None:
        for n in nodes if nodes is not None else range(self.count):
            steps, first = self.writers[n], n * PER_NODE
            current = steps.open[STEP]
            for rank in range(first, first + PER_NODE):
                name = f"node-{first:05d}/rank-{rank:05d}.safetensors"
                (current.tmp_dir / name).write_bytes(bytes([rank]) * 3)
                steps.end(STEP, RankPart(rank, name, "raw", 0, 0, [], [], {"list": []}), {})

    def nodes(self) -> tuple[NodePart, ...]:
        return tuple(self.announced[n * PER_NODE] for n in range(self.count))

    def commit(self) -> tuple:
        requester = Told()
        self.writers[0].commit_nodes(STEP, self.world, self.nodes(), requester)
        return requester.wait()

    def close(self) -> None:
        for steps in self.writers:  # what a test left open fails at once
            steps.close(timeout=0)
        for mark in self.marks:
            mark.release()


@pytest.fixture
def job(tmp_path):
    made: list[Job] = []

    def make(nodes: int, root_name: str = "ckpt") -> Job:
        made.append(Job(tmp_path / root_name, nodes))
        return made[-1]
    yield make
    for j in made:
        j.close()


def assert_whole(root, nodes: int) -> None:
    """Step STEP committed, laid out as every several-node step is: the manifest and
    one folder a node holding each rank's part file and data file, bytes intact."""
    path = root / f"step-{STEP:08d}"
    folders = [f"node-{n * PER_NODE:05d}" for n in range(nodes)]
    assert sorted(os.listdir(path)) == ["manifest.json", *folders]
    manifest = read_manifest_at(path)
    assert [(e.first, e.count) for e in manifest.parts] == [
        (n * PER_NODE, PER_NODE) for n in range(nodes)]
    for n, folder in enumerate(folders):
        ranks = range(n * PER_NODE, (n + 1) * PER_NODE)
        assert sorted(os.listdir(path / folder)) == sorted(
            [f"rank-{r:05d}.json" for r in ranks] + [f"rank-{r:05d}.safetensors" for r in ranks])
        for r in ranks:
            assert (path / folder / f"rank-{r:05d}.safetensors").read_bytes() == bytes([r]) * 3


def test_the_shared_name_is_a_tmp_dir_of_the_step_and_differs_by_save():
    name = shared.shared_name(STEP, 3, 16)
    assert name == shared.shared_name(STEP, 3, 16) and is_tmp_dir(name)
    assert tmp_step_of(name) == STEP and shared.is_shared(name, STEP)
    assert not shared.is_shared(name, STEP + 1)
    assert len({shared.shared_name(STEP, s, w) for s in (1, 2) for w in (16, 32)}) == 4
    assert shared.shared_name(STEP + 1, 3, 16) != name
    assert not shared.is_shared(f"step-{STEP:08d}.tmp-1c2d3e4f9a0b7c6d")  # a writer's own


@pytest.mark.parametrize("nodes", [2, 12])
def test_the_leaders_commit_renames_and_lists_one_directory_whatever_the_nodes(job, nodes,
                                                                              monkeypatch):
    """Every node puts its folder into the save's shared directory itself; the leader's
    commit then makes the same few metadata calls at 2 nodes as at 12 (on the old
    protocol: one rename and one listing a node), and the step is laid out as before."""
    j = job(nodes)
    j.begin(1)
    j.end()
    names = {p.tmp for p in j.nodes()}
    assert names == {shared.shared_name(STEP, 1, j.world)}  # every node announced it
    calls: collections.Counter[str] = collections.Counter()
    for name in ("rename", "listdir", "scandir", "mkdir", "rmdir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, _name=name, **k: (
            calls.update([_name]), _real(*a, **k))[1])
    error, path = j.commit()
    with j.writers[0].lock:  # the committer's sweep after the word, too
        assert j.writers[0].idle.wait_for(lambda: STEP not in j.writers[0].committing, 10)
    monkeypatch.undo()
    assert error is None
    # the manifest's rename, the directory's, `latest`'s; listings: the shared directory
    # once, the root's once for `latest` and retention (a scandir) and once for the sweep,
    # as at one node (it was 3 of the root's: `latest`, retention's committed and retired)
    assert calls == {"rename": 3, "listdir": 2, "scandir": 1}, calls
    assert calls["mkdir"] == calls["rmdir"] == 0, calls
    assert_whole(j.root, nodes)
    for n in range(1, nodes):  # each node hears, drops its emptied own tmp dir
        j.writers[n].outcome(STEP, None, sender=n * PER_NODE)
        assert j.told[n * PER_NODE + 1].wait() == (None, path)
    j.writers[0].outcome(STEP, None, sender=0)
    assert tmp_dirs(j.root) == []


def test_a_node_whose_begin_names_another_directory_is_moved_in_by_the_leader(job):
    """Nodes need not agree: a node with no shared name (an older client) or another
    one (its ranks counted saves differently) is moved in, one rename for it."""
    j = job(3)
    j.begin(1, saves=[1, None, 7])
    j.end()
    assert j.nodes()[0].tmp == shared.shared_name(STEP, 1, j.world)
    assert j.nodes()[1].tmp != j.nodes()[0].tmp != j.nodes()[2].tmp
    assert j.commit()[0] is None
    assert_whole(j.root, 3)
    for n in range(3):
        j.writers[n].outcome(STEP, None, sender=n * PER_NODE)
    assert tmp_dirs(j.root) == []


def test_the_leader_commits_only_from_where_its_own_node_put_its_folder(job):
    """A store line claiming the leader's node announced another directory (a stale or
    planted key) is refused, and nothing is committed."""
    j = job(2)
    j.begin(1)
    j.end()
    other = shared.shared_name(STEP, 99, j.world)
    (j.root / other / "node-00000").mkdir(parents=True)
    nodes = (j.nodes()[0]._replace(tmp=other), j.nodes()[1])
    requester = Told()
    j.writers[0].commit_nodes(STEP, j.world, nodes, requester)
    error, _ = requester.wait()
    assert isinstance(error, SaveFailedError) and "put its part in" in str(error)
    assert not (j.root / f"step-{STEP:08d}").exists()


def test_a_node_killed_mid_write_leaves_the_step_invisible_and_everything_swept(job):
    """Node 1 dies before its part is durable (its folder still in its own tmp dir, not
    in the shared one); the save fails; the leader's writer drops the shared directory,
    and the dead writer's own tmp dir is swept by owner."""
    j = job(3)
    j.begin(1)
    j.end(nodes=[0, 2])
    shared_dir = shared.shared_name(STEP, 1, j.world)
    assert sorted(os.listdir(j.root / shared_dir)) == ["node-00000", "node-00004"]
    j.marks[1].release()  # node 1's writer is killed mid-write
    error = SaveFailedError("node 1 is silent", step=STEP)
    for n in (2, 0):
        j.writers[n].outcome(STEP, error, sender=n * PER_NODE)
    assert not (j.root / f"step-{STEP:08d}").exists()
    assert tmp_dirs(j.root) == []


def test_a_node_killed_after_placing_its_folder_and_the_leader_gone_too_is_swept(job):
    """Node 1 dies after its folder went into the shared directory (crash point
    `part_written`), the leader's writer dies too: the shared directory is left, and a
    sweep keeps it while a live writer still has the step under way (its own tmp dir),
    and removes it (renamed aside first) once none has."""
    j = job(3)
    j.begin(1)
    j.end()
    shared_dir = shared.shared_name(STEP, 1, j.world)
    storage = PosixStorage(j.root)
    j.marks[0].release()
    j.marks[1].release()
    sweep_dead(storage)  # node 2's writer still waits for the outcome: kept
    assert shared_dir in tmp_dirs(j.root)
    assert sorted(os.listdir(j.root / shared_dir)) == ["node-00000", "node-00002", "node-00004"]
    j.writers[2].outcome(STEP, SaveFailedError("the leader is silent", step=STEP),
                         sender=2 * PER_NODE)  # its own dir goes, then its sweep
    assert tmp_dirs(j.root) == [] and not (j.root / f"step-{STEP:08d}").exists()


def test_a_node_told_of_a_failure_never_pulls_its_folder_from_a_commit_under_way(job):
    """A node whose watch gave up on a slow leader hears a failure while the leader,
    alive, has claimed the commit: the node discards only its own (empty) tmp dir; the
    step the leader then commits is whole."""
    j = job(2)
    j.begin(1)
    j.end()
    j.writers[1].outcome(STEP, SaveFailedError("the leader's commit made no progress",
                                               step=STEP), sender=PER_NODE)
    assert j.commit()[0] is None
    assert_whole(j.root, 2)


def test_the_leader_killed_before_its_rename_leaves_no_step_and_its_leftovers_swept(job):
    """The leader's writer dies after the manifest is written into the shared directory,
    before the rename (crash point `manifest_written`): no step; once the other nodes hear
    the failure their sweeps remove the dead leader's tmp dir and the shared one."""
    j = job(2)
    j.begin(1)
    j.end()
    storage = PosixStorage(j.root)
    source = commit.commit_dir(storage, j.writers[0].open[STEP].tmp_dir, j.nodes())
    assert source.name == shared.shared_name(STEP, 1, j.world)
    commit.gather_nodes(storage, source, STEP, j.world, j.nodes())
    (source / "manifest.json").write_bytes(b"{}")  # as far as the manifest got
    j.marks[0].release()
    j.writers[1].outcome(STEP, SaveFailedError("the leader's writer is gone", step=STEP),
                         sender=PER_NODE)
    assert tmp_dirs(j.root) == [] and storage.committed_steps() == []


def test_the_leader_killed_after_its_rename_leaves_the_step_whole(job):
    """The leader's writer dies right after the rename (crash point `step_renamed`,
    `latest` not yet written): the step is committed and whole; the other node, told of a
    failure by its watch, removes nothing of it, and the sweep leaves it alone."""
    j = job(3)
    j.begin(1)
    j.end()
    storage = PosixStorage(j.root)
    source = commit.commit_dir(storage, j.writers[0].open[STEP].tmp_dir, j.nodes())
    entries = commit.gather_nodes(storage, source, STEP, j.world, j.nodes())
    storage.publish(source, STEP, Manifest(STEP, j.world, [], parts=entries).to_bytes())
    j.marks[0].release()
    for n in (1, 2):
        j.writers[n].outcome(STEP, SaveFailedError("may have landed", step=STEP),
                             sender=n * PER_NODE)
    sweep_dead(storage)
    assert_whole(j.root, 3)
    assert tmp_dirs(j.root) == []


def test_a_late_node_of_an_aborted_save_never_reaches_the_step(job):
    """Save 1 of the step is aborted while node 1 is paused; save 2 of the same step (the
    retry: a new save id, a new shared directory) commits; node 1 then wakes and puts
    its save-1 folder into save 1's directory (making it again): the step is untouched,
    and that directory is swept once no writer has the step under way."""
    j = job(2)
    j.begin(1)
    j.end(nodes=[0])  # node 1 paused before its part
    paused = j.writers[1].open[STEP]
    error = SaveFailedError("node 1 is silent", step=STEP)
    j.writers[0].outcome(STEP, error, sender=0)
    assert tmp_dirs(j.root) == [paused.tmp_dir.name]  # the leader dropped save 1's dir
    # node 1 wakes: its ranks end save 1, its folder goes into save 1's directory
    j.end(nodes=[1])
    first = shared.shared_name(STEP, 1, j.world)
    assert os.listdir(j.root / first) == ["node-00002"]
    j.writers[1].outcome(STEP, error, sender=PER_NODE)  # it hears the failure at last
    # the retry, save 2
    j.announced.clear()
    j.begin(2)
    j.end()
    assert {p.tmp for p in j.nodes()} == {shared.shared_name(STEP, 2, j.world)}
    assert j.commit()[0] is None
    assert_whole(j.root, 2)
    for n in range(2):
        j.writers[n].outcome(STEP, None, sender=n * PER_NODE)
    sweep_dead(PosixStorage(j.root))
    assert tmp_dirs(j.root) == []
    assert_whole(j.root, 2)


def test_a_taken_slot_fails_that_nodes_save_and_a_stale_folder_fails_the_commit(job):
    """An abandoned folder of the same name in the shared directory (only a collision of
    step, save id and world size makes one): a node whose slot it holds fails its save
    (a directory is never renamed over a non-empty one); one of a node that is not in
    the save fails the leader's one listing. Nothing is committed either way."""
    j = job(2)
    name = shared.shared_name(STEP, 1, j.world)
    (j.root / name / "node-00002").mkdir(parents=True)
    (j.root / name / "node-00002" / "stale").write_bytes(b"x")
    j.begin(1)
    j.end(nodes=[0])
    j.end(nodes=[1])
    error = j.told[PER_NODE + 1].wait()[0]
    assert isinstance(error, SaveFailedError) and "is taken" in str(error), error
    assert (j.root / name / "node-00002" / "stale").read_bytes() == b"x"
    k = job(2, "other")
    name = shared.shared_name(STEP, 1, k.world)
    (k.root / name / "node-00009").mkdir(parents=True)
    k.begin(1)
    k.end()
    error, _ = k.commit()
    assert isinstance(error, SaveFailedError) and "node-00009" in str(error), error
    assert not (k.root / f"step-{STEP:08d}").exists()


def test_a_job_restarted_after_its_saves_failed_reuses_the_name_and_commits(job):
    """Every node's step fails through the step table (its ranks gone: the job is
    restarted); the abandoned shared directory goes with the last node's failure, so the
    restarted job's first save, whose save id and so name are the same, commits."""
    j = job(2)
    j.begin(1)
    j.end()
    name = shared.shared_name(STEP, 1, j.world)
    assert sorted(os.listdir(j.root / name)) == ["node-00000", "node-00002"]
    for steps in j.writers:
        steps.fail(STEP, SaveFailedError("rank disconnected", step=STEP))
    assert tmp_dirs(j.root) == []
    k = job(2)  # the restarted job's writers on the same root
    k.begin(1)
    k.end()
    assert {p.tmp for p in k.nodes()} == {name}
    assert k.commit()[0] is None
    assert_whole(k.root, 2)
