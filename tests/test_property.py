"""Property tests: random states round-trip bit-exact through a real writer with a tiny ring.

A 4 KiB slot and a 16 KiB ring make every non-trivial state stream through many frames and
reuse each slot several times; tensor sizes are drawn around slot multiples so frame
boundaries fall inside, at, and just beside tensor boundaries. One writer per codec serves
the whole hypothesis run (steps increase), since starting one costs ~0.3 s.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiers import process_fixture

import asyncckpt
from asyncckpt.codec.registry import make_codec
from asyncckpt.format.layout import layout
from asyncckpt.format.manifest import Manifest, parse_manifest
from asyncckpt.format.records import Frame, RankPart
from asyncckpt.format.tree import unflatten
from asyncckpt.rank.flatten import flatten
from asyncckpt.torchutil.dtypes import DTYPE_NAMES

SLOT, RING = 4096, 16384
DTYPES = list(DTYPE_NAMES)
SETTINGS = dict(deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


# -- strategies -----------------------------------------------------------------------------------

def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes of `dtype` (any bit pattern: NaN payloads, subnormals, -0.0)."""
    n = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    size = torch.empty((), dtype=dtype).element_size()
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["shape", "straddle", "transposed", "sliced", "permuted",
                                 "expanded", "scalar", "empty"]))
    if kind == "shape":
        shape = tuple(draw(st.lists(st.integers(0, 24), max_size=3)))
        return random_tensor(dtype, shape, seed)
    if kind == "straddle":  # byte size at, just under or just over a multiple of the slot
        nbytes = draw(st.integers(0, 4)) * SLOT + draw(st.integers(-2 * size, 2 * size))
        return random_tensor(dtype, (max(0, nbytes // size),), seed)
    if kind == "transposed":
        a, b = draw(st.integers(1, 90)), draw(st.integers(1, 90))
        return random_tensor(dtype, (a, b), seed).t()
    if kind == "sliced":
        a, b = draw(st.integers(2, 90)), draw(st.integers(2, 90))
        t = random_tensor(dtype, (a, b), seed)
        return draw(st.sampled_from([t[::2, 1:], t[:, ::3], t[1:-1, 1], t[1:, :-1][:, ::2]]))
    if kind == "permuted":
        a, b, c = draw(st.integers(1, 12)), draw(st.integers(1, 12)), draw(st.integers(1, 40))
        return random_tensor(dtype, (a, b, c), seed).permute(2, 0, 1)
    if kind == "expanded":  # stride 0: overlapping memory
        a, b = draw(st.integers(1, 60)), draw(st.integers(1, 60))
        return random_tensor(dtype, (a, 1), seed).expand(a, b)
    if kind == "scalar":
        return random_tensor(dtype, (), seed)
    return random_tensor(dtype, (0, draw(st.integers(0, 5))), seed)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
keys = st.one_of(st.text(alphabet="ab.~_0", max_size=4),
                 st.sampled_from(["__metadata__", "tensor"]), st.integers(-3, 3))
leaves = st.one_of(tensors(), tensors(), scalars)  # tensors drawn more often
trees = st.recursive(
    leaves,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.lists(children, max_size=3).map(tuple),
                               st.dictionaries(keys, children, max_size=4)),
    max_leaves=10)
states = st.dictionaries(keys, trees, max_size=5)


# -- a writer for the whole run --------------------------------------------------------------------

class Tiny:
    def __init__(self, writer: asyncckpt.WriterProcess, client: asyncckpt.Client) -> None:
        self.writer, self.client = writer, client
        self.steps = itertools.count(1)

    def save(self, state: Any):
        step = next(self.steps)
        path = self.client.save(step, state).wait(60)
        assert path == self.writer.root / f"step-{step:08d}"
        return path


@pytest.fixture(scope="module", params=["zstd", "raw", "bytegroup"])
@process_fixture
def tiny(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiny]:
    base = tmp_path_factory.mktemp(f"prop-{request.param}")
    writer = asyncckpt.start_writer(base / "ckpt", codec=request.param,
                                    log_file=base / "writer.log")
    client = asyncckpt.connect(writer.address, rank=0, world_size=1, slot_size=SLOT, ring_size=RING)
    yield Tiny(writer, client)
    client.close(timeout=30)
    writer.stop(timeout=30)


def empty_like_state(state: Any) -> Any:
    """Targets with the same shapes, dtypes and strides, holding garbage."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)  # keeps a transposed/sliced layout: non-contiguous target
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(empty_like_state(v) for v in state)
    return state


def canon(state: Any) -> Any:
    """`state` with each tensor as (dtype, shape, its bytes in row-major order), so that
    assert_same compares bits for every dtype (torch.equal lacks float8 kernels)."""
    if isinstance(state, torch.Tensor):
        flat = state.contiguous().as_strided((state.numel(),), (1,))
        return ("tensor", str(state.dtype), tuple(state.shape),
                flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    if isinstance(state, dict):
        return {k: canon(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(canon(v) for v in state)
    return state


def tensor_leaves(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensor_leaves(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensor_leaves(v)]
    return []


# -- properties ------------------------------------------------------------------------------------

@settings(max_examples=30, **SETTINGS)
@given(state=states)
def test_random_state_round_trips_bit_exact(tiny, state):
    path = tiny.save(state)
    assert_same(canon(state), canon(asyncckpt.load(path)))


@settings(max_examples=15, **SETTINGS)
@given(state=states)
def test_random_state_loads_into_targets_in_place(tiny, state):
    path = tiny.save(state)
    target = empty_like_state(state)
    out = asyncckpt.load(path, into=target)
    assert_same(canon(state), canon(out))
    for got, want in zip(tensor_leaves(out), tensor_leaves(target), strict=True):
        assert got is want


@settings(max_examples=10, **SETTINGS)
@given(sizes=st.lists(st.integers(0, 3 * SLOT + 7), min_size=1, max_size=6))
def test_byte_sizes_around_slot_boundaries(tiny, sizes):
    state = {f"t{i}": random_tensor(torch.uint8, (n,), i) for i, n in enumerate(sizes)}
    path = tiny.save(state)
    assert_same(canon(state), canon(asyncckpt.load(path)))


@settings(max_examples=40, deadline=None)
@given(state=states)
def test_tree_round_trips_through_strict_json(state):
    tree, entries = flatten(state)
    by_name = {e.name: e.tensor for e in entries}
    assert len(by_name) == len(entries) and "__metadata__" not in by_name
    out = unflatten(json.loads(json.dumps(tree, allow_nan=False)), by_name.__getitem__)
    assert_same(canon(state), canon(out))


@settings(max_examples=50, deadline=None)
@given(data=st.binary(min_size=1, max_size=20_000), codec=st.sampled_from(["raw", "zstd"]))
def test_codec_round_trip(data, codec):
    c = make_codec(codec)
    out = bytearray(len(data))
    c.decode_into(bytes(c.encode(data)), memoryview(out))
    assert bytes(out) == data


@settings(max_examples=50, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from(sorted({n for n in DTYPE_NAMES.values()})),
                                st.lists(st.integers(0, 9), max_size=3)), max_size=6),
       frame=st.integers(1, 300), codec=st.sampled_from(["raw", "zstd"]),
       step=st.integers(0, 2**40))
def test_manifest_round_trip(specs, frame, codec, step):
    prefix, tensors_ = layout([(f"t.{i}", dtype, tuple(shape))
                               for i, (dtype, shape) in enumerate(specs)])
    raw_size = tensors_[-1].end if tensors_ else len(prefix)
    frames, stored = [], 0
    for i, begin in enumerate(range(0, raw_size, frame)):
        length = min(frame, raw_size - begin)
        stored_len = length if codec == "raw" else 1 + length // 3
        stored_hash = i * 7919 if codec == "raw" else 2**64 - 1 - i  # raw frames: one hash
        frames.append(Frame(begin, length, stored, stored_len, codec, i * 7919, stored_hash))
        stored += stored_len
    tree = {"list": [{"tensor": t.name} for t in tensors_]}
    part = RankPart(0, "rank-00000.safetensors" + (".zst" if codec == "zstd" else ""), codec,
                    raw_size, stored, tensors_, frames, tree)
    m = Manifest(step=step, world_size=1, ranks=[part], created=12.5)
    assert parse_manifest(m.to_bytes(), max_frame_bytes=frame) == m
