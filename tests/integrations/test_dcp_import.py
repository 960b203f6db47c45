"""`asyncckpt import-dcp`: a checkpoint `dcp.save` wrote (FileSystemWriter, torchtitan's
`step-N` folder) becomes a verified asyncckpt step, read in bounded parts, objects kept
without running pickle code."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import asyncckpt
from asyncckpt.dcp import StorageReader
from asyncckpt.errors import UntrustedPickleError
from asyncckpt.storage.local import read_manifest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Opaque:
    """An object only a pickle holds: it comes back through DCP only when trusted, and is
    never run here."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value


def dcp_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(),
            "extra": {"step": 5, "seen": {1, 2}, "opaque": Opaque(7)}}


def import_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncckpt", "import-dcp", *args, "--json"],
                          capture_output=True, text=True, timeout=300)


def test_a_dcp_checkpoint_imports_as_a_verified_step(tmp_path):
    state = dcp_state()
    dcp.save(state, checkpoint_id=tmp_path / "titan" / "step-5")
    done = import_cli(str(tmp_path / "titan" / "step-5"), str(tmp_path / "root"), "--step", "5",
                      "--part-size", "20K")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "failed" not in done.stderr  # a part handed over is no failed save
    out = Path(json.loads(done.stdout)["out"])
    assert read_manifest(out).world_size == 4  # 20 KiB parts of 0.07 MiB of tensors
    assert asyncckpt.verify(tmp_path / "root").ok
    loaded = asyncckpt.load(tmp_path / "root")
    for name, tensor in state["model"].items():
        assert torch.equal(loaded[f"model.{name}"], tensor)
    assert loaded["extra.step"] == 5  # a plain value is stored as itself
    assert isinstance(loaded["extra.opaque"], bytes)  # the rest stays DCP's pickle
    target = dcp_state()
    target["extra"] = {"step": 0, "seen": None, "opaque": None}
    for t in torch.utils._pytree.tree_leaves(target):
        if isinstance(t, torch.Tensor):
            t.zero_()
    with pytest.raises(CheckpointException) as caught:  # an object of a class: only if trusted
        dcp.load(target, storage_reader=StorageReader(tmp_path / "root"))
    assert isinstance(caught.value.failures[0][0], UntrustedPickleError)
    assert "object 'extra.opaque': it needs test_dcp_import.Opaque" in str(caught.value)
    dcp.load(target, storage_reader=StorageReader(tmp_path / "root", trust_pickles=True))
    assert target["extra"] == state["extra"]
    assert torch.equal(target["optim"]["state"][0]["exp_avg"],
                       state["optim"]["state"][0]["exp_avg"])


def test_import_refuses_what_is_not_dcp_and_a_committed_step(tmp_path):
    (tmp_path / "plain").mkdir()
    done = import_cli(str(tmp_path / "plain"), str(tmp_path / "root"), "--step", "1")
    assert done.returncode == 1 and "no .metadata" in done.stderr
    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "src")
    assert import_cli(str(tmp_path / "src"), str(tmp_path / "root"), "--step", "1").returncode == 0
    again = import_cli(str(tmp_path / "src"), str(tmp_path / "root"), "--step", "1")
    assert again.returncode == 2 and "already committed" in again.stderr


PEAK = textwrap.dedent("""
    import sys
    from asyncckpt.integrations.dcp_import import import_dcp
    from asyncckpt.runtime.procstat import PeakSampler, read_status
    base = read_status("self")["RssAnon"]
    sampler = PeakSampler(interval=0.005)
    import_dcp(sys.argv[1], sys.argv[2], 1, part_bytes=8 << 20)
    print(sampler.stop() - base)
""")


def test_import_holds_about_one_part_in_private_memory(tmp_path):
    """288 MiB of tensors imported in 8 MiB parts add at most half of that to the
    importer's private memory (measured: 32 to 96 MiB, glibc's arenas keeping some of
    each part; all of the state would be 288 MiB and more)."""
    dcp.save({f"w{i}": torch.randn(2 << 20) for i in range(36)}, checkpoint_id=tmp_path / "src")
    done = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "src"),
                           str(tmp_path / "root")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    extra = int(done.stdout.split()[-1])
    assert extra < 144 << 20, f"{extra >> 20} MiB"
    assert asyncckpt.verify(tmp_path / "root").ok
