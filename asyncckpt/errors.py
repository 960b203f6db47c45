"""Typed errors.

Every error a caller can see is a `CheckpointError`. The message names what is known of
where it happened -- step, rank, file, frame, tensor key -- and the cause, so that a log
line alone is enough to act on. The fields are also kept as attributes for programs.
"""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Base class of every asyncckpt error.

    Attributes:
        step, rank, file: where it happened, when known (else None).
        cause: the underlying reason, as text.
    """

    def __init__(
        self,
        cause: str,
        *,
        step: int | None = None,
        rank: int | None = None,
        file: str | None = None,
        **detail: Any,
    ) -> None:
        self.cause = cause
        self.step = step
        self.rank = rank
        self.file = file
        self.detail = detail
        where = []
        if step is not None:
            where.append(f"step {step}")
        if rank is not None:
            where.append(f"rank {rank}")
        if file is not None:
            where.append(str(file))
        super().__init__(f"{', '.join(where)}: {cause}" if where else cause)


class UnsupportedStateError(CheckpointError, TypeError):
    """A value in the state dict cannot be saved (dtype, layout, object type, key type).

    Raised by `save()` before anything is sent to the writer.
    """


class SaveFailedError(CheckpointError):
    """The writer could not complete a save (I/O error, a rank failed, a conflict).

    Nothing of that step was committed; earlier checkpoints are untouched.
    """


class StepAlreadyCommittedError(SaveFailedError):
    """The step being saved is already committed in the root, in the root's current
    timeline: it is replaced only when the save asks (`replace=True`; through DCP
    `StorageWriter(overwrite=True)`). A committed step of an abandoned timeline is
    replaced without asking (docs/FORMAT.md, "Timelines")."""


class TimelineMovedError(SaveFailedError):
    """A save began a timeline from a restore, but another run began a timeline on the
    root since that restore read it (a paused or stale job): the save is refused, so it
    never abandons its successor's steps. The message names the step and both timelines;
    restore again to resume from the root as it is now."""


class DiskFullError(SaveFailedError):
    """The writer ran out of space (ENOSPC or EDQUOT) while writing a checkpoint."""


class MemoryTierFullError(SaveFailedError):
    """A memory-tier save would take the writer's memory tier past its bound (knob
    `memory_max_bytes`): the save is refused, nothing held is dropped for it. The
    message names the image's size, the bytes held and the bound."""


class WriterUnavailableError(CheckpointError):
    """The writer cannot be reached: not started, gone, refused authentication."""


class WriterRootMismatchError(WriterUnavailableError):
    """The writer reached (an address given, ASYNCCKPT_ADDRESS, a client given) serves
    another checkpoint root than the one the save names: it refused this rank, and
    nothing was saved. The message names both roots."""


class WriterLockedError(CheckpointError):
    """Another writer already holds the checkpoint root."""


class LeaseLostError(SaveFailedError):
    """This writer's lease on an object-store root lapsed or was taken over (the writer
    was paused, or cut off from the store, for longer than the lease lasts): another
    writer may hold the root now, so this one publishes and deletes nothing more. The
    message names the root, the holder now (when known) and the step."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists where one was asked for."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint failed verification: bad checksum, size, structure or path.

    Raised before any corrupt byte is returned to the caller.
    """


class UntrustedPickleError(CheckpointError):
    """A pickle in a checkpoint or a source (a DCP `.metadata`, an object DCP pickled)
    needs a global that the safe unpickler does not admit. Nothing of it was run: the
    global is refused by name before it is looked up. The message names the file or
    the key, and the global when known."""


class StateMismatchError(CheckpointError):
    """`load(..., into=...)` found a target whose key, shape or dtype disagrees."""


class ReplicaError(CheckpointError):
    """A replica could not be sent to, held by or fetched from a partner writer
    (asyncckpt/net/): refused, too large, a checksum or step that does not match, a peer
    gone or stalled. Nothing of that replica was accepted. The message names this node,
    the generation (step), the peer and the cause.

    Attributes:
        node, peer: this node's name and the partner's address (text), when known.
    """

    def __init__(self, cause: str, *, node: str | None = None, peer: str | None = None,
                 step: int | None = None, **detail: Any) -> None:
        self.node, self.peer = node, peer
        where = [f"node {node}"] if node else []
        where += [f"peer {peer}"] if peer else []
        super().__init__(f"{', '.join(where)}: {cause}" if where else cause, step=step,
                         **detail)
        self.cause = cause


class ReplicaAuthError(ReplicaError):
    """A peer did not prove the job's secret (none, a wrong one, a replayed handshake, a
    message whose MAC fails): nothing was read from it or sent to it."""


def error_class(name: str) -> type[SaveFailedError]:
    """The SaveFailedError subclass called `name` (as a writer or another rank reports
    it: DiskFullError, ...), else SaveFailedError itself."""
    cls = globals().get(name)
    return cls if isinstance(cls, type) and issubclass(cls, SaveFailedError) else SaveFailedError
