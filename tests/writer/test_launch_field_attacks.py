"""Attacks on a begin's `launch` (ipc/messages.py) and the shared tmp directory's name it
goes into (writer/shared.py): only hex digits pass, and whatever passes names a directory
of its step, never a path elsewhere."""

from __future__ import annotations

import pytest

from asyncckpt.ipc import messages
from asyncckpt.ipc.messages import NodeRanks, ProtocolError
from asyncckpt.writer import shared


def _begin() -> dict:
    return messages.decode(messages.Begin(3, 7, 4, (), None, coordinated=True,
                                          node=NodeRanks(2, 2)).encode())


@pytest.mark.parametrize("bad", ["0a\n", "\n0a", "0a\x00", "\x00", "０１", "0a ", " 0a",
                                 "0a/../b", "..", "/", True, 0, 1.5, "g",
                                 {"0a": 1}, "f" * 10_000])
def test_a_launch_with_a_path_or_line_or_nul_in_it_is_refused(bad):
    with pytest.raises(ProtocolError, match="launch"):
        messages.parse({**_begin(), "launch": bad})


@pytest.mark.parametrize("launch", ["0", "f" * 64, "00", "0" * 64, "deadbeef"])
def test_any_launch_that_passes_names_a_shared_dir_of_its_step(launch):
    got = messages.parse({**_begin(), "launch": launch})
    assert isinstance(got, messages.Begin) and got.launch == launch
    name = shared.shared_name(7, 3, 4, got.launch)
    assert shared.is_shared(name, 7) and "/" not in name and name != shared.shared_name(7, 3, 4)


def test_launches_that_differ_only_in_leading_zeros_name_apart():
    """"0" and "00" are different launches: the name hashes the text, not a number."""
    assert shared.shared_name(7, 3, 4, "0") != shared.shared_name(7, 3, 4, "00")
