"""The Lightning markers' rules (asyncckpt/integrations/lightning_marker.py) on a real
root: what a pending marker loads, and which step numbers a new save must leave alone.
No Lightning here: the module imports none (the plugin is tested with the real package
in tests/integrations/frameworks/)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.errors import CheckpointNotFoundError
from asyncckpt.format.timeline import TimelineStart, new_timeline_id
from asyncckpt.integrations import lightning_marker as markers


def committed_root(tmp_path: Path, steps: list[int]) -> Path:
    root = tmp_path / "ckpts" / "asyncckpt"
    with InProcessWriter(root, codec="raw") as writer, \
            asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
        for step in steps:
            client.save(step, {"w": torch.full((4,), float(step))}).wait(60)
    return root.resolve()


def test_a_pending_marker_reads_as_pending_and_its_final_one_replaces_it(tmp_path: Path) -> None:
    root = (tmp_path / "asyncckpt").resolve()
    path = tmp_path / "sub" / "last.ckpt"
    markers.write_pending(path, root, 3)
    marker = markers.marker_of(path)
    assert marker is not None and (marker.root, marker.step, marker.pending) == (root, 3, True)
    assert markers.read_marker(path) == (root, 3)
    markers.write_marker(path, root, 3)
    marker = markers.marker_of(path)
    assert marker is not None and not marker.pending
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no tmp left


def test_a_pending_marker_over_a_symbolic_link_replaces_the_link(tmp_path: Path) -> None:
    root = (tmp_path / "asyncckpt").resolve()
    target = tmp_path / "step=2.ckpt"
    markers.write_marker(target, root, 1)
    link = tmp_path / "last.ckpt"
    link.symlink_to(target.name)
    markers.write_pending(link, root, 2)
    assert not link.is_symlink() and markers.read_marker(link) == (root, 2)
    assert markers.read_marker(target) == (root, 1)  # the file it pointed to is untouched


def test_a_pending_marker_whose_step_committed_loads_that_step(tmp_path: Path) -> None:
    root = committed_root(tmp_path, [1, 2])
    path = tmp_path / "ckpts" / "step=4.ckpt"
    markers.write_pending(path, root, 2)
    marker = markers.marker_of(path)
    assert marker is not None and markers.resolve_marker(path, marker) == 2


def linked(path: Path) -> Path:
    """A `save_last="link"` link to `path` beside it."""
    link = path.with_name("last.ckpt")
    link.symlink_to(path.name)
    return link


def test_through_a_link_a_save_that_never_completed_loads_the_step_before(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = committed_root(tmp_path, [1, 2, 5])
    path = tmp_path / "ckpts" / "step=8.ckpt"
    markers.write_pending(path, root, 4)  # 4 never committed; 5 is a later save's, not before it
    link = linked(path)
    marker = markers.marker_of(link)
    assert marker is not None
    with caplog.at_level(logging.WARNING, logger="asyncckpt.lightning"):
        assert markers.resolve_marker(link, marker) == 2
    assert "step 4, whose save never completed" in caplog.text and "loading step 2" in caplog.text


def test_a_file_whose_save_never_completed_loads_the_newest_committed_step_before(
        tmp_path: Path) -> None:
    root = committed_root(tmp_path, [1, 2, 3])
    over = tmp_path / "ckpts" / "last.ckpt"  # saved over: it named 1, then 7 (never saved)
    markers.write_pending(over, root, 4, before=[1, 7])
    marker = markers.marker_of(over)
    assert marker is not None and marker.before == (1, 7)
    assert markers.resolve_marker(over, marker) == 3  # as Lightning's IO leaves: the last
    new = tmp_path / "ckpts" / "step=9.ckpt"
    markers.write_pending(new, root, 3)  # committed since: its own
    marker = markers.marker_of(new)
    assert marker is not None and markers.resolve_marker(new, marker) == 3


def test_a_pending_marker_waits_for_a_writer_still_running_on_the_root(tmp_path: Path) -> None:
    """The process that saved it was killed and its writer is still committing: every
    rank must resolve the marker alike, so the load waits for that writer to end."""
    root = tmp_path / "ckpts" / "asyncckpt"
    path = tmp_path / "ckpts" / "last.ckpt"
    with InProcessWriter(root, codec="raw") as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
            client.save(1, {"w": torch.zeros(4)}).wait(60)
        markers.write_pending(path, root.resolve(), 2)

        def commit_then_stop() -> None:
            time.sleep(0.5)
            with asyncckpt.connect(writer.address, rank=0, world_size=1) as late:
                late.save(2, {"w": torch.ones(4)}).wait(60)
            writer.stop()

        late = threading.Thread(target=commit_then_stop)
        late.start()
        marker = markers.marker_of(path)
        assert marker is not None
        try:
            assert markers.resolve_marker(path, marker, wait=30) == 2
        finally:
            late.join()
    assert markers.resolve_marker(path, marker, wait=0) == 2


def test_step_numbers_are_reserved_beside_the_root_ahead_of_the_saves(tmp_path: Path) -> None:
    root = tmp_path / "ckpts" / "asyncckpt"
    assert markers.reserved(root) == 0  # none yet
    upto = markers.reserve(root, 5)
    assert upto == 5 + markers.RESERVE_BLOCK == markers.reserved(root)
    assert markers.reserve(root, 3) == upto + markers.RESERVE_BLOCK  # never goes down
    reservation = tmp_path / "ckpts" / ".asyncckpt.lightning-steps"
    assert reservation.read_text() == f"{upto + markers.RESERVE_BLOCK}\n"
    for junk in ("", "-3", "x", str(1 << 70)):
        reservation.write_text(junk)
        assert markers.reserved(root) == 0, junk


def test_the_steps_a_file_names(tmp_path: Path) -> None:
    root = (tmp_path / "asyncckpt").resolve()
    path = tmp_path / "last.ckpt"
    assert markers.steps_named(path, root) == set()  # no file
    markers.write_marker(path, root, 3)
    assert markers.steps_named(path, root) == {3}
    markers.write_pending(path, root, 5, before=[3, 4])
    assert markers.steps_named(path, root) == {3, 4, 5}
    assert markers.steps_named(path, (tmp_path / "other").resolve()) == set()
    link = tmp_path / "link.ckpt"
    link.symlink_to(path.name)
    assert markers.steps_named(link, root) == set()  # the file it points to names them


def test_a_link_with_nothing_committed_before_it_is_refused(tmp_path: Path) -> None:
    root = committed_root(tmp_path, [3])
    link = linked(tmp_path / "ckpts" / "step=2.ckpt")
    markers.write_pending(tmp_path / "ckpts" / "step=2.ckpt", root, 2)
    marker = markers.marker_of(link)
    assert marker is not None
    with pytest.raises(CheckpointNotFoundError, match="no committed step before it"):
        markers.resolve_marker(link, marker)


def test_a_final_marker_names_its_step_as_it_is(tmp_path: Path) -> None:
    root = committed_root(tmp_path, [1])
    path = tmp_path / "ckpts" / "x.ckpt"
    markers.write_marker(path, root, 7)  # not committed: the load says so, not the resolution
    marker = markers.marker_of(path)
    assert marker is not None and markers.resolve_marker(path, marker) == 7


def test_a_pending_marker_falls_back_within_the_roots_timeline(tmp_path: Path) -> None:
    """1, 2, 3 saved; a run resumed from 1 saved 2 again (3 abandoned); a pending marker
    of its step 4 that never completed loads its 2, never the abandoned 3."""
    root = tmp_path / "ckpts" / "asyncckpt"
    with InProcessWriter(root, codec="raw") as writer, \
            asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
        for step in (1, 2, 3):
            client.save(step, {"w": torch.full((4,), float(step))}).wait(60)
        fork = TimelineStart(id=new_timeline_id(), at=1, based_on=0)
        client.save(2, {"w": torch.full((4,), 20.0)}, replace=True, timeline=fork).wait(60)
    path = tmp_path / "ckpts" / "step=8.ckpt"
    markers.write_pending(path, root.resolve(), 4)
    link = linked(path)
    marker = markers.marker_of(link)
    assert marker is not None and markers.resolve_marker(link, marker) == 2
    assert asyncckpt.load(root, step=2)["w"][0].item() == 20.0


def test_pending_steps_are_the_pending_markers_of_that_root_only(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    root, other = (folder / "asyncckpt").resolve(), (tmp_path / "other").resolve()
    markers.write_pending(folder / "a.ckpt", root, 4)
    markers.write_pending(folder / "b.ckpt", root, 6)
    markers.write_pending(folder / "c.ckpt", other, 9)  # another root's
    markers.write_marker(folder / "d.ckpt", root, 8)  # final
    torch.save({"x": 1}, folder / "e.ckpt")  # Lightning's own
    (folder / "f.ckpt").symlink_to("a.ckpt")
    (folder / "g.ckpt").mkdir()  # a sharded checkpoint's folder
    (folder / "h.txt").write_text('{"asyncckpt": 1, "root": "asyncckpt", "step": 7, '
                                  '"pending": true}')  # not a .ckpt
    assert sorted(markers.pending_steps(folder, root)) == [4, 6]
    assert markers.pending_steps(tmp_path / "missing", root) == []


def test_a_marker_is_not_read_from_a_large_or_foreign_file(tmp_path: Path) -> None:
    big = tmp_path / "big.ckpt"
    big.write_bytes(b'{"asyncckpt": 1, "root": "r", "step": 1}' + b" " * 5000)
    assert markers.marker_of(big) is None
    for text in ('{"asyncckpt": 2, "root": "r", "step": 1}', '{"root": "r", "step": 1}',
                 '{"asyncckpt": 1, "root": "r", "step": 1, "before": [true]}',
                 '{"asyncckpt": 1, "root": "r", "step": -1}',
                 '{"asyncckpt": 1, "root": "r", "step": ' + str(1 << 62) + "}",
                 '{"asyncckpt": 1, "root": "r", "step": 1, "before": [' + str(1 << 62) + "]}",
                 '{"asyncckpt": 1, "root": "r", "step": true}', "[1]", "{not json"):
        path = tmp_path / "x.ckpt"
        path.write_text(text)
        assert markers.marker_of(path) is None, text


def test_a_number_past_the_reservation_goes_above_another_processs(tmp_path: Path) -> None:
    root = tmp_path / "ckpts" / "asyncckpt"
    step, upto = markers.claim(root, 1, None)
    assert (step, upto) == (1, 1 + markers.RESERVE_BLOCK)
    assert markers.claim(root, 5, upto) == (5, upto)  # within ours: no write
    markers.reserve(root, 200)  # another process (of the same job) reserved since
    step, again = markers.claim(root, upto + 1, upto)
    assert step == 200 + markers.RESERVE_BLOCK + 1 and again == step + markers.RESERVE_BLOCK


def test_a_stale_pending_marker_does_not_wait_for_a_later_writer(tmp_path: Path) -> None:
    """A killed run's pending step 2 never committed; the relaunch's writer runs and has
    committed step 3: nothing can commit 2 any more, so a load does not wait."""
    root = tmp_path / "ckpts" / "asyncckpt"
    path = tmp_path / "ckpts" / "step=4.ckpt"
    with InProcessWriter(root, codec="raw") as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
            for step in (1, 3):
                client.save(step, {"w": torch.full((4,), float(step))}).wait(60)
        markers.write_pending(path, root.resolve(), 2)
        marker = markers.marker_of(path)
        assert marker is not None
        started = time.monotonic()
        assert markers.resolve_marker(path, marker, wait=30) == 1
        assert time.monotonic() - started < 5


def test_a_writers_lock_file_tells_whether_it_runs(tmp_path: Path) -> None:
    import fcntl

    from asyncckpt.writer.owners import OWNER_PREFIX, writer_running
    assert not writer_running(tmp_path / "missing")
    stale = tmp_path / f"{OWNER_PREFIX}0badc0de"
    stale.write_bytes(b"")  # a killed writer's, its lock released by the kernel
    assert not writer_running(tmp_path)
    live = tmp_path / f"{OWNER_PREFIX}12345678"
    with open(live, "wb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert writer_running(tmp_path)
    assert not writer_running(tmp_path)
