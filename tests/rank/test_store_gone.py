"""A node's lead waiting for a save's outcome when the job's store dies (its host, the
rank 0 process or torchrun's agent, killed): the wait must end with the store's error,
which fails the save, not spin for ever on requests that fail at once."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from stores import store_fixture  # noqa: F401 (a fixture)
from tiers import process_fixture
from torch.distributed import TCPStore

from asyncckpt.rank import coordination
from asyncckpt.rank.coordination import StoreCoordinator, store_gone

HOST = """
import time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(120)
"""


@pytest.fixture
@process_fixture
def store_host() -> Iterator[subprocess.Popen[str]]:
    """A TCPStore served by a process of its own, as a job's rank 0 serves it."""
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    yield host
    host.kill()
    host.wait()
    coordination._ordinals.clear()


def test_a_lead_waiting_for_the_outcome_fails_once_the_store_is_gone(store_host):
    """Node 1's lead (rank 8 of 16) waits, watched, for save "s"'s outcome; the store's
    host is SIGKILLed. The wait raises the store's network error within seconds (before:
    it caught every error as a timeout and waited again, each request failing at once:
    a busy loop that never ended, the save never failed)."""
    assert store_host.stdout is not None
    port = int(store_host.stdout.readline())
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    lead = StoreCoordinator(client, 8, 16, 0.5, (8, 8))
    lead.session = "a-session"  # met before the save, as a lead meets the leader
    prefix = lead.prefix("s")
    store_host.kill()
    store_host.wait()
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            lead.wait(prefix, watched=True)
        except BaseException as e:  # noqa: BLE001 - what the test looks at
            raised.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(20)
    assert not waiter.is_alive(), "the wait did not end after the store died"
    assert len(raised) == 1 and store_gone(raised[0]), raised


def test_a_wait_that_times_out_is_not_taken_for_the_store_gone(store):
    """The store's timeout error is not its network error: a live store's slow key is
    waited for again, as before."""
    with pytest.raises(Exception) as timed_out:
        store.wait(["never"], datetime.timedelta(seconds=0.2))
    assert not store_gone(timed_out.value)
    coordination._ordinals.clear()
    lead = StoreCoordinator(store, 8, 16, 0.5, (8, 8))
    assert lead._wait_key("never", 0.2) is False
