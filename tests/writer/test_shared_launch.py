"""The launch in a shared tmp directory's name (writer/shared.py): a node's lead marks its
coordinated begins with its launch (its coordination session's hash); the writer hashes it into
the name, so a relaunch never names the directory of a killed launch's save of the same
step and save id; a begin without it (an older rank's) names it as before."""

from __future__ import annotations

import pytest

from asyncckpt.ipc import messages
from asyncckpt.ipc.messages import NodeRanks, ProtocolError
from asyncckpt.rank.client import launch_of
from asyncckpt.writer import shared


def test_a_begin_without_a_launch_names_the_directory_as_an_older_writer_does():
    # the name every writer before the launch computed (an older rank, an older writer)
    assert shared.shared_name(1, 1, 4) == "step-00000001.tmp-600f115758d1ef4915136002"
    assert shared.shared_name(1, 1, 4, None) == shared.shared_name(1, 1, 4)


def test_launches_name_their_saves_apart_and_every_node_of_one_alike():
    a, b = launch_of("0f" * 8), launch_of("e1" * 8)  # two leaders' sessions
    assert a != b and len(a) == 16 and int(a, 16) >= 0
    names = {shared.shared_name(5, 2, 8, x) for x in (a, b, None)}
    assert len(names) == 3 and all(shared.is_shared(n, 5) for n in names)
    assert shared.shared_name(5, 2, 8, a) == shared.shared_name(5, 2, 8, launch_of("0f" * 8))


def _begin(**fields) -> messages.Begin:
    return messages.Begin(3, 7, 4, (), None, coordinated=True, node=NodeRanks(2, 2), **fields)


def test_the_begin_carries_the_launch_and_an_older_ranks_begin_has_none():
    launch = launch_of("5a" * 8)
    got = messages.parse(_begin(launch=launch).encode())
    assert isinstance(got, messages.Begin) and got.launch == launch and got.refused is None
    older = messages.parse(_begin().encode())
    assert isinstance(older, messages.Begin) and older.launch is None
    assert b"launch" not in _begin().encode()  # at its default, the field is left out


@pytest.mark.parametrize("bad", ["", "A0", "x" * 8, "0" * 65, 12, ["0a"], "0a/.."])
def test_a_launch_that_is_not_hex_digits_is_refused(bad):
    m = messages.decode(_begin().encode())
    with pytest.raises(ProtocolError, match="launch"):
        messages.parse({**m, "launch": bad})
