"""Staging: the bytes that reach the slots are the tensors' row-major bytes, packed."""

from __future__ import annotations

import torch

from asyncckpt import ring
from asyncckpt.stager import byte_pieces, stage


def row_major_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_byte_pieces_of_non_contiguous_tensors_are_bounded_and_ordered():
    base = torch.arange(64 * 300, dtype=torch.float32).reshape(64, 300)
    for t in (base.t(), base[:, ::3], base.t()[5:9]):
        pieces = list(byte_pieces(t, max_bytes=256))
        assert all(p.numel() <= 256 for p in pieces) or t.is_contiguous()
        assert b"".join(p.numpy().tobytes() for p in pieces) == row_major_bytes(t)


def test_rows_larger_than_a_slot_are_split_recursively():
    big_rows = torch.randn(2, 4, 3000)[:, :, ::2]  # rows of 6000 bytes, slots of 1024
    for tensor in (big_rows, big_rows.transpose(0, 1)):
        pieces = list(byte_pieces(tensor, max_bytes=1024))
        assert max(p.numel() for p in pieces) <= 1024
        assert b"".join(p.numpy().tobytes() for p in pieces) == row_major_bytes(tensor)


def test_stage_packs_slots_across_tensor_boundaries():
    r = ring.Ring.create(4096, 4)
    try:
        tensors = [torch.arange(1000, dtype=torch.int32), torch.ones(3, dtype=torch.bool),
                   torch.randn(700, 3).t(), torch.empty(0), torch.tensor(2.5)]
        expected = b"".join(row_major_bytes(t) for t in tensors)
        free, got = [0, 1, 2, 3], []

        def emit(slot: int, length: int) -> None:
            view = r.slot_bytes(slot, length)
            got.append(bytes(view))
            view.release()
            free.append(slot)

        total = stage(tensors, r, acquire=lambda: free.pop(0), emit=emit)
        assert total == len(expected) and b"".join(got) == expected
        assert [len(g) for g in got[:-1]] == [4096] * (len(got) - 1)  # every frame but the last is full
    finally:
        r.close()


def test_contiguous_tensor_with_odd_strides_on_size_one_dims():
    t = torch.tensor([[-1213]], dtype=torch.int16).as_strided((1, 1), (2, 2))
    assert t.is_contiguous()
    assert b"".join(p.numpy().tobytes() for p in byte_pieces(t, 64)) == (-1213).to_bytes(2, "little", signed=True)


def test_slots_held_when_staging_stops_are_given_back():
    r = ring.Ring.create(1024, 4)
    try:
        free, emitted, released = [0, 1, 2, 3], [], []

        def tensors():
            yield torch.zeros(700, dtype=torch.int32)  # fills slots 0, 1 and part of 2
            raise RuntimeError("torn")

        try:
            stage(tensors(), r, acquire=lambda: free.pop(0), emit=lambda s, n: emitted.append(s),
                  release=released.append)
        except RuntimeError:
            pass
        else:
            raise AssertionError("the error must propagate")
        assert emitted == [0, 1] and released == [2] and free == [3]
    finally:
        r.close()
