"""The README's Python snippets run as written.

Each ```python block is executed in a fresh directory, in a namespace of small
stand-ins for what the prose assumes exists (a model and its optimizer, a batch, a
training step, a root): a snippet that drifts from the API fails here, as the sharded
example once did (it loaded "optim" from a root that stores "optimizer"). A block that
cannot run in this process says why in the README, in a comment line just above it:
`<!-- snippet not run: REASON -->`, the reason naming the test that covers it instead.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import asyncckpt

pytestmark = pytest.mark.process  # the snippets start writers
README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(?:<!-- snippet not run: (?P<why>[^>]*?) -->\n)?```python\n(?P<code>.*?)```",
                   re.DOTALL)
BLOCKS = [(m.group("code"), m.group("why")) for m in BLOCK.finditer(README.read_text())]


def first_line(code: str) -> str:
    return next(line for line in code.splitlines() if line.strip())[:60]


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group, for the sharded snippet's DTensors."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def stand_ins(tmp_path: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randn(4, 8)

    def forward_backward(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        loss = m(b).square().mean()
        loss.backward()
        return loss

    def train_step() -> None:
        forward_backward(model, batch)
        optimizer.step()
        optimizer.zero_grad()
    return {"torch": torch, "asyncckpt": asyncckpt, "model": model, "optimizer": optimizer,
            "opt": optimizer, "optim": optimizer, "batch": batch, "steps": 200,
            "forward_backward": forward_backward, "train_step": train_step,
            "loader_state": {"epoch": 0, "position": 17}}


def test_every_block_runs_or_says_why_not():
    assert len(BLOCKS) >= 6
    for code, why in BLOCKS:
        assert why is None or len(why.split()) >= 3, f"{first_line(code)!r}: say why it is not run"


@pytest.mark.parametrize("code", [c for c, why in BLOCKS if why is None and "s3://" not in c],
                         ids=first_line)
def test_a_readme_block_runs_as_written(code, tmp_path, monkeypatch, group):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ASYNCCKPT_ADDRESS", raising=False)
    namespace = stand_ins(tmp_path)
    if "get_state_dict(model, optim)" in code:  # the sharded block: a root saved by FSDP2
        namespace.update(sharded_stand_ins(tmp_path, namespace))
    try:
        exec(compile(code, f"README.md: {first_line(code)}", "exec"), namespace)
    finally:
        for name in ("client", "ckpt"):
            if hasattr(namespace.get(name), "close"):
                namespace[name].close()
        if isinstance(namespace.get("writer"), asyncckpt.WriterProcess):
            namespace["writer"].stop()
    if "Checkpointer(" in code:
        assert asyncckpt.Checkpointer("ckpts/run1").all_steps() == [100, 200]
    if "start_writer(\"ckpts/run1\")" in code:
        assert namespace["report"].ok and (tmp_path / "hf-model").is_dir()
        assert namespace["state"]["step"] == 1000


@pytest.mark.parametrize("code", [c for c, why in BLOCKS if why is None and "s3://" in c],
                         ids=first_line)
def test_the_object_store_block_runs_against_a_real_s3_server(code, tmp_path, s3_server,
                                                              monkeypatch):
    from conftest import use_s3
    use_s3(s3_server, monkeypatch, "readme")
    namespace = {"asyncckpt": asyncckpt, "step": 1, "state": {"w": torch.arange(6.0)}}
    run = f"s3://ckpt/readme-{tmp_path.name[-8:]}"
    try:
        exec(compile(code.replace("s3://ckpt/run1", run), "README.md: s3", "exec"), namespace)
    finally:
        from asyncckpt.rank import client
        for shared in list(client._shared.values()):  # asyncckpt.save's process-wide client
            shared.close()
        client._shared.clear()
        namespace["w"].stop()
    assert torch.equal(namespace["state"]["w"], torch.arange(6.0))


def sharded_stand_ins(tmp_path: Path, namespace: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 over the one-rank group, a root holding its DTensor state dicts saved as the
    first README block saves ("model", "optim"), and DCP's state-dict functions."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    model = fully_shard(namespace["model"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    namespace["train_step"]()
    model_sd, optim_sd = get_state_dict(model, optim)
    root = tmp_path / "sharded"
    writer = asyncckpt.start_writer(root)
    try:
        with asyncckpt.connect(writer.address) as client:
            client.save(1, {"model": model_sd, "optim": optim_sd}).wait(60)
    finally:
        writer.stop()
    return {"model": model, "optim": optim, "root": root, "get_state_dict": get_state_dict,
            "set_state_dict": set_state_dict}
