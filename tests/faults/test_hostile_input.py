"""Hostile checkpoints: only asyncckpt's own errors come out, nothing huge is allocated."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncckpt
from asyncckpt.errors import CheckpointError
from asyncckpt.format.layout import MANIFEST_NAME
from asyncckpt.read.verification import verify_checkpoint

PREFIX = len('{"xxh3":"0123456789abcdef","manifest":')


pytestmark = pytest.mark.process  # every step here is saved by a writer process


def read_body(d: Path) -> dict:
    return json.loads((d / MANIFEST_NAME).read_bytes()[PREFIX:-2])


def write_signed(d: Path, body: object) -> None:
    raw = json.dumps(body, separators=(",", ":")).encode()
    (d / MANIFEST_NAME).write_bytes(b'{"xxh3":"%016x","manifest":' % xxhash.xxh3_64_intdigest(raw)
                                    + raw + b"}\n")


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "ckpt"
    writer = asyncckpt.start_writer(root, codec="zstd")
    try:
        with asyncckpt.connect(writer.address, rank=0, world_size=1, slot_size=4096,
                               ring_size=16384) as client:
            client.save(1, {"w": torch.randn(3000), "opt": {0: {"m": torch.ones(7)}},
                            "meta": [1, "x", None]}).wait(30)
    finally:
        writer.stop()
    return root / "step-00000001"


def test_huge_declared_tensor_is_refused_before_allocation(committed, tmp_path):
    d = tmp_path / "step-00000001"
    shutil.copytree(committed, d)
    body = read_body(d)
    part = body["ranks"][0]
    frame_bytes = 256 << 20
    header_len = part["tensors"][0]["range"][0]
    count = 4096  # a 1 TiB tensor over 4096 frames of 256 MiB, each stored in 1 byte
    part["tensors"] = [{"name": "w", "dtype": "U8", "shape": [count * frame_bytes],
                        "range": [header_len, header_len + count * frame_bytes]}]
    part["frames"] = part["frames"][:1] + [
        {"raw": [header_len + i * frame_bytes, frame_bytes],
         "stored": [part["frames"][0]["stored"][1] + i, 1],
         "codec": "zstd", "xxh3_raw": "0" * 16, "xxh3_stored": "0" * 16} for i in range(count)]
    part["frames"][0]["raw"][1] = header_len
    part["raw_size"] = header_len + count * frame_bytes
    part["stored_size"] = part["frames"][0]["stored"][1] + count
    part["tree"] = {"dict": [["w", {"tensor": "w"}]]}
    write_signed(d, body)
    data = next(d.glob("rank-*"))
    data.write_bytes(data.read_bytes()[:part["frames"][0]["stored"][1]] + b"\0" * count)
    started = time.monotonic()
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="header"):
        asyncckpt.load(d)
    assert time.monotonic() - started < 5
    assert not verify_checkpoint(d).ok


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
                       | st.text(max_size=8),
                       lambda kids: (st.lists(kids, max_size=4)
                                     | st.dictionaries(st.text(max_size=6), kids, max_size=4)),
                       max_leaves=12)


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


@pytest.fixture(scope="module")
def committed_sharded(tmp_path_factory) -> Path:
    """Two (simulated) ranks saving DTensors, one of them replicated, plus plain values."""
    from test_sharded import dtensor_of, save_ranks
    from torch.distributed.tensor import Replicate, Shard
    root = tmp_path_factory.mktemp("hostile-sharded") / "ckpt"
    full = {"w": torch.randn(30, 7), "v": torch.randn(5), "r": torch.randn(3)}
    places = {"w": (Shard(1),), "v": (Shard(0),), "r": (Replicate(),)}
    with asyncckpt.start_writer(root, codec="raw") as writer:
        save_ranks(writer.address, 2, lambda r: {
            "model": {k: dtensor_of(v, (2,), places[k]) for k, v in full.items()},
            "step": torch.tensor(r)}, step=1)
    return root / "step-00000001"


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_manifests_raise_only_library_errors(committed, tmp_path_factory, data):
    fuzz_manifest(committed, tmp_path_factory, data)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_sharded_manifests_raise_only_library_errors(committed_sharded, tmp_path_factory,
                                                            data):
    fuzz_manifest(committed_sharded, tmp_path_factory, data)


def fuzz_manifest(committed: Path, tmp_path_factory, data) -> None:
    """1-3 random re-signed edits; load and verify must raise library errors only, and a
    checkpoint verify passes must load."""
    d = tmp_path_factory.mktemp("fuzz") / "step-00000001"
    shutil.copytree(committed, d)
    body = read_body(d)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(body) if p]
        path = data.draw(st.sampled_from(paths))
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        if data.draw(st.booleans()):
            parent[path[-1]] = data.draw(JSONISH)
        elif isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    write_signed(d, body)
    try:
        asyncckpt.load(d)
    except CheckpointError:
        pass
    report = verify_checkpoint(d)
    if report.ok:  # an edit the format does not protect by design (e.g. a JSON object)
        assert asyncckpt.load(d) is not None


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 10_000), junk=st.binary(min_size=1, max_size=64))
def test_fuzzed_data_files_raise_only_library_errors(committed, tmp_path_factory, cut, junk):
    d = tmp_path_factory.mktemp("fuzzdata") / "step-00000001"
    shutil.copytree(committed, d)
    data = next(d.glob("rank-*"))
    raw = data.read_bytes()
    cut %= len(raw)
    data.write_bytes(raw[:cut] + junk + raw[cut + len(junk):])
    if data.read_bytes() == raw:
        return
    with pytest.raises(asyncckpt.CorruptCheckpointError):
        asyncckpt.load(d)
    assert not verify_checkpoint(d).ok


# -- view nodes (tensors stored once, seen twice) ---------------------------------------------

@pytest.fixture(scope="module")
def committed_views(tmp_path_factory) -> Path:
    """w (5 x 4), and three views of it: tied, transposed, a slice; plus a plain tensor."""
    root = tmp_path_factory.mktemp("hostile-views") / "ckpt"
    w = torch.arange(20.0).view(5, 4)
    with asyncckpt.start_writer(root, codec="raw") as writer:
        with asyncckpt.connect(writer.address, rank=0, world_size=1) as client:
            client.save(1, {"w": w, "tied": w, "t": w.t(), "s": w[1:3],
                            "p": torch.ones(3, dtype=torch.int64)}).wait(30)
    d = root / "step-00000001"
    assert [t["name"] for t in read_body(d)["ranks"][0]["tensors"]] == ["w", "p"]
    return d


def _edit_view(body: dict, key: str, edit) -> None:
    tree = body["ranks"][0]["tree"]["dict"]
    node = next(v for k, v in tree if k == key)
    edit(node["view"])


@pytest.mark.parametrize("edit, match", [
    (lambda v: v.update(of="nowhere"), "not a tensor this rank saved"),
    (lambda v: v.update(of="t"), "not a tensor this rank saved"),           # another view
    (lambda v: v.update(of="p"), "does not fit"),                           # another dtype
    (lambda v: v.update(dtype="I64"), "does not fit"),
    (lambda v: v.update(offset=1), "does not fit"),                          # one past the end
    (lambda v: v.update(shape=[6, 4]), "does not fit"),
    (lambda v: v.update(stride=[4, 2]), "does not fit"),
    (lambda v: v.update(stride=[-4, 1]), "view node"),
    (lambda v: v.update(shape=[5, 4, 1]), "view node"),                      # ranks differ
    (lambda v: v.update(shape=[2**40, 2**40], stride=[0, 0]), "view node"),  # 2**80 elements
    (lambda v: v.update(offset=2**62), "view node"),
    (lambda v: v.update(shape=[1] * 65, stride=[1] * 65), "view node"),
    (lambda v: v.pop("dtype"), "view node"),
    (lambda v: v.update(offset="0"), "view node"),
], ids=["missing-base", "view-of-view", "other-dtype-base", "dtype", "offset", "shape", "stride",
        "negative-stride", "rank", "huge", "huge-offset", "many-dims", "no-dtype", "str-offset"])
def test_hostile_view_nodes_are_corrupt(committed_views, tmp_path, edit, match):
    d = tmp_path / "step-00000001"
    shutil.copytree(committed_views, d)
    body = read_body(d)
    _edit_view(body, "tied", edit)
    write_signed(d, body)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match=match):
        asyncckpt.load(d)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match=match):
        asyncckpt.load(d, into={"w": torch.zeros(5, 4)}, strict=False)
    assert not verify_checkpoint(d).ok


def test_view_nodes_load_as_views_and_fill_targets(committed_views):
    out = asyncckpt.load(committed_views)
    w = torch.arange(20.0).view(5, 4)
    assert (torch.equal(out["t"], w.t()) and torch.equal(out["s"], w[1:3])
            and out["tied"] is not out["w"])
    assert ({out[k].untyped_storage().data_ptr() for k in ("w", "tied", "t", "s")}
            == {out["w"].data_ptr()})
    targets = {"w": torch.zeros(5, 4), "tied": torch.zeros(5, 4), "t": torch.zeros(4, 5),
               "s": torch.zeros(2, 4), "p": torch.zeros(3, dtype=torch.int64)}
    filled = asyncckpt.load(committed_views, into=targets)
    assert all(filled[k] is targets[k] for k in targets)
    assert torch.equal(targets["t"], w.t()) and torch.equal(targets["s"], w[1:3])
    with pytest.raises(asyncckpt.StateMismatchError,
                       match=r"state\['t'\]: target torch.float32 \(5, 4\)"):
        asyncckpt.load(committed_views, into={"t": torch.zeros(5, 4)})


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, 30), shape=st.lists(st.integers(0, 6), max_size=3),
       strides=st.lists(st.integers(0, 8), min_size=3, max_size=3))
def test_fuzzed_view_geometry_loads_exactly_or_is_corrupt(committed_views, tmp_path_factory, offset,
                                                          shape, strides):
    """Any geometry either loads as exactly `as_strided` of the base, or is corrupt."""
    d = tmp_path_factory.mktemp("fuzzview") / "step-00000001"
    shutil.copytree(committed_views, d)
    body = read_body(d)
    stride = strides[:len(shape)]
    _edit_view(body, "tied", lambda v: v.update(offset=offset, shape=shape, stride=stride))
    write_signed(d, body)
    extent = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else 0
    try:
        out = asyncckpt.load(d)
    except asyncckpt.CorruptCheckpointError:
        assert extent > 20
        return
    assert extent <= 20
    assert torch.equal(out["tied"], torch.arange(20.0).as_strided(shape, stride, offset))


# -- reference frames (incremental saves) -----------------------------------------------------

@pytest.fixture(scope="module")
def committed_refs(tmp_path_factory) -> tuple[Path, dict]:
    """A root whose step 2 references step 1 (a frozen tensor), and another root beside it
    holding a step 1 of its own, for references that try to escape."""
    base = tmp_path_factory.mktemp("hostile-refs")
    frozen = torch.randn(30_000, generator=torch.Generator().manual_seed(5))
    states = {s: {"frozen": frozen, "w": torch.full((500,), float(s))} for s in (1, 2)}
    for name in ("ckpt", "other"):
        with asyncckpt.start_writer(base / name, codec="zstd") as writer:
            with asyncckpt.connect(writer.address, rank=0, world_size=1, slot_size=16384,
                                   ring_size=65536) as client:
                for step in ((1, 2) if name == "ckpt" else (1,)):
                    client.save(step, states[step]).wait(30)
    body = read_body(base / "ckpt" / "step-00000002")
    assert body["format_version"] == 2 and any("ref" in f for f in body["ranks"][0]["frames"])
    return base, states[2]


def _first_ref(body: dict) -> dict:
    return next(f for f in body["ranks"][0]["frames"] if "ref" in f)


HOSTILE_REFS = {
    "missing-step": (lambda f: f["ref"].update(step=0), "not in"),
    "own-step": (lambda f: f["ref"].update(step=2), "not one older than 2"),
    "newer-step": (lambda f: f["ref"].update(step=3), "not one older than 2"),
    "negative-step": (lambda f: f["ref"].update(step=-1), "not a valid size"),
    "step-as-path": (lambda f: f["ref"].update(step="../other/step-00000001"), "not a valid size"),
    "dotdot-file": (lambda f: f["ref"].update(file="../step-00000001/rank-00000.safetensors.zst"),
                    "not a data file name"),
    "absolute-file": (lambda f: f["ref"].update(file="/etc/passwd"), "not a data file name"),
    "other-root": (lambda f: f["ref"].update(
        file="../../other/step-00000001/rank-00000.safetensors.zst"), "not a data file name"),
    "other-rank-file": (lambda f: f["ref"].update(file="rank-00001.safetensors.zst"), "not in"),
    "beyond-file": (lambda f: f["ref"].update(stored=[10**9, f["ref"]["stored"][1]]), "bytes"),
    "shifted": (lambda f: f["ref"].update(stored=[f["ref"]["stored"][0] + 1,
                                                  f["ref"]["stored"][1]]),
                "xxh3"),
    "empty": (lambda f: f["ref"].update(stored=[0, 0]), "empty referenced range"),
    "huge": (lambda f: f["ref"].update(stored=[0, 1 << 40]), "beyond any encoding"),
    "bytes-here-too": (lambda f: f.update(stored=[f["stored"][0], 7]), "stores no bytes here"),
    "not-an-object": (lambda f: f.update(ref=[1, "rank-00000.safetensors.zst", 0, 9]), "bad "
                                                                                       "reference"),
    "no-file": (lambda f: f["ref"].pop("file"), "invalid"),
}


@pytest.mark.parametrize("name", list(HOSTILE_REFS))
def test_hostile_references_are_corrupt(committed_refs, tmp_path, name):
    base, _ = committed_refs
    shutil.copytree(base, tmp_path / "b")
    d = tmp_path / "b" / "ckpt" / "step-00000002"
    body = read_body(d)
    edit, match = HOSTILE_REFS[name]
    edit(_first_ref(body))
    write_signed(d, body)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match=match):
        asyncckpt.load(d)
    assert not verify_checkpoint(d).ok


def test_references_in_a_version_1_manifest_are_corrupt(committed_refs, tmp_path):
    base, _ = committed_refs
    shutil.copytree(base, tmp_path / "b")
    d = tmp_path / "b" / "ckpt" / "step-00000002"
    body = read_body(d)
    body["format_version"] = 1
    write_signed(d, body)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="needs format_version 2"):
        asyncckpt.load(d)


def test_a_version_1_reader_refuses_an_incremental_checkpoint(committed_refs):
    """What today's readers (format 1 only) do with a version 2 manifest: refuse it by
    its version, never read a zero-length frame."""
    from asyncckpt.format import manifest
    data = (committed_refs[0] / "ckpt" / "step-00000002" / MANIFEST_NAME).read_bytes()
    old = manifest.READABLE_VERSIONS
    try:
        manifest.READABLE_VERSIONS = (1,)
        with pytest.raises(asyncckpt.CorruptCheckpointError,
                           match="format_version 2 is not 1; a newer asyncckpt wrote it"):
            manifest.parse_manifest(data, max_frame_bytes=1 << 20)
    finally:
        manifest.READABLE_VERSIONS = old


@pytest.mark.parametrize("how", ["deleted", "step-symlink", "file-symlink", "retired-symlink"])
def test_referenced_data_that_is_gone_or_elsewhere_is_corrupt(committed_refs, tmp_path, how):
    base, state = committed_refs
    shutil.copytree(base, tmp_path / "b")
    root, other = tmp_path / "b" / "ckpt", tmp_path / "b" / "other"
    target = root / "step-00000001"
    shutil.rmtree(target)
    if how == "step-symlink":  # a step directory planted as a link into another root
        target.symlink_to(other / "step-00000001")
    elif how == "retired-symlink":
        (root / "step-00000001.retired").symlink_to(other / "step-00000001")
    elif how == "file-symlink":
        target.mkdir()
        (target / "rank-00000.safetensors.zst").symlink_to(
            other / "step-00000001" / "rank-00000.safetensors.zst")
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="not in"):
        asyncckpt.load(root, step=2)
    assert not verify_checkpoint(root / "step-00000002").ok


def test_a_chain_through_a_step_that_holds_only_references_is_corrupt(committed_refs, tmp_path):
    """References are flattened; one aimed at bytes a step does not hold itself (they
    are references there too) finds no such bytes: no chain, no cycle is ever followed."""
    base, _ = committed_refs
    shutil.copytree(base, tmp_path / "b")
    root = tmp_path / "b" / "ckpt"
    shutil.copytree(root / "step-00000002", root / "step-00000003")
    body = read_body(root / "step-00000003")
    body["step"] = 3
    for f in body["ranks"][0]["frames"]:
        if "ref" in f:
            f["ref"]["step"] = 2
    write_signed(root / "step-00000003", body)
    with pytest.raises(asyncckpt.CorruptCheckpointError):
        asyncckpt.load(root, step=3)
    assert not verify_checkpoint(root / "step-00000003").ok


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_references_raise_only_library_errors(committed_refs, tmp_path_factory, data):
    """Random values in a reference's fields: library errors only; if it still verifies,
    it loads exactly the saved state."""
    base, state = committed_refs
    b = tmp_path_factory.mktemp("fuzzref")
    shutil.copytree(base / "ckpt", b / "ckpt")
    d = b / "ckpt" / "step-00000002"
    body = read_body(d)
    ref = _first_ref(body)["ref"]
    key = data.draw(st.sampled_from(["step", "file", "stored"]))
    ref[key] = data.draw(st.one_of(JSONISH, st.integers(-3, 5), st.lists(st.integers(-1, 1 << 20),
                                                                          min_size=2, max_size=2),
                                   st.sampled_from(["rank-00000.safetensors", "..", "/",
                                                    "rank-00000.safetensors.bg"])))
    write_signed(d, body)
    try:
        loaded = asyncckpt.load(d)
    except CheckpointError:
        loaded = None
    if verify_checkpoint(d).ok:
        assert loaded is not None
        assert (torch.equal(loaded["frozen"], state["frozen"])
                and torch.equal(loaded["w"], state["w"]))
