"""A job's TCPStore for the rank tests, served in the test process as rank 0 serves it:
the fixture `store`, clients of it, a client that counts its requests, and the fixture
`fresh_ordinals` (autouse) that leaves no client ordinal behind a test.

The fixtures reach a test module by import (`from stores import fresh_ordinals_fixture,
store_fixture  # noqa: F401`): a conftest.py here would shadow tests/conftest.py, which
test modules import by name."""

from __future__ import annotations

import collections
import datetime
from collections.abc import Iterator
from typing import Any

import pytest
from torch.distributed import TCPStore

from asyncckpt.rank import coordination

TIMEOUT = datetime.timedelta(seconds=30)


@pytest.fixture(name="store")
def store_fixture() -> Iterator[TCPStore]:
    """A store on a free port of this host, served by the test process."""
    yield TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


@pytest.fixture(name="fresh_ordinals", autouse=True)
def fresh_ordinals_fixture() -> Iterator[None]:
    """Leave no client ordinal behind: a later test's in-process ranks would not meet."""
    yield
    coordination._ordinals.clear()


def client(store: TCPStore) -> TCPStore:
    """A client of `store` of its own (as another rank's)."""
    return TCPStore("127.0.0.1", store.port, is_master=False, timeout=TIMEOUT)


class Counting:
    """A store client that counts its requests by kind (its clone counts nothing)."""

    def __init__(self, store: TCPStore) -> None:
        self._store, self.requests = store, collections.Counter[str]()

    def clone(self) -> TCPStore:
        return self._store.clone()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counted(*args: Any) -> Any:
            self.requests[name] += 1
            return method(*args)
        return counted
