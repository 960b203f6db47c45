"""An in-memory stand-in for the boto3 client's GET side, for tests of ranged reads.

It answers `get_object(Bucket, Key, Range)` from a dict of objects as botocore does
(`ContentLength`, `ContentRange`, a `Body` with `readinto`, `read` and `close`), counts
and records the requests (the seam through which a test sees how many GETs a load
made), and fails where a test tells it to: a request refused (`refuse`), or an answer
that breaks off after some bytes (`break_after`), as a reset connection does.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any


class StoreRefused(Exception):
    """What botocore raises for an error answer: `response["Error"]["Code"]`."""

    def __init__(self, code: str) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code}}


class BrokenAnswer(Exception):
    """What botocore raises when an answer's connection breaks (not an OSError)."""


class FakeBody:
    def __init__(self, data: bytes, break_after: int | None, pieces: list[int]) -> None:
        self._data, self._pos, self._break = memoryview(data), 0, break_after
        self._pieces = pieces
        self.closed = False

    def readinto(self, view: memoryview) -> int:
        if self.closed:
            raise ValueError("read of a closed answer")
        if self._break is not None and self._pos >= self._break:
            raise BrokenAnswer("connection reset by peer")
        end = len(self._data) if self._break is None else min(len(self._data), self._break)
        n = min(len(view), end - self._pos)
        view[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        self._pieces.append(n)
        return n

    def read(self, amt: int | None = None) -> bytes:
        out = bytearray(len(self._data) - self._pos if amt is None else amt)
        n = self.readinto(memoryview(out))
        return bytes(out[:n])

    def close(self) -> None:
        self.closed = True


class FakeS3:
    """Objects by key; `gets` records (key, first byte, end) of every GET in order.

    Args:
        refuse: called with the GET's number (0-based) and its range; a code it returns
            is the store's error answer to it.
        break_after: called likewise; a byte count it returns cuts that answer there.
    """

    def __init__(self, objects: dict[str, bytes],
                 refuse: Callable[[int, int, int], str | None] = lambda n, a, b: None,
                 break_after: Callable[[int, int, int], int | None] = lambda n, a, b: None,
                 ignore_range: bool = False) -> None:
        self.objects, self.refuse, self.break_after = objects, refuse, break_after
        self.ignore_range = ignore_range
        self.gets: list[tuple[str, int, int]] = []
        self.pieces: list[int] = []  # bytes handed out by each readinto
        self.bodies: list[FakeBody] = []
        self._lock = threading.Lock()

    def get_object(self, *, Bucket: str, Key: str, Range: str) -> dict[str, Any]:  # noqa: N803 -- boto3's names
        asked = re.fullmatch(r"bytes=(\d+)-(\d+)", Range)
        assert asked is not None, Range
        first, last = int(asked[1]), int(asked[2])
        with self._lock:
            number = len(self.gets)
            self.gets.append((Key, first, last + 1))
        code = self.refuse(number, first, last + 1)
        if code:
            raise StoreRefused(code)
        data = self.objects[Key]
        if self.ignore_range:
            first, last = 0, len(data) - 1
        body = FakeBody(data[first:last + 1], self.break_after(number, first, last + 1),
                        self.pieces)
        with self._lock:
            self.bodies.append(body)
        return {"Body": body, "ContentLength": min(last + 1, len(data)) - first,
                "ContentRange": f"bytes {first}-{last}/{len(data)}"}
