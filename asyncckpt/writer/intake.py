"""How the slots a rank announces leave its ring: copied out at once, or held until the
rank has staged its save (stage first).

Each chunk is copied out of the ring into the writer's own buffer before it is hashed,
encoded or written, and then its slot is returned: the bytes on disk are exactly the
bytes hashed, whatever the rank later does to its slot. (The copy runs at memory speed
and releases the GIL.) With `stage_first` the copies wait until the rank has staged the
whole save (its `end`) or waits for a free slot (`need_slot`, or all its slots
announced): the rank's copy into the ring is what its training loop waits for, and a
writer copying out beside it takes the memory bandwidth and, on a small node, the core
it needs. The save's writes then start later by at most its staging time; a save whose
rank had to wait streams as before. While the chunks are held, taking one is a tuple
appended to a list: a rank announces the slots it fills back to back in one `chunks`
message, so the writer's thread stays off the core the rank copies on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncckpt.errors import SaveFailedError
from asyncckpt.ipc import messages
from asyncckpt.ipc.messages import ProtocolError
from asyncckpt.writer.memory_image import RankImage
from asyncckpt.writer.pipeline import RankFileWriter

if TYPE_CHECKING:
    from asyncckpt.writer.session import Session


@dataclass
class RankSave:
    step: int
    file: RankFileWriter | None
    tree: Any
    failed: bool = False
    stats: dict = field(default_factory=dict)
    copy_at_once: bool = False  # its rank waited for a slot: stage first no longer
    memory: RankImage | None = None  # a memory-tier save: its image (memory_tier.py)


class Intake:
    """The chunks of one session's saves, in the order announced: each is copied out of
    the ring and handed to its save's file (or memory image), then its slot is freed;
    with `stage_first` they wait in `held` until the rank ends the save or waits."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.stage_first = False  # the knob, for a rank that says need_slot
        self.held: list[tuple[int, int, int]] = []  # (save id, slot, length), in order

    def chunk(self, save_id: int, slot: int, length: int) -> None:
        """Slot `slot` holds the next `length` bytes of save `save_id`."""
        save = self.session.save_of(save_id)
        if not self.stage_first or save.copy_at_once:
            self._copy_out(save, save_id, slot, length)
            return
        ring = self.session.ring
        assert ring is not None
        self.held.append((save_id, slot, length))
        if len(self.held) >= ring.slots:  # it holds none: it must be waiting
            save.copy_at_once = True
            self.copy_out_held()

    def need_slot(self, saves: list[RankSave]) -> None:
        """The rank waits for a slot: its ring is smaller than its save, so copying
        out after the rank would only stall it; its open `saves` stream from now on."""
        for save in saves:
            save.copy_at_once = True
        self.copy_out_held()

    def copy_out_held(self) -> None:
        held, self.held = self.held, []
        for save_id, slot, length in held:
            self._copy_out(self.session.save_of(save_id), save_id, slot, length)

    def _copy_out(self, save: RankSave, save_id: int, slot: int, length: int) -> None:
        session = self.session
        ring = session.ring
        assert ring is not None
        if not ring.holds(slot, length):  # before a buffer of `length` is made
            raise ProtocolError(f"slot {slot} / length {length} outside the ring")
        if save.memory is not None and not save.failed:
            self._copy_to_memory(save, save.memory, save_id, slot, length)
            return
        buffers = session.writer.buffers
        buf = buffers.get(length)
        try:
            raw = ring.copy_out(slot, length, buf)
        except ValueError as e:
            buffers.put(buf)
            raise ProtocolError(str(e)) from None
        session.send(messages.Free(slot))
        if save.failed or save.file is None or save.memory is not None:
            buffers.put(buf)
            return
        try:
            save.file.submit(raw, lambda: buffers.put(buf))
        except ValueError as e:
            buffers.put(buf)
            session.fail(save, SaveFailedError(str(e), step=save.step, rank=session.rank))

    def _copy_to_memory(self, save: RankSave, image: RankImage, save_id: int, slot: int,
                        length: int) -> None:
        """A memory save's chunk: straight from the ring into its image, then freed."""
        session = self.session
        ring = session.ring
        assert ring is not None
        try:
            image.append(lambda out: ring.copy_out(slot, length, out), length)
        except ValueError as e:
            session.send(messages.Free(slot))
            error = SaveFailedError(str(e), step=save.step, rank=session.rank)
            session.notifier(save, save_id)(error, None, {})
            session.fail_memory(save, error)
            return
        session.send(messages.Free(slot))
