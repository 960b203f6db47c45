"""The ring a rank's first save sizes for itself (rank/ringsize.py)."""

from __future__ import annotations

from asyncckpt.rank.ringsize import auto_ring_size

MiB, GiB = 1 << 20, 1 << 30
SLOT = 4 * MiB


def test_a_state_that_fits_in_half_of_memavailable_gets_a_ring_of_its_size():
    """4 GiB of state with 15 GiB available (make bench-dcp's 4 GiB case on a 24 GiB
    node): a quarter is 3.75 GiB, short of the state, so the last 0.28 GiB of every
    save waited for the disk; the whole state fits within half."""
    size, why = auto_ring_size(4 * GiB, SLOT, 1, 15 * GiB)
    assert size == 4 * GiB and "whole state fits" in why
    size, why = auto_ring_size(4 * GiB, SLOT, 2, 15 * GiB)  # two ranks: 3.75 GiB each at most
    assert size == int(15 * GiB * 0.25 / 2) // SLOT * SLOT and "whole state" not in why


def test_a_state_beyond_half_keeps_the_quarter():
    """A ring that cannot hold the state anyway stays within a quarter of MemAvailable."""
    size, _ = auto_ring_size(10 * GiB, SLOT, 1, 16 * GiB)
    assert size == 4 * GiB
