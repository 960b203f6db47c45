"""`Checkpointer.restore()` across the two tiers when a run forked (read/resume.py,
read/memory_restore.py `_floor`).

Run A commits steps 4 and 5. Run B restores 4 (a new timeline, forked at 4), trains,
and saves 5 to the memory tier only: the root still holds A's 5, live, since B has not
committed yet. B's restart must resume B's 5 (the state B's history reached), go on in
B's timeline, and B's first durable commit must abandon A's 5: the root's history then
never holds A's 5 beside B's 6. A generation of a run another run overtook is not
taken.

In process: one writer, world 1, a linear model.
"""

from __future__ import annotations

import torch
from inprocess import InProcessWriter
from one_rank_node import one_rank_writer  # noqa: F401 (the fixture writer)

from asyncckpt.checkpointer import Checkpointer, CheckpointerOptions
from asyncckpt.storage.location import storage_for
from asyncckpt.storage.timeline import live_steps, read_current

WAIT_S = 30.0


def _model(fill: float) -> torch.nn.Linear:
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    return model


def _run(w: InProcessWriter, model: torch.nn.Module, memory: bool) -> Checkpointer:
    options = (CheckpointerOptions(memory_interval=1, save_interval=2) if memory
               else CheckpointerOptions(save_interval=1))
    return Checkpointer(w.root, model=model, address=w.address, fence=False, options=options)


def _save(ckpt: Checkpointer, step: int) -> str:
    handle = ckpt.save(step)
    assert handle is not None
    handle.wait(WAIT_S)
    return handle.stats.tier


def _run_a_then_b(w: InProcessWriter) -> None:
    """A commits 4 and 5; B restores 4, trains to 55.0 and saves 5 to memory."""
    a = _run(w, _model(0.0), memory=False)
    for step in (4, 5):
        with torch.no_grad():
            a.model.weight.fill_(float(step))  # type: ignore[union-attr]
        assert _save(a, step) == "durable"
    a.close()
    model = _model(0.0)
    b = _run(w, model, memory=True)
    assert b.restore(step=4) == 4 and float(model.weight[0, 0]) == 4.0
    with torch.no_grad():
        model.weight.fill_(55.0)
    assert _save(b, 5) == "memory"
    b.close()


def test_a_forked_runs_memory_step_wins_and_its_commit_abandons_the_old_one(
        writer: InProcessWriter) -> None:
    _run_a_then_b(writer)
    model = _model(0.0)
    again = _run(writer, model, memory=True)
    assert again.restore() == 5
    assert again.restored_tier == "memory" and float(model.weight[0, 0]) == 55.0
    with torch.no_grad():
        model.weight.fill_(66.0)
    assert _save(again, 6) == "durable"
    again.close()
    storage = storage_for(writer.root)
    current = read_current(storage)
    assert live_steps(storage, storage.committed_steps(), current) == [4, 6], (
        "B's commit of 6 must abandon A's 5: B resumed from 4 and its 5 was never durable")
    assert current.lineage and current.lineage[-1][1] == 4, current  # forked at 4


def test_a_memory_step_of_an_overtaken_run_is_not_taken(writer: InProcessWriter) -> None:
    """After B's memory 5, run C restores 4 and commits 6: B can never commit (its
    fork is of a timeline no longer current). A restart takes C's 6: B's 5, forked at
    4, would otherwise count as newer than every root step above 4."""
    _run_a_then_b(writer)
    c = _run(writer, _model(0.0), memory=False)
    assert c.restore(step=4) == 4
    with torch.no_grad():
        c.model.weight.fill_(77.0)  # type: ignore[union-attr]
    assert _save(c, 6) == "durable"
    c.close()
    model = _model(0.0)
    again = _run(writer, model, memory=True)
    assert again.restore() == 6
    assert again.restored_tier == "durable" and float(model.weight[0, 0]) == 77.0
    again.close()
