"""The measured training loop of bench-frameworks: when to save, what to time, and how.

Each case (a framework, a checkpoint method, a state) runs one training loop whose steps
are the framework's own (its optimizer, its backward) and whose saves go through the
method under test. The schedule is fixed by a `Plan`:

    warm steps | baseline steps | first save | gap steps, save (x spaced) | back saves | gap steps

- The memory baseline is taken after the warm steps (model, gradients, optimizer
  moments and the framework's objects exist; no checkpoint code has run): VmHWM is reset
  to the RSS there, and the extra host memory is VmHWM at the end over it, plus the
  private memory of helper processes started since (the asyncckpt writer; a ring is
  shared memory mapped by the trainer, so it is already in the trainer's RSS).
  Gradients are zeroed in place (`set_to_none=False`), so a step does not move the RSS.
- The first save is reported apart: it pays one-time costs (a writer process started, a
  ring allocated, a thread pool made).
- "Spaced" saves have `gap` training steps between them, as a training run spaces them;
  "back to back" saves follow each other with no step between (a save then waits for
  whatever the previous one still holds).
- The time the loop blocks per save is the save call plus what the training step right
  after it took beyond the median baseline step: a fence that holds `optimizer.step()`
  until the state is copied, or a background writer competing for the cores, shows
  there. Back-to-back saves have a step after the last one only.
- Time to durable runs from the save call to the moment its bytes are durable: asyncckpt's
  commit (data, manifest and directory fsynced, then renamed); for a method that never
  fsyncs (torch.save, DCP's FileSystemWriter with sync_files=False), the moment its files
  are written plus an fsync of them done by the bench right then -- on a watcher thread
  for asynchronous methods, on the loop for synchronous ones (after the call's timing).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import measure


@dataclass
class Plan:
    """How many steps and saves a case runs (see the module docstring)."""

    warm: int = 2
    baseline: int = 3
    gap: int = 3
    spaced: int = 4
    back: int = 3

    def steps(self) -> int:
        """Training steps in all."""
        return self.warm + self.baseline + self.gap * (self.spaced + 1) + self.gap

    def actions(self) -> dict[int, list[str]]:
        """After which step (1-based) which saves run, by kind."""
        out: dict[int, list[str]] = {}
        at = self.warm + self.baseline
        out[at] = ["first"]
        for _ in range(self.spaced):
            at += self.gap
            out[at] = ["spaced"]
        at += self.gap
        out[at] = ["back"] * self.back
        return out


@dataclass
class Saved:
    """What a method's save left to wait for: `wait` blocks until its bytes are written
    (None: written when the call returned); `fsync`, files the bench must fsync to make
    them durable (None: the method made them durable itself); `stats`, the method's own
    figures for the save, read once it is durable (asyncckpt's handle stats)."""

    wait: Callable[[], Any] | None = None
    fsync: Path | None = None
    stats: Callable[[], dict[str, Any]] | None = None


def fsync_tree(path: Path) -> None:
    """fsync every file under `path` (or `path` itself), then the directories. A file
    gone meanwhile is passed over: another rank's save still writing there renamed its
    tmp file (Accelerate's ranks share `checkpoint_N`), and that rank fsyncs the result."""
    if not path.exists():
        return
    files = measure.files_under(path)
    dirs = {path} if path.is_dir() else set()
    for p in files:
        dirs.add(p.parent)
        _fsync(p)
    for d in dirs:
        _fsync(d)


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Record:
    kind: str
    call: float
    started: float
    next_step: float | None = None
    durable: float | None = None
    error: str | None = None
    stats: dict[str, Any] | None = None


@dataclass
class Bench:
    """Drives the schedule: call `on_step(seconds)` after every training step; it runs
    the saves due then and returns True once the last step is done (then `result()`)."""

    plan: Plan
    save: Callable[[int], Saved]
    after: Callable[[int], None] = lambda n: None  # after save n's timing: rotation
    step: int = 0
    saves: list[Record] = field(default_factory=list)
    step_times: list[tuple[int, float]] = field(default_factory=list)
    probe: measure.MemoryProbe | None = None
    memory: dict[str, int] = field(default_factory=dict)
    profile: Any = None  # a cProfile.Profile run around every save call but the first
    extra: dict[str, Any] = field(default_factory=dict)  # the driver's figures for the run
    _watchers: list[threading.Thread] = field(default_factory=list)
    _pending_next: Record | None = None
    _actions: dict[int, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._actions = self.plan.actions()

    def on_step(self, seconds: float) -> bool:
        self.step += 1
        self.step_times.append((self.step, seconds))
        if self._pending_next is not None:
            self._pending_next.next_step = seconds
            self._pending_next = None
        if self.step == self.plan.warm:
            self.probe = measure.MemoryProbe()
            self.probe.start()
        for kind in self._actions.get(self.step, []):
            self._save(kind)
        if self.step >= self.plan.steps():
            self.finish()
            return True
        return False

    def _save(self, kind: str) -> None:
        n = len(self.saves) + 1
        profile = self.profile if kind != "first" else None
        started = time.perf_counter()
        if profile is not None:
            profile.enable()
        try:
            saved = self.save(n)
        finally:
            if profile is not None:
                profile.disable()
        call = time.perf_counter() - started
        record = Record(kind, call, started)
        self.saves.append(record)
        if saved.wait is None:
            if saved.fsync is not None:
                fsync_tree(saved.fsync)
            record.durable = time.perf_counter() - started
        else:
            watcher = threading.Thread(target=self._watch, args=(record, saved), daemon=True,
                                       name=f"bench-durable-{n}")
            watcher.start()
            self._watchers.append(watcher)
        self.after(n)
        self._pending_next = record

    @staticmethod
    def _watch(record: Record, saved: Saved) -> None:
        try:
            assert saved.wait is not None
            saved.wait()
            if saved.fsync is not None:
                fsync_tree(saved.fsync)
            record.durable = time.perf_counter() - record.started
            if saved.stats is not None:
                record.stats = saved.stats()
        except BaseException as e:  # noqa: BLE001 - reported in the result, never hidden
            record.error = f"{type(e).__name__}: {e}"

    def finish(self) -> None:
        """Wait until every save is durable, then read the memory peaks."""
        for w in self._watchers:
            w.join()
        if self.probe is not None:
            self.memory = self.probe.stop()
            self.probe = None

    def result(self) -> dict[str, Any]:
        base = [s for i, s in self.step_times
                if self.plan.warm < i <= self.plan.warm + self.plan.baseline]
        return {"base_step": statistics.median(base) if base else None,
                "saves": [vars(r) for r in self.saves],
                "steps": len(self.step_times), "memory": self.memory, "extra": self.extra,
                "step_times": [s for _, s in self.step_times]}


def blocked(record: dict[str, Any], base_step: float | None) -> float:
    """Seconds the loop lost to one save: the call, plus the step after it beyond the
    baseline step (never below the call alone)."""
    extra = 0.0
    if record.get("next_step") is not None and base_step is not None:
        extra = max(0.0, record["next_step"] - base_step)
    return float(record["call"]) + extra
