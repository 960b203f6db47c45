"""The memory tier's crash points between two nodes: a node lost mid-replication, or after
its generation became whole but before its replica began.

Two in-process writers stand for nodes 0 (ranks 0, 1) and 1 (ranks 2, 3) of a 2 x 2
job; replicas go from node 1 to node 0 through `send_all` (the seam the transport plugs
into), so the test decides where node 1 dies. Node 1 lost, a replacement writer (started
with `replica_partner`, as a replacement node's is) takes back from node 0 what node 0
holds of node 1, and the ranks pick a generation with the restore's rule (the newest
that every rank's own writer holds it for). Nothing half-made may be picked: whatever
is picked must read back bit-exact as it was saved, on every rank.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter

from asyncckpt.errors import MemoryTierFullError
from asyncckpt.rank.client import Client
from asyncckpt.read import memory
from asyncckpt.storage.location import root_path
from asyncckpt.writer.memory_replica import ReplicaIn, offer, send_all
from asyncckpt.writer.memory_store import partner_replica
from asyncckpt.writer.memory_tier import MemoryTier

WAIT_S = 30.0
CHUNK = 4096
MAX_FRAME = 1 << 20


def _state(rank: int, step: int, run: int = 0) -> dict:
    """Rank `rank`'s state at `step` in run `run` (a rerun after a restore need not
    compute the same bytes: nondeterministic kernels, another data order)."""
    g = torch.Generator().manual_seed(1000 * step + rank + 10**6 * run)
    return {"w": torch.randn(300, 17, generator=g), "obj": {"rank": rank, "step": step}}


class Job:
    """Nodes 0 (writer a, listening for replicas) and 1 (writer b): 4 rank clients."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("ASYNCCKPT_JOB_SECRET", "cd" * 32)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        self.tmp = tmp_path
        self.a = InProcessWriter(tmp_path / "ckpt-a", codec="raw", export=False,
                                 replica_listen="127.0.0.1:0")
        self.b = InProcessWriter(tmp_path / "ckpt-b", codec="raw", export=False)
        self.clients = []
        for rank in range(4):
            monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
            self.clients.append(Client((self.a, self.b)[rank // 2].address, rank=rank,
                                       world_size=4, coordination="local",
                                       slot_size=1 << 16, ring_size=1 << 18))
        self.writers = [self.a, self.b]

    def save(self, step: int, ranks: range = range(4), run: int = 0) -> None:
        for h in [self.clients[r].save(step, _state(r, step, run), tier="memory")
                  for r in ranks]:
            h.wait(WAIT_S)

    def replicate_b(self, step: int, chunks: int | None = None) -> None:
        """Node 1's generation `step` to node 0: whole, or `chunks` chunks of it and then
        the connection lost (the sink aborted, as the transport does)."""
        doc, ranks = offer(self.b.server.memory, step)
        try:
            sink = ReplicaIn(self.a.server.memory, doc, MAX_FRAME, expect_step=step)
        except BaseException:
            for _, fd, _ in ranks:
                os.close(fd)
            raise
        if chunks is None:
            send_all((doc, ranks), CHUNK, sink)
            return
        rank, fd, start = ranks[0]
        for i in range(chunks):
            sink.data(rank, start + i * CHUNK, os.pread(fd, CHUNK, start + i * CHUNK))
        sink.abort()
        for _, fd, _ in ranks:
            os.close(fd)

    def lose_node_1(self, monkeypatch: pytest.MonkeyPatch | None = None) -> InProcessWriter:
        """Node 1 lost (its ranks and writer); its replacement writer, recovering from
        node 0, serves ranks 2 and 3 from now on (with `monkeypatch`: new rank clients
        connected to it)."""
        for c in self.clients[2:]:
            c.close()
        self.writers[1].stop()
        host, port = self.a.server.replicator.address
        self.lost = getattr(self, "lost", 0) + 1
        c = InProcessWriter(self.tmp / f"ckpt-c{self.lost}", codec="raw", export=False,
                            replica_partner=f"{host}:{port}")
        self.writers[1] = c
        if monkeypatch is not None:
            for rank in (2, 3):
                monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
                self.clients[rank] = Client(c.address, rank=rank, world_size=4,
                                            coordination="local", slot_size=1 << 16,
                                            ring_size=1 << 18)
        return c

    def restore_step(self) -> int | None:
        """The restore's rule (Checkpointer._restore_memory): the newest generation every
        rank's own writer holds that rank's image of (same world)."""
        usable = []
        for rank in range(4):
            held = memory.generations(self.writers[rank // 2].address)
            usable.append({g["step"] for g in held if g["world_size"] == 4
                           and rank in g["ranks"]})
        common = set.intersection(*usable)
        return max(common) if common else None

    def read(self, step: int) -> dict[int, dict]:
        """Every rank's state of `step`, each read from its own writer's images."""
        images = [memory.open_images(w.address, step, [2 * i, 2 * i + 1])
                  for i, w in enumerate(self.writers)]
        try:
            parts = {**images[0].parts, **images[1].parts}
            out = {}
            for rank in range(4):
                mine = images[rank // 2]
                root = root_path(self.writers[rank // 2].root)
                with memory.open_checkpoint(root, mine, parts) as ckpt:
                    out[rank] = memory.load(ckpt, rank, None)
            return out
        finally:
            for i in images:
                i.close()

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for w in {*self.writers, self.a, self.b}:
            w.stop()


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    j = Job(tmp_path, monkeypatch)
    try:
        yield j
    finally:
        j.close()


def _exact(job: Job, step: int) -> None:
    for rank, state in job.read(step).items():
        want = _state(rank, step)
        assert state["obj"] == want["obj"] and torch.equal(state["w"], want["w"]), rank


@pytest.mark.parametrize("replica_of_6", ["never began", "lost mid-way"])
def test_a_node_lost_before_its_newest_replica_is_whole_resumes_at_the_one_before(
        job: Job, replica_of_6: str) -> None:
    """Generation 6 is whole on both nodes, node 0 has sent its own, node 1 dies before
    its replica of 6 reached node 0 (none of it, or part): node 0 must still hold node
    1's replica of 5 and its own 5, so the job resumes at 5 from memory, bit-exact --
    never at the half-replicated 6."""
    job.save(5)
    job.replicate_b(5)
    job.save(6)
    if replica_of_6 == "lost mid-way":
        job.replicate_b(6, chunks=3)
    held = {g["step"]: g["ranks"] for g in memory.generations(job.a.address)}
    assert held.get(5) == [0, 1, 2, 3], held
    job.lose_node_1()
    assert job.restore_step() == 5
    _exact(job, 5)


def test_a_replacement_takes_back_every_generation_its_partner_holds(job: Job) -> None:
    """Node 1's replica of 6 reaches node 0 only after node 0's own 7 became whole (node
    1 slow): node 0 holds 5 (both nodes), node 1's 6, its own 7. The replacement must
    take back 5 as well as 6, or no generation is common to every rank."""
    job.save(5)
    job.replicate_b(5)
    job.save(6)
    job.save(7, range(2))  # node 0 goes on; node 1's ranks are slow
    job.replicate_b(6)
    job.lose_node_1()
    assert job.restore_step() == 5
    _exact(job, 5)


def test_a_whole_replica_after_a_crash_resumes_at_the_newest(job: Job) -> None:
    """Node 1's replica of 6 whole on node 0 before node 1 dies: the job resumes at 6,
    and node 0 no longer holds 5 (a newer generation holds both nodes)."""
    job.save(5)
    job.replicate_b(5)
    job.save(6)
    job.replicate_b(6)
    assert [g["step"] for g in memory.generations(job.a.address)] == [6]
    job.lose_node_1()
    assert job.restore_step() == 6
    _exact(job, 6)


def test_a_rerun_step_never_mixes_with_a_replica_of_the_abandoned_run(
        job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 holds node 1's replica of 6 (its own 6 gone: it went on to 7), node 1 is
    lost, the job resumes at 5 and saves 6 again -- other bytes (run 1). Node 1's
    replica of 6 belongs to the abandoned run: if node 0 kept it beside its new 6, a
    second loss of node 1 would restore 6 mixed from two runs."""
    job.save(5)
    job.replicate_b(5)
    job.save(6)
    job.save(7, range(2))
    job.replicate_b(6)
    job.lose_node_1(monkeypatch)
    assert job.restore_step() == 5
    job.save(6, run=1)  # resumed at 5: step 6 again, not the same bytes
    job.lose_node_1()  # its replica of the new 6 never left
    step = job.restore_step()
    assert step is not None
    states = job.read(step)
    runs = {run for rank, state in states.items() for run in (0, 1)
            if torch.equal(state["w"], _state(rank, step, run)["w"])}
    assert len(runs) == 1, f"step {step} restored from runs {runs}"


def _node_bytes(job: Job, step: int) -> dict[int, int]:
    """Each node's image bytes of `step` as its own writer holds them (the node's shard
    with its headers): {first rank: bytes}."""
    out = {}
    for first, w in ((0, job.a), (2, job.writers[1])):
        gen = w.server.memory._gens[step]
        out[first] = sum(gen.images[r].size for r in (first, first + 1))
    return out


def _partial_replica_b(job: Job, step: int, chunks: int) -> tuple[ReplicaIn, list, int]:
    """Node 1's replica of `step` begun on node 0 and left in flight after `chunks`
    chunks of its first rank: (sink, descriptors, next offset) to finish it later."""
    doc, ranks = offer(job.b.server.memory, step)
    sink = ReplicaIn(job.a.server.memory, doc, MAX_FRAME, expect_step=step)
    rank, fd, start = ranks[0]
    for i in range(chunks):
        sink.data(rank, start + i * CHUNK, os.pread(fd, CHUNK, start + i * CHUNK))
    return sink, ranks, start + chunks * CHUNK


def _finish_replica(sink: ReplicaIn, ranks: list, offset: int) -> None:
    """Send the rest of a `_partial_replica_b` and finish it."""
    for index, (rank, fd, start) in enumerate(ranks):
        size = os.fstat(fd).st_size
        for at in range(offset if index == 0 else start, size, CHUNK):
            sink.data(rank, at, os.pread(fd, min(CHUNK, size - at), at))
    sink.finish()
    for _, fd, _ in ranks:
        os.close(fd)


@pytest.mark.parametrize("then", ["replica finishes", "node 1 lost"])
def test_host_memory_stays_within_two_generations_of_each_node(job: Job, then: str) -> None:
    """Node 0 holds 5 (both nodes), its own 6, node 1's replica of 6 arriving; node 0's
    ranks go on to 7 before it is whole (node 1's replica slow). Holding 7 too would
    take node 0's writer to 5 x the node's shard (its 5 and 6 and 7, node 1's 5 and 6):
    the writer holds at most two generations of each node, so 7 is skipped (its
    handles done, `stats.tier` "skipped", nothing held) and the memory held, by the
    tier's own count and by the pages of its memfds, stays within 4 x. The crash
    guarantee holds at every point: node 1 lost mid-replication resumes at 5, a whole
    replica of 6 at 6, bit-exact."""
    tier = job.a.server.memory
    job.save(5)
    job.replicate_b(5)
    job.save(6)
    shards = _node_bytes(job, 6)
    bound = 2 * (shards[0] + shards[2])  # 4 x the node's shard: equal nodes
    pages = bound + 8 * mmap.PAGESIZE  # its 8 images' memfds, each rounded up to a page
    sink, ranks, offset = _partial_replica_b(job, 6, chunks=3)
    handles = [job.clients[r].save(7, _state(r, 7), tier="memory") for r in (0, 1)]
    for h in handles:
        h.wait(WAIT_S)
    assert [h.stats.tier for h in handles] == ["skipped", "skipped"]
    held = {g["step"]: g["ranks"] for g in memory.generations(job.a.address)}
    assert 7 not in held and held.get(5) == [0, 1, 2, 3], held
    assert tier.peak_bytes <= bound, (tier.peak_bytes, bound)
    assert tier.allocated_bytes() <= pages, (tier.allocated_bytes(), pages)
    if then == "node 1 lost":
        sink.abort()
        for _, fd, _ in ranks:
            os.close(fd)
        job.lose_node_1()
        assert job.restore_step() == 5
        _exact(job, 5)
        return
    _finish_replica(sink, ranks, offset)
    assert [g["step"] for g in memory.generations(job.a.address)] == [6]
    assert tier.peak_bytes <= bound, (tier.peak_bytes, bound)
    job.save(8)  # the next step is held again
    assert 8 in {g["step"] for g in memory.generations(job.a.address)}
    assert tier.peak_bytes <= bound and tier.allocated_bytes() <= pages
    job.lose_node_1()
    assert job.restore_step() == 6
    _exact(job, 6)


def test_a_replica_past_two_generations_of_its_node_is_refused(job: Job) -> None:
    """Node 0 holds node 1 at 5 (with its own 5) and node 1's replica of 6 is arriving
    when node 1's replica of 7 is offered (two senders, or a sender that gave up on 6):
    a third generation of node 1 would pass the bound, so 7 is refused before a byte
    is taken, and 6 arrives and counts as before. A replica of a step this node skipped
    is refused too (it could never be held for both nodes here)."""
    tier = job.a.server.memory
    job.save(5)
    job.replicate_b(5)
    job.save(6)
    bound = 2 * sum(_node_bytes(job, 6).values())
    sink, ranks, offset = _partial_replica_b(job, 6, chunks=2)
    job.save(7, range(2, 4))  # node 1 only: node 0 is slow
    with pytest.raises(MemoryTierFullError, match="node \\[2, 2\\] of step 7 not taken"):
        job.replicate_b(7)
    assert tier.peak_bytes <= bound, (tier.peak_bytes, bound)
    _finish_replica(sink, ranks, offset)
    assert [g["step"] for g in memory.generations(job.a.address)] == [6]
    job.lose_node_1()
    assert job.restore_step() == 6
    _exact(job, 6)


def test_a_replica_of_a_step_this_node_skipped_is_refused(job: Job) -> None:
    """Node 0 skipped 7 (node 1's replica of 6 was still arriving): node 1's replica of
    7, offered once 6 is whole, is refused -- node 0 can never hold 7 for both nodes."""
    job.save(5)
    job.replicate_b(5)
    job.save(6)
    sink, ranks, offset = _partial_replica_b(job, 6, chunks=1)
    job.save(7)
    _finish_replica(sink, ranks, offset)
    with pytest.raises(MemoryTierFullError, match="step 7 was skipped"):
        job.replicate_b(7)
    assert [g["step"] for g in memory.generations(job.a.address)] == [6]


def test_a_generation_being_sent_is_not_dropped_to_make_room(job: Job) -> None:
    """Node 0's own 6 is being sent to its partner (the sender holds descriptors of its
    sealed images) when its ranks begin 7: dropping 6 then would leave its memory held by
    the sender, outside the count, beside 5 and 7 -- so 7 is skipped. Once the send is
    over, 8 takes 6's place (6 was never held for both nodes)."""
    job.save(5)
    job.replicate_b(5)
    job.save(6, range(2))
    replica = partner_replica(job.a.server.memory, 6)
    try:
        handles = [job.clients[r].save(7, _state(r, 7), tier="memory") for r in (0, 1)]
        for h in handles:
            h.wait(WAIT_S)
        assert [h.stats.tier for h in handles] == ["skipped"] * 2
    finally:
        replica.release()
    job.save(8, range(2))
    assert [g["step"] for g in memory.generations(job.a.address)] == [5, 8]
    job.lose_node_1()
    assert job.restore_step() == 5
    _exact(job, 5)


def test_a_replacement_drops_what_it_took_back_once_the_job_reruns_below_it(
        job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1 lost after generation 6; its replacement takes back node 1's 6 from node
    0. The job resumes below it (at 4, say: the restore fell back) and saves 5 again:
    the 6 taken back belongs to the abandoned run. Kept, it would meet node 0's rerun
    of 6 arriving as a replica -- a generation of two runs, listed whole -- and, whole,
    supersede the rerun's 5 while node 1's ranks still save it (their save failed, the
    job restarted without end: found by `make torture-memory`)."""
    job.save(5)
    job.replicate_b(5)
    job.save(6)
    job.replicate_b(6)
    c = job.lose_node_1(monkeypatch)
    assert 6 in {g["step"] for g in memory.generations(c.address)}
    job.save(5, run=1)
    assert [g["step"] for g in memory.generations(c.address) if g["step"] > 5] == []
    job.save(6, run=1, ranks=range(2))  # node 0's rerun of 6, sent to node 1's writer
    doc, ranks = offer(job.a.server.memory, 6)
    send_all((doc, ranks), CHUNK, ReplicaIn(c.server.memory, doc, MAX_FRAME,
                                            expect_step=6))
    for g in memory.generations(c.address):
        assert not (g["step"] == 6 and 2 in g["ranks"]), g


def _inodes(tier: MemoryTier) -> set[int]:
    """The memfds (inodes) a writer's tier holds: its generations, spares, fetched and
    leaving images -- whatever of them this version has."""
    gens = [*tier._gens.values(), *tier._fetched.values(), *getattr(tier, "_leaving", [])]
    images = [i for g in gens for i in g.images.values()] + list(tier._spare)
    return {os.fstat(i.fd).st_ino for i in images if i.fd >= 0}


def _memfds() -> dict[int, int]:
    """{inode: bytes of its pages} of every image memfd open in this process."""
    seen: dict[int, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        path = f"/proc/self/fd/{fd}"
        try:
            if os.readlink(path).startswith("/memfd:asyncckpt-mem-"):
                st = os.stat(path)
                seen[st.st_ino] = st.st_blocks * 512
        except OSError:
            continue
    return seen


def _node_0_pages(job: Job, before: set[int]) -> int:
    """The pages of every image memfd open in this process but node 1's writer's and
    those open `before` the test: node 0's writer's images, by its tier or by its
    sender's descriptors, each inode once -- what `make bench-memory-tier` counts in
    /proc/PID/fd."""
    other = _inodes(job.b.server.memory) | before
    return sum(b for ino, b in _memfds().items() if ino not in other)


def test_a_generation_superseded_while_being_sent_still_counts(job: Job) -> None:
    """Node 0's own 5 is being sent to its partner (slow link) when node 1's replica of
    6 makes 6 whole there: 5 is superseded, but the sender's descriptors keep its pages
    alive. Counted as gone, it let node 0 take its own 7 and node 1's 7 as well: its 5
    (in the sender), 6 (its own and node 1's, kept to refill) and 7 (both), 5 x the
    node's shard. The memfd pages node 0's writer holds -- the tier's and the sender's
    -- stay within 4 x at every point, and the crash guarantee holds: node 1 lost
    afterwards resumes at 6 from memory, bit-exact."""
    before = set(_memfds())  # another test's, still open in this process
    job.save(5)
    job.replicate_b(5)
    replica = partner_replica(job.a.server.memory, 5)  # node 0's 5 on its way, slowly
    peak = 0
    try:
        job.save(6)
        shards = _node_bytes(job, 6)
        bound = 2 * (shards[0] + shards[2]) + 8 * mmap.PAGESIZE  # 4 x, 8 images' pages
        peak = max(peak, _node_0_pages(job, before))
        job.replicate_b(6)  # 6 whole for both nodes on node 0: 5 is superseded
        peak = max(peak, _node_0_pages(job, before))
        job.save(7)
        peak = max(peak, _node_0_pages(job, before))
        doc, ranks = offer(job.b.server.memory, 7)
        try:
            sink = ReplicaIn(job.a.server.memory, doc, MAX_FRAME, expect_step=7)
        except MemoryTierFullError:  # node 0 skipped its own 7: never whole here
            for _, fd, _ in ranks:
                os.close(fd)
        else:
            send_all((doc, ranks), CHUNK, sink)
        peak = max(peak, _node_0_pages(job, before))
        assert peak <= bound, f"{peak / bound * 4:.2f} x the node's shard"
        assert 6 in {g["step"] for g in memory.generations(job.a.address)
                     if g["ranks"] == [0, 1, 2, 3]}
    finally:
        replica.release()
    job.save(8)  # the send over, the next step is held again
    assert 8 in {g["step"] for g in memory.generations(job.a.address)}
    assert _node_0_pages(job, before) <= bound
    job.lose_node_1()
    assert job.restore_step() == 6
    _exact(job, 6)


def test_a_send_of_the_own_node_holds_no_partner_replica_of_a_superseded_step(
        job: Job) -> None:
    """R3-6 (fixed, b50e04f): a generation superseded mid-send kept every sealed image, the
    partner's replica images too. Node 1's replica of 5 held here was read once (a restore
    opened it: its images sealed). Node 0's own 5 on its way to its partner (slow link);
    node 1's replica of 6 makes 6 whole there: 5 superseded. The sender holds node 0's
    images of 5 (ranks 0, 1), not node 1's replica of 5 (ranks 2, 3): those can go, and node
    1's replica of 7 -- 5 (sending, node 0's), 6 (both nodes), 7 (node 1's): 2 x each node
    -- is taken."""
    tier = job.a.server.memory
    job.save(5)
    job.replicate_b(5)
    memory.open_images(job.a.address, 5, [2, 3]).close()  # read once (a restore's open)
    replica = partner_replica(tier, 5)  # node 0's own images of 5 (ranks 0, 1) out
    try:
        job.save(6)
        job.replicate_b(6)  # 6 whole for both nodes here: 5 superseded mid-send
        kept = sorted(r for g in tier._leaving for r in g.images)
        job.save(7, ranks=range(2, 4))  # node 1's 7 (node 0's ranks do not save it yet)
        try:
            job.replicate_b(7)
            taken = None
        except MemoryTierFullError as e:
            taken = str(e)
        assert kept == [0, 1] and taken is None, (kept, taken)
    finally:
        replica.release()
