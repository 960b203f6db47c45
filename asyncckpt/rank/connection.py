"""A rank's connection to its writer: the handshake, a sender thread, a receiver thread.

Messages go out through a sender thread, so a writer that reads its socket slowly (it
stops reading while its frame threads are busy, i.e. at disk speed) never stalls the
copy into free ring slots: with blocking sends, staging ran at the disk's speed instead
of the copy's (docs/design/staging.md). The queue of unsent messages is bounded by the
ring (at most one chunk message per slot). A receiver thread hands each reply of the
writer to the client's handler for its type; whatever ends either thread -- a lost
writer, a bad message, the client closing -- is reported once through `lost`, so that
no save waits forever on a dead writer.

The ring travels over this connection: once in the handshake, and again when the
client replaces it while nothing is in flight (`replace_ring`, at its first save), so
the threads and the writer's session live as long as the client.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from asyncckpt.errors import WriterRootMismatchError, WriterUnavailableError
from asyncckpt.ipc import messages, protocol, ring

log = logging.getLogger("asyncckpt.rank")

Handler = Callable[[Any], None]
_Outgoing = bytes | Callable[[], None] | None  # a frame, a step of the sender, or stop


class WriterConnection:
    """The authenticated socket to one writer, with its two threads.

    Args:
        address: the writer's address.
        hello: this rank's hello (its ring's size is filled in from `first_ring`).
        first_ring: the ring passed in the handshake (closed here if it fails).
        timeout: for the dial and the welcome, seconds.
        asked_root: the root the caller saves to, or None for the writer's.
        handlers: the client's handler per writer message type.
        lost: called once, from either thread, with why the connection ended.
    Raises:
        WriterUnavailableError: no writer, a failed authentication or handshake, or a
            refusal.
        WriterRootMismatchError: the writer serves another root than `asked_root`.
    """

    def __init__(self, address: str, hello: messages.Hello, first_ring: ring.Ring,
                 timeout: float, asked_root: str | None,
                 handlers: dict[type[messages.Message], Handler],
                 lost: Callable[[str], None]) -> None:
        self.address = address
        self.rank = hello.rank
        self._asked_root = asked_root
        self._handlers = handlers
        self._lost = lost
        self.closing = False  # set by the client before it hangs up
        self._conn, self.welcome = self._handshake(hello, first_ring, timeout)
        self._outbox: queue.SimpleQueue[_Outgoing] = queue.SimpleQueue()
        self._receiver = threading.Thread(target=self._receive, daemon=True,
                                          name=f"asyncckpt-recv-{self.rank}")
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"asyncckpt-send-{self.rank}")
        self._receiver.start()
        self._sender.start()

    # -- handshake ---------------------------------------------------------------------

    def _handshake(self, hello: messages.Hello, new: ring.Ring, timeout: float
                   ) -> tuple[Connection, messages.Welcome]:
        conn = None
        try:
            conn = protocol.dial(self.address, protocol.read_authkey(self.address), timeout)
            protocol.send_message(conn, hello)
            protocol.send_fd(conn, new.fileno())
            if not conn.poll(timeout):
                raise WriterUnavailableError(f"writer at {self.address} did not welcome us")
            reply = protocol.receive(conn)
        except (OSError, EOFError, ValueError) as e:
            new.close()
            raise WriterUnavailableError(f"writer at {self.address} closed the connection during "
                                         f"the handshake: {e}", rank=self.rank) from None
        except BaseException:
            new.close()
            raise
        finally:
            new.release_fd()  # the writer holds its own descriptor now
        served = reply.root if isinstance(reply, (messages.Welcome, messages.Refused)) else None
        if (self._asked_root is not None and served is not None
                and not protocol.same_root(self._asked_root, served)):
            protocol.hang_up(conn)  # a writer too old to check the hello's root welcomes it
            new.close()
            raise WriterRootMismatchError(
                f"the writer at {self.address} serves {served}, not {self._asked_root}: start "
                f"a writer on {self._asked_root}, or give no address (and unset "
                "ASYNCCKPT_ADDRESS) so that the Checkpointer or StorageWriter starts its "
                "own", rank=self.rank)
        if not isinstance(reply, messages.Welcome):
            protocol.hang_up(conn)
            new.close()
            reason = reply.reason if isinstance(reply, messages.Refused) else reply.OP
            raise WriterUnavailableError(f"writer at {self.address} refused this rank: "
                                         f"{reason[:500]}", rank=self.rank)
        return conn, reply

    # -- sending -----------------------------------------------------------------------

    def send(self, message: messages.Message) -> None:
        """Queue `message` for the sender thread; never blocks."""
        self._outbox.put(message.encode())

    def send_frame(self, frame: bytes) -> None:
        """Queue an encoded message (a begin, encoded when the save was made)."""
        self._outbox.put(frame)

    def after_sent(self, then: Callable[[], None]) -> None:
        """Call `then` on the sender thread once every message queued before it is on
        the socket (not merely queued)."""
        self._outbox.put(then)

    def replace_ring(self, new: ring.Ring) -> None:
        """Queue the switch to ring `new`: its message and descriptor go out in order
        with the other messages, so every chunk queued later names a slot of `new`.
        The caller must have nothing in flight (no slot of the old ring held)."""
        frame = messages.NewRing(new.slot_size, new.slots).encode()

        def hand_over() -> None:
            try:
                self._conn.send_bytes(frame)
                protocol.send_fd(self._conn, new.fileno())
            finally:
                new.release_fd()
        self._outbox.put(hand_over)

    def _send_loop(self) -> None:
        try:
            while (data := self._outbox.get()) is not None:
                if callable(data):
                    data()
                    continue
                self._conn.send_bytes(data)
        except (OSError, EOFError):
            self._lost("writer connection lost while sending")

    # -- receiving ---------------------------------------------------------------------

    def _receive(self) -> None:
        try:
            while True:
                data = protocol.recv(self._conn)
                if data["op"] not in messages.MESSAGES:
                    continue  # a reply of a newer writer that this client does not use
                message = messages.parse(data)
                handler = self._handlers.get(type(message))
                if handler is not None:
                    handler(message)
        except Exception as e:  # whatever ends this thread must fail the pending handles,
            # or their wait() would hang: a lost writer, a closed client, a bad message
            if self.closing:
                self._lost("the client was closed")
            elif isinstance(e, (EOFError, OSError)):
                self._lost("the writer closed the connection")
            else:
                log.warning("bad message from the writer: %s: %s", type(e).__name__, e)
                self._lost(f"bad message from the writer ({type(e).__name__})")

    # -- closing -----------------------------------------------------------------------

    def stop_sending(self, timeout: float | None) -> None:
        """Send what is queued, then stop the sender thread (waiting up to `timeout`)."""
        self._outbox.put(None)
        self._sender.join(timeout)

    def hang_up(self, timeout: float | None) -> None:
        """Close the socket and wait up to `timeout` for the receiver thread to end."""
        self.closing = True
        protocol.hang_up(self._conn)
        self._receiver.join(timeout)


def hello_for(rank: int, world_size: int, new: ring.Ring, root: str | None) -> messages.Hello:
    """This process's hello for a ring `new`."""
    return messages.Hello(rank, new.slot_size, new.slots, world_size=world_size,
                          pid=os.getpid(), need_slot=True, root=root)
