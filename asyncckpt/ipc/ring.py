"""A rank's shared-memory ring: fixed-size slots that carry tensor bytes to the writer.

The rank creates the ring (it is the rank's memory, bounded and reused across saves) as
an anonymous memfd, sizes it, *seals* its size (F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL), pre-touches it so staging never pays first-touch page faults, and passes
the file descriptor to the writer over the control socket (SCM_RIGHTS). Two properties
follow, and they are why it is a sealed memfd rather than a named /dev/shm file:

- A rank cannot hurt the writer through the mapping. With a plain shared file, a rank
  that truncated it after the handshake made the writer's next read of a slot a SIGBUS
  that killed the writer for every rank. Sealed, the size cannot change for anyone,
  and the writer refuses a descriptor whose seals do not say so.
- Nothing can outlive its users. The memory has no name: it exists exactly as long as
  some process maps it or holds the descriptor, so the kernel frees it however either
  side dies, `kill -9` included, and there is nothing to sweep.

Slot ownership moves by messages on the control channel, so no cross-process atomics
are needed. We use `mmap` rather than `multiprocessing.SharedMemory`, whose resource
tracker unlinks segments it did not create (Python 3.11) and whose close() with live
tensor views crashes the process.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat

MEMFD_NAME = "asyncckpt-ring"  # shows in /proc/PID/maps as /memfd:asyncckpt-ring
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
MADV_POPULATE_WRITE = 23  # Linux 5.14+; not exported by Python 3.11's mmap module


class Ring:
    """`slots` slots of `slot_size` bytes in one shared mapping of a sealed memfd."""

    def __init__(self, mapping: mmap.mmap, slot_size: int, slots: int, fd: int = -1) -> None:
        self.slot_size = slot_size
        self.slots = slots
        self._fd = fd  # kept by the creator until the writer has it (see fileno)
        self._mmap = mapping
        anchor = ctypes.c_char.from_buffer(mapping)
        self.address = ctypes.addressof(anchor)  # valid while mapped; for memmove staging
        del anchor  # a live export would keep close() from unmapping

    @property
    def size(self) -> int:
        return self.slot_size * self.slots

    @classmethod
    def create(cls, slot_size: int, slots: int) -> Ring:
        """Create, size, seal and pre-touch a new ring owned by this process.

        Raises:
            OSError: the memory cannot be had (ENOMEM, memfd unsupported).
        """
        size = slot_size * slots
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        _huge_pages(mapping)
        try:
            mapping.madvise(MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            for offset in range(0, size, mmap.PAGESIZE):
                mapping[offset] = 0
        return cls(mapping, slot_size, slots, fd)

    @classmethod
    def attach(cls, fd: int, slot_size: int, slots: int) -> Ring:
        """Map a ring another process passed us; takes ownership of `fd` (closes it).

        Raises:
            ValueError: not a memfd of exactly `slot_size * slots` bytes whose size is
                sealed (a resizable mapping would let its creator crash us with SIGBUS).
        """
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != slot_size * slots:
                raise ValueError(f"ring descriptor: {st.st_size} bytes (mode {st.st_mode:o}), "
                                 f"expected a file of {slot_size * slots}")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if seals & _SIZE_SEALS != _SIZE_SEALS:
                raise ValueError("ring descriptor is not size-sealed (F_SEAL_SHRINK|F_SEAL_GROW)")
            mapping = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        _huge_pages(mapping)
        return cls(mapping, slot_size, slots)

    def fileno(self) -> int:
        """The creator's descriptor, to pass to the writer (-1 once released)."""
        return self._fd

    def release_fd(self) -> None:
        """Close the creator's descriptor once the writer holds its own (the mapping stays)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def slot_bytes(self, slot: int, length: int) -> memoryview:
        """A view of the first `length` bytes of `slot`; release it before close()."""
        if not (0 <= slot < self.slots and 0 <= length <= self.slot_size):
            raise ValueError(f"slot {slot} / length {length} outside the ring")
        start = slot * self.slot_size
        return memoryview(self._mmap)[start:start + length]

    def holds(self, slot: int, length: int) -> bool:
        """True if `slot` is one of the ring's and `length` bytes fit in it."""
        return 0 <= slot < self.slots and 0 <= length <= self.slot_size

    def copy_out(self, slot: int, length: int, out: bytearray | memoryview) -> memoryview:
        """Copy the first `length` bytes of `slot` into `out`; return that part of `out`.

        The copy is the writer's snapshot: from then on nothing the rank does to its
        slot can change what the writer hashes, encodes and writes.
        """
        if not self.holds(slot, length) or len(out) < length:
            raise ValueError(f"slot {slot} / length {length} outside the ring")
        dest = memoryview(out)[:length]
        if length:  # ctypes.memmove releases the GIL: frame threads copy in parallel
            target = ctypes.addressof(ctypes.c_char.from_buffer(dest))
            ctypes.memmove(target, self.address + slot * self.slot_size, length)
        return dest

    @property
    def mapping(self) -> mmap.mmap:
        """The shared mapping (the rank side views slots of it as tensors)."""
        return self._mmap

    def close(self) -> None:
        """Unmap. Every view of `mapping` or from slot_bytes() must be gone first.

        Raises:
            BufferError: a view is still alive (the mapping then goes with the process).
        """
        self.release_fd()
        if not self._mmap.closed:
            self._mmap.close()


def _huge_pages(mapping: mmap.mmap) -> None:
    """Ask for 2 MiB pages (a ring the size of the state spans a GiB or more of 4 KiB
    TLB entries otherwise). The kernel grants them to a memfd only where
    /sys/kernel/mm/transparent_hugepage/shmem_enabled is `advise` or `always`; elsewhere
    this changes nothing. On a 2-core VM with `advise` the copy of a state into the
    ring showed no difference beyond the noise (docs/design/staging.md); larger rings
    and nodes with more TLB pressure are where it is meant to count."""
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
