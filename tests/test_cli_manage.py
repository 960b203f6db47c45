"""`asyncckpt inspect` and `asyncckpt gc`."""

from __future__ import annotations

import json

import pytest
import torch

import asyncckpt
from asyncckpt.cli import main
from asyncckpt.storage.posix import PosixStorage
from asyncckpt.storage.registry import open_storage


@pytest.mark.parametrize("codec", ["zstd"], indirect=True)
def test_inspect_reports_tensors_and_ratio_per_dtype(client, root, capsys):
    state = {"w": torch.zeros(1_000_000, dtype=torch.bfloat16), "r": torch.randn(20_000),
             "opt": {0: {"m": torch.zeros(10)}}}
    client.save(5, state).wait(30)
    assert main(["inspect", str(root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 5 and out["codecs"] == ["zstd"]
    names = {t["name"]: t for t in out["tensors"]}
    assert names["w"]["shape"] == [1_000_000] and names["w"]["bytes"] == 2_000_000
    assert names["opt.0.m"]["dtype"] == "F32"
    assert out["by_dtype"]["BF16"]["ratio"] < 0.05      # zeros compress to nothing
    assert 0.5 < out["by_dtype"]["F32"]["ratio"] < 1.01  # random floats compress little
    stored = sum(t["stored_bytes"] for t in out["tensors"])
    assert stored <= out["stored_bytes"]
    assert main(["inspect", str(root)]) == 0
    assert "BF16" in capsys.readouterr().out
    assert main(["inspect", str(root / "nothing")]) == 2


@pytest.mark.process
def test_gc_keeps_last_and_every_and_refuses_a_live_writer(tmp_path, capsys):
    root = tmp_path / "gc"
    writer = asyncckpt.start_writer(root, log_file=tmp_path / "w.log")
    with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
        for step in range(1, 8):
            client.save(step * 10, {"s": torch.tensor(step)}).wait(30)
    assert main(["gc", str(root), "--keep-last", "2"]) == 3  # the writer holds the root
    writer.stop()
    (root / "step-00000099.tmp-ab").mkdir()
    capsys.readouterr()
    assert main(["gc", str(root), "--keep-last", "2", "--keep-every", "30", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["deleted_steps"] == [10, 20, 40, 50]
    assert out["removed_tmp"] == ["step-00000099.tmp-ab"]
    assert PosixStorage(root).committed_steps() == out["kept_steps"] == [30, 60, 70]
    assert not (root / "step-00000099.tmp-ab").exists()
    assert PosixStorage(root).read_latest() == 70


def test_every_option_says_what_it_does_and_every_command_its_exit_status():
    import argparse

    from asyncckpt.cli_parser import EXIT_STATUS, parser
    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) == set(EXIT_STATUS)
    for name, sub in commands.choices.items():
        assert sub.epilog.startswith("exit status: 0 "), name
        for action in sub._actions:
            if action.help != argparse.SUPPRESS:
                assert action.help, f"asyncckpt {name} {action.dest}: no help text"


@pytest.mark.parametrize("codec", ["raw"], indirect=True)
def test_inspect_marks_a_name_it_cuts(client, root, capsys):
    long = "model.layers.17.self_attention.query_key_value.weight"  # 53 characters
    client.save(1, {long: torch.ones(4), "short": torch.ones(2)}).wait(30)
    assert main(["inspect", str(root)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert any(f" {long[:39]}… " in row for row in rows)
    assert any(" short " in row and "…" not in row for row in rows)


@pytest.fixture(params=["posix", "s3"])
def any_root(request, tmp_path) -> str:
    """A fresh root of each backend, by its text."""
    return str(tmp_path / "root") if request.param == "posix" else \
        request.getfixturevalue("s3_root")


def _abandon(root: str, step: int, size: int) -> str:
    """A save of `step` that a writer began and never published; where it lies."""
    storage = open_storage(root)
    tmp = storage.make_tmp(step)
    out = storage.create_data_file(tmp, "rank-00000.safetensors.zst", 0)
    out.append([memoryview(b"x" * size)])
    out.sync()
    out.close()
    return str(tmp)


@pytest.mark.process
def test_ls_and_gc_behave_the_same_on_both_backends(any_root, tmp_path, capsys):
    """`ls` lists a save under way on a bucket too (it listed the root with os.listdir,
    so a bucket's never showed), and `gc` sweeps it and prunes alike on both."""
    writer = asyncckpt.start_writer(any_root, log_file=tmp_path / "w.log")
    with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
        for step in (1, 2, 3):
            client.save(step, {"s": torch.tensor(step)}).wait(60)
    writer.stop()
    where = _abandon(any_root, 4, 4096)
    capsys.readouterr()
    assert main(["ls", "--json", any_root]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["timeline"] == {"id": "", "gen": 0, "lineage": []}  # never forked
    rows = listed["steps"]
    assert [(r["step"], r["state"], r["latest"]) for r in rows] == [
        (1, "committed", False), (2, "committed", False), (3, "committed", True),
        (4, "in-progress", False)]
    assert rows[3]["path"] == where and rows[3]["stored_bytes"] == 4096
    assert 0 <= rows[3]["age_seconds"] < 600
    assert main(["ls", any_root]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[:2] == ["4", "in-progress"]

    hold = open_storage(any_root).take("another job")
    try:
        assert main(["gc", any_root, "--keep-last", "1"]) == 3  # a writer holds the root
    finally:
        hold.release()
    capsys.readouterr()
    assert main(["gc", any_root, "--keep-last", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["deleted_steps"] == [1] and len(out["removed_tmp"]) == 1
    assert out["kept_steps"] == open_storage(any_root).committed_steps() == [2, 3]
    assert main(["ls", "--json", any_root]) == 0
    assert [r["state"] for r in json.loads(capsys.readouterr().out)["steps"]] == \
        ["committed"] * 2


@pytest.mark.parametrize("command", [["ls"], ["gc", "--keep-last", "1"]])
def test_ls_and_gc_refuse_a_root_that_holds_nothing(command, tmp_path, capsys):
    assert main([*command, str(tmp_path / "absent")]) == 2
    assert "asyncckpt" in capsys.readouterr().err


def test_ls_memory_lists_the_writers_generations_beside_the_root(tmp_path, capsys,
                                                                 monkeypatch):
    """`ls --memory` adds what the node writer holds in memory; no writer there is exit 2."""
    from inprocess import InProcessWriter

    from asyncckpt.rank.client import Client
    with InProcessWriter(tmp_path / "root", codec="raw", export=False) as w:
        client = Client(w.address, rank=0, world_size=1, slot_size=1 << 16, ring_size=1 << 18)
        try:
            client.save(1, {"w": torch.ones(64)}).wait(30)
            client.save(2, {"w": torch.zeros(64)}, tier="memory").wait(30)
        finally:
            client.close()
        monkeypatch.setenv("ASYNCCKPT_ADDRESS", w.address)
        assert main(["ls", str(tmp_path / "root"), "--memory", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["steps"]
        assert [(r["step"], r["state"]) for r in rows] == [(1, "committed"), (2, "memory")]
        assert rows[1]["path"] == f"memory of {w.address} (ranks 0)"
        assert main(["ls", str(tmp_path / "root"), "--memory"]) == 0
        table = capsys.readouterr().out
        assert "memory of" in table and " 2  memory" in table
    monkeypatch.delenv("ASYNCCKPT_ADDRESS")
    assert main(["ls", str(tmp_path / "root"), "--memory"]) == 2
    assert "no writer address" in capsys.readouterr().err
    assert main(["ls", str(tmp_path / "root"), "--memory", str(tmp_path / "nowhere.sock")]) == 2
    assert "memory generations" in capsys.readouterr().err
