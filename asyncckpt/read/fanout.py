"""Frames to threads: the frames a read touches, which of them one request reads, and
the threads that run them.

A read of byte ranges of a rank's stream becomes one job per frame it touches (`plan`:
the outputs the frame's bytes go to, and gaps no range wants), and the jobs become
units: a unit is one frame, or, where the file asks for it (`ReadFile.request_bytes`, an
object store), frames whose stored bytes lie back to back, read through one request of
up to that many bytes (`ReadFile.open_range`). A round trip per 4 MiB frame is what held
a load from an object store to about half its download speed; one per `request_bytes`
keeps as many requests in flight as there are threads, each streaming its bytes straight
into the tensors they belong to, while every frame is verified (and decoded) as soon as
its own bytes are in, not once the whole request is. Memory does not grow with
`request_bytes`: the bytes land in their outputs, and a thread's scratch is one frame's
(a gap no range wants, a compressed frame's stored bytes), as without coalescing.

Units run on a `FramePool` of the reader's threads. The first error is raised once
every unit has finished or been skipped, so no thread writes into the outputs after the
caller has the error; units not yet started are skipped, and one under way stops at its
next frame.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncckpt.runtime.pool import FramePool

if TYPE_CHECKING:
    from asyncckpt.format.records import Frame
    from asyncckpt.storage.handles import ReadFile

Job = tuple[int, list, "str | None"]  # (frame index, output views or gap lengths, tensor)
Unit = list[Job]  # frames read through one request (one frame: its own reads)


def load_pool(threads: int) -> FramePool:
    return FramePool(threads, 2 * threads, name="asyncckpt-load")


def plan(frames: list[Frame], ranges: list[tuple[int, int, memoryview, str | None]]
         ) -> list[Job]:
    """Per frame touched: (index, pieces, tensor name); a piece is an output view or
    the length of a gap no range wants."""
    ranges = [r for r in ranges if r[1] > r[0]]
    r = 0
    index = frame_at(frames, ranges[0][0]) if ranges else 0
    jobs: list[Job] = []
    while r < len(ranges):
        frame = frames[index]
        f_begin, f_end = frame.raw_offset, frame.raw_offset + frame.raw_length
        pieces: list[memoryview | int] = []
        pos, name = f_begin, None
        while r < len(ranges) and ranges[r][0] < f_end:
            begin, end, out, tensor = ranges[r]
            lo, hi = max(begin, pos), min(end, f_end)
            if lo > pos:
                pieces.append(lo - pos)
            pieces.append(out[lo - begin:hi - begin])
            pos, name = hi, name or tensor
            if end > f_end:
                break  # continues in the next frame
            r += 1
        if pos < f_end:
            pieces.append(f_end - pos)
        jobs.append((index, pieces, name))
        if r < len(ranges):
            index = frame_at(frames, max(ranges[r][0], f_end))
    return jobs


def units(jobs: list[Job], frames: list[Frame],
          where: Callable[[Frame], tuple[ReadFile, int]], max_iov: int,
          spread: int = 1) -> list[Unit]:
    """`jobs` (in stream order) grouped into units: consecutive frames whose stored bytes
    follow each other in one file that asks for coalescing, up to its `request_bytes`,
    and to 1/`spread` of the bytes of all `jobs` (so that a read smaller than `spread`
    requests still keeps `spread` threads busy).

    A frame joins a unit only if reading it consumes exactly its stored bytes (a raw
    frame read straight into its outputs reads its raw length: that must be its stored
    length), so each frame of a unit starts where the one before ended.
    """
    out: list[Unit] = []
    file: ReadFile | None = None
    end = size = 0
    share = -(-sum(frames[job[0]].encoded_length for job in jobs) // max(spread, 1))
    for job in jobs:
        frame = frames[job[0]]
        here, offset = where(frame)
        length = frame.encoded_length
        straight = frame.codec != "raw" or len(job[1]) > max_iov or frame.raw_length == length
        limit = min(here.request_bytes, share)
        if (out and straight and here is file and offset == end and limit > 0
                and size + length <= limit):
            out[-1].append(job)
            size += length
        else:
            out.append([job])
            size = length
            file = here if straight else None
        end = offset + length
    return out


def run_parallel(pool: FramePool, work: list[Unit],
                 run: Callable[[Unit, dict[str, Any], Callable[[], bool]], None]) -> None:
    """`run(unit, context, stopped)` for every unit on `pool`; raise the first error once
    every unit has finished or been skipped (no thread writes into the outputs after
    this returns). `stopped()` is true once a unit has failed: a unit checks it between
    frames."""
    errors: list[BaseException] = []
    left = [len(work)]
    finished = threading.Condition()

    def stopped() -> bool:
        return bool(errors)

    def job_for(unit: Unit) -> Callable[[dict], None]:
        def go(context: dict) -> None:
            try:
                if not errors:
                    run(unit, context, stopped)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                errors.append(e)
            finally:
                pool.release()
                with finished:
                    left[0] -= 1
                    finished.notify_all()
        return go

    submitted = 0
    try:
        for unit in work:
            pool.submit(job_for(unit))
            submitted += 1
    finally:
        with finished:
            while left[0] > len(work) - submitted:
                finished.wait()
    if errors:
        raise errors[0]


def frame_at(frames: list[Frame], offset: int) -> int:
    """The index of the frame holding raw stream byte `offset` (frames sorted)."""
    lo, hi = 0, len(frames) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if frames[mid].raw_offset <= offset:
            lo = mid
        else:
            hi = mid - 1
    return lo
