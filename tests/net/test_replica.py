"""What a replica is (net/replica.py): an offer checked field by field and against the
bound before anything is allocated for it; the reference store; sources that are short."""

from __future__ import annotations

import os
from typing import Any

import pytest

from asyncckpt.errors import ReplicaError
from asyncckpt.net.replica import (
    MAX_STREAMS,
    MemoryStore,
    Offer,
    Stream,
    offer_from_json,
    source_view,
)

GOOD = {"node": 1, "step": 5, "doc": {"a": 1}, "streams": [[2, 10, 100], [3, 0, 0]]}


def test_an_offer_roundtrips_through_json() -> None:
    offer = offer_from_json(GOOD, 1000)
    assert offer == Offer(1, 5, {"a": 1}, (Stream(2, 10, 100), Stream(3, 0, 0)))
    assert offer.total_bytes == 90 and offer_from_json(offer.to_json(), 90) == offer


@pytest.mark.parametrize("change, cause", [
    ({"node": True}, "not integers"),
    ({"step": -1}, "not integers"),
    ({"step": 5.0}, "not integers"),
    ({"doc": []}, "facts are not a JSON object"),
    ({"streams": {}}, "not a list"),
    ({"streams": [[2, 10]]}, "not \\[rank, start, size\\]"),
    ({"streams": [[2, 101, 100]]}, "start <= size"),
    ({"streams": [[2, 0, 1 << 49]]}, "2\\*\\*48"),
    ({"streams": [[2, 0, 1], [2, 0, 1]]}, "a rank twice"),
    ({"streams": [[i, 0, 0] for i in range(MAX_STREAMS + 1)]}, "at most 65536"),
    ({"streams": [[2, 0, 600], [3, 0, 401]]}, "1001 bytes, larger than the bound"),
])
def test_a_bad_offer_is_refused(change: dict[str, Any], cause: str) -> None:
    with pytest.raises(ReplicaError, match=cause):
        offer_from_json({**GOOD, **change}, 1000)
    with pytest.raises(ReplicaError, match="not a JSON object"):
        offer_from_json([GOOD], 1000)


def test_the_memory_store_keeps_the_newest_two_per_node() -> None:
    store = MemoryStore()
    for node, step in ((1, 4), (1, 5), (2, 5), (1, 6)):
        offer = Offer(node, step, {}, (Stream(0, 0, 3),))
        sink = store.put_generation("peer", offer)
        sink.data(0, 0, memoryview(bytes([step] * 3)))
        assert sink.finish()
    assert [(g["node"], g["step"]) for g in store.list_generations()] == [(1, 5), (1, 6),
                                                                          (2, 5)]
    newest = store.get_generation(1, None)
    assert newest is not None and newest.offer.step == 6
    assert bytes(newest.sources[0]) == b"\x06\x06\x06"  # type: ignore[arg-type]
    assert store.get_generation(1, 4) is None and store.get_generation(3, None) is None
    sink = store.put_generation("peer", Offer(1, 7, {}, (Stream(0, 0, 3),)))
    with pytest.raises(ReplicaError, match="out of order"):
        sink.data(0, 1, memoryview(b"x"))
    with pytest.raises(ReplicaError, match="ended short"):
        sink.finish()
    sink.abort()
    assert store.aborted == 1 and store.get_generation(1, 7) is None


def test_a_short_source_is_refused() -> None:
    with pytest.raises(ReplicaError, match="holds 3 bytes, its stream 4"):
        source_view(b"abc", 4)
    fd = os.memfd_create("short")
    try:
        os.write(fd, b"abc")
        with pytest.raises(ReplicaError, match="holds 3 bytes"):
            source_view(fd, 4)
        view, release = source_view(fd, 3)
        assert bytes(view) == b"abc" and view.readonly
        release()
    finally:
        os.close(fd)
