"""reader.py through the real writer: which step loads, loading in place, and corruption.

One writer per codec (the writer's own server, in this process: tests/inprocess.py) saves
two steps once per module (`saved`); tests that damage a checkpoint work on their own copy
of it (`copy_steps`), so they never disturb each other.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from conftest import SMALL_RING, assert_same
from inprocess import InProcessWriter

import asyncckpt
from asyncckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError
from asyncckpt.format.layout import MANIFEST_NAME, data_file_name, layout
from asyncckpt.format.manifest import Manifest
from asyncckpt.format.records import Frame, RankPart
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.storage.local import read_manifest

SLOT = SMALL_RING["slot_size"]


# -- shared helpers (test_verify_cli imports these) -----------------------------------------------

def reader_state(seed: int) -> dict[str, Any]:
    """A state whose first tensor spans several 64 KiB frames, then small ones that share."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(300, 128, generator=g),          # 153600 B: frames 1, 2 inside
                  "emb": torch.randn(50, 64, generator=g).bfloat16(),
                  "b": torch.zeros(128), "empty": torch.empty(0, 3), "scale": torch.tensor(0.5)},
        "optim": {"state": {0: {"step": torch.tensor(seed),
                                "exp_avg": torch.randn(128, generator=g)}},
                  "param_groups": [{"lr": 1e-3 * seed, "betas": (0.9, 0.999), "params": [0]}]},
        "step": seed * 100, "note": None, "loss": float("nan"),
        "mask": torch.rand(17, generator=g) > 0.5,
    }


@dataclasses.dataclass
class Saved:
    root: Path
    codec: str
    states: dict[int, dict[str, Any]]

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    @property
    def data_name(self) -> str:
        return data_file_name(0, self.codec)


@pytest.fixture(scope="module", params=["zstd", "raw"])
def saved(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    """Steps 1 and 2 of `reader_state`, committed by the writer with 64 KiB slots."""
    codec = request.param
    base = tmp_path_factory.mktemp(f"saved-{codec}")
    writer = InProcessWriter(base / "ckpt", codec=codec, export=False,
                             incremental=False)  # damage tests: every step whole
    try:
        client = asyncckpt.connect(writer.address, rank=0, world_size=1, **SMALL_RING)
        states = {step: reader_state(step) for step in (1, 2)}
        for step, state in states.items():
            client.save(step, state).wait(60)
        client.close(timeout=30)
    finally:
        writer.stop(timeout=30)
    yield Saved(writer.root, codec, states)


def copy_steps(saved: Saved, dest: Path, steps: tuple[int, ...] = (1, 2)) -> Path:
    """A private root holding copies of `steps` (and a `latest` naming the newest)."""
    dest.mkdir(parents=True, exist_ok=True)
    for step in steps:
        shutil.copytree(saved.step_dir(step), dest / saved.step_dir(step).name)
    if steps:
        (dest / "latest").write_text(f"step-{max(steps):08d}\n")
    return dest


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def frame_inside(manifest: Manifest, tensor: str) -> int:
    """Index of the first frame lying wholly inside `tensor`'s bytes."""
    part = manifest.ranks[0]
    spec = next(t for t in part.tensors if t.name == tensor)
    for i, f in enumerate(part.frames):
        if f.raw_offset >= spec.begin and f.raw_offset + f.raw_length <= spec.end:
            return i
    raise AssertionError(f"no frame inside {tensor}")


def resign_manifest(directory: Path, edit) -> None:
    """Apply `edit` to the manifest body and write it back with a correct checksum."""
    data = (directory / MANIFEST_NAME).read_bytes()
    doc = json.loads(data)["manifest"]
    edit(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    (directory / MANIFEST_NAME).write_bytes(
        b'{"xxh3":"' + f"{xxhash.xxh3_64_intdigest(body):016x}".encode() + b'","manifest":'
        + body + b"}\n")


def zeros_like_state(state: Any) -> Any:
    """The same structure with every tensor replaced by a same-shaped one full of 7s."""
    if isinstance(state, torch.Tensor):
        return torch.full_like(state, 7) if state.dtype != torch.bool else torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(zeros_like_state(v) for v in state)
    return state


def snapshot(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    return state


def hand_made_checkpoint(directory: Path, tree: Any = None) -> Path:
    """A tensorless raw checkpoint written without the writer: header frame + manifest."""
    prefix, _ = layout([])
    digest = xxhash.xxh3_64_intdigest(prefix)
    part = RankPart(0, "rank-00000.safetensors", "raw", len(prefix), len(prefix), [],
                    [Frame(0, len(prefix), 0, len(prefix), "raw", digest, digest)],
                    {"dict": []} if tree is None else tree)
    directory.mkdir(parents=True)
    (directory / part.file).write_bytes(prefix)
    (directory / MANIFEST_NAME).write_bytes(Manifest(step=1, world_size=1, ranks=[part]).to_bytes())
    return directory


def hangs(fn, fifo: Path, seconds: float = 1.0) -> tuple[bool, dict]:
    """Run `fn` in a thread; if it is still blocked after `seconds` (opening `fifo`), release
    it by opening the FIFO's other end. Returns (hung, {"value"|"error": ...})."""
    result: dict = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    hung = thread.is_alive()
    if hung:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
    return hung, result


@pytest.fixture
def own(saved: Saved, tmp_path: Path) -> Path:
    """A private copy of both steps, free to damage."""
    return copy_steps(saved, tmp_path / "root")


# -- which checkpoint loads -----------------------------------------------------------------------

def test_load_root_picks_newest_committed_step(saved):
    assert (saved.root / "latest").read_text() == "step-00000002\n"
    with Checkpoint.open(saved.root) as ckpt:
        assert ckpt.directory == saved.step_dir(2) and ckpt.root == saved.root
    assert_same(saved.states[2], asyncckpt.load(saved.root))
    assert_same(saved.states[2], asyncckpt.load(str(saved.root)))


def test_load_a_given_step(saved):
    loaded = asyncckpt.load(saved.root, step=1)
    assert_same(saved.states[1], loaded)
    assert list(loaded["optim"]["state"]) == [0]


def test_load_a_checkpoint_directory(saved):
    assert_same(saved.states[1], asyncckpt.load(saved.step_dir(1)))
    assert_same(saved.states[2], asyncckpt.load(saved.step_dir(2), rank=0))


def test_loaded_tensors_are_fresh_writable_cpu_tensors(saved):
    a, b = asyncckpt.load(saved.root), asyncckpt.load(saved.root)
    w = a["model"]["w"]
    assert w.device.type == "cpu" and w.is_contiguous()
    assert w.data_ptr() != b["model"]["w"].data_ptr()
    w.add_(1)  # writable, and owns its memory
    assert torch.equal(b["model"]["w"], saved.states[2]["model"]["w"])


def test_empty_root_and_missing_paths_are_not_found(saved, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "step-00000005.tmp-abcd").mkdir()  # in progress: not a checkpoint
    for path, step in [(tmp_path / "empty", None), (tmp_path / "nowhere", None),
                       (saved.root, 3), (saved.root / "step-00000003", None)]:
        with pytest.raises(CheckpointNotFoundError) as info:
            asyncckpt.load(path, step=step)
        assert isinstance(info.value, FileNotFoundError)
        assert str(path) in str(info.value)
    # a step directory without its manifest is a damaged checkpoint, however it is reached
    (tmp_path / "empty" / "step-00000006").mkdir()
    for path, step in [(tmp_path / "empty", 6), (tmp_path / "empty" / "step-00000006", None),
                       (tmp_path / "empty", None)]:
        with pytest.raises(CorruptCheckpointError, match="has no manifest.json") as info:
            asyncckpt.load(path, step=step)
        assert info.value.step == 6
    assert "no older step is intact" in str(info.value)


def test_a_step_that_is_not_there_lists_the_steps_that_are(saved, tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"step 999 .*its committed steps: 1, 2\)$"):
        asyncckpt.load(saved.root, step=999)
    with pytest.raises(CheckpointNotFoundError, match=r"\(it does not exist\)"):
        asyncckpt.load(tmp_path / "runrot", step=999)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"\(it holds no committed step\)"):
        asyncckpt.load(tmp_path / "empty", step=1)
    many = tmp_path / "many"
    for step in range(1, 21):
        (many / f"step-{step:08d}").mkdir(parents=True)
    with pytest.raises(CheckpointNotFoundError,
                       match=r"its committed steps: 1, \.\.\., 15, 16, 17, 18, 19, 20 "
                             r"\(20 in all\)"):
        asyncckpt.load(many, step=99)


def test_rank_out_of_range(saved):
    for rank in (1, 5, -1):
        with pytest.raises(CheckpointNotFoundError, match=r"ranks 0\.\.0") as info:
            asyncckpt.load(saved.root, rank=rank)
        assert info.value.rank == rank and info.value.step == 2


# -- a damaged newest step is an error naming the newest intact one (never a silent fallback) -----

def damage(saved: Saved, d: Path, kind: str) -> str:
    """Damage checkpoint `d` one way; returns what the error must say."""
    if kind == "manifest-deleted":
        (d / MANIFEST_NAME).unlink()
        return "has no manifest.json"
    if kind == "manifest-left-as-tmp":  # as if its rename never happened
        os.rename(d / MANIFEST_NAME, d / ".manifest.json.tmp-0123abcd")
        return "has no manifest.json"
    if kind == "manifest-corrupt":
        flip_byte(d / MANIFEST_NAME, len((d / MANIFEST_NAME).read_bytes()) // 2)
        return "xxh3 mismatch"
    if kind == "manifest-resigned-bad-tree":
        resign_manifest(d, lambda doc: doc["ranks"][0]["tree"]["dict"].pop(0))
        return "tree and tensor table disagree"
    if kind == "data-missing":
        (d / saved.data_name).unlink()
        return "missing file"
    if kind == "data-corrupt":
        frame = read_manifest(d).ranks[0].frames[frame_inside(read_manifest(d), "model.w")]
        flip_byte(d / saved.data_name, frame.stored_offset + frame.stored_length // 2)
        return "xxh3"
    raise AssertionError(kind)


DAMAGE = ["manifest-deleted", "manifest-left-as-tmp", "manifest-corrupt",
          "manifest-resigned-bad-tree", "data-missing", "data-corrupt"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_newest_step_names_itself_and_the_newest_intact_one(saved, own, kind):
    """latest names step 2; whatever the damage, load(root) raises, never returns step 1."""
    cause = damage(saved, own / "step-00000002", kind)
    with pytest.raises(CorruptCheckpointError) as info:
        asyncckpt.load(own)
    message = str(info.value)
    assert cause in message, message
    assert info.value.step == 2 and info.value.detail["newest_intact"] == 1
    assert "step 2 is the newest step" in message and "the newest intact step is 1" in message
    with pytest.raises(CorruptCheckpointError, match=cause):  # asked for by step: plain error
        asyncckpt.load(own, step=2)
    assert_same(saved.states[1], asyncckpt.load(own, step=1))


def test_damaged_newest_step_skips_damaged_older_ones_when_naming_the_intact_one(saved, own):
    shutil.copytree(own / "step-00000002", own / "step-00000003")
    resign_manifest(own / "step-00000003", lambda doc: doc.update(step=3))
    damage(saved, own / "step-00000003", "manifest-deleted")
    damage(saved, own / "step-00000002", "manifest-corrupt")
    with pytest.raises(CorruptCheckpointError, match="newest intact step is 1") as info:
        asyncckpt.load(own)
    assert info.value.step == 3
    (own / "step-00000001" / "planted").write_bytes(b"x")  # now no step is intact
    with pytest.raises(CorruptCheckpointError, match="no older step is intact"):
        asyncckpt.load(own)


def test_hand_made_checkpoint_loads(tmp_path):
    """The on-disk format alone (no writer) is enough to make a loadable checkpoint."""
    d = hand_made_checkpoint(tmp_path / "root" / "step-00000001",
                             {"dict": [["lr", 0.5], [3, {"tuple": [None, {"float": "-inf"}]}]]})
    assert asyncckpt.load(tmp_path / "root") == {"lr": 0.5, 3: (None, float("-inf"))}
    assert asyncckpt.load(d) == {"lr": 0.5, 3: (None, float("-inf"))}


def test_multi_rank_checkpoint(inproc_shared, codec, monkeypatch):
    """Two ranks of one step: each loads its own part; the default rank comes from RANK."""
    shared = inproc_shared
    root, step = shared.root, shared.step()
    states = [{"w": torch.full((1000,), float(r)), "rank": r, "shared": {"k": [r]}} for r in (0, 1)]
    clients = [asyncckpt.connect(shared.address, rank=r, world_size=2, slot_size=4096,
                                 ring_size=16384) for r in (0, 1)]
    try:
        handles = [c.save(step, s) for c, s in zip(clients, states)]
        paths = {h.wait(60) for h in handles}
    finally:
        for c in clients:
            c.close(timeout=30)
    assert paths == {root.resolve() / f"step-{step:08d}"}
    manifest = read_manifest(root / f"step-{step:08d}")
    assert manifest.world_size == 2 and [p.file for p in manifest.ranks] == [
        data_file_name(0, codec), data_file_name(1, codec)]
    for r in (0, 1):
        assert_same(states[r], asyncckpt.load(root, rank=r))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert_same(states[1], asyncckpt.load(root))
    with pytest.raises(CheckpointNotFoundError, match=r"ranks 0\.\.1"):
        asyncckpt.load(root, rank=2)


def test_load_into_parameters(saved):
    target = zeros_like_state(saved.states[1])
    target["model"]["w"] = torch.nn.Parameter(torch.zeros(300, 128))
    target["model"]["b"] = torch.nn.Parameter(torch.zeros(128))
    out = asyncckpt.load(saved.root, step=1, into=target)
    assert out["model"]["w"] is target["model"]["w"] and out["model"]["w"].requires_grad
    assert torch.equal(target["model"]["w"].detach(), saved.states[1]["model"]["w"])


# -- loading in place -----------------------------------------------------------------------------

def test_load_into_fills_targets_in_place(saved):
    target = zeros_like_state(saved.states[2])
    target["model"]["w"] = torch.full((128, 300), 7.0).t()   # non-contiguous target
    assert not target["model"]["w"].is_contiguous()
    ptrs = {("model", k): v.data_ptr() for k, v in target["model"].items()}
    w_obj, exp_avg = target["model"]["w"], target["optim"]["state"][0]["exp_avg"]
    out = asyncckpt.load(saved.root, into=target)
    assert_same(saved.states[2], out)                       # values, and the objects too
    assert out["model"]["w"] is w_obj and out["optim"]["state"][0]["exp_avg"] is exp_avg
    assert {("model", k): v.data_ptr() for k, v in target["model"].items()} == ptrs
    assert torch.equal(target["model"]["w"], saved.states[2]["model"]["w"])
    assert out["optim"]["param_groups"][0]["lr"] == 2e-3 and out["step"] == 200


def test_load_into_partial_target_loads_the_rest_fresh(saved):
    target = {"model": {"w": torch.zeros(300, 128)}}
    out = asyncckpt.load(saved.root, step=1, into=target)
    assert out["model"]["w"] is target["model"]["w"]
    assert torch.equal(target["model"]["w"], saved.states[1]["model"]["w"])
    assert_same(saved.states[1], out)


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_mismatch_raises_before_any_target_is_modified(saved, bad):
    target = zeros_like_state(saved.states[2])
    if bad == "shape":
        target["optim"]["state"][0]["exp_avg"] = torch.full((129,), 7.0)
        expect = (r"state\['optim'\]\['state'\]\[0\]\['exp_avg'\]: target torch.float32 "
                  r"\(129,\), saved torch.float32 \(128,\)")
    else:
        target["model"]["emb"] = torch.full((50, 64), 7.0)   # saved as bfloat16
        expect = (r"state\['model'\]\['emb'\]: target torch.float32 \(50, 64\), "
                  r"saved torch.bfloat16 \(50, 64\)")
    before = snapshot(target)
    with pytest.raises(StateMismatchError, match=expect) as info:
        asyncckpt.load(saved.root, into=target)
    assert info.value.step == 2 and info.value.rank == 0
    assert_same(before, target)  # the tensor read first (model.w) was not touched either


def test_strict_missing_key(saved):
    target = zeros_like_state(saved.states[2])
    target["model"]["extra"] = torch.full((3,), 7.0)
    target["optim"]["state"][1] = {"exp_avg": torch.full((2,), 7.0)}
    before = snapshot(target)
    with pytest.raises(StateMismatchError) as info:
        asyncckpt.load(saved.root, into=target)
    assert "state['model']['extra'] is not in the checkpoint" in str(info.value)
    assert "state['optim']['state'][1]['exp_avg'] is not in the checkpoint" in str(info.value)
    assert_same(before, target)
    out = asyncckpt.load(saved.root, into=target, strict=False)
    assert torch.equal(target["model"]["extra"], torch.full((3,), 7.0))  # left alone
    assert torch.equal(target["model"]["w"], saved.states[2]["model"]["w"])
    assert "extra" not in out["model"] and 1 not in out["optim"]["state"]


def test_a_missing_key_names_what_the_checkpoint_holds(saved):
    """A target under another top-level name (`optimizer` for `optim`) says which top-level
    keys the checkpoint has and the nearest saved paths, not only what is missing."""
    target = zeros_like_state(saved.states[2])
    target["optimizer"] = target.pop("optim")
    with pytest.raises(StateMismatchError) as info:
        asyncckpt.load(saved.root, into=target)
    message = str(info.value)
    assert "the checkpoint holds top-level keys ['mask', 'model', 'optim']" in message
    assert "nearest to state['optimizer']" in message and "state['optim']" in message


def test_int_and_str_keys_are_different_targets(saved):
    target = {"optim": {"state": {"0": {"exp_avg": torch.zeros(128)}}}}  # str "0", saved int 0
    with pytest.raises(StateMismatchError, match=r"\['0'\]"):
        asyncckpt.load(saved.root, into=target)


# -- corruption -----------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["tensor-frame", "last-frame"])
def test_flipped_byte_is_caught_naming_file_and_frame(saved, own, where):
    d = own / "step-00000002"
    manifest = read_manifest(d)
    part = manifest.ranks[0]
    index = frame_inside(manifest, "model.w") if where == "tensor-frame" else len(part.frames) - 1
    frame = part.frames[index]
    flip_byte(d / saved.data_name, frame.stored_offset + frame.stored_length // 2)
    with pytest.raises(CorruptCheckpointError) as info:
        asyncckpt.load(own)
    message = str(info.value)
    assert saved.data_name in message and f"frame {index}" in message and "xxh3" in message, message
    assert (info.value.step, info.value.rank, info.value.file) == (2, 0, saved.data_name)
    assert message.startswith(f"step 2, rank 0, {saved.data_name}: ")
    if where == "tensor-frame":
        assert "'model.w'" in message
    assert_same(saved.states[1], asyncckpt.load(own, step=1))  # the other step is untouched


def test_every_frame_holding_tensor_bytes_is_checked(saved, tmp_path):
    """A flipped byte in any frame that carries tensor bytes, at either end, fails the load."""
    manifest = read_manifest(saved.step_dir(1))
    first = manifest.ranks[0].tensors[0].begin
    checked = 0
    for index, frame in enumerate(manifest.ranks[0].frames):
        if frame.raw_offset + frame.raw_length <= first:
            continue  # header only: see test_flipped_header_byte_never_returns_wrong_values
        for offset in (frame.stored_offset, frame.stored_offset + frame.stored_length - 1):
            own = copy_steps(saved, tmp_path / f"r{index}-{offset}", steps=(1,))
            flip_byte(own / "step-00000001" / saved.data_name, offset)
            with pytest.raises(CorruptCheckpointError, match=f"frame {index}"):
                asyncckpt.load(own)
            checked += 1
    assert checked >= 6  # three tensor frames with 64 KiB slots


def test_flipped_header_byte_never_returns_wrong_values(saved, own):
    """load() reads only tensor bytes, so damage confined to the safetensors header frame
    may go unnoticed by it (verify reports it); what it must never do is return wrong values."""
    d = own / "step-00000002"
    frame = read_manifest(d).ranks[0].frames[0]
    assert frame.raw_length <= read_manifest(d).ranks[0].tensors[0].begin  # header-only frame
    flip_byte(d / saved.data_name, frame.stored_offset + frame.stored_length // 2)
    try:
        loaded = asyncckpt.load(own)
    except CorruptCheckpointError as e:
        assert "frame 0" in str(e)
    else:
        assert_same(saved.states[2], loaded)


@pytest.mark.parametrize("damage", ["truncate", "append", "empty"])
def test_wrong_size_data_file(saved, own, damage):
    path = own / "step-00000002" / saved.data_name
    data = path.read_bytes()
    path.write_bytes({"truncate": data[:-1], "append": data + b"\0", "empty": b""}[damage])
    with pytest.raises(CorruptCheckpointError, match=r"data file has \d+ bytes, manifest says "
                       f"{len(data)}") as info:
        asyncckpt.load(own)
    assert info.value.file == saved.data_name


def test_deleted_data_file(saved, own):
    (own / "step-00000002" / saved.data_name).unlink()
    with pytest.raises(CorruptCheckpointError, match="missing file|cannot open data file") as info:
        asyncckpt.load(own)
    assert saved.data_name in str(info.value)


def test_data_file_symlink_is_refused(saved, own, tmp_path):
    path = own / "step-00000002" / saved.data_name
    os.rename(path, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", path)
    with pytest.raises(CorruptCheckpointError, match="cannot open data file"):
        asyncckpt.load(own)


def test_data_file_from_another_step_is_caught(saved, own):
    shutil.copyfile(own / "step-00000001" / saved.data_name,
                    own / "step-00000002" / saved.data_name)
    with pytest.raises(CorruptCheckpointError):
        asyncckpt.load(own)


def test_corrupt_newest_manifest_is_an_error_not_a_silent_fallback(saved, own):
    path = own / "step-00000002" / MANIFEST_NAME
    flip_byte(path, len(path.read_bytes()) // 2)
    with pytest.raises(CorruptCheckpointError, match="xxh3 mismatch") as info:
        asyncckpt.load(own)
    assert info.value.file == str(path)
    assert_same(saved.states[1], asyncckpt.load(own, step=1))


def test_tree_and_tensor_table_must_agree(saved, own):
    d = own / "step-00000002"
    resign_manifest(d, lambda doc: doc["ranks"][0]["tree"]["dict"].pop(0))  # drop "model"
    with pytest.raises(CorruptCheckpointError, match="tree and tensor table disagree"):
        asyncckpt.load(d)


def test_wrong_frame_checksum_in_manifest(saved, own):
    d = own / "step-00000002"
    index = frame_inside(read_manifest(d), "model.w")

    def edit(doc):
        frame = doc["ranks"][0]["frames"][index]
        frame["xxh3_raw"] = f"{int(frame['xxh3_raw'], 16) ^ 1:016x}"
        if frame["codec"] == "raw":  # a raw frame has one checksum, recorded twice
            frame["xxh3_stored"] = frame["xxh3_raw"]
    resign_manifest(d, edit)
    with pytest.raises(CorruptCheckpointError, match=f"frame {index}.*xxh3 of raw bytes mismatch"):
        asyncckpt.load(d)


def test_load_into_with_corruption_raises(saved, own):
    d = own / "step-00000002"
    frame = read_manifest(d).ranks[0].frames[frame_inside(read_manifest(d), "model.w")]
    flip_byte(d / saved.data_name, frame.stored_offset + 10)
    with pytest.raises(CorruptCheckpointError):
        asyncckpt.load(d, into=zeros_like_state(saved.states[2]))


# -- bugs -----------------------------------------------------------------------------------------

def test_fifo_in_place_of_data_file_does_not_hang(tmp_path):
    d = hand_made_checkpoint(tmp_path / "root" / "step-00000001")
    (d / "rank-00000.safetensors").unlink()
    os.mkfifo(d / "rank-00000.safetensors")
    hung, result = hangs(lambda: asyncckpt.load(d), d / "rank-00000.safetensors")
    assert not hung, "load() blocked opening a FIFO"
    assert isinstance(result.get("error"), CorruptCheckpointError)


def test_load_of_a_regular_file_is_not_found(tmp_path):
    (tmp_path / "file").write_text("hello")
    with pytest.raises(CheckpointNotFoundError):
        asyncckpt.load(tmp_path / "file")


def test_step_dir_with_trailing_newline_is_not_a_checkpoint(saved, own):
    shutil.copytree(own / "step-00000001", own / "step-00000009\n")
    assert_same(saved.states[2], asyncckpt.load(own))


def test_manifest_step_must_match_directory(saved, own):
    os.rename(own / "step-00000001", own / "step-00000005")
    with pytest.raises(CorruptCheckpointError, match="step"):
        asyncckpt.load(own, step=5)
