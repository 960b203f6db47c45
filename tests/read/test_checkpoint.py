"""Opening a checkpoint while its step is replaced (`replace=True`): a load reads one
version of the step whole, never the manifest of one and the files of the other."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from inprocess import inprocess_writer

import asyncckpt
from asyncckpt.format.layout import MANIFEST_NAME, step_dir_name
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.storage import posix
from asyncckpt.storage.posix import PosixStorage

STEP = 3


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(4096, generator=g) for i in range(6)},
            "seed": seed}


def save_two_versions(base: Path, make: Callable[[int], dict]) -> dict[int, Path]:
    """Step STEP saved as `make(1)`, then replaced by `make(2)`, each committed version
    copied aside as a directory to swap in: {seed: directory}."""
    kept = {}
    with inprocess_writer(base, codec="zstd") as w, \
            asyncckpt.connect(w.address, rank=0, world_size=1, slot_size=16 << 10,
                              ring_size=64 << 10) as c:
        for seed in (1, 2):
            c.save(STEP, make(seed), replace=seed > 1).wait(60)
            kept[seed] = base / f"version-{seed}"
            shutil.copytree(base / "ckpt" / step_dir_name(STEP), kept[seed])
    return kept


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Two committed versions of step STEP (seeds 1 and 2), kept as directories to swap in."""
    return save_two_versions(tmp_path_factory.mktemp("replace-versions"), state)


@pytest.fixture(scope="module")
def restorable(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Two versions of step STEP as a Checkpointer saves them (model, step, extra)."""
    return save_two_versions(tmp_path_factory.mktemp("replace-restorable"), lambda seed: {
        "model": state(seed)["model"], "step": STEP, "extra": {"seed": seed}})


def test_restore_during_a_replace_never_falls_back(restorable, tmp_path, caplog):
    """Checkpointer.restore() while the step is replaced again and again: it restores
    that step every time, one version whole, and never skips it as damaged."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(restorable[1], root / step_dir_name(STEP))
    PosixStorage(root).write_latest(STEP)
    model = torch.nn.ParameterDict({f"w{i}": torch.nn.Parameter(torch.zeros(4096))
                                    for i in range(6)})
    ckpt = asyncckpt.Checkpointer(root, model=model)
    assert ckpt.restore() == STEP  # warm: what a first restore imports
    stop, swaps, restores = threading.Event(), [], 0
    thread = threading.Thread(target=replace_in_a_loop, args=(root, restorable, stop, swaps))
    thread.start()
    try:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            assert ckpt.restore() == STEP
            expected = state(ckpt.extra["seed"])["model"]
            assert all(torch.equal(model[k].data, v) for k, v in expected.items())
            restores += 1
    finally:
        stop.set()
        thread.join()
        ckpt.close()
    assert len(swaps) > 10 and restores > 10
    assert "restore skips" not in caplog.text


def same(a: dict, b: dict) -> bool:
    return a["seed"] == b["seed"] and all(torch.equal(a["model"][k], v)
                                          for k, v in b["model"].items())


def replace_in_a_loop(root: Path, versions: dict[int, Path], stop: threading.Event,
                      swaps: list[int]) -> None:
    """What the writer's commit of a replacing save does: the new version in a tmp
    directory, manifest last, swapped in by `publish(replace=True)`, the old deleted."""
    storage = PosixStorage(root)
    seed = 1
    while not stop.is_set():
        seed = 3 - seed
        tmp = storage.make_tmp(STEP)
        for f in versions[seed].iterdir():
            if f.name != MANIFEST_NAME:
                shutil.copyfile(f, tmp / f.name)
        storage.publish(tmp, STEP, (versions[seed] / MANIFEST_NAME).read_bytes(), replace=True)
        swaps.append(seed)


@pytest.mark.parametrize("how", ["exchange", "aside"])
@pytest.mark.parametrize("newest", [False, True])
def test_loads_during_a_replace_read_one_version_whole(versions, tmp_path, monkeypatch, how,
                                                       newest):
    """A thread replaces the step again and again (both versions valid, different bytes)
    while loads read it by number (and as the root's newest): each returns one version
    whole, none raises. Where the filesystem cannot exchange two directories (`aside`:
    the old step renamed away, then the new one in), the name is briefly absent."""
    if how == "aside":
        monkeypatch.setattr(posix, "_exchange", lambda a, b: False)
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(versions[1], root / step_dir_name(STEP))
    PosixStorage(root).write_latest(STEP)  # as the writer leaves it
    expected = {seed: state(seed) for seed in (1, 2)}
    stop, swaps, failures, seen = threading.Event(), [], [], {1: 0, 2: 0}
    thread = threading.Thread(target=replace_in_a_loop, args=(root, versions, stop, swaps))
    thread.start()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                loaded = asyncckpt.load(root) if newest else asyncckpt.load(root, step=STEP)
            except asyncckpt.CheckpointError as e:
                failures.append(e)
                continue
            assert same(loaded, expected[loaded["seed"]])
            seen[loaded["seed"]] += 1
    finally:
        stop.set()
        thread.join()
    assert len(swaps) > 20, "the replacing thread barely ran"
    assert failures == []
    assert seen[1] and seen[2]


@pytest.mark.parametrize("newest", [False, True])
def test_a_step_renamed_back_just_after_the_wait_gave_up_is_read(versions, tmp_path,
                                                                monkeypatch, newest):
    """A replace without an exchange whose second rename comes only after the reader
    stopped waiting for it (a slow fsync of the root between the two renames): the load
    opens the step again and reads the new version, rather than calling it damaged."""
    root = tmp_path / "root"
    root.mkdir()
    final = root / step_dir_name(STEP)
    shutil.copytree(versions[1], final)
    PosixStorage(root).write_latest(STEP)
    real_open = PosixStorage.open_checkpoint_dir
    real_came_back = PosixStorage.came_back
    aside = final.with_name(f"{final.name}.replaced-0badf00d")

    def open_while_set_aside(self, where):  # the first rename lands as the load opens
        if not aside.exists() and final.exists() and not hasattr(open_while_set_aside, "done"):
            open_while_set_aside.done = True
            os.rename(final, aside)
        return real_open(self, where)

    def gave_up_then_renamed_in(self, directory):
        monkeypatch.setattr(posix, "REPLACE_WAIT", 0.01)
        came = real_came_back(self, directory)
        shutil.copytree(versions[2], final)  # the second rename, just after the wait
        shutil.rmtree(aside)
        return came

    monkeypatch.setattr(posix, "_exchange", lambda a, b: False)
    monkeypatch.setattr(PosixStorage, "open_checkpoint_dir", open_while_set_aside)
    monkeypatch.setattr(PosixStorage, "came_back", gave_up_then_renamed_in)
    loaded = asyncckpt.load(root) if newest else asyncckpt.load(root, step=STEP)
    assert same(loaded, state(2)) and getattr(open_while_set_aside, "done", False)


def test_a_checkpoint_reads_the_version_it_opened_after_a_replace(versions, tmp_path):
    """Opened before a replace and read after it (its readers made before or after the
    swap, the replaced directory deleted meanwhile): it reads the version it opened,
    whole and verified, and `swapped()` says a newer one is at its name."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(versions[1], root / step_dir_name(STEP))
    with Checkpoint.open(root, STEP) as early, Checkpoint.open(root, STEP) as late:
        early.reader(0)
        assert not early.swapped()
        swaps: list[int] = []
        replace_in_a_loop(root, versions, _stop_after_one(), swaps)
        assert swaps == [2] and [p.name for p in root.iterdir()] == [step_dir_name(STEP)]
        assert early.swapped() and late.swapped()
        for ckpt in (early, late):
            tensors = {leaf.path[-1]: ckpt.read_full(leaf.tensor) for leaf in ckpt.leaves(0)}
            assert all(torch.equal(tensors[k], v) for k, v in state(1)["model"].items())
    assert asyncckpt.load(root, step=STEP)["seed"] == 2


class _stop_after_one:
    """An Event-like stop that lets `replace_in_a_loop` make exactly one swap."""

    def __init__(self) -> None:
        self._calls = 0

    def is_set(self) -> bool:
        self._calls += 1
        return self._calls > 1
