"""A rank's shared-memory ring: fixed-size slots that carry tensor bytes to the writer.

The rank creates the segment (it is the rank's memory, bounded and reused across
saves), pre-touches it so staging never pays first-touch page faults, and names it in
its hello. The writer maps it and unlinks the name at once: from then on the memory
lives exactly as long as the two mappings, so it is freed by the kernel however either
process dies, `kill -9` included. The short window between create and unlink is
covered by `sweep_stale()`, which removes segments whose creating process is gone (the
creator's pid is in the name). Slot ownership moves by messages on the control channel,
so no cross-process atomics are needed.

We use /dev/shm files with plain `mmap` rather than `multiprocessing.SharedMemory`,
whose resource tracker unlinks segments it did not create (Python 3.11) and whose
close() with live tensor views crashes the process.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "asyncckpt-"
_NAME = re.compile(r"^asyncckpt-(\d+)-[0-9a-f]{16}$")
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not exported by Python 3.11's mmap module


class Ring:
    """`slots` slots of `slot_size` bytes in one shared-memory mapping."""

    def __init__(self, name: str, mapping: mmap.mmap, slot_size: int, slots: int) -> None:
        self.name = name
        self.slot_size = slot_size
        self.slots = slots
        self._mmap = mapping
        self._tensor: "torch.Tensor | None" = None
        anchor = ctypes.c_char.from_buffer(mapping)
        self.address = ctypes.addressof(anchor)  # valid while mapped; for memmove staging
        del anchor  # a live export would keep close() from unmapping

    @classmethod
    def create(cls, slot_size: int, slots: int) -> "Ring":
        """Create, size and pre-touch a new 0600 segment owned by this process."""
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        size = slot_size * slots
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(SHM_DIR / name)
            raise
        finally:
            os.close(fd)
        try:
            mapping.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            for offset in range(0, size, mmap.PAGESIZE):
                mapping[offset] = 0
        return cls(name, mapping, slot_size, slots)

    @classmethod
    def attach(cls, name: str, slot_size: int, slots: int) -> "Ring":
        """Map a segment another process of this user created, then unlink its name.

        Raises:
            ValueError: the name is not an asyncckpt segment, or its size, owner or
                mode is not what the creator announced.
        """
        if not _NAME.match(name):
            raise ValueError(f"not an asyncckpt ring name: {name!r}")
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ValueError(f"{path}: owner {st.st_uid} / mode {st.st_mode & 0o777:o} refused")
            if st.st_size != slot_size * slots:
                raise ValueError(f"{path}: {st.st_size} bytes, expected {slot_size * slots}")
            mapping = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
        return cls(name, mapping, slot_size, slots)

    def unlink(self) -> None:
        """Remove the name (the memory stays while mapped)."""
        (SHM_DIR / self.name).unlink(missing_ok=True)

    def slot_bytes(self, slot: int, length: int) -> memoryview:
        """A view of the first `length` bytes of `slot`; release it before close()."""
        if not (0 <= slot < self.slots and 0 <= length <= self.slot_size):
            raise ValueError(f"slot {slot} / length {length} outside the ring")
        start = slot * self.slot_size
        return memoryview(self._mmap)[start:start + length]

    def slot_tensor(self, slot: int) -> "torch.Tensor":
        """Slot `slot` as a uint8 tensor (a view into the shared memory)."""
        if self._tensor is None:
            import torch  # the writer maps rings too, and never imports torch
            self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        start = slot * self.slot_size
        return self._tensor[start:start + self.slot_size]

    def close(self) -> None:
        """Unmap. Every view from slot_tensor()/slot_bytes() must be gone first."""
        self._tensor = None
        if not self._mmap.closed:
            self._mmap.close()


def sweep_stale() -> list[str]:
    """Unlink ring segments whose creating process no longer exists; returns their names."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            try:
                if (SHM_DIR / name).stat().st_uid == os.getuid():
                    (SHM_DIR / name).unlink()
                    removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
