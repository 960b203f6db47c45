"""A replica's streams on a channel: sent paced and chunk by chunk, received checked.

Both directions use these: a client's PUT sends and the server receives; a GET the
other way round. The receiver checks every chunk before its sink sees a byte of it: its
step is the offer's (a chunk of another generation is refused), its stream and offset
are the next expected (nothing out of order, nothing past a stream's size), and its
bytes match the xxh3 the sender took (besides the channel's MAC). The sink -- the memory
tier -- then checks the frames it knows against the digests taken when they were saved.
"""

from __future__ import annotations

from collections.abc import Callable

import xxhash

from asyncckpt.net.pacing import Pacer
from asyncckpt.net.replica import Offer, Replica, ReplicaSink, source_view
from asyncckpt.net.wire import DATA_HEAD, Channel, Kind, loads

END_LIMIT = 256  # bytes of an END message's body


def send_streams(channel: Channel, replica: Replica, chunk: int, pacer: Pacer,
                 poll: Callable[[], None] | None = None) -> None:
    """Send every stream of `replica` in chunks of at most `chunk` bytes, then END;
    `replica.release()` is called in any case.

    Args:
        poll: called after each chunk (a client checks there for an early refusal).
    Raises:
        ReplicaError: the peer stalled, went away or refused; a source is too short.
    """
    offer = replica.offer
    try:
        for index, (stream, source) in enumerate(zip(offer.streams, replica.sources,
                                                     strict=True)):
            view, let_go = source_view(source, stream.size)
            try:
                for offset in range(stream.start, stream.size, chunk):
                    piece = view[offset:min(offset + chunk, stream.size)]
                    try:
                        pacer.wait(len(piece))
                        channel.send(Kind.DATA, DATA_HEAD.pack(
                            offer.step, index, offset, xxhash.xxh3_64_intdigest(piece)), piece)
                    finally:
                        piece.release()
                    if poll is not None:
                        poll()
            finally:
                let_go()
        channel.send_json(Kind.END, {"step": offer.step})
    finally:
        replica.release()


def receive_streams(channel: Channel, offer: Offer, sink: ReplicaSink, chunk: int) -> None:
    """Receive every stream of `offer` into `sink`, each chunk checked first, then END.
    The caller calls `sink.finish()` (or `abort()` on an error).

    Raises:
        ReplicaError: a chunk of another step, out of order, past its stream, larger
            than `chunk`, or whose bytes do not match its xxh3; a stall; the peer gone.
        ReplicaAuthError: a message's MAC fails.
        CheckpointError: the sink refused the bytes.
    """
    step = offer.step
    limits = {Kind.DATA: DATA_HEAD.size + chunk, Kind.END: END_LIMIT}
    for index, stream in enumerate(offer.streams):
        offset = stream.start
        while offset < stream.size:
            kind, body = channel.recv(limits, step)
            if kind is not Kind.DATA or len(body) <= DATA_HEAD.size:
                raise channel.error(f"rank {stream.rank}'s stream ended at {offset} of "
                                    f"{stream.size} bytes: refused", step)
            their_step, their_index, at, digest = DATA_HEAD.unpack_from(body)
            piece = body[DATA_HEAD.size:]
            if their_step != step:
                raise channel.error(f"a chunk of step {their_step} in the replica of step "
                                    f"{step}: wrong step, refused", step)
            if their_index != index or at != offset or at + len(piece) > stream.size:
                raise channel.error(
                    f"bytes {at}..{at + len(piece)} of stream {their_index}, expected stream "
                    f"{index} (rank {stream.rank}) at {offset} of {stream.size}: refused", step)
            if xxhash.xxh3_64_intdigest(piece) != digest:
                raise channel.error(f"bytes {at}..{at + len(piece)} of rank {stream.rank} do "
                                    f"not match their xxh3 ({digest:#018x}): refused", step)
            sink.data(stream.rank, at, piece)
            offset += len(piece)
    _, body = channel.recv({Kind.END: END_LIMIT}, step)
    if loads(body, channel, step).get("step") != step:
        raise channel.error("the replica ended with another step: refused", step)
