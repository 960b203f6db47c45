"""Emergency flush: the newest memory generation written to the root as a committed step.

A preemption notice (SIGTERM) gives a node seconds to minutes; what the job has in the
memory tier alone is lost with it. So a stopping writer -- and `asyncckpt flush` on
demand -- writes its newest whole memory generation as an ordinary durable step: the
images are fed, frame by frame, through the same path a rank's chunks take (the
step table, `RankFileWriter`, the committer: codec, checksums, timeline, retention,
the manifest checked as a reader would), as if the generation's ranks saved it again.
Every frame is checked against the xxh3 it was held with before it is written, so a
byte that changed in memory is never made durable.

Only a generation whose every rank this writer holds is flushed (one node's job, or a
node that holds its partner's replica of the rest); one that is not newer than the
newest durable step is not (it is on disk already, or would be older). The flush takes
the time of a durable save of the generation: its bytes over the disk's (or the codec's)
bandwidth; it must end within the writer's `shutdown_timeout`, or the step fails and
nothing is committed (the previous durable step stays newest).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import xxhash

from asyncckpt.errors import CheckpointError, SaveFailedError
from asyncckpt.format.layout import layout
from asyncckpt.format.records import RankPart
from asyncckpt.format.timeline import TimelineStart
from asyncckpt.ipc.options import SaveOptions
from asyncckpt.storage.timeline import newest_live, read_current
from asyncckpt.writer.filespec import FileSettings, FileTarget, Stream
from asyncckpt.writer.memory_generation import Generation
from asyncckpt.writer.pipeline import RankFileWriter

if TYPE_CHECKING:
    from asyncckpt.writer.session import WriterContext

log = logging.getLogger("asyncckpt.writer")


def flush_newest(context: WriterContext, timeout: float) -> int | None:
    """Write the newest whole memory generation whose every rank is held here as a
    committed step, waiting up to `timeout` s for its commit.

    Returns:
        The step committed, or None when there was nothing to flush (no such
        generation, or the root already holds a step as new).
    Raises:
        SaveFailedError (or a subclass): the flush failed (nothing of it committed), or
            did not commit within `timeout`.
    """
    memory = context.memory
    if memory is None:
        return None
    step = memory.newest_complete()
    if step is None:
        log.info("flush: no memory generation held whole for every rank of its world")
        return None
    storage = context.steps.storage
    newest = newest_live(storage, read_current(storage))
    if newest is not None and newest >= step:
        log.info("flush: memory generation %d is not newer than durable step %d", step, newest)
        return None
    try:
        gen, parts, fds = memory.open(step)
    except KeyError:
        return None  # dropped since (a newer one became whole): the next flush takes it
    try:
        _write(context, gen, parts, fds, timeout)
    finally:
        for fd in fds:
            os.close(fd)
    log.info("flush: memory generation %d committed as a durable step", step)
    return step


def _write(context: WriterContext, gen: Generation, parts: list[RankPart], fds: list[int],
           timeout: float) -> None:
    """Feed every rank's image of `gen` to the step table and wait for the commit."""
    steps, step, world = context.steps, gen.step, gen.world_size
    outcome: dict[int, CheckpointError | None] = {}
    settled = threading.Event()

    def notifier(rank: int) -> Any:
        def notify(error: CheckpointError | None, path: Any, stats: dict, **_: Any) -> None:
            outcome.setdefault(rank, error)
            if len(outcome) == world or error is not None:
                settled.set()
        return notify

    start = TimelineStart.from_json(gen.timeline) if gen.timeline is not None else None
    options = SaveOptions(timeline=start)
    files: list[tuple[RankFileWriter, RankPart]] = []
    try:
        for part in parts:
            current = steps.begin(step, part.rank, world, notifier(part.rank), options)
            files.append((_feed(context, current, part, fds[len(files)]), part))
        for file, part in files:
            written = file.finish(part.tree)
            steps.end(step, written, {"tier": "durable", "flushed": True,
                                      "write_seconds": file.write_seconds})
    except CheckpointError as e:
        steps.fail(step, e)
        raise
    except (OSError, ValueError) as e:
        error = SaveFailedError(f"flush of memory generation {step} failed: {e}", step=step)
        steps.fail(step, error)
        raise error from None
    finally:
        for file, _ in files:
            file.close(wait=True)
    if not settled.wait(timeout):
        error = SaveFailedError(f"flush of memory generation {step} did not commit within "
                                f"{timeout} s", step=step)
        steps.fail(step, error)
        raise error
    failed = next((e for e in outcome.values() if e is not None), None)
    if failed is not None:
        raise failed


def _feed(context: WriterContext, current: Any, part: RankPart, fd: int) -> RankFileWriter:
    """A data file of `current` for `part`'s rank, fed every frame of its image (each
    checked against its xxh3 first); the header the file writes itself is checked
    against the image's."""
    rank, buffers = part.rank, context.buffers
    header, specs = layout([(t.name, t.dtype, tuple(t.shape)) for t in part.tensors])
    largest = max((f.raw_length for f in part.frames), default=len(header)) or 1
    file = RankFileWriter(
        FileSettings.from_knobs(context.knobs, context.steps.storage, context.pool),
        FileTarget(current.tmp_dir, rank, current.codec, current.folder(rank)),
        Stream(header, specs, largest),
        chooser=context.chooser if current.choice is not None else None,
        on_error=lambda e: context.steps.fail(current.number, SaveFailedError(
            f"flush: {type(e).__name__}: {e}", step=current.number, rank=rank)))
    for frame in part.frames:
        buf = buffers.get(frame.raw_length)
        view = memoryview(buf)[:frame.raw_length]
        if os.preadv(fd, [view], frame.raw_offset) != frame.raw_length or (
                xxhash.xxh3_64_intdigest(view) != frame.xxh3_raw):
            buffers.put(buf)
            file.close(wait=True)
            raise SaveFailedError(f"memory image of rank {rank}: frame at {frame.raw_offset} "
                                  "does not match its xxh3 (changed in memory)",
                                  step=current.number, rank=rank)
        if frame.raw_offset < len(header):  # the file writes the header itself
            same = bytes(view) == header[frame.raw_offset:frame.raw_offset + frame.raw_length]
            buffers.put(buf)
            if not same:
                file.close(wait=True)
                raise SaveFailedError(f"memory image of rank {rank}: its header is not its "
                                      "tensor table's", step=current.number, rank=rank)
            continue
        file.submit(view, lambda buf=buf: buffers.put(buf))  # type: ignore[misc]
    return file
