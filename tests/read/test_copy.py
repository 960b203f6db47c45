"""`asyncckpt copy` of an incremental step whose referenced frames were stored with
another codec (a writer restarted with another codec, or codec="auto"): the copy's
files obey their suffix (docs/FORMAT.md), so a raw copy is a safetensors file any tool
opens and a zstd copy a zstd stream, and the copy verifies and loads bit-exact with the
original root gone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
import zstandard
from conftest import SMALL_RING, assert_same
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.cli import main as cli
from asyncckpt.storage.local import read_manifest

# what each suffix's file may hold (docs/FORMAT.md's codec table), spelled out here
ALLOWED = {"raw": {"raw"}, "zstd": {"zstd"}, "bytegroup": {"bytegroup", "raw"}}
PAIRS = [(a, b) for a in ALLOWED for b in ALLOWED if a != b]


def frozen(n: int = 120_000) -> torch.Tensor:
    """bf16 weights: their exponent plane compresses, so bytegroup stores bytegroup frames."""
    return (torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return {"model": {"frozen": frozen(), "lora": torch.randn(4000, generator=g),
                      "ints": torch.arange(20_000, dtype=torch.int32)},
            "step": step}


def save(root: Path, step: int, codec: str) -> None:
    with InProcessWriter(root, codec=codec) as w:
        with asyncckpt.connect(w.address, rank=0, world_size=1, **SMALL_RING) as client:
            client.save(step, state(step)).wait(60)


@pytest.fixture(scope="module", params=PAIRS, ids=[f"{a}-then-{b}" for a, b in PAIRS])
def copied(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, str, Path]:
    """Step 1 saved with one codec, step 2 with another (referencing step 1), step 2
    copied out with `asyncckpt copy` and the root deleted."""
    first, second = request.param
    tmp_path = tmp_path_factory.mktemp(f"copy-{first}-{second}")
    root = tmp_path / "ckpt"
    save(root, 1, first)
    save(root, 2, second)
    m = read_manifest(root / "step-00000002")
    refs = [f for f in m.ranks[0].frames if f.ref is not None]
    assert refs and {f.codec for f in refs} <= ALLOWED[first]  # they keep step 1's codecs
    out = tmp_path / "elsewhere" / "step-00000002"
    assert cli(["copy", str(root), "--step", "2", "--out", str(out)]) == 0
    shutil.rmtree(root)
    return first, second, out


def test_every_frame_of_the_copy_has_a_codec_its_file_admits(copied):
    _, second, out = copied
    m = read_manifest(out)
    part = m.ranks[0]
    assert m.format_version == 1 and m.referenced_size == 0 and part.codec == second
    assert {f.codec for f in part.frames} <= ALLOWED[second], [f.codec for f in part.frames]
    assert (out / part.file).stat().st_size == part.stored_size
    assert asyncckpt.verify(out).ok
    assert cli(["verify", str(out)]) == 0
    assert_same(state(2), asyncckpt.load(out))


def safetensors_of(out: Path, codec: str) -> bytes | None:
    """The safetensors file the copy's data file is as a whole (raw), or decompresses to
    (zstd); None for bytegroup, whose file is neither."""
    data = (out / read_manifest(out).ranks[0].file).read_bytes()
    if codec == "zstd":
        return zstandard.ZstdDecompressor().decompressobj(read_across_frames=True).decompress(data)
    return data if codec == "raw" else None


def test_the_copy_is_what_its_suffix_promises(copied):
    """raw: `safetensors.safe_open` opens the file itself; zstd: the file decompresses
    (`zstd -d`) to one. Before the fix a raw copy held the referenced bytegroup or zstd
    frames as stored, and safe_open failed ("incomplete metadata")."""
    _, second, out = copied
    stream = safetensors_of(out, second)
    if stream is None:
        pytest.skip("a bytegroup file is no safetensors stream as a whole: nothing to open")
    assert len(stream) == read_manifest(out).ranks[0].raw_size
    if second == "raw":
        with safetensors.safe_open(str(out / "rank-00000.safetensors"), "pt") as f:
            assert set(f.keys()) == {"model.frozen", "model.lora", "model.ints"}
            loaded = {name: f.get_tensor(name) for name in f.keys()}
    else:
        loaded = safetensors.torch.load(stream)
    for name, value in state(2)["model"].items():
        assert torch.equal(loaded[f"model.{name}"], value), name
