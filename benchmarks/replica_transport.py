"""Loopback throughput of the replica transport (asyncckpt/net/), and where its CPU goes.

    python -m benchmarks.replica_transport [--mib 256] [--chunk-mib 1] [--repeat 3]

One process, a TcpServer and a TcpTransport on 127.0.0.1: a memfd image of --mib MiB put
to the server (a sink that checks nothing more and copies into one reused buffer, as
the memory tier copies into its image), unpaced, best of --repeat. Beside it, the
per-byte costs on this machine of what each byte goes through on each side: HMAC-SHA256
(the channel's MAC), xxh3 (the chunk's checksum) and a memcpy. On loopback the kernel's
copies through the socket are CPU too, so the figure is a CPU bound, not a link's.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import time

import xxhash

from asyncckpt.config import ReplicaKnobs
from asyncckpt.net.replica import Offer, Replica, Stream
from asyncckpt.net.tcp import TcpTransport

MiB = 1 << 20


class _NullStore:
    """Keeps nothing: each chunk is copied into one reused buffer (the tier's copy)."""

    def __init__(self, chunk: int) -> None:
        self.buffer = bytearray(chunk)

    def put_generation(self, peer: str, offer: Offer) -> _NullStore:
        return self

    def data(self, rank: int, offset: int, chunk: memoryview) -> None:
        self.buffer[:len(chunk)] = chunk

    def finish(self) -> bool:
        return True

    def abort(self) -> None:
        pass

    def get_generation(self, node: int, step: int | None) -> None:
        return None

    def list_generations(self) -> list[dict]:
        return []


def _rate(fn, nbytes: int, repeat: int) -> float:
    best = min(_timed(fn) for _ in range(repeat))
    return nbytes / best / 1e6


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--chunk-mib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    size, chunk = args.mib * MiB, int(args.chunk_mib * MiB)
    knobs = ReplicaKnobs(replica_chunk_bytes=chunk)
    secret = os.urandom(32)
    fd = os.memfd_create("bench-replica")
    data = os.urandom(size)
    os.write(fd, data)
    transport = TcpTransport(secret, knobs, name="bench")
    with transport.serve(_NullStore(chunk)) as server:  # type: ignore[arg-type]
        offer = Offer(0, 1, {}, (Stream(0, 0, size),))
        put = _rate(lambda: transport.put(server.address, Replica(offer, [fd])), size,
                    args.repeat)
    os.close(fd)
    key = os.urandom(32)
    view = memoryview(data)
    out = bytearray(size)
    figures = {
        "bytes": size, "chunk_bytes": chunk,
        "put_loopback_MBps": round(put),
        "hmac_sha256_MBps": round(_rate(lambda: hmac.new(key, view, hashlib.sha256).digest(),
                                        size, args.repeat)),
        "xxh3_MBps": round(_rate(lambda: xxhash.xxh3_64_intdigest(view), size, args.repeat)),
        "memcpy_MBps": round(_rate(lambda: out.__setitem__(slice(None), view), size,
                                   args.repeat)),
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
