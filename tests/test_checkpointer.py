"""Checkpointer: interval, contents, retention from disk, busy policy, fence, restore.

Tests that set retention or list the root's steps have a writer of their own (`writer`);
the others save their own steps through the session's writer (`shared`)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same
from tiers import process_fixture

import asyncckpt
from asyncckpt import Checkpointer, CheckpointerOptions
from asyncckpt.errors import StepAlreadyCommittedError, WriterUnavailableError


def make_model(seed: int = 0, width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, model[0].in_features, generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_interval_retention_and_restore(writer, root):
    model, opt = make_model()
    options = CheckpointerOptions(save_interval=2, keep_last=2, keep_every=4)
    with Checkpointer(root, model=model, optimizer=opt, options=options,
                      client=asyncckpt.connect(writer.address, rank=0, world_size=1)) as ckpt:
        assert [s for s in range(1, 7) if ckpt.should_save(s)] == [2, 4, 6]
        for step in range(1, 13):
            train_step(model, opt, step)
            ckpt.save(step, extra={"seen": step * 8})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [4, 8, 10, 12] and ckpt.latest_step() == 12
        expected = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        ckpt.client.close()

    fresh_model, fresh_opt = make_model(seed=1)
    restored = Checkpointer(root, model=fresh_model, optimizer=fresh_opt, fence=False)
    assert restored.restore() == 12 and restored.extra == {"seen": 96}
    assert_same(expected["model"], fresh_model.state_dict())
    assert_same(expected["optimizer"]["state"], fresh_opt.state_dict()["state"])
    assert restored.restore(step=8) == 8
    with pytest.raises(asyncckpt.CheckpointNotFoundError):
        restored.restore(step=6)  # deleted by retention


def test_restore_with_nothing_committed_returns_none(tmp_path):
    model, opt = make_model()
    assert Checkpointer(tmp_path / "none", model=model, optimizer=opt).restore() is None


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_fence_keeps_the_optimizer_from_tearing_a_save(shared):
    root, torn, fenced = shared.root, shared.step(), shared.step()
    model, opt = make_model(width=1024)  # 4 MiB of weights through a 64 KiB ring
    client = asyncckpt.connect(shared.address, rank=0, world_size=1,
                               slot_size=16 << 10, ring_size=64 << 10)
    ckpt = Checkpointer(root, model=model, optimizer=opt, client=client, fence=False,
                        options=CheckpointerOptions(save_interval=1, contents=("model",)))
    train_step(model, opt, 1)
    handle = ckpt.save(torn)
    with torch.no_grad():  # no fence: an update lands while staging runs (at once, so
        for p in model.parameters():  # that a fast writer cannot finish staging first)
            p.mul_(0.5)
    with pytest.raises(asyncckpt.SaveFailedError, match="modified in place"):
        handle.wait(60)

    ckpt.install_fence()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, model[0].in_features, generator=torch.Generator().manual_seed(4))
    model(x).pow(2).mean().backward()  # before the save: the step follows it at once (a
    handle = ckpt.save(fenced)         # cold backward let staging finish first, 1 run in 6)
    opt.step()  # the fence holds optimizer.step() until staging is done
    assert handle.wait(60).name == f"step-{fenced:08d}"
    assert ckpt.fence_blocked_seconds > 0
    assert_same(before, asyncckpt.load(root, step=fenced)["model"])
    ckpt.close()
    client.close()


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_busy_policies(shared):
    root, steps = shared.root, [shared.step() for _ in range(7)]
    client = asyncckpt.connect(shared.address, rank=0, world_size=1,
                               slot_size=16 << 10, ring_size=32 << 10)
    big = {"w": torch.randn(2 << 20)}
    skip = Checkpointer(root, client=client,
                        options=CheckpointerOptions(save_interval=1, on_busy="skip"))
    assert skip.save(steps[0], extra=big) is not None
    with pytest.warns(UserWarning, match=f"skipping the save of step {steps[1]}"):
        assert skip.save(steps[1], extra=big) is None
    skip.wait_until_finished()
    block = Checkpointer(root, client=client, options=CheckpointerOptions(save_interval=1))
    first = block.save(steps[2], extra=big)
    block.save(steps[3], extra=big)
    assert first.done()  # "block" waited for the 3rd step before starting the 4th
    queue = Checkpointer(root, client=client,
                         options=CheckpointerOptions(save_interval=1, on_busy="queue",
                                                     max_in_flight=3))
    handles = [queue.save(s, extra=big) for s in steps[4:]]
    queue.close()
    block.close()
    assert all(h.done() and h.exception() is None for h in handles)
    assert asyncckpt.load(root)["step"] == steps[6]
    client.close()


@pytest.mark.parametrize("fields, match", [
    ({"keep_last": 2.5}, "keep_last must be an int in 0.."),
    ({"keep_last": True}, "keep_last must be an int in 0.."),
    ({"keep_last": 3, "keep_every": -1}, "keep_every must be an int in 0.."),
    ({"keep_every": 1.5}, "keep_every must be an int in 0.."),
])
def test_retention_options_follow_the_saves_own_rule(fields, match):
    """The Checkpointer's retention options are checked by the rule every save's options
    are (SaveOptions): a float or a bool used to pass here and fail each save."""
    with pytest.raises(ValueError, match=match):
        CheckpointerOptions(**fields)


def test_options_are_validated():
    with pytest.raises(ValueError, match="on_busy"):
        CheckpointerOptions(on_busy="later")
    with pytest.raises(ValueError, match="contents"):
        CheckpointerOptions(contents=("weights",))


@pytest.mark.process  # starts a writer
def test_checkpointer_without_keep_last_leaves_the_writers_retention_on(tmp_path):
    """Regression: an unset keep_last was sent as keep_last=0, which overrode the writer's
    own keep_last knob and disabled its retention: every step stayed on disk."""
    import time
    model, opt = make_model(width=8)
    with asyncckpt.start_writer(tmp_path / "ckpt", codec="raw", keep_last=2) as writer:
        with Checkpointer(tmp_path / "ckpt", model=model, optimizer=opt,
                          options=CheckpointerOptions(save_interval=1),
                          client=asyncckpt.connect(writer.address, rank=0, world_size=1)) as ckpt:
            for step in range(1, 5):
                ckpt.save(step)
                ckpt.wait_until_finished()
            deadline = time.monotonic() + 10  # retention may run just after the commit
            while ckpt.all_steps() != [3, 4] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ckpt.all_steps() == [3, 4]
            ckpt.client.close()


@pytest.mark.process  # starts a writer
def test_keep_last_0_keeps_every_step_against_the_writers_knob(tmp_path):
    """One "keep all": keep_last 0, as for the writer's knob and a client's save; None
    alone means the writer's knob applies."""
    from asyncckpt.config import KEEP_ALL
    assert KEEP_ALL == 0 and CheckpointerOptions(keep_last=KEEP_ALL).keep_last == 0
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointerOptions(keep_last=-1)
    model, opt = make_model(width=8)
    with asyncckpt.start_writer(tmp_path / "ckpt", codec="raw", keep_last=1) as writer:
        with Checkpointer(tmp_path / "ckpt", model=model, optimizer=opt,
                          options=CheckpointerOptions(save_interval=1, keep_last=KEEP_ALL),
                          client=asyncckpt.connect(writer.address, rank=0, world_size=1)) as ckpt:
            for step in range(1, 4):
                ckpt.save(step)
                ckpt.wait_until_finished()
            assert ckpt.all_steps() == [1, 2, 3]
            ckpt.client.close()


# -- restore from a root whose newest steps are damaged ---------------------------------------

@pytest.fixture
@process_fixture
def three_steps(tmp_path):
    """Steps 1..3 of a trained model (the states kept), saved by a Checkpointer."""
    model, opt = make_model(width=16)
    states = {}
    with asyncckpt.start_writer(tmp_path / "ckpt", codec="zstd") as writer:
        with Checkpointer(tmp_path / "ckpt", model=model, optimizer=opt,
                          options=CheckpointerOptions(save_interval=1),
                          client=asyncckpt.connect(writer.address, rank=0, world_size=1)) as ckpt:
            for step in range(1, 4):
                train_step(model, opt, step)
                ckpt.save(step, extra={"seen": step})
                ckpt.wait_until_finished()
                states[step] = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.client.close()
    return tmp_path / "ckpt", states


def flip_tensor_byte(directory) -> None:
    from asyncckpt.read.checkpoint import Checkpoint
    with Checkpoint.open(directory) as ckpt:
        part = ckpt.manifest.ranks[0]
    frame = part.frames[-1]  # the last frame holds tensor bytes
    path = directory / part.file
    data = bytearray(path.read_bytes())
    data[frame.stored_offset + frame.stored_length // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_restore_falls_back_to_the_newest_step_that_loads_and_warns(three_steps, caplog):
    root, states = three_steps
    flip_tensor_byte(root / "step-00000003")                    # data corrupt
    (root / "step-00000002" / "manifest.json").unlink()          # manifest gone
    model, opt = make_model(seed=5, width=16)
    ckpt = Checkpointer(root, model=model, optimizer=opt, fence=False)
    with caplog.at_level("WARNING", logger="asyncckpt.checkpointer"):
        assert ckpt.restore() == 1
    assert_same(states[1], dict(model.state_dict())) and ckpt.extra == {"seen": 1}
    skipped = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(skipped) == 2
    assert "skips step 3" in skipped[0] and "xxh3" in skipped[0]
    assert "skips step 2" in skipped[1] and "has no manifest.json" in skipped[1]


@pytest.mark.parametrize("how", ["argument", "option"])
def test_strict_restore_raises_naming_the_damaged_and_the_intact_step(three_steps, how):
    root, states = three_steps
    flip_tensor_byte(root / "step-00000003")
    model, opt = make_model(seed=5, width=16)
    options = CheckpointerOptions(strict_restore=how == "option")
    ckpt = Checkpointer(root, model=model, optimizer=opt, fence=False, options=options)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="newest intact step is 2") as info:
        ckpt.restore(strict=True) if how == "argument" else ckpt.restore()
    assert info.value.step == 3
    assert ckpt.restore(strict=False) == 2
    assert_same(states[2], dict(model.state_dict()))


def test_restore_when_no_step_loads_raises(three_steps):
    root, _ = three_steps
    for step in (1, 2, 3):
        (root / f"step-0000000{step}" / "planted").write_bytes(b"")
    model, opt = make_model(seed=5, width=16)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="no step under .* loads"):
        Checkpointer(root, model=model, optimizer=opt, fence=False).restore()


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_blocked_seconds_include_collecting_the_state(shared, monkeypatch):
    """Regression: blocked_seconds counted only Client.save, not get_*_state_dict."""
    model, opt = make_model()
    client = asyncckpt.connect(shared.address, rank=0, world_size=1)
    ckpt = Checkpointer(shared.root, model=model, optimizer=opt, client=client)
    collect = ckpt._state_dicts

    def slow_collect():
        import time
        time.sleep(0.3)
        return collect()
    monkeypatch.setattr(ckpt, "_state_dicts", slow_collect)
    handle = ckpt.save(shared.step(), force=True)
    assert handle.stats.blocked_seconds >= 0.3
    handle.wait(60)
    assert handle.stats.blocked_seconds >= 0.3  # the writer's figures do not replace it
    ckpt.close()
    client.close()


def test_interval_skip_is_logged_once(tmp_path, caplog):
    model, opt = make_model()
    ckpt = Checkpointer(tmp_path, model=model, optimizer=opt, fence=False)
    with caplog.at_level("INFO", logger="asyncckpt.checkpointer"):
        assert ckpt.save(7) is None and ckpt.save(8) is None
    said = [r.getMessage() for r in caplog.records if r.name == "asyncckpt.checkpointer"]
    assert len(said) == 1 and "save_interval=1000" in said[0] and "force=True" in said[0]


def test_auto_ring_size_rules():
    from asyncckpt.rank.ringsize import auto_ring_size
    MiB, GiB = 1 << 20, 1 << 30
    slot = 4 * MiB
    size, why = auto_ring_size(3 * GiB, slot, 2, 24 * GiB)  # share 3 GiB: the whole state
    assert size == 3 * GiB and "whole state fits" in why
    size, _ = auto_ring_size(3 * GiB, slot, 8, 24 * GiB)  # share 768 MiB
    assert size == 768 * MiB
    size, _ = auto_ring_size(3 * GiB + 1, slot, 1, 64 * GiB)  # never more than the state
    assert size == 3 * GiB + slot
    size, why = auto_ring_size(3 * GiB, slot, 8, 256 * MiB)  # tight: the old default
    assert size == 64 * MiB and "floor" in why
    size, why = auto_ring_size(5 * MiB, slot, 1, 64 * GiB)  # small: 4 saves, within 64 MiB
    assert size == 32 * MiB and "4 states fit" in why
    assert auto_ring_size(20 * MiB, slot, 1, 64 * GiB)[0] == 64 * MiB  # 3 fit: the default
    assert auto_ring_size(10, slot, 1, None)[0] == 4 * slot
    assert auto_ring_size(3 * GiB, slot, 1, None)[0] == 64 * MiB


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_own_client_ring_sized_from_the_state(shared, monkeypatch, caplog):
    """A Checkpointer's own client gets a ring sized from the state (memory allowing; a
    small state: room for four saves of it); ring_size= and ASYNCCKPT_RING_SIZE still
    win."""
    root = shared.root
    monkeypatch.setenv("ASYNCCKPT_ADDRESS", shared.address)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("ASYNCCKPT_RING_SIZE", raising=False)
    model, opt = make_model(width=512)  # 1 MiB of weights, 2 MiB of Adam state
    train_step(model, opt, 1)
    with caplog.at_level("INFO", logger="asyncckpt.checkpointer"):
        with Checkpointer(root, model=model, optimizer=opt) as ckpt:
            ckpt.save(shared.step(), force=True).wait(60)
            assert ckpt.client.knobs.ring_size == 16 << 20  # 4 x (3 MiB in a 4 MiB slot)
    assert any("ring of 16 MiB" in r.getMessage() and "4 states fit" in r.getMessage()
               for r in caplog.records)
    with Checkpointer(root, model=model, optimizer=opt, ring_size=8 << 20) as ckpt:
        ckpt.save(shared.step(), force=True).wait(60)
        assert ckpt.client.knobs.ring_size == 8 << 20
    monkeypatch.setenv("ASYNCCKPT_RING_SIZE", str(4 << 20))
    with Checkpointer(root, model=model, optimizer=opt) as ckpt:
        ckpt.save(shared.step(), force=True).wait(60)
        assert ckpt.client.knobs.ring_size == 4 << 20


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_restore_reads_only_the_contents_asked_for(shared, monkeypatch):
    """Regression: restoring only the model still read (and allocated) the saved optimizer
    state, as full tensors for a sharded one."""
    from asyncckpt.read import loader
    root, step = shared.root, shared.step()
    model, opt = make_model()
    train_step(model, opt, 1)
    with Checkpointer(root, model=model, optimizer=opt,
                      client=asyncckpt.connect(shared.address, rank=0, world_size=1)) as ckpt:
        ckpt.save(step, extra={"seen": 8}, force=True).wait(60)
        ckpt.client.close()
    planned = []
    plan = loader._plan
    monkeypatch.setattr(loader, "_plan", lambda p, g, *a: planned.append(g.path) or plan(p, g, *a))
    fresh, fresh_opt = make_model(seed=3)
    only_model = Checkpointer(root, model=fresh, optimizer=fresh_opt, fence=False,
                              options=CheckpointerOptions(contents=("model", "extra")))
    assert only_model.restore() == step and only_model.extra == {"seen": 8}
    assert planned and all(path[0] == "model" for path in planned), planned
    assert_same(model.state_dict(), fresh.state_dict())
    assert fresh_opt.state_dict()["state"] == {}


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_replace_and_keep_from_reach_the_writer(writer, root):
    """save(replace=True) replaces a committed step (a rerun into an old root); keep_from
    protects steps from retention (a step a tracker file still names), keep_steps the
    steps it names (a framework's best)."""
    model, opt = make_model()
    options = CheckpointerOptions(save_interval=1, keep_last=1)
    with Checkpointer(root, model=model, optimizer=opt, options=options,
                      client=asyncckpt.connect(writer.address, rank=0, world_size=1)) as ckpt:
        ckpt.save(1).wait(60)
        first = {k: v.clone() for k, v in model.state_dict().items()}
        train_step(model, opt, 2)
        with pytest.raises(StepAlreadyCommittedError):
            ckpt.save(1).wait(60)
        assert_same(first, asyncckpt.load(root, step=1)["model"])
        ckpt.save(1, replace=True).wait(60)
        assert_same(dict(model.state_dict()), asyncckpt.load(root, step=1)["model"])
        ckpt.save(2, keep_from=1).wait(60)
        assert ckpt.all_steps() == [1, 2]  # keep_last=1, but step 1 is protected
        ckpt.save(3, keep_from=2).wait(60)
        assert ckpt.all_steps() == [2, 3]
        ckpt.save(4, keep_steps=(2,)).wait(60)
        ckpt.save(5, keep_steps=(2,)).wait(60)
        assert ckpt.all_steps() == [2, 5]  # 2 kept outside keep_last's count
        ckpt.client.close()


def test_restore_skips_a_step_that_retention_deletes_while_it_looks(three_steps, monkeypatch,
                                                                   caplog):
    """A writer still running on the root may prune the newest step between restore's
    listing and its load: that step is skipped like a damaged one, not fatal."""
    import shutil

    from asyncckpt import checkpointer
    root, states = three_steps
    real = checkpointer.load_parts

    def pruned_first(root_, step, *args):
        if step == 3:
            shutil.rmtree(root / "step-00000003")
        return real(root_, step, *args)
    monkeypatch.setattr(checkpointer, "load_parts", pruned_first)
    model, opt = make_model(seed=5, width=16)
    ckpt = Checkpointer(root, model=model, optimizer=opt, fence=False)
    with caplog.at_level("WARNING", logger="asyncckpt.checkpointer"):
        assert ckpt.restore() == 2
    assert_same(states[2], dict(model.state_dict()))
    assert any("skips step 3" in r.getMessage() and "deleted while" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("made", [False, True])
def test_restore_from_nothing_warns_that_training_starts_from_scratch(tmp_path, caplog, made):
    """A mistyped root used to resume from nothing silently."""
    root = tmp_path / "runrot"
    if made:
        root.mkdir()
    model, opt = make_model()
    ckpt = Checkpointer(root, model=model, optimizer=opt, fence=False)
    with caplog.at_level("WARNING", logger="asyncckpt.checkpointer"):
        assert ckpt.restore() is None
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    why = "holds no checkpoint" if made else "does not exist"
    assert any(f"{root} {why}" in m and "starts from scratch" in m for m in said), said
    ckpt.close()



@pytest.mark.process  # the Checkpointer starts the writer itself
def test_the_readme_loop_needs_no_writer_code(tmp_path, monkeypatch, caplog):
    """No address, no ASYNCCKPT_ADDRESS: the first due save starts the writer (its log
    beside the root, said once), `close()` stops it and forgets its address, and the
    next run of the same loop resumes from the last save."""
    import logging
    monkeypatch.delenv("ASYNCCKPT_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)

    def run(steps: int) -> tuple[int, Checkpointer, torch.nn.Module]:
        model, opt = make_model(seed=1)
        ckpt = Checkpointer("ckpts/run1", model=model, optimizer=opt,
                            options=CheckpointerOptions(save_interval=2, keep_last=3))
        start = ckpt.restore() or 0
        for step in range(start + 1, steps + 1):
            train_step(model, opt, step)
            ckpt.save(step, extra={"loader": step})
        return start, ckpt, model

    with caplog.at_level(logging.INFO, logger="asyncckpt.checkpointer"):
        start, ckpt, model = run(6)
    writer = ckpt.writer
    assert start == 0 and writer is not None and writer.alive()
    assert any("started this node's writer" in r.getMessage() and "run1.writer.log" in
               r.getMessage() for r in caplog.records)
    ckpt.close()
    assert not writer.alive() and "ASYNCCKPT_ADDRESS" not in __import__("os").environ
    assert "committed step 6" in (tmp_path / "ckpts" / "run1.writer.log").read_text()
    assert ckpt.all_steps() == [2, 4, 6]
    start, again, resumed = run(8)
    again.close()
    assert start == 6 and again.all_steps() == [4, 6, 8]
    assert again.extra == {"loader": 6}


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_writer_that_is_not_there_fails_the_construction(tmp_path, monkeypatch, how):
    """An address where nothing listens (a writer that died, a mistyped path) is an
    error when the Checkpointer is built, not 1000 steps later at its first due save."""
    gone = str(tmp_path / "writer.sock")
    monkeypatch.setenv("ASYNCCKPT_CONNECT_TIMEOUT", "0.5")
    model, opt = make_model()
    if how == "environment":
        monkeypatch.setenv("ASYNCCKPT_ADDRESS", gone)
    with pytest.raises(WriterUnavailableError, match="writer.sock"):
        Checkpointer(tmp_path / "ckpts", model=model, optimizer=opt,
                     address=gone if how == "argument" else None)


def test_a_run_that_never_reached_save_interval_is_told_at_close(tmp_path, caplog):
    """50 save() calls under the default interval of 1000 wrote nothing, silently."""
    model, opt = make_model()
    ckpt = Checkpointer(tmp_path / "never", model=model, optimizer=opt)
    for step in range(1, 51):
        assert ckpt.save(step) is None
    with caplog.at_level("WARNING", logger="asyncckpt.checkpointer"):
        ckpt.close()
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "50 save() call(s) and no checkpoint written" in said[0]
    assert "save_interval=1000" in said[0] and ckpt.writer is None
    assert not (tmp_path / "never").exists()  # no writer was started for nothing


def _failed_resave(ckpt: Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer):
    """Step 1 committed, then saved again (a framework resuming from an older step): a
    save that fails while nobody waits for it."""
    ckpt.save(1).wait(60)
    train_step(model, opt, 2)
    handle = ckpt.save(1)
    assert handle._done.wait(60)  # done, its error not taken
    return handle


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_a_failed_save_is_raised_by_the_next_save_once_and_logged(writer, root, caplog):
    """The next save() used to drop a failed handle: the root then mixed two timelines."""
    import logging
    model, opt = make_model()
    ckpt = Checkpointer(root, model=model, optimizer=opt, fence=False,
                        client=asyncckpt.connect(writer.address, rank=0, world_size=1),
                        options=CheckpointerOptions(save_interval=1))
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.ERROR):
        _failed_resave(ckpt, model, opt)
    assert any(r.levelno == logging.ERROR and "step 1" in r.getMessage()
               and "StepAlreadyCommittedError" in r.getMessage() for r in caplog.records)
    with pytest.raises(StepAlreadyCommittedError, match="step 1") as raised:
        ckpt.save(2)
    assert raised.value.step == 1
    ckpt.save(2).wait(60)  # told once: the next save goes ahead
    ckpt.close()
    assert ckpt.all_steps() == [1, 2]
    assert_same(first, asyncckpt.load(root, step=1)["model"])
    ckpt.client.close()


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
@pytest.mark.parametrize("then", ["close", "wait_until_finished"])
def test_close_and_wait_until_finished_raise_a_failed_save(writer, root, then):
    model, opt = make_model()
    client = asyncckpt.connect(writer.address, rank=0, world_size=1)
    ckpt = Checkpointer(root, model=model, optimizer=opt, client=client,
                        options=CheckpointerOptions(save_interval=1))
    _failed_resave(ckpt, model, opt)
    with pytest.raises(StepAlreadyCommittedError, match="step 1"):
        getattr(ckpt, then)()
    ckpt.close()  # raised once: not again
    assert ckpt._fences == []  # close() finished its work
    client.close()


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_a_failure_the_caller_took_is_not_raised_again(writer, root):
    model, opt = make_model()
    ckpt = Checkpointer(root, model=model, optimizer=opt, fence=False,
                        client=asyncckpt.connect(writer.address, rank=0, world_size=1),
                        options=CheckpointerOptions(save_interval=1))
    handle = _failed_resave(ckpt, model, opt)
    with pytest.raises(StepAlreadyCommittedError):
        handle.wait()
    ckpt.save(2).wait(60)
    ckpt.close()
    ckpt.client.close()


@pytest.mark.process  # each Checkpointer starts its root's writer itself
def test_two_checkpointers_on_two_roots_each_save_and_restore_their_own(tmp_path, monkeypatch):
    """A policy and a critic in one process: the first auto-start exported its address,
    so the second Checkpointer saved into the first one's root."""
    import os
    import subprocess
    import sys
    monkeypatch.delenv("ASYNCCKPT_ADDRESS", raising=False)
    options = CheckpointerOptions(save_interval=1)
    (policy, popt), (critic, copt) = make_model(seed=1), make_model(seed=2, width=32)
    first = Checkpointer(tmp_path / "policy", model=policy, optimizer=popt, options=options)
    second = Checkpointer(tmp_path / "critic", model=critic, optimizer=copt, options=options)
    for step in (1, 2):
        train_step(policy, popt, step)
        train_step(critic, copt, step)
        first.save(step)
        assert "ASYNCCKPT_ADDRESS" not in os.environ  # the user's environment is untouched
        second.save(step)
    child = subprocess.run([sys.executable, "-c",
                            "import os; print(os.environ.get('ASYNCCKPT_ADDRESS'))"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "None"  # a process spawned now inherits no address
    assert first.writer.root != second.writer.root
    first.close()
    second.close()
    for root, want, seed, width in ((tmp_path / "policy", policy, 5, 64),
                                    (tmp_path / "critic", critic, 6, 32)):
        fresh, fresh_opt = make_model(seed=seed, width=width)
        restorer = Checkpointer(root, model=fresh, optimizer=fresh_opt, fence=False)
        assert restorer.restore() == 2 and restorer.all_steps() == [1, 2]
        assert_same(dict(want.state_dict()), dict(fresh.state_dict()))


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
@pytest.mark.parametrize("how", ["environment", "client"])
def test_a_writer_of_another_root_is_refused_naming_both(writer, root, tmp_path, monkeypatch, how):
    """ASYNCCKPT_ADDRESS (or a client) pointing at another root's writer: a typed error,
    not a save into the wrong root."""
    from asyncckpt.errors import WriterRootMismatchError
    other = tmp_path / "other"
    model, opt = make_model()
    client = None
    if how == "environment":
        monkeypatch.setenv("ASYNCCKPT_ADDRESS", writer.address)
    else:
        client = asyncckpt.connect(writer.address, rank=0, world_size=1)
    ckpt = Checkpointer(other, model=model, optimizer=opt, client=client,
                        options=CheckpointerOptions(save_interval=1))
    with pytest.raises(WriterRootMismatchError) as raised:
        ckpt.save(1)
    assert str(root) in str(raised.value) and str(other) in str(raised.value)
    assert isinstance(raised.value, WriterUnavailableError)
    assert not list(root.glob("step-*")) and ckpt.writer is None
    ckpt.close()
    if client is not None:
        client.close()


# -- timelines: a restore begins one ---------------------------------------------------------

def test_a_restore_from_an_older_step_begins_a_timeline(tmp_path):
    """8, 10, 12 saved; restore(8), save 9 and 10: the newest is 9, then the new 10 (the
    old one replaced without replace=True), never 12; a later restore() takes the new 10."""
    from inprocess import InProcessWriter

    from asyncckpt.read.resolve import current_timeline
    model, opt = make_model(width=8)
    states = {}
    root = tmp_path / "ckpt"
    with InProcessWriter(root, codec="raw") as writer:
        def checkpointer() -> Checkpointer:
            return Checkpointer(root, model=model, optimizer=opt, fence=False,
                                options=CheckpointerOptions(save_interval=1),
                                client=asyncckpt.connect(writer.address, rank=0, world_size=1))
        with checkpointer() as ckpt:
            for step in (8, 10, 12):
                train_step(model, opt, step)
                ckpt.save(step).wait(60)
                states[step] = {k: v.clone() for k, v in model.state_dict().items()}
            assert ckpt.timeline is None and ckpt.latest_step() == 12
            ckpt.client.close()
        with checkpointer() as ckpt:
            assert ckpt.restore(step=8) == 8
            assert_same(states[8], dict(model.state_dict()))
            assert (ckpt.timeline.at, ckpt.timeline.based_on) == (8, 0)
            assert ckpt.latest_step() == 12  # nothing saved yet: the root is as it was...
            for step in (9, 10):
                train_step(model, opt, step + 100)
                ckpt.save(step).wait(60)
                states[step] = {k: v.clone() for k, v in model.state_dict().items()}
                assert ckpt.latest_step() == step  # ...until the first save of the timeline
            assert current_timeline(root).id == ckpt.timeline.id
            assert ckpt.all_steps() == [8, 9, 10, 12]
            ckpt.client.close()
        fresh, fresh_opt = make_model(seed=3, width=8)
        with Checkpointer(root, model=fresh, optimizer=fresh_opt, fence=False,
                          client=asyncckpt.connect(writer.address, rank=0, world_size=1)) as again:
            assert again.restore() == 10
            assert_same(states[10], dict(fresh.state_dict()))
            assert again.timeline.at == 10 and again.timeline.based_on == 1
            again.client.close()


def test_restore_from_nothing_leaves_a_sharded_optimizer_untouched(tmp_path):
    """Regression: restore() on an empty root made the targets of a load it never ran;
    DCP's get_optimizer_state_dict initialises a fresh optimizer's state (its step count
    too), so an FSDP2 job's first run trained differently from an uninterrupted one."""
    import socket

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ckpt = Checkpointer(tmp_path / "empty", model=model, optimizer=optim, fence=False)
        assert ckpt.restore() is None
        assert len(optim.state) == 0
        ckpt.close()
    finally:
        dist.destroy_process_group()


def test_several_optimizers_are_fenced_once_each_and_close_removes_every_hook(tmp_path):
    model = torch.nn.Linear(4, 4)
    first = torch.optim.SGD([model.weight], lr=0.1)
    second = torch.optim.SGD([model.bias], lr=0.1)
    ckpt = Checkpointer(tmp_path / "root", model=model, optimizer=first)  # fences `first`
    ckpt.install_fence(second)
    ckpt.install_fence(first)  # again: no second hook
    assert [len(o._optimizer_step_pre_hooks) for o in (first, second)] == [1, 1]
    ckpt.close()
    assert [len(o._optimizer_step_pre_hooks) for o in (first, second)] == [0, 0]


def test_save_keeps_what_the_flatten_fast_paths_see(shared):
    """The exact-type shortcuts of the flatten (plain tensors, str, int, None) save what
    the general walk saved: a tensor that requires grad (saved detached), the same
    storage twice (a view), non-ASCII keys, large ints; and still refuse what it refused."""
    root, step = shared.root, shared.step()
    client = asyncckpt.connect(shared.address, rank=0, world_size=1)
    leaf = torch.arange(12, dtype=torch.float32).requires_grad_()
    extra = {"leaf": leaf, "again": leaf, "größe": 3, "big": 2 ** 62, "none": None,
             "flag": True, "name": "ß", "nested": [torch.ones(2, dtype=torch.int64), "x", 1.5]}
    with Checkpointer(root, client=client,
                      options=CheckpointerOptions(save_interval=1, contents=("extra",))) as ckpt:
        handle = ckpt.save(step, extra=extra)
        assert handle is not None
        handle.wait(60)
        for bad in ({"\ud800": 1}, {"int": 1 << 14001}, {1.5: 1}):
            with pytest.raises(asyncckpt.UnsupportedStateError):
                ckpt.save(shared.step(), extra=bad)
    loaded = asyncckpt.load(root, step=step)["extra"]
    assert not loaded["leaf"].requires_grad
    assert torch.equal(loaded["leaf"], leaf.detach())
    assert torch.equal(loaded["again"], leaf.detach())
    assert {k: loaded[k] for k in ("größe", "big", "none", "flag", "name")} == {
        "größe": 3, "big": 2 ** 62, "none": None, "flag": True, "name": "ß"}
    assert torch.equal(loaded["nested"][0], torch.ones(2, dtype=torch.int64))
    assert loaded["nested"][1:] == ["x", 1.5]
    client.close()
