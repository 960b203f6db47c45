"""The memory tier (writer/memory_tier.py, read/memory.py, Checkpointer memory_interval).

A memory save is held by the node's writer, never written to the root; it is read back
verified, it bounds its memory, and a restore takes the newest generation across the
memory and durable tiers, falling back to the durable one when the memory copy is gone
or unusable. The writer runs in process (tests/inprocess.py): these are about what the
writer holds and hands back, not about processes.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter
from memory_ring import read_image

from asyncckpt import Checkpointer, CheckpointerOptions
from asyncckpt.errors import CorruptCheckpointError, MemoryTierFullError, SaveFailedError
from asyncckpt.ipc.options import SaveOptions
from asyncckpt.rank.client import Client
from asyncckpt.read import memory
from asyncckpt.storage.location import root_path

WAIT_S = 30.0


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(257, 33, generator=g), "b": torch.arange(50, dtype=torch.int64),
            "obj": {"rank": rank, "step": step}}


def _same(a: dict, b: dict) -> None:
    assert a["obj"] == b["obj"]
    for key in ("w", "b"):
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_memory_save_is_held_not_written(tmp_path: Path) -> None:
    """Two ranks' memory save of step 3: done with tier "memory", nothing in the root,
    each rank's state read back bit-exact from the writer's memory."""
    with InProcessWriter(tmp_path / "ckpt", codec="raw") as w:
        clients = [Client(w.address, rank=r, world_size=2) for r in range(2)]
        try:
            handles = [c.save(3, _state(r, 3), tier="memory") for r, c in enumerate(clients)]
            for h in handles:
                h.wait(WAIT_S)
                assert h.stats.tier == "memory" and h.stats.stored_bytes == 0
            assert not any(p.name.startswith("step-") for p in w.root.iterdir())
            [gen] = memory.generations(w.address)
            assert (gen["step"], gen["world_size"], gen["ranks"], gen["whole"]) == (3, 2, [0, 1],
                                                                                  True)
            for r in range(2):
                _same(read_image(w, 3, r), _state(r, 3))
        finally:
            for c in clients:
                c.close()


def test_newest_whole_generation_drops_the_older(tmp_path: Path) -> None:
    """Held: the newest whole generation (and one in flight); a newer whole one drops
    the older (its images kept to be refilled), so memory is two generations."""
    with InProcessWriter(tmp_path / "ckpt", codec="raw") as w, \
            Client(w.address, rank=0, world_size=1) as c:
        for step in (1, 2, 3):
            c.save(step, _state(0, step), tier="memory").wait(WAIT_S)
        assert [g["step"] for g in memory.generations(w.address)] == [3]
        _same(read_image(w, 3, 0), _state(0, 3))
        # the newest whole one, and the older one's images kept to refill: 2 generations
        assert w.server.memory.held_bytes == 2 * memory.generations(w.address)[0]["bytes"]


def test_over_the_bound_is_refused_and_the_held_one_survives(tmp_path: Path) -> None:
    """A memory save past memory_max_bytes fails with MemoryTierFullError naming the
    knob; the generation held before stays whole and readable."""
    small = {"w": torch.zeros(1000)}
    with InProcessWriter(tmp_path / "ckpt", codec="raw", memory_max_bytes=3 * 4096) as w, \
            Client(w.address, rank=0, world_size=1) as c:
        c.save(1, small, tier="memory").wait(WAIT_S)
        handle = c.save(2, {"w": torch.zeros(100_000)}, tier="memory")
        with pytest.raises(MemoryTierFullError, match="memory_max_bytes"):
            handle.wait(WAIT_S)
        assert [g["step"] for g in memory.generations(w.address)] == [1]


def test_a_rank_cannot_change_an_image_it_is_handed(tmp_path: Path) -> None:
    """The descriptor handed to a reader is of a sealed memfd: reopened for writing, a
    write is refused (EPERM), so a rank cannot alter another restore's bytes."""
    with InProcessWriter(tmp_path / "ckpt", codec="raw") as w, \
            Client(w.address, rank=0, world_size=1) as c:
        c.save(1, _state(0, 1), tier="memory").wait(WAIT_S)
        images = memory.open_images(w.address, 1)
        try:
            fd = os.open(f"/proc/self/fd/{images.fds[0]}", os.O_RDWR)
            try:
                with pytest.raises(OSError) as e:
                    os.pwrite(fd, b"x", 100)
                assert e.value.errno == errno.EPERM
            finally:
                os.close(fd)
        finally:
            images.close()
        _same(read_image(w, 1, 0), _state(0, 1))


def test_a_wrong_checksum_is_never_returned(tmp_path: Path) -> None:
    """An entry whose frame checksum disagrees with the image (a hostile or confused
    peer) fails the load with CorruptCheckpointError: verified as from disk."""
    with InProcessWriter(tmp_path / "ckpt", codec="raw") as w, \
            Client(w.address, rank=0, world_size=1) as c:
        c.save(1, _state(0, 1), tier="memory").wait(WAIT_S)
        images = memory.open_images(w.address, 1)
        try:
            frames = images.parts[0]["frames"]
            last = frames[-1]
            bad = f"{int(last['xxh3_raw'], 16) ^ 1:016x}"
            frames[-1] = {**last, "xxh3_raw": bad, "xxh3_stored": bad}
            with pytest.raises(CorruptCheckpointError, match="xxh3"):
                with memory.open_checkpoint(root_path(w.root), images, images.parts) as ckpt:
                    memory.load(ckpt, 0, None)
        finally:
            images.close()


def test_a_missing_rank_entry_is_refused(tmp_path: Path) -> None:
    """Entries that do not cover the saved world never make a checkpoint."""
    with InProcessWriter(tmp_path / "ckpt", codec="raw") as w:
        clients = [Client(w.address, rank=r, world_size=2) for r in range(2)]
        try:
            for h in [c.save(1, _state(r, 1), tier="memory") for r, c in enumerate(clients)]:
                h.wait(WAIT_S)
            images = memory.open_images(w.address, 1)
            try:
                with pytest.raises(CorruptCheckpointError, match="entries of ranks"):
                    memory.open_checkpoint(root_path(w.root), images, {0: images.parts[0]})
            finally:
                images.close()
        finally:
            for c in clients:
                c.close()


def test_bad_tier_is_refused() -> None:
    with pytest.raises(ValueError, match="tier must be one of"):
        SaveOptions(tier="disk")


def test_a_rank_gone_mid_save_fails_the_generation(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A node of two ranks: rank 0 ends its memory save of step 2, rank 1 disconnects
    without saving it: rank 0 hears the failure (it does not wait forever), step 2 is
    never whole, step 1 stays."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with InProcessWriter(tmp_path / "ckpt", codec="raw") as w:
        clients = []
        for r in range(2):
            monkeypatch.setenv("LOCAL_RANK", str(r))
            clients.append(Client(w.address, rank=r, world_size=2))
        for h in [c.save(1, _state(r, 1), tier="memory") for r, c in enumerate(clients)]:
            h.wait(WAIT_S)
        first = clients[0].save(2, _state(0, 2), tier="memory")
        # rank 0's image ended on the writer before rank 1 goes (staged on the rank is
        # not begun on the writer: a disconnect seen first fails step 2 only after
        # absent_rank_timeout, past WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while not any(g["step"] == 2 and g["ranks"] == [0]
                      for g in memory.generations(w.address)):
            assert time.monotonic() < deadline, memory.generations(w.address)
            time.sleep(0.01)
        assert not first.done()  # waits for its node's other rank
        clients[1].close()
        with pytest.raises(SaveFailedError, match="rank 1 of the node disconnected"):
            first.wait(WAIT_S)
        assert [(g["step"], g["whole"]) for g in memory.generations(w.address)] == [(1, True)]
        _same(read_image(w, 1, 1), _state(1, 1))
        clients[0].close()


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)


def _train(ckpt: Checkpointer, model: _Net, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        model.zero_grad()
        model.lin(torch.full((4, 16), float(step))).square().sum().backward()
        opt.step()
        if ckpt.should_save(step):
            ckpt.save(step, extra={"step": step})
    ckpt.wait_until_finished()


def _fresh() -> tuple[_Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Net()
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def test_restore_takes_the_newest_memory_generation(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """memory_interval=1, save_interval=4, trained to step 6: steps 4 on disk, 6 in
    memory; a new Checkpointer (a restarted process on the same node) resumes at 6
    from memory, bit-exact, model and optimizer; with the memory copy gone (a new
    writer) it falls back to step 4 and says so."""
    options = CheckpointerOptions(memory_interval=1, save_interval=4)
    with InProcessWriter(tmp_path / "ckpt", codec="raw") as w:
        model, opt = _fresh()
        ckpt = Checkpointer(w.root, model=model, optimizer=opt, options=options,
                            address=w.address)
        _train(ckpt, model, opt, range(1, 7))
        ckpt.close()
        assert [p.name for p in sorted(w.root.glob("step-*"))] == ["step-00000004"]
        expect = {k: v.clone() for k, v in model.state_dict().items()}
        expect_opt = opt.state_dict()["state"][0]["exp_avg"].clone()

        model2, opt2 = _fresh()
        again = Checkpointer(w.root, model=model2, optimizer=opt2, options=options,
                             address=w.address)
        assert again.restore() == 6 and again.restored_tier == "memory"
        assert again.extra == {"step": 6}
        for k, v in model2.state_dict().items():
            assert torch.equal(v, expect[k]), k
        assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], expect_opt)
        # training goes on: the next durable save commits (no timeline fork from memory)
        _train(again, model2, opt2, range(7, 9))
        again.close()
        assert (w.root / "step-00000008").is_dir()
    with InProcessWriter(tmp_path / "ckpt", codec="raw") as w2:  # the memory copy is gone
        model3, opt3 = _fresh()
        third = Checkpointer(w2.root, model=model3, optimizer=opt3, options=options,
                             address=w2.address)
        with caplog.at_level(logging.WARNING, "asyncckpt.checkpointer"):
            assert third.restore() == 8
        assert third.restored_tier == "durable"
        assert "restoring from the durable tier" in caplog.text
        third.close()


def test_restore_prefers_a_newer_durable_step(tmp_path: Path) -> None:
    """A durable step newer than every memory generation wins."""
    with InProcessWriter(tmp_path / "ckpt", codec="raw") as w, \
            Client(w.address, rank=0, world_size=1) as c:
        model, opt = _fresh()
        c.save(2, {"step": 2, "model": model.state_dict()}, tier="memory").wait(WAIT_S)
        c.save(5, {"step": 5, "model": model.state_dict()}).wait(WAIT_S)
        ckpt = Checkpointer(w.root, model=model, options=CheckpointerOptions(
            memory_interval=1, contents=("model",)), address=w.address)
        assert ckpt.restore() == 5 and ckpt.restored_tier == "durable"
        ckpt.close()


def test_memory_save_does_not_wait_for_a_durable_one(tmp_path: Path) -> None:
    """on_busy "block": a memory save is not held behind a durable save in flight
    (only behind an earlier memory save)."""
    options = CheckpointerOptions(memory_interval=1, save_interval=2)
    with InProcessWriter(tmp_path / "ckpt", codec="raw") as w:
        model, opt = _fresh()
        ckpt = Checkpointer(w.root, model=model, optimizer=opt, options=options,
                            address=w.address)
        durable = ckpt.save(2)
        memory_save = ckpt.save(3)
        assert durable is not None and memory_save is not None
        assert durable in ckpt._in_flight or durable.done()
        memory_save.wait(WAIT_S)
        assert memory_save.stats.tier == "memory"
        durable.wait(WAIT_S)
        assert durable.stats.tier == "durable"
        ckpt.close()


def test_failed_memory_save_is_raised(tmp_path: Path) -> None:
    """A refused memory save is never dropped silently: the next save raises it."""
    with InProcessWriter(tmp_path / "ckpt", codec="raw", memory_max_bytes=4096) as w, \
            Client(w.address, rank=0, world_size=1) as c:
        c.save(1, {"w": torch.zeros(100_000)}, tier="memory")
        with pytest.raises(SaveFailedError):
            for _ in range(200):
                c.save(2, {"w": torch.zeros(10)}, tier="memory").wait(WAIT_S)


def test_flush_commits_the_newest_generation(tmp_path: Path) -> None:
    """`flush` makes memory generation 6 (newer than durable 4) an ordinary committed
    step that loads bit-exact; a second flush has nothing newer to write."""
    import asyncckpt
    with InProcessWriter(tmp_path / "ckpt", codec="zstd") as w:
        clients = [Client(w.address, rank=r, world_size=2) for r in range(2)]
        try:
            for step, tier in ((4, "durable"), (6, "memory")):
                for h in [c.save(step, _state(r, step), tier=tier)
                          for r, c in enumerate(clients)]:
                    h.wait(WAIT_S)
            assert memory.flush(w.address) == 6
            for r in range(2):
                _same(asyncckpt.load(w.root, rank=r), _state(r, 6))
            assert asyncckpt.verify(w.root / "step-00000006").ok
            assert memory.flush(w.address) is None
        finally:
            for c in clients:
                c.close()


def test_stopping_writer_flushes(tmp_path: Path) -> None:
    """A writer stopping (SIGTERM's path: `WriterServer.stop`) makes its newest memory
    generation durable before it lets the root go."""
    import asyncckpt
    w = InProcessWriter(tmp_path / "ckpt", codec="raw")
    with Client(w.address, rank=0, world_size=1) as c:
        c.save(3, _state(0, 3), tier="memory").wait(WAIT_S)
    w.stop()
    _same(asyncckpt.load(tmp_path / "ckpt"), _state(0, 3))


def test_a_flush_that_fails_commits_nothing(tmp_path: Path) -> None:
    """A generation whose timeline start is stale (another run forked the root since):
    the flush fails with TimelineMovedError and the root's newest step stays."""
    import asyncckpt
    from asyncckpt.errors import TimelineMovedError
    from asyncckpt.format.timeline import TimelineStart, new_timeline_id
    with InProcessWriter(tmp_path / "ckpt", codec="raw") as w, \
            Client(w.address, rank=0, world_size=1) as c:
        c.save(2, _state(0, 2)).wait(WAIT_S)
        stale = TimelineStart(new_timeline_id(), 2, 7)  # based on a gen the root never had
        c.save(5, _state(0, 5), tier="memory", timeline=stale).wait(WAIT_S)
        with pytest.raises(TimelineMovedError):
            memory.flush(w.address)
        assert [p.name for p in w.root.glob("step-*")] == ["step-00000002"]
        _same(asyncckpt.load(w.root), _state(0, 2))


def test_a_rank_that_never_begins_fails_the_generation(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A node of two ranks: rank 0 saves memory step 2, rank 1 stays connected but never
    begins it: after `absent_rank_timeout` rank 0 hears a SaveFailedError naming the step
    and rank 1 (it does not wait forever); step 2 is never whole, step 1 stays held."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with InProcessWriter(tmp_path / "ckpt", codec="raw", absent_rank_timeout=1.0) as w:
        clients = []
        for r in range(2):
            monkeypatch.setenv("LOCAL_RANK", str(r))
            clients.append(Client(w.address, rank=r, world_size=2))
        try:
            for h in [c.save(1, _state(r, 1), tier="memory") for r, c in enumerate(clients)]:
                h.wait(WAIT_S)
            first = clients[0].save(2, _state(0, 2), tier="memory")
            with pytest.raises(SaveFailedError, match="rank 1") as caught:
                first.wait(WAIT_S)
            assert caught.value.step == 2 and "never began" in str(caught.value)
            assert [(g["step"], g["whole"]) for g in memory.generations(w.address)] == [
                (1, True)]
            for r in range(2):
                _same(read_image(w, 1, r), _state(r, 1))
            # the connected ranks go on: the next generation is whole as usual
            for h in [c.save(3, _state(r, 3), tier="memory") for r, c in enumerate(clients)]:
                h.wait(WAIT_S)
            assert [g["step"] for g in memory.generations(w.address)] == [3]
        finally:  # rank 1 first: its leaving fails what rank 0 may still wait on
            for c in reversed(clients):
                c.close()
