"""verl's own checkpoint test (`tests/special_distributed/test_fsdp_ckpt.py`, ported to
CPU in verl_fsdp_ckpt.py) through the drop-in: 2 ranks, each with its own
`tempfile.mkdtemp()`, for verl's `fsdp` (FSDP1) and `fsdp2` strategies, run twice into
the same directories. The port asserts what verl's test does (the state and the logits
after the load and a repeated update) and the optimizer and LR scheduler state too.

Here, around it: the checkpoint lives under rank 0's temp dir and nowhere else (rank
1's stays empty; nothing appears beside them in the ranks' TMPDIR), the second run
replaces the first run's step 0 (the rerun of a user who restarts from scratch into an
old directory), and the test's own `shutil.rmtree(temp_dir)` leaves nothing behind.

verl pins transformers below this venv's, so the ranks run in the verl venv that
`make verl-setup` builds (`make test` builds it first); without it these tests skip.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
PORT = str(Path(__file__).with_name("verl_fsdp_ckpt.py"))
VERL_PYTHON = os.environ.get("ASYNCCKPT_VERL_PYTHON", str(REPO / ".venv-verl" / "bin" / "python"))
WORLD = 2

pytestmark = pytest.mark.skipif(not Path(VERL_PYTHON).exists(),
                                reason=f"no verl venv at {VERL_PYTHON}: run `make verl-setup`")


def run_port(strategy: str, tmpdir: Path, rank_args: list[list[str]]) -> list[str]:
    """verl's test on WORLD ranks (rank r gets rank_args[r]), TMPDIR=tmpdir; their output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(WORLD),
           "WORLD_SIZE": str(WORLD), "STRATEGY": strategy, "TMPDIR": str(tmpdir),
           "PYTHONWARNINGS": "ignore",
           "TORCHINDUCTOR_CACHE_DIR": str(tmpdir.parent / "inductor")}  # torch's, not a save's
    procs = [subprocess.Popen([VERL_PYTHON, PORT, *rank_args[r]],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"OK rank {r}" in text, \
            f"{strategy} rank {r}/{WORLD}:\n{text[-4000:]}"
        assert "Checkpoint save/load test passed!" in text
    return outputs


def temp_dir_of(output: str) -> Path:
    lines = [line for line in output.splitlines() if line.startswith("TEMP_DIR ")]
    assert len(lines) == 1, output[-2000:]
    return Path(lines[0].split(" ", 1)[1])


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture(scope="module", params=["fsdp", "fsdp2"])
def first_run(request, tmp_path_factory) -> tuple[str, Path, list[Path], list[str]]:
    """verl's test once, each rank in its own mkdtemp() directory, kept for the rerun."""
    tmpdir = tmp_path_factory.mktemp(f"verl-{request.param}") / "tmp"
    tmpdir.mkdir()
    outputs = run_port(request.param, tmpdir, [["--keep"]] * WORLD)
    return request.param, tmpdir, [temp_dir_of(o) for o in outputs], outputs


def test_per_rank_temp_dirs_save_under_rank_0s_and_nowhere_else(first_run):
    strategy, tmpdir, dirs, outputs = first_run
    assert len(set(dirs)) == WORLD and all(d.parent == tmpdir for d in dirs)
    assert sorted(tmpdir.iterdir()) == sorted(dirs)  # nothing beside the ranks' own dirs
    assert files_under(dirs[1]) == []  # rank 1's path was agreed away, and said so:
    assert f"rank 1: {dirs[1] / 'checkpoint'}" in outputs[0]
    local = dirs[0] / "checkpoint"
    assert json.loads((local / "asyncckpt.json").read_text()) == {"root": "asyncckpt", "step": 0}
    step = local / "asyncckpt" / "step-00000000"
    assert sorted(p.name for p in step.glob("rank-*")) == \
        ["rank-00000.safetensors", "rank-00001.safetensors"]
    assert (local / "huggingface" / "config.json").is_file()


def test_saved_as_global_tensors_that_load_and_export_without_verl(first_run, tmp_path):
    """FSDP1's shards too: one global tensor per parameter, loadable at world size 1."""
    import asyncckpt
    strategy, tmpdir, dirs, _ = first_run
    root = dirs[0] / "checkpoint" / "asyncckpt"
    state = asyncckpt.load(root)
    weight = state["model"]["model.embed_tokens.weight"]
    assert tuple(weight.shape) == (512, 64) and str(weight.dtype) == "torch.bfloat16"
    assert set(state["optimizer"]["state"]["model.embed_tokens.weight"]) == \
        {"step", "exp_avg", "exp_avg_sq"}
    index = asyncckpt.export_hf(root, tmp_path / "hf")
    assert "model.embed_tokens.weight" in index["weight_map"]


def test_second_run_into_the_same_directories_replaces_step_0_and_cleans_up(first_run):
    """The rerun saves step 0 again where step 0 is committed (verl's manager
    overwrites; the drop-in replaces it once the new one is durable), loads it back
    (the port's assertions: the new state, not the first run's), and its rmtree of
    each rank's temp dir leaves the ranks' TMPDIR empty. Had the first run's step
    survived, the load would bring back the first run's model (another random init)
    and the port's assertions would fail."""
    strategy, tmpdir, dirs, _ = first_run
    assert (dirs[0] / "checkpoint" / "asyncckpt" / "step-00000000").is_dir()
    run_port(strategy, tmpdir, [["--temp-dir", str(d)] for d in dirs])
    assert files_under(tmpdir) == []
