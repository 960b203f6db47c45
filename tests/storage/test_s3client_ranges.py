"""storage/s3client.py's reading side: one ranged GET per range, streamed in pieces,
resumed where an answer broke off, refused when the store ignores the range.

A fake client (tests/fake_s3.py) stands in for boto3 and counts the requests."""

from __future__ import annotations

import os

import pytest
from fake_s3 import FakeS3

from asyncckpt.config import ObjectStoreKnobs
from asyncckpt.storage import s3client
from asyncckpt.storage.paths import ObjectPath
from asyncckpt.storage.s3client import ObjectStoreError, S3ReadFile

KEY = "root/step-00000001/rank-00000.safetensors"
DATA = os.urandom(300_000)


def opened(s3: FakeS3, **knobs: int) -> S3ReadFile:
    return S3ReadFile(s3, ObjectPath("/", "ckpt", *KEY.split("/")), len(DATA),
                      ObjectStoreKnobs.from_env(**knobs))


def test_its_knobs_come_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv("ASYNCCKPT_READ_REQUEST_BYTES", "12345")
    monkeypatch.setenv("ASYNCCKPT_MAX_ATTEMPTS", "7")
    plain = S3ReadFile(FakeS3({}), ObjectPath("/", "ckpt", "k"), 10)
    assert (plain.request_bytes, plain.attempts) == (12345, 7)
    assert opened(FakeS3({}), read_request_bytes=0).request_bytes == 0


def test_a_range_is_one_get_streamed_in_pieces_into_the_callers_buffers(monkeypatch):
    monkeypatch.setattr(s3client, "READ_PIECE", 4096)
    s3 = FakeS3({KEY: DATA})
    outs = [bytearray(n) for n in (10, 50_000, 0, 70_000)]
    with opened(s3).open_range(1000, 130_010) as stream:
        assert stream.read_into([memoryview(o) for o in outs[:2]]) == 50_010
        assert stream.read_into([memoryview(o) for o in outs[2:]]) == 70_000
        rest = bytearray(20_000)
        assert stream.read_into([memoryview(rest)]) == 10_000  # the range ends first
        assert stream.read_into([memoryview(rest)]) == 0
    assert b"".join(outs) + rest[:10_000] == DATA[1000:131_010]
    assert s3.gets == [(KEY, 1000, 131_010)]
    assert max(s3.pieces) <= 4096  # what one GET holds at once beyond the caller's buffers


def test_a_range_past_the_end_is_cut_at_the_objects_end():
    s3 = FakeS3({KEY: DATA})
    out = bytearray(5000)
    assert opened(s3).read_into(len(DATA) - 100, [memoryview(out)]) == 100
    assert out[:100] == DATA[-100:]
    assert s3.gets == [(KEY, len(DATA) - 100, len(DATA))]


def test_an_answer_that_breaks_off_is_asked_again_from_the_first_byte_not_read():
    s3 = FakeS3({KEY: DATA}, break_after=lambda n, a, b: 12_345 if n == 0 else None)
    out = bytearray(200_000)
    with opened(s3).open_range(7, 200_000) as stream:
        assert stream.read_into([memoryview(out)]) == 200_000
    assert out == DATA[7:200_007]
    assert s3.gets == [(KEY, 7, 200_007), (KEY, 7 + 12_345, 200_007)]
    assert s3.bodies[0].closed  # the broken connection is not reused


def test_answers_that_keep_breaking_off_fail_naming_the_object_and_the_bytes():
    s3 = FakeS3({KEY: DATA}, break_after=lambda n, a, b: 1000)
    with pytest.raises(ObjectStoreError, match=rf"{KEY} bytes \d+\.\.200000 .*broke off, 3 "
                       r"times \(BrokenAnswer: connection reset by peer\)") as info:
        opened(s3, max_attempts=3).read_into(0, [memoryview(bytearray(200_000))])
    assert info.value.errno is not None and len(s3.gets) == 3
    assert all(body.closed for body in s3.bodies)


def test_a_refused_get_is_not_asked_again_here():
    s3 = FakeS3({KEY: DATA}, refuse=lambda n, a, b: "AccessDenied")
    with pytest.raises(ObjectStoreError, match="refused the credentials"):
        opened(s3).read_into(0, [memoryview(bytearray(10))])
    assert len(s3.gets) == 1  # botocore retries requests; an answer given is final


def test_a_store_that_ignores_the_range_is_an_error_not_other_bytes():
    s3 = FakeS3({KEY: DATA}, ignore_range=True)
    with pytest.raises(ObjectStoreError, match=r"asked for bytes 100\.\.200, .* answered "
                       rf"{len(DATA)} bytes"):
        opened(s3).read_into(100, [memoryview(bytearray(100))])
    assert s3.bodies[0].closed


def test_a_range_closed_halfway_closes_its_answer_and_one_read_to_the_end_does_not():
    s3 = FakeS3({KEY: DATA})
    with opened(s3).open_range(0, 1000) as stream:
        stream.read_into([memoryview(bytearray(10))])
    with opened(s3).open_range(0, 1000) as stream:
        stream.read_into([memoryview(bytearray(1000))])
    assert [body.closed for body in s3.bodies] == [True, False]
