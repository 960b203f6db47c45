"""The replica transport between node writers (the memory tier's copy on another node).

A writer sends its node's newest memory generation to a partner writer and fetches it
back when a node is lost. What the bytes mean is the memory tier's business
(writer/memory_replica.py); this package moves them, and only between processes that
prove the job's secret: `secret.py` (the secret, in the job's root), `wire.py` (the
framed, authenticated protocol), `tcp.py` (the TCP transport: a server and a client),
`replica.py` (what is moved and the store a server holds it in), `transport.py` (the
seam an RDMA or NCCL transport would plug into), `pacing.py` (the bandwidth knob).

Torch-free, like the writer that runs it.
"""

from asyncckpt.net.replica import (
    Address,
    MemoryStore,
    Offer,
    Replica,
    ReplicaSink,
    ReplicaStore,
    Stream,
)
from asyncckpt.net.secret import SECRET_ENV, SECRET_NAME, job_secret
from asyncckpt.net.tcp import TcpServer, TcpTransport
from asyncckpt.net.transport import ReplicaServer, Transport

__all__ = ["SECRET_ENV", "SECRET_NAME", "Address", "MemoryStore", "Offer", "Replica",
           "ReplicaServer", "ReplicaSink", "ReplicaStore", "Stream", "TcpServer",
           "TcpTransport", "Transport", "job_secret"]
