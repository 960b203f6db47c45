"""`asyncckpt verify` and `asyncckpt ls`, and the data files as standard formats.

Most cases call `asyncckpt.cli.main(argv)` in-process (exit code returned, output captured):
`verify` imports torch, so each real subprocess costs ~2.5 s on these machines. The
`cli_runs` fixture still runs the installed console script and `python -m asyncckpt` as
real subprocesses, concurrently, for the cases that matter end to end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import test_reader
from conftest import assert_same
from test_reader import (
    Saved,
    copy_steps,
    flip_byte,
    frame_inside,
    hangs,
    reader_state,
    resign_manifest,
)
from tiers import process_fixture

from asyncckpt import cli
from asyncckpt.format.layout import MANIFEST_NAME
from asyncckpt.rank.flatten import flatten
from asyncckpt.storage.local import read_manifest

SCRIPT = str(Path(sys.executable).parent / "asyncckpt")
saved = test_reader.saved  # the module's fixture: steps 1 and 2 committed once per codec


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def own(saved: Saved, tmp_path: Path) -> Path:
    return copy_steps(saved, tmp_path / "root")


def damage_tensor_frame(saved: Saved, directory: Path) -> int:
    index = frame_inside(read_manifest(directory), "model.w")
    frame = read_manifest(directory).ranks[0].frames[index]
    flip_byte(directory / saved.data_name, frame.stored_offset + frame.stored_length // 2)
    return index


def lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.strip()]


# -- real subprocesses, run together --------------------------------------------------------------

@pytest.fixture(scope="module")
@process_fixture
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A zstd root (step 1 good, step 2 with a flipped tensor byte); the console script and
    `python -m asyncckpt` then run on it as real subprocesses, concurrently."""
    import asyncckpt
    base = tmp_path_factory.mktemp("cli")
    writer = asyncckpt.start_writer(base / "ckpt", codec="zstd", log_file=base / "writer.log")
    try:
        client = asyncckpt.connect(writer.address, rank=0, world_size=1,
                                   slot_size=64 << 10, ring_size=256 << 10)
        for step in (1, 2):
            client.save(step, reader_state(step)).wait(60)
        client.close(timeout=30)
    finally:
        writer.stop(timeout=30)
    root = writer.root
    index = damage_tensor_frame(Saved(root, "zstd", {}), root / "step-00000002")
    commands = {
        "verify": [SCRIPT, "verify", str(root)],
        "verify-json": [SCRIPT, "verify", "--json", str(root / "step-00000001")],
        "ls-json": [sys.executable, "-m", "asyncckpt", "ls", "--json", str(root)],
    }
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    stdin=subprocess.DEVNULL) for name, cmd in commands.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[name] = (proc.returncode, out, err)
    yield {"root": root, "index": index, **results}


@pytest.mark.process  # runs a command
def test_console_script_verify_reports_ok_and_corrupt(cli_runs):
    rc, out, err = cli_runs["verify"]
    root = cli_runs["root"]
    assert rc == 1, err
    ok, bad = lines(out)
    assert ok.startswith("OK") and str(root / "step-00000001") in ok and "frames" in ok
    assert bad.startswith("CORRUPT") and str(root / "step-00000002") in bad
    assert f"frame {cli_runs['index']}" in bad and "xxh3" in bad
    assert "rank-00000.safetensors.zst" in bad
    assert "Traceback" not in err


def test_console_script_verify_json_on_a_good_checkpoint(cli_runs):
    rc, out, err = cli_runs["verify-json"]
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["ok"] is True and len(doc["checkpoints"]) == 1
    c = doc["checkpoints"][0]
    m = read_manifest(cli_runs["root"] / "step-00000001")
    assert c["ok"] is True and c["problems"] == [] and c["step"] == 1
    assert (c["raw_bytes"], c["stored_bytes"]) == (m.raw_size, m.stored_size)
    assert c["frames"] == len(m.ranks[0].frames) >= 4


def test_python_m_ls_json(cli_runs):
    rc, out, err = cli_runs["ls-json"]
    assert rc == 0, err
    rows = json.loads(out)["steps"]
    assert [(r["step"], r["state"], r["latest"]) for r in rows] == [(1, "committed", False),
                                                                      (2, "committed", True)]


# -- verify (in-process) --------------------------------------------------------------------------

def test_verify_good_root_prints_ok_per_checkpoint(saved, capsys):
    rc, out, err = run(capsys, "verify", str(saved.root))
    assert rc == 0 and err == ""
    got = lines(out)
    assert len(got) == 2 and all(line.startswith("OK ") for line in got)
    assert str(saved.step_dir(1)) in got[0] and str(saved.step_dir(2)) in got[1]


def test_verify_single_checkpoint_directory(saved, capsys):
    rc, out, _ = run(capsys, "verify", str(saved.step_dir(1)))
    assert rc == 0 and lines(out) == [lines(out)[0]] and str(saved.step_dir(1)) in out


@pytest.mark.parametrize("name", ["nowhere", "step-00000031"])
def test_verify_of_a_path_that_does_not_exist_says_so_and_exits_2(saved, capsys, name):
    """Never CORRUPT: a mistyped root or step is a usage error."""
    rc, out, err = run(capsys, "verify", str(saved.root / name))
    assert rc == 2 and "CORRUPT" not in out + err
    assert f"{saved.root / name} does not exist" in err


def test_verify_flipped_byte(saved, own, capsys):
    index = damage_tensor_frame(saved, own / "step-00000002")
    rc, out, _ = run(capsys, "verify", str(own))
    assert rc == 1
    ok, bad = lines(out)
    assert ok.startswith("OK") and "step-00000001" in ok
    assert bad.startswith("CORRUPT") and "step-00000002" in bad
    assert f"frame {index}" in bad and "xxh3" in bad and saved.data_name in bad


def test_verify_json_reports_the_problem(saved, own, capsys):
    index = damage_tensor_frame(saved, own / "step-00000002")
    rc, out, _ = run(capsys, "verify", "--json", str(own))
    assert rc == 1
    doc = json.loads(out)
    assert doc["ok"] is False
    good, bad = doc["checkpoints"]
    assert good["ok"] is True and good["step"] == 1
    assert bad["ok"] is False and bad["step"] == 2 and len(bad["problems"]) == 1
    assert f"frame {index}" in bad["problems"][0] and saved.data_name in bad["problems"][0]


def test_verify_catches_a_flipped_header_byte(saved, own, capsys):
    d = own / "step-00000002"
    frame = read_manifest(d).ranks[0].frames[0]
    flip_byte(d / saved.data_name, frame.stored_offset + frame.stored_length // 2)
    rc, out, _ = run(capsys, "verify", str(d))
    assert rc == 1 and "CORRUPT" in out and "frame 0" in out


def test_verify_catches_a_header_that_disagrees_with_the_manifest(saved, own, capsys):
    """A re-signed manifest that reinterprets a tensor (F32 -> I32, same size): every frame
    checksum still matches, but the data file's safetensors header says F32."""
    d = own / "step-00000002"

    def edit(doc):
        spec = next(t for t in doc["ranks"][0]["tensors"] if t["name"] == "model.b")
        spec["dtype"] = "I32"
    resign_manifest(d, edit)
    rc, out, _ = run(capsys, "verify", str(d))
    assert rc == 1 and "safetensors header differs from the manifest" in out


def test_verify_reports_an_extra_file(saved, own, capsys):
    (own / "step-00000001" / "notes.txt").write_text("hi")
    rc, out, _ = run(capsys, "verify", str(own))
    assert rc == 1
    bad = next(line for line in lines(out) if "step-00000001" in line)
    assert bad.startswith("CORRUPT") and "unexpected file 'notes.txt'" in bad


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest"])
def test_verify_reports_damaged_files(saved, own, capsys, damage):
    d = own / "step-00000002"
    if damage == "truncate":
        data = (d / saved.data_name).read_bytes()
        (d / saved.data_name).write_bytes(data[:-7])
        expect = f"data file has {len(data) - 7} bytes"
    elif damage == "delete":
        (d / saved.data_name).unlink()
        expect = f"missing file '{saved.data_name}'"
    else:
        flip_byte(d / MANIFEST_NAME, 100)
        expect = "manifest xxh3 mismatch"
    rc, out, _ = run(capsys, "verify", "--json", str(own))
    assert rc == 1
    bad = json.loads(out)["checkpoints"][1]
    assert bad["ok"] is False and bad["path"] == str(d)
    assert any(expect in p for p in bad["problems"]), bad["problems"]


def test_verify_reports_latest_pointing_to_a_missing_step(saved, own, capsys):
    (own / "latest").write_text("step-00000099\n")
    rc, out, _ = run(capsys, "verify", str(own))
    assert rc == 1
    got = lines(out)
    assert [line.split()[0] for line in got] == ["OK", "OK", "CORRUPT"]
    assert "latest" in got[2] and "'step-00000099'" in got[2]
    rc, out, _ = run(capsys, "verify", "--json", str(own))
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False and doc["checkpoints"][-1]["ok"] is False


def test_verify_latest_left_behind_by_a_deleted_manifest(saved, own, capsys):
    (own / "step-00000002" / MANIFEST_NAME).unlink()  # latest still names step 2
    rc, out, _ = run(capsys, "verify", str(own))
    got = lines(out)
    assert rc == 1 and got[0].startswith("OK") and "step-00000001" in got[0]
    assert len(got) == 3
    assert got[1].startswith("CORRUPT") and "step-00000002" in got[1] and "manifest" in got[1]
    assert got[2].startswith("CORRUPT") and "'step-00000002'" in got[2]  # latest


@pytest.mark.parametrize("what", ["empty-dir", "missing", "tmp-only"])
def test_verify_non_checkpoint_exits_2(tmp_path, capsys, what):
    path = tmp_path / "x"
    if what == "empty-dir":
        path.mkdir()
    elif what == "tmp-only":
        (path / "step-00000001.tmp-abcd").mkdir(parents=True)
    rc, out, err = run(capsys, "verify", str(path))
    assert rc == 2 and out == ""
    said = "does not exist" if what == "missing" else "holds no committed checkpoint"
    assert err.startswith("asyncckpt verify: ") and said in err


def test_verify_random_file_exits_2(tmp_path, capsys):
    (tmp_path / "random").write_bytes(os.urandom(100))
    rc, out, err = run(capsys, "verify", str(tmp_path / "random"))
    assert rc == 2 and "asyncckpt verify: " in err


def test_verify_reports_manifest_step_differing_from_directory(saved, tmp_path, capsys):
    root = tmp_path / "r"
    root.mkdir()
    shutil.copytree(saved.step_dir(1), root / "step-00000005")
    rc, out, _ = run(capsys, "verify", str(root))
    assert rc == 1 and "CORRUPT" in out


def test_verify_manifest_fifo_does_not_hang(tmp_path, capsys):
    d = tmp_path / "step-00000001"
    d.mkdir()
    os.mkfifo(d / MANIFEST_NAME)
    hung, result = hangs(lambda: cli.main(["verify", str(d)]), d / MANIFEST_NAME)
    assert not hung, "verify blocked opening a FIFO"
    assert result.get("value") in (1, 2)


# -- ls -------------------------------------------------------------------------------------------

def test_ls_lists_committed_and_in_progress(saved, own, capsys):
    tmp = own / "step-00000003.tmp-abcd"
    tmp.mkdir()
    (tmp / "rank-00000.safetensors.zst").write_bytes(b"x" * 4096)
    rc, out, err = run(capsys, "ls", str(own))
    assert rc == 0 and err == ""
    header, *rows = lines(out)
    assert header.split() == ["STEP", "STATE", "SIZE", "RATIO", "AGE", "PATH"]
    assert [r.split()[:2] for r in rows] == [
        ["1", "committed"], ["2", "committed"], ["3", "in-progress"]]
    assert rows[1].endswith("<- latest") and not rows[0].endswith("<- latest")
    assert rows[2].split()[-1] == str(tmp)

    rc, out, _ = run(capsys, "ls", "--json", str(own))
    doc = json.loads(out)["steps"]
    assert rc == 0 and [(r["step"], r["state"], r["latest"]) for r in doc] == [
        (1, "committed", False), (2, "committed", True), (3, "in-progress", False)]
    m = read_manifest(own / "step-00000002")
    assert doc[1]["stored_bytes"] == m.stored_size and doc[1]["raw_bytes"] == m.raw_size
    assert doc[1]["world_size"] == 1 and doc[1]["path"] == str(own / "step-00000002")
    assert doc[2]["stored_bytes"] == 4096 and doc[2]["path"] == str(tmp)
    assert abs(doc[1]["ratio"] - m.stored_size / m.raw_size) < 1e-9


def test_ls_marks_damaged_steps(saved, own, capsys):
    flip_byte(own / "step-00000001" / MANIFEST_NAME, 50)
    (own / "step-00000007").mkdir()  # no manifest: a damaged step, as load(root) sees it
    rc, out, _ = run(capsys, "ls", "--json", str(own))
    doc = json.loads(out)["steps"]
    assert rc == 0 and [(r["step"], r["state"]) for r in doc] == [
        (1, "damaged"), (2, "committed"), (7, "damaged")]
    assert "xxh3" in doc[0]["error"] and "has no manifest.json" in doc[2]["error"]


@pytest.mark.parametrize("what", ["missing", "file"])
def test_ls_non_directory_exits_2(tmp_path, capsys, what):
    path = tmp_path / "x"
    if what == "file":
        path.write_text("x")
    rc, out, err = run(capsys, "ls", str(path))
    assert rc == 2 and out == "" and "is not a directory" in err


def test_ls_empty_root(tmp_path, capsys):
    rc, out, _ = run(capsys, "ls", "--json", str(tmp_path))
    assert rc == 0 and json.loads(out) == {"timeline": {"id": "", "gen": 0, "lineage": []},
                                            "steps": []}


# -- data files are standard safetensors / zstd ---------------------------------------------------

@pytest.mark.process  # runs a command
def test_data_file_is_standard_safetensors(saved, tmp_path):
    """raw: the file *is* safetensors; zstd: `zstd -d` turns it into one."""
    path = saved.step_dir(2) / saved.data_name
    _, entries = flatten(saved.states[2])
    expected = {e.name: e.tensor for e in entries}
    assert "model.w" in expected and "optim.state.0.exp_avg" in expected  # dotted paths
    if saved.codec == "raw":
        with safetensors.safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt", "writer": "asyncckpt"}
            got = {name: f.get_tensor(name) for name in f.keys()}
    else:
        plain = subprocess.run(["zstd", "-d", "-c", "-q", str(path)], capture_output=True,
                               check=True, timeout=60).stdout
        assert len(plain) == read_manifest(saved.step_dir(2)).ranks[0].raw_size
        got = safetensors.torch.load(plain)
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert_same(t, got[name], name)


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    import asyncckpt
    assert capsys.readouterr().out.strip() == f"asyncckpt {asyncckpt.__version__}"


# -- the Python API and the progress bar ----------------------------------------------------------

def test_verify_function_reports_and_never_raises_for_corruption(saved, own):
    import asyncckpt
    good = asyncckpt.verify(own)
    assert good.ok and [r.step for r in good.checkpoints] == [1, 2] and good.problems == []
    index = damage_tensor_frame(saved, own / "step-00000002")
    (own / "step-00000001" / "planted.bin").write_bytes(b"x" * 10)
    report = asyncckpt.verify(own)
    assert not report.ok and [r.ok for r in report.checkpoints] == [False, False]
    assert "unexpected file 'planted.bin'" in report.checkpoints[0].problems[0]
    assert f"frame {index}" in report.checkpoints[1].problems[0]
    assert report.to_json()["ok"] is False and len(report.to_json()["checkpoints"]) == 2
    single = asyncckpt.verify(own / "step-00000002")
    assert [r.path for r in single.checkpoints] == [str(own / "step-00000002")] and not single.ok


def test_verify_function_raises_not_found_for_a_non_checkpoint(tmp_path):
    import asyncckpt
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "nowhere"):
        with pytest.raises(asyncckpt.CheckpointNotFoundError):
            asyncckpt.verify(path)


class _Terminal:
    """A stderr that says it is a terminal and keeps what is written."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


def test_verify_root_progress_bar_total_and_advance_use_the_same_bytes(saved, own, capsys,
                                                                      monkeypatch):
    """Regression: the total summed the directory's file sizes (manifest, planted files)
    and the bar advanced by frame bytes, so it never reached 100 %."""
    (own / "step-00000001" / "planted.bin").write_bytes(b"x" * 100_000)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    cli.main(["verify", str(own)])
    draws = [d for d in terminal.text.split("\r") if d.startswith("step-")]
    by_step: dict[str, list[float]] = {}
    for d in draws:
        name, pct = d.split(" [")[0], float(d.rsplit("]", 1)[1].strip().rstrip("%"))
        by_step.setdefault(name, []).append(pct)
    assert set(by_step) == {"step-00000001", "step-00000002"}
    for name, pcts in by_step.items():
        assert pcts == sorted(pcts) and pcts[-1] == 100.0, (name, pcts[-3:])
