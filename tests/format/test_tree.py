"""tree.flatten / unflatten: the JSON object tree, tensor names, and what save() refuses."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SMALL_RING, assert_same, small_ring_client
from inprocess import InProcessWriter, inprocess_writer

import asyncckpt
from asyncckpt.errors import CorruptCheckpointError, UnsupportedStateError
from asyncckpt.format.tree import check_tree, tensor_paths, unflatten
from asyncckpt.rank.flatten import flatten
from asyncckpt.storage.local import read_manifest

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support:UserWarning",
                                        "ignore:torch.quantize_per_tensor:UserWarning")


# -- helpers and fixtures ---------------------------------------------------------------

def json_round_trip(state: object) -> object:
    """flatten -> strict JSON text -> unflatten, resolving tensors from the entries."""
    tree, entries = flatten(state)
    text = json.dumps(tree, allow_nan=False)  # the tree must be strict JSON
    by_name = {e.name: e.tensor for e in entries}
    assert len(by_name) == len(entries), "tensor names must be unique"
    return unflatten(json.loads(text), by_name.__getitem__)


@pytest.fixture(scope="module")
def mwriter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessWriter]:
    """One writer for the module's save() tests, in this process (tests/inprocess.py)."""
    with inprocess_writer(tmp_path_factory.mktemp("tree")) as w:
        yield w


@pytest.fixture
def mclient(mwriter: InProcessWriter) -> Iterator[asyncckpt.Client]:
    with small_ring_client(mwriter) as c:
        yield c


def step_entries(root: Path, step: int) -> list[str]:
    prefix = f"step-{step:08d}"
    return sorted(n for n in os.listdir(root) if n.startswith(prefix))


class Opaque:
    pass


# -- round trips without a writer -------------------------------------------------------

def test_nested_containers_round_trip_with_key_types():
    t = torch.arange(6.0).reshape(2, 3)
    state = {
        "a": {"b": [1, (2, 3), [t, {"c": None}]]},
        0: {1: "int keys", "1": "str key beside int key 1"},
        -7: (),
        "empty": {"d": {}, "l": [], "t": ()},
        "tuple_of_tuples": ((1,), ((2,),)),
    }
    out = json_round_trip(state)
    assert_same(state, out)
    assert list(out.keys()) == ["a", 0, -7, "empty", "tuple_of_tuples"]
    assert type(list(out[0].keys())[0]) is int and list(out[0].keys())[1] == "1"
    assert type(out["a"]["b"][1]) is tuple and type(out["a"]["b"][2]) is list
    assert out["a"]["b"][2][0].data_ptr() == t.data_ptr()  # resolved straight from the entries


def test_scalar_leaves_round_trip_exactly():
    state = {"inf": math.inf, "ninf": -math.inf, "nan": math.nan, "negzero": -0.0,
             "tiny": 5e-324, "huge": 1.7976931348623157e308, "third": 1 / 3,
             "none": None, "true": True, "false": False, "big": 2**200, "nbig": -(2**100),
             "i64max": 2**63 - 1, "str": "ünïcode \u2603 \n \"quoted\" \\", "empty": ""}
    out = json_round_trip(state)
    assert_same(state, out)
    assert out["inf"] == math.inf and out["ninf"] == -math.inf and math.isnan(out["nan"])
    assert math.copysign(1.0, out["negzero"]) == -1.0
    assert out["true"] is True and out["false"] is False
    assert type(out["big"]) is int and out["big"] == 2**200


def test_non_finite_floats_are_tagged_nodes():
    tree, _ = flatten([math.inf, -math.inf, math.nan, 1.5])
    assert tree == {"list": [{"float": "inf"}, {"float": "-inf"}, {"float": "nan"}, 1.5]}


def test_tree_encoding_of_each_node_kind():
    t = torch.zeros(1)
    tree, entries = flatten({"x": (1, [t]), 3: None})
    assert tree == {"dict": [["x", {"tuple": [1, {"list": [{"tensor": "x.1.0"}]}]}], [3, None]]}
    assert [e.name for e in entries] == ["x.1.0"]
    assert entries[0].path == ("x", 1, 0)


def test_tensor_names_are_dotted_paths_in_order():
    g = torch.Generator().manual_seed(0)
    state = {"model": {"layers": [{"w": torch.randn(2, 2, generator=g)},
                                  {"w": torch.randn(2, generator=g)}]},
             "optim": {"state": {0: {"exp_avg": torch.zeros(3)}}}}
    tree, entries = flatten(state)
    assert [e.name for e in entries] == ["model.layers.0.w", "model.layers.1.w",
                                         "optim.state.0.exp_avg"]
    assert [e.path for e in entries] == [("model", "layers", 0, "w"), ("model", "layers", 1, "w"),
                                         ("optim", "state", 0, "exp_avg")]
    assert entries[0].dtype_name == "F32"
    assert tensor_paths(tree) == {e.name: e.path for e in entries}


def test_top_level_tensor_and_empty_path_names():
    tree, entries = flatten(torch.ones(2))
    assert tree == {"tensor": "tensor"} and entries[0].path == ()
    tree, entries = flatten([torch.ones(1), torch.ones(1)])
    assert [e.name for e in entries] == ["0", "1"]


def test_colliding_dotted_names_are_made_unique():
    x, y, z = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    state = {"a": {"b.c": x}, "a.b": {"c": y}, "a.b.c": z}
    tree, entries = flatten(state)
    names = [e.name for e in entries]
    assert len(set(names)) == 3 and names[0] == "a.b.c"
    assert all(n.startswith("a.b.c") for n in names)
    out = json_round_trip(state)
    assert [out["a"]["b.c"].item(), out["a.b"]["c"].item(), out["a.b.c"].item()] == [1.0, 0.0, 2.0]


def test_metadata_key_never_becomes_a_tensor_name():
    state = {"__metadata__": torch.ones(2), "m": {"__metadata__": torch.zeros(1)}}
    _, entries = flatten(state)
    assert "__metadata__" not in [e.name for e in entries]
    assert_same(state, json_round_trip(state))


def test_tensor_leaves_are_detached_and_keep_their_storage():
    p = torch.nn.Parameter(torch.ones(3))
    _, entries = flatten({"p": p})
    assert not entries[0].tensor.requires_grad
    assert entries[0].tensor.data_ptr() == p.data_ptr()  # no copy at save() time


def test_shared_objects_are_not_cycles():
    shared = [1, 2]
    t = torch.ones(2)
    state = {"a": shared, "b": shared, "t1": t, "t2": t}
    out = json_round_trip(state)
    assert out["a"] == [1, 2] and out["b"] == [1, 2]
    tree, entries = flatten(state)
    assert [e.name for e in entries] == ["t1"]  # the same tensor twice is stored once
    assert out["t2"].data_ptr() == out["t1"].data_ptr()


# -- views: tensors sharing storage are stored once ---------------------------------------

def test_tied_tensor_is_a_view_node_and_comes_back_tied():
    w = torch.randn(5, 4)
    tree, entries = flatten({"emb": w, "head": w})
    assert [e.name for e in entries] == ["emb"]
    assert tree == {"dict": [["emb", {"tensor": "emb"}],
                             ["head", {"view": {"of": "emb", "dtype": "F32", "offset": 0,
                                                "shape": [5, 4], "stride": [4, 1]}}]]}
    out = json_round_trip({"emb": w, "head": w})
    assert out["head"].data_ptr() == out["emb"].data_ptr() and torch.equal(out["head"], w)
    out["emb"][0, 0] = 42.0
    assert out["head"][0, 0] == 42.0


@pytest.mark.parametrize("make", [
    lambda w: w[2:4],                    # a slice: offset 8
    lambda w: w.t(),                     # a transpose: strides (1, 4)
    lambda w: w[1:, ::2],                # offset and a stride
    lambda w: w.view(-1)[3:7].view(2, 2),
    lambda w: w[0].expand(3, 4),         # a zero stride
], ids=["slice", "transpose", "strided", "reshaped", "expanded"])
def test_views_inside_an_earlier_contiguous_tensor_are_recorded_and_rebuilt(make):
    w = torch.arange(20.0).view(5, 4)
    v = make(w)
    tree, entries = flatten({"w": w, "v": v})
    assert [e.name for e in entries] == ["w"]
    body = tree["dict"][1][1]["view"]
    assert (body["offset"], body["shape"], body["stride"]) == (
        v.storage_offset(), list(v.shape), list(v.stride()))
    out = json_round_trip({"w": w, "v": v})
    assert torch.equal(out["v"], v) and out["v"].stride() == v.stride()
    assert out["v"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()


@pytest.mark.parametrize("state", [
    lambda w: {"v": w[1:], "w": w},                    # the view comes first
    lambda w: {"w": w.t(), "v": w.t()[1:]},            # the first is not contiguous
    lambda w: {"a": w.view(-1)[:10], "b": w.view(-1)[5:]},  # overlapping, neither holds the other
    lambda w: {"w": w, "v": w.view(torch.int32)},      # another dtype
    lambda w: {"w": w, "c": w.clone()},                # another storage
], ids=["view-first", "non-contiguous-base", "overlap", "dtype", "clone"])
def test_tensors_not_inside_an_earlier_contiguous_one_are_saved_on_their_own(state):
    s = state(torch.arange(20.0).view(5, 4))
    tree, entries = flatten(s)
    assert len(entries) == 2 and "view" not in json.dumps(tree)
    out = json_round_trip(s)
    for k, v in s.items():
        assert torch.equal(out[k], v)


@pytest.mark.parametrize("body", [
    {"of": "w", "dtype": "F32", "offset": 0, "shape": [2], "stride": [1, 1]},   # ranks differ
    {"of": "w", "dtype": "F32", "offset": -1, "shape": [2], "stride": [1]},
    {"of": "w", "dtype": "F32", "offset": 0, "shape": [2], "stride": [-1]},
    {"of": "w", "dtype": "F32", "offset": 0, "shape": [2**62], "stride": [1]},
    {"of": "w", "dtype": "F32", "offset": 0, "shape": [2**31] * 3, "stride": [1] * 3},
    {"of": "w", "dtype": "F32", "offset": 2**61, "shape": [3], "stride": [2**61]},
    {"of": "w", "dtype": "F32", "offset": 0, "shape": [1] * 65, "stride": [1] * 65},
    {"of": "w", "dtype": "F32", "offset": 0, "shape": [True], "stride": [1]},
    {"of": "w", "dtype": "F32", "offset": 0.0, "shape": [1], "stride": [1]},
    {"of": 3, "dtype": "F32", "offset": 0, "shape": [1], "stride": [1]},
    {"of": "w", "offset": 0, "shape": [1], "stride": [1]},
    {"of": "w", "dtype": "F32", "offset": 0, "shape": [1], "stride": [1], "extra": 1},
    ["w", 0],
], ids=repr)
def test_malformed_view_nodes_are_corrupt(body):
    with pytest.raises(CorruptCheckpointError, match="view node"):
        unflatten({"dict": [["v", {"view": body}]]},
                  lambda name: pytest.fail("resolved the base of a malformed view"))


# -- what flatten refuses ---------------------------------------------------------------

def _cyclic_list() -> object:
    a: list = [1]
    a.append({"back": a})
    return {"c": a}


def _cyclic_dict() -> object:
    d: dict = {"x": 1}
    d["self"] = d
    return {"top": d}


UNSUPPORTED = {
    "set": (lambda: {"opt": {"ids": {1, 2}}}, ["state['opt']['ids']", "set"]),
    "custom_object": (lambda: {"cfg": [1, Opaque()]}, ["state['cfg'][1]", "Opaque"]),
    "complex_number": (lambda: {"z": [0, 1j]}, ["state['z'][1]", "complex"]),
    "torch_dtype": (lambda: {"amp": {"dtype": torch.bfloat16}}, ["state['amp']['dtype']", "dtype"]),
    "complex_tensor": (lambda: {"w": {"c": torch.zeros(2, dtype=torch.complex64)}},
                       ["state['w']['c']", "complex64"]),
    "sparse_coo": (lambda: {"s": [torch.eye(2).to_sparse()]}, ["state['s'][0]", "layout"]),
    "sparse_csr": (lambda: {"s": torch.eye(2).to_sparse_csr()}, ["state['s']", "layout"]),
    "meta_tensor": (lambda: {"m": torch.empty(3, device="meta")}, ["state['m']", "meta"]),
    "quantized": (lambda: {"q": {0: torch.quantize_per_tensor(torch.ones(2), 0.1, 0,
                                                              torch.quint8)}},
                  ["state['q'][0]", "quantized"]),
    "bool_key": (lambda: {"x": {True: 1}}, ["state['x']", "True", "bool"]),
    "tuple_key": (lambda: {"x": {("a", "b"): 1}}, ["state['x']", "('a', 'b')", "tuple"]),
    "float_key": (lambda: {1.5: 1}, ["state", "1.5", "float"]),
    "none_key": (lambda: {"n": {None: 1}}, ["state['n']", "None"]),
    "cycle_list": (_cyclic_list, ["state['c'][1]['back']", "cycle"]),
    "cycle_dict": (_cyclic_dict, ["state['top']['self']", "cycle"]),
    # numpy's scalars print as numbers: the message says what they are and what to pass
    "numpy_scalar": (lambda: {"loss": np.float32(1.5)},
                     ["state['loss']", "numpy.float32, a numpy scalar", "x.item()"]),
    "numpy_array": (lambda: {"mask": np.zeros(3)},
                    ["state['mask']", "numpy.ndarray", "torch.from_numpy(x)"]),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_value_names_its_key_path(case):
    make, fragments = UNSUPPORTED[case]
    with pytest.raises(UnsupportedStateError) as info:
        flatten(make())
    assert isinstance(info.value, TypeError)  # also catchable as TypeError
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_save_refuses_before_sending_anything(mclient, mwriter):
    root = mwriter.root
    for case, (make, fragments) in UNSUPPORTED.items():
        with pytest.raises(UnsupportedStateError) as info:
            mclient.save(40, make())
        assert fragments[0] in str(info.value), case
    assert step_entries(root, 40) == []  # no tmp dir, no step
    # the writer never heard of step 40: this rank can save it now, and it loads back
    state = {"w": torch.arange(5), "ok": True}
    assert mclient.save(40, state).wait(30) == root / "step-00000040"
    assert_same(state, asyncckpt.load(root, step=40))
    assert step_entries(root, 40) == ["step-00000040"]


def test_save_refuses_bad_steps(mclient, mwriter):
    for bad in (-1, 1.0, "3", True, None):
        with pytest.raises(ValueError):
            mclient.save(bad, {"x": 1})  # type: ignore[arg-type]
    assert not any(n.startswith("step-") and ".tmp-" in n for n in os.listdir(mwriter.root))


def test_step_beyond_manifest_limit_is_refused_or_loadable(mclient):
    try:
        handle = mclient.save(2**62, {"t": torch.ones(2)})
    except ValueError:
        return
    assert_same({"t": torch.ones(2)}, asyncckpt.load(handle.wait(30)))


def test_tricky_state_round_trips_through_a_real_writer(mclient, mwriter):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(3, generator=g)
    state = {
        "a": {"b.c": x}, "a.b": {"c": y},           # colliding dotted names
        "__metadata__": {"note": "not the safetensors metadata", "t": torch.ones(2)},
        "optim": {"state": {0: {"step": torch.tensor(7)}, 11: {"step": torch.tensor(8)}},
                  "param_groups": [{"betas": (0.9, 0.999), "params": [0, 11]}]},
        "floats": [math.inf, -math.inf, math.nan, -0.0, 1e-310], "big": 2**130,
        "flags": (True, False, None), "unicode ключ": "значение",
    }
    path = mclient.save(50, state).wait(30)
    loaded = asyncckpt.load(path)
    assert_same(state, loaded)
    assert list(loaded["optim"]["state"]) == [0, 11]
    assert math.copysign(1.0, loaded["floats"][3]) == -1.0
    names = [t.name for t in read_manifest(path).ranks[0].tensors]
    assert len(names) == len(set(names)) == 5 and "__metadata__" not in names
    assert "optim.state.0.step" in names and "a.b.c" in names


def test_bytes_values_round_trip_as_bytes_through_a_real_writer(mclient):
    state = {"blob": b"\x00\x01\xff", "empty": b"", "mutable": bytearray(b"xy"),
             "view": memoryview(b"abc"), "nested": [b"a", {"k": b"b"}], "t": torch.ones(2)}
    loaded = asyncckpt.load(mclient.save(51, state).wait(30))
    assert loaded["blob"] == b"\x00\x01\xff" and loaded["empty"] == b""
    assert loaded["mutable"] == b"xy" and loaded["view"] == b"abc"
    assert loaded["nested"] == [b"a", {"k": b"b"}] and all(
        type(v) is bytes for v in (loaded["blob"], loaded["mutable"], loaded["view"]))


def test_bytes_nodes_are_uint8_vectors_of_the_table():
    tree, entries = flatten({"b": b"hi"})
    assert tree == {"dict": [["b", {"bytes": "b"}]]}
    assert entries[0].tensor.dtype == torch.uint8 and entries[0].tensor.tolist() == [104, 105]
    check_tree([("b", "U8", (2,))], {"bytes": "b"})
    check_tree([("b", "U8", (2,))], {"pickled": "b"})
    for table in ([("b", "F32", (2,))], [("b", "U8", (1, 2))]):
        with pytest.raises(CorruptCheckpointError, match="not 1-D U8"):
            check_tree(table, {"bytes": "b"})


# -- unflatten of malformed trees -------------------------------------------------------

@pytest.mark.parametrize("tree", [
    [1, 2],                                  # a bare JSON list is not a node
    {"list": [1], "tuple": [2]},             # two kinds in one node
    {"float": "NaN"}, {"float": 1.0}, {"tensor": 3}, {"bogus": []},
    {"dict": [["a"]]}, {"dict": [[True, 1]]}, {"dict": [[1.5, 1]]}, {"dict": [[None, 1]]},
    {"dict": {"a": 1}}, {"list": {"a": 1}},
], ids=repr)
def test_unflatten_rejects_malformed_nodes(tree):
    with pytest.raises(CorruptCheckpointError):
        unflatten(tree, lambda name: pytest.fail("resolved a tensor of a malformed tree"))


@pytest.mark.parametrize("items,key", [
    ([["a", 1], ["a", 1]], "'a'"),                           # even with equal values
    ([["a", 1], ["b", 2], ["a", {"tensor": "w"}]], "'a'"),
    ([[0, 1], ["0", 2], [0, 3]], "0"),                       # 0 and "0" differ; 0 twice does not
], ids=repr)
def test_unflatten_refuses_a_dict_node_repeating_a_key(items, key):
    """Python would keep the last value, another reader the first: two states from one
    tree. Nested too, with the path named."""
    with pytest.raises(CorruptCheckpointError, match=rf"dict at \[\] repeats the key {key}"):
        unflatten({"dict": items}, lambda name: torch.zeros(1))
    with pytest.raises(CorruptCheckpointError, match=rf"dict at \['m', 2\] repeats the key {key}"):
        unflatten({"dict": [["m", {"list": [1, 2, {"dict": items}]}]]}, lambda name: torch.zeros(1))


def test_int_and_str_keys_that_print_alike_are_two_keys():
    rebuilt = unflatten({"dict": [[1, "int"], ["1", "str"]]}, lambda name: None)
    assert rebuilt == {1: "int", "1": "str"}


def test_a_view_with_a_zero_dimension_has_no_offset_bound():
    """docs/FORMAT.md: an empty view reads nothing, so only [0, 2**62) bounds its offset."""
    table = [("w", "F32", (4,))]
    far = {"of": "w", "dtype": "F32", "offset": 2**62 - 1, "shape": [0, 3], "stride": [1, 1]}
    tree = {"dict": [["w", {"tensor": "w"}], ["v", {"view": far}]]}
    check_tree(table, tree)
    rebuilt = unflatten(tree, lambda name: torch.arange(4.0))
    assert rebuilt["v"].shape == (0, 3)
    for body in ({**far, "shape": [1, 3]}, {**far, "offset": 2**62}):
        with pytest.raises(CorruptCheckpointError, match="view"):
            check_tree(table, {"dict": [["w", {"tensor": "w"}], ["v", {"view": body}]]})


def test_unflatten_of_absurdly_deep_tree_is_corrupt_not_a_crash():
    tree: object = 1
    for _ in range(100_000):
        tree = {"list": [tree]}
    with pytest.raises(CorruptCheckpointError, match="deep"):
        unflatten(tree, lambda name: None)


# -- bugs ---------------------------------------------------------------------------------

def test_huge_int_is_refused_in_save_and_client_keeps_working(mclient, mwriter):
    with pytest.raises(UnsupportedStateError, match=r"state\['x'\]"):
        mclient.save(60, {"x": 10**5000})
    assert mclient.save(61, {"t": torch.ones(2)}).wait(30) == mwriter.root / "step-00000061"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_deeply_nested_dict_saves_or_is_refused_but_never_hangs(mwriter):
    client = asyncckpt.connect(mwriter.address, rank=0, world_size=1, **SMALL_RING)
    try:
        state: object = torch.ones(2)
        for _ in range(400):
            state = {"k": state}
        try:
            handle = client.save(70, state)
        except UnsupportedStateError:
            pass
        else:
            handle.wait(2)  # TimeoutError here is the hang (a tiny save commits in ~10 ms)
        assert client.save(71, {"t": torch.ones(2)}).wait(2) == mwriter.root / "step-00000071"
    finally:
        client.close(timeout=0.5)


def test_too_deep_list_is_unsupported_state():
    state: object = torch.ones(1)
    for _ in range(3000):
        state = [state]
    with pytest.raises(UnsupportedStateError):
        flatten(state)


def test_show_path_spells_a_key_path_as_python_indexes_the_state():
    from asyncckpt.format.tree import show_path
    assert show_path(()) == "state"
    assert show_path(("model", 0, "w.x")) == "state['model'][0]['w.x']"
