"""memo.py and the checks that use it: a pass is remembered by the exact content checked,
so the same structures cost no second walk, and anything else is still checked in full
(a copy differing only in a bad tree or table is refused with the memo warm)."""

from __future__ import annotations

import collections
import copy
import enum
import json
from collections.abc import Iterator
from typing import Any

import pytest

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format import memo, records, tiling, tree
from asyncckpt.format.layout import layout
from asyncckpt.format.manifest import Manifest, check_readable
from asyncckpt.format.records import Frame, RankPart
from asyncckpt.ipc.messages import Begin, parse

LIMITS = ReadLimits()


class Small(enum.IntEnum):
    ONE = 1


class Name(str):
    pass


@pytest.fixture(autouse=True)
def cold_memos() -> Iterator[None]:
    for m in (tree._CHECKED, tiling._NO_GLOBALS, records._TABLES):
        m.clear()
    yield


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times a tree was walked (by check_tree and by rank_globals)."""
    calls = [0]
    real = tree.walk

    def counting(t: Any) -> Any:
        calls[0] += 1
        return real(t)
    monkeypatch.setattr(tree, "walk", counting)
    monkeypatch.setattr(tiling, "walk", counting)
    return calls


@pytest.fixture
def table_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tensor table entries rank_from_json checked (one element_size each)."""
    calls = [0]
    real = records.element_size

    def counting(dtype: str) -> int:
        calls[0] += 1
        return real(dtype)
    monkeypatch.setattr(records, "element_size", counting)
    return calls


# -- the key ------------------------------------------------------------------------------

@pytest.mark.parametrize("a, b", [
    ([1], (1,)),                      # a list is not a tuple
    ([1], [1.0]), ([1], [True]),      # nor 1 a float or a bool
    ([0.0], [-0.0]),
    ({1: "a"}, {"1": "a"}),           # an int key is not a str key
    ({"a": 1, "b": 2}, {"a": 2, "b": 1}),
    ("ab", b"ab"),
    ([[1], 2], [1, [2]]),
])
def test_different_values_have_different_keys(a, b):
    assert memo.exact_key(a) is not None and memo.exact_key(b) is not None
    assert memo.exact_key(a) != memo.exact_key(b)


def test_equal_values_have_one_key_however_they_share_objects():
    leaf = {"tensor": "w"}
    shared = {"list": [leaf, leaf]}
    assert memo.exact_key(shared) == memo.exact_key(json.loads(json.dumps(shared)))


@pytest.mark.parametrize("value", [[Small.ONE], [Name("a")], {"a": collections.OrderedDict()},
                                   [object()]])
def test_other_types_have_no_key(value):
    assert memo.exact_key(value) is None


def test_a_cycle_or_too_deep_a_nesting_has_no_key():
    cycle: list[Any] = []
    cycle.append(cycle)
    assert memo.exact_key(cycle) is None
    deep: Any = 0
    for _ in range(100_000):
        deep = [deep]
    assert memo.exact_key(deep) is None


def test_a_memo_holds_its_size_the_most_recently_used():
    m: memo.Memo[int] = memo.Memo(3)
    keys = [memo.exact_key(i) for i in range(5)]
    for i, key in enumerate(keys[:3]):
        m.put(key, i)
    assert m.get(keys[0]) == 0  # used: kept
    m.put(keys[3], 3)
    m.put(keys[4], 4)
    assert len(m) == 3
    assert m.get(keys[1]) is None and m.get(keys[2]) is None
    assert [m.get(k) for k in (keys[0], keys[3], keys[4])] == [0, 3, 4]
    m.put(None, 9)  # no key: nothing kept
    assert m.get(None) is None and len(m) == 3


# -- check_tree ----------------------------------------------------------------------------

TABLE = [("w", "F32", (4, 3)), ("b", "U8", (5,))]
TREE = {"dict": [["w", {"tensor": "w"}], ["b", {"bytes": "b"}], ["lr", 0.001],
                 ["t", {"view": {"of": "w", "dtype": "F32", "offset": 3, "shape": [3],
                                 "stride": [1]}}]]}


def bad_trees() -> list[tuple[Any, Any, str]]:
    """(table, tree) copies of TABLE/TREE differing in one thing the reader refuses."""
    repeated = copy.deepcopy(TREE)
    repeated["dict"].append(["lr", 1])
    outside = copy.deepcopy(TREE)
    outside["dict"][3][1]["view"]["offset"] = 10
    as_tuple = {"list": ({"tensor": "w"}, {"bytes": "b"})}  # a "list" node's body: a tuple
    int_offset = copy.deepcopy(TREE)
    int_offset["dict"][3][1]["view"]["offset"] = Small.ONE  # an int only by subclass
    return [
        (TABLE, repeated, "repeats the key 'lr'"),
        (TABLE, outside, "does not fit"),
        (TABLE, as_tuple, "malformed tree node"),
        (TABLE, int_offset, "malformed view node"),
        ([("w", "F32", (4, 3)), ("b", "F32", (5,))], TREE, "not 1-D U8"),
        ([("w", "F32", (4, 3))], TREE, "disagree"),
    ]


@pytest.mark.parametrize("table, bad, why", bad_trees())
def test_a_copy_with_a_bad_tree_or_table_is_refused_with_the_memo_warm(table, bad, why):
    paths = tree.check_tree(TABLE, TREE)
    assert tree.check_tree(TABLE, json.loads(json.dumps(TREE))) == paths  # a hit
    assert len(tree._CHECKED) == 1
    with pytest.raises(CorruptCheckpointError, match=why):
        tree.check_tree(table, bad)
    with pytest.raises(CorruptCheckpointError, match=why):  # refusals are not remembered
        tree.check_tree(table, bad)


def test_a_tree_changed_after_its_check_is_checked_again():
    mine = copy.deepcopy(TREE)
    tree.check_tree(TABLE, mine)
    mine["dict"][0][1]["tensor"] = "b"  # references b twice, w never
    with pytest.raises(CorruptCheckpointError, match="twice"):
        tree.check_tree(TABLE, mine)


def test_a_remembered_pass_returns_a_fresh_dict(walks):
    first = tree.check_tree(TABLE, TREE)
    first["w"] = ("spoiled",)
    assert tree.check_tree(TABLE, TREE) == {"w": ("w",), "b": ("b",)}


def test_the_same_begin_again_walks_its_tree_no_more(walks):
    """A job's saves send the same table and tree every step: the begin's check walks the
    tree once for the first, not at all for the next (before: three walks each)."""
    def begin(step: int) -> dict[str, Any]:
        return {"op": "begin", "save": step, "step": step, "world_size": 1,
                "tensors": [[n, d, list(s)] for n, d, s in TABLE], "tree": TREE}
    first = parse(begin(1))
    assert isinstance(first, Begin) and first.refused is None
    assert walks[0] == 1
    for step in (2, 3, 4):
        again = parse(begin(step))
        assert isinstance(again, Begin) and again.refused is None
    assert walks[0] == 1
    bad = begin(5)
    bad["tree"] = bad_trees()[0][1]
    refused = parse(bad)
    assert isinstance(refused, Begin) and "repeats the key 'lr'" in (refused.refused or "")


# -- a manifest's tables and trees (the commit's check) ------------------------------------

def part(rank: int, salt: int, tree_json: Any = None) -> RankPart:
    prefix, specs = layout([("model.w", "F32", (4, 3)), ("model.b", "BF16", (5,)),
                            ("step", "I64", ())])
    raw = specs[-1].end
    frames = [Frame(0, raw, 0, raw, "raw", 0x1000 + salt, 0x1000 + salt)]
    model = {"dict": [["w", {"tensor": "model.w"}], ["b", {"tensor": "model.b"}]]}
    tree_json = tree_json or {"dict": [["model", model], ["step", {"tensor": "step"}]]}
    return RankPart(rank, f"rank-{rank:05d}.safetensors", "raw", raw, raw, specs, frames,
                    tree_json)


def manifest(step: int, ranks: list[RankPart] | None = None) -> Manifest:
    ranks = ranks or [part(0, step), part(1, step + 1)]
    return Manifest(step=step, world_size=len(ranks), ranks=ranks, created=1.0)


def commit_check(m: Manifest) -> Manifest:
    """What the writer asks before it commits (server.py): the reader's parse, then the
    tiling of global tensors."""
    readable = check_readable(m.to_bytes(), LIMITS)
    tiling.global_tensors(readable)
    return readable


def test_the_next_saves_manifest_walks_no_tree_and_checks_no_table(walks, table_checks):
    """Frames change every save (their checksums), tables and trees do not: the first
    commit's check walks the tree and checks the table once (both ranks have the same),
    the next ones not at all (before: a walk and three entries a rank, every save)."""
    first = commit_check(manifest(100))
    assert (walks[0], table_checks[0]) == (1, 3)
    for step in (101, 102):
        again = commit_check(manifest(step))
        assert [p.tensors for p in again.ranks] == [p.tensors for p in first.ranks]
        assert [p.frames[0].xxh3_raw for p in again.ranks] == [0x1000 + step, 0x1001 + step]
    assert (walks[0], table_checks[0]) == (1, 3)


def test_a_manifest_differing_in_a_bad_table_is_refused_with_the_memo_warm():
    commit_check(manifest(100))
    bad = part(1, 7)
    # model.b's range holds 10 bytes (BF16 (5,)); as F32 it needs 20
    bad.tensors = [bad.tensors[0], bad.tensors[1]._replace(dtype="F32"), *bad.tensors[2:]]
    with pytest.raises(CorruptCheckpointError, match="shape and dtype need 20"):
        commit_check(manifest(101, [part(0, 7), bad]))
    repeated = part(1, 7)
    repeated.tensors = [repeated.tensors[0], repeated.tensors[1]._replace(name="model.w"),
                        repeated.tensors[2]]
    with pytest.raises(CorruptCheckpointError, match="repeated tensor name"):
        commit_check(manifest(102, [part(0, 7), repeated]))
    commit_check(manifest(103))  # the good one still passes


def test_a_manifest_differing_in_a_bad_tree_is_refused_with_the_memo_warm():
    commit_check(manifest(100))
    malformed = {"dict": [["model", {"dtensor": {"name": "model.w", "dtype": "F32",
                                                 "shape": [4, 3], "offsets": [0, 0, 0],
                                                 "placements": ["S(0)"]}}],
                          ["b", {"tensor": "model.b"}], ["step", {"tensor": "step"}]]}
    with pytest.raises(CorruptCheckpointError, match="does not fit the global shape"):
        commit_check(manifest(101, [part(0, 7), part(1, 8, malformed)]))
    not_a_name = {"dict": [["model", {"dtensor": {"name": 3}}]]}
    with pytest.raises(CorruptCheckpointError, match="malformed dtensor node"):
        commit_check(manifest(102, [part(0, 7), part(1, 8, not_a_name)]))
    commit_check(manifest(103))
