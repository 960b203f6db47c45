"""A coordinated step's commit across two writers of one root, in-process: the leader's
writer commits from the parts both nodes announced and tells its rank at once, doing no
file-system work a node (no rmdir of the other nodes' tmp directories on the commit's
path), and each node's writer removes its own emptied tmp directory once it hears that
the step committed; a crash between the two leaves a committed step and only an empty
tmp directory, which a writer that takes the root sweeps."""

from __future__ import annotations

import os
import threading

import pytest

from asyncckpt.errors import SaveFailedError
from asyncckpt.format.records import RankPart
from asyncckpt.ipc.messages import NodePart, NodeRanks
from asyncckpt.storage.location import read_manifest_at
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.writer.committer import sweep_dead
from asyncckpt.writer.nodes import NodeJoin
from asyncckpt.writer.owners import OwnerMark
from asyncckpt.writer.steps import Steps

STEP, WORLD, PER_NODE = 5, 4, 2


class Told:
    """What one party was told: (error, path) once, waited for."""

    def __init__(self) -> None:
        self.got: list[tuple] = []
        self.event = threading.Event()
        self.tmp_dirs_then: list[str] = []  # the root's tmp directories when it was told
        self.root = None

    def __call__(self, error, path, stats, **_):
        if self.root is not None:
            self.tmp_dirs_then = tmp_dirs(self.root)
        self.got.append((error, path))
        self.event.set()

    def wait(self) -> tuple:
        assert self.event.wait(10), "never told"
        return self.got[0]


def tmp_dirs(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if ".tmp-" in n)


def two_nodes(root, owners=(None, None)):
    """Two writers of one root (with their `owners` marks), each with its node's two
    ranks begun, ended and durable: (the writers, each node's announcement, each rank's
    Told)."""
    writers = [Steps(root, storage=PosixStorage(root), owner=owner) for owner in owners]
    announced: dict[int, NodePart] = {}
    told = {r: Told() for r in range(WORLD)}
    for n, steps in enumerate(writers):
        first = n * PER_NODE

        def durable(tmp, entry, first=first):
            announced[first] = NodePart(first, PER_NODE, tmp, entry)
        for rank in range(first, first + PER_NODE):
            steps.rank_joined(rank)
            current = steps.begin(STEP, rank, WORLD, told[rank],
                                  join=NodeJoin(NodeRanks(first, PER_NODE), durable))
        for rank in range(first, first + PER_NODE):
            name = f"node-{first:05d}/rank-{rank:05d}.safetensors"
            (current.tmp_dir / name).write_bytes(b"")
            steps.end(STEP, RankPart(rank, name, "raw", 0, 0, [], [], {"list": []}), {})
        assert first in announced
    return writers, (announced[0], announced[PER_NODE]), told


@pytest.fixture
def root(tmp_path):
    return tmp_path / "ckpt"


def test_the_leader_tells_before_any_node_tmp_is_removed_and_each_node_drops_its_own(root):
    root.mkdir()
    writers, nodes, told = two_nodes(root)
    leader, other = writers
    try:
        assert len(tmp_dirs(root)) == 2
        requester = Told()
        requester.root = root
        leader.commit_nodes(STEP, WORLD, nodes, requester)
        error, path = requester.wait()
        assert error is None and path.name == "step-00000005"
        # the other node's emptied tmp directory is still there when the leader's rank
        # hears: the leader removed nothing of the other nodes before telling
        assert requester.tmp_dirs_then == [nodes[1].tmp], requester.tmp_dirs_then
        manifest = read_manifest_at(path)  # the root lists both nodes' parts
        assert [(e.first, e.count) for e in manifest.parts] == [(0, 2), (2, 2)]
        # the other node's writer hears the outcome (from its lead): its ranks are told,
        # and its emptied tmp directory goes; nothing of the step is left in the root
        other.outcome(STEP, None, sender=PER_NODE)
        assert told[PER_NODE + 1].wait() == (None, path)
        assert tmp_dirs(root) == []
        leader.outcome(STEP, None, sender=0)  # the leader's own node: nothing left to drop
        assert told[1].wait() == (None, path) and tmp_dirs(root) == []
        assert sorted(os.listdir(path)) == ["manifest.json", "node-00000", "node-00002"]
    finally:
        for steps in writers:
            steps.close(timeout=1)


def test_a_node_that_hears_of_a_failure_discards_its_tmp_and_the_step_stays_invisible(root):
    root.mkdir()
    writers, nodes, told = two_nodes(root)
    try:
        error = SaveFailedError("failed elsewhere", step=STEP)
        writers[1].outcome(STEP, error, sender=PER_NODE)
        assert told[PER_NODE + 1].wait()[0] is error
        assert tmp_dirs(root) == [nodes[0].tmp]  # the leader's node's, for its own writer
        assert not (root / "step-00000005").exists()
    finally:
        for steps in writers:
            steps.close(timeout=1)


def test_a_node_writer_killed_before_it_drops_its_tmp_leaves_only_an_empty_dir_swept(root):
    """The kill at the new step: the step committed, the other node's writer dies before
    it hears the outcome (its emptied tmp directory not removed). The step is whole and
    listed; what is left is an empty tmp directory, never a checkpoint, which the sweep
    of dead writers' directories removes once that writer's lock is free."""
    root.mkdir()
    marks = (OwnerMark(root), OwnerMark(root))
    writers, nodes, told = two_nodes(root, marks)
    storage = PosixStorage(root)
    try:
        requester = Told()
        writers[0].commit_nodes(STEP, WORLD, nodes, requester)
        error, path = requester.wait()
        assert error is None and storage.committed_steps() == [STEP]
        left = root / nodes[1].tmp
        assert tmp_dirs(root) == [nodes[1].tmp] and os.listdir(left) == []
        sweep_dead(storage)  # its writer lives: its directory stays
        assert tmp_dirs(root) == [nodes[1].tmp]
        marks[1].release()  # the node's writer is killed (its lock goes with it)
        sweep_dead(storage)
        assert tmp_dirs(root) == [] and storage.committed_steps() == [STEP]
        assert storage.read_latest() == STEP
        assert [(e.first, e.count) for e in read_manifest_at(path).parts] == [(0, 2), (2, 2)]
    finally:
        for steps in writers:
            steps.close(timeout=1)
        marks[0].release()


class CountingChecks(PosixStorage):
    """A storage that counts the leader's checks of announced tmp directory names."""

    checks = 0

    def check_node_tmp(self, tmp, step, name):
        CountingChecks.checks += 1
        return super().check_node_tmp(tmp, step, name)


def test_the_leader_checks_a_shared_tmp_name_once_whatever_the_nodes(root):
    """Every node announces the save's one shared tmp directory: the leader checks that
    name once, not once a node (before: once a node, its Python per node at 1000 nodes),
    and the step it gathers is the same."""
    from asyncckpt.writer import commit, shared
    root.mkdir()
    writers, own, _ = two_nodes(root)
    try:
        storage = CountingChecks(root)
        name = shared.shared_name(STEP, 1, WORLD)
        nodes = tuple(NodePart(first, count, commit.place_node(storage, root / tmp, STEP, part,
                                                               name), part)
                      for first, count, tmp, part in own)
        assert {node[2] for node in nodes} == {name}
        CountingChecks.checks = 0
        tmp = commit.commit_dir(storage, root / nodes[0].tmp, nodes)
        entries = commit.gather_nodes(storage, tmp, STEP, WORLD, nodes)
        assert [(e.first, e.count) for e in entries] == [(0, PER_NODE), (PER_NODE, PER_NODE)]
        assert CountingChecks.checks == 1
        bad = (nodes[0], NodePart(PER_NODE, PER_NODE, "not-a-tmp", nodes[1][3]))
        with pytest.raises(SaveFailedError, match="not a tmp directory"):
            commit.gather_nodes(storage, tmp, STEP, WORLD, bad)
    finally:
        for steps in writers:
            steps.close(timeout=1)
