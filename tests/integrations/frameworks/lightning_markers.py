"""What the Lightning tests check on disk: the `.ckpt` markers Lightning keeps and the
asyncckpt steps they name (shared by the DDP and the sharded-strategy tests)."""

from __future__ import annotations

import json
from pathlib import Path

from asyncckpt.storage.location import storage_for


def markers(ckpts: Path) -> dict[str, int]:
    """Lightning's files in `ckpts` and the steps they name."""
    return {p.name: json.loads(p.read_text())["step"] for p in ckpts.glob("*.ckpt")}


def assert_rotation(ckpts: Path, files: int = 3) -> None:
    """Top 2 + last (and `files` - 3 of an abandoned timeline): each file names a
    committed step, and no other step is kept."""
    named = markers(ckpts)
    assert len(named) == files and "last.ckpt" in named, named
    assert set(storage_for(ckpts / "asyncckpt").committed_steps()) == set(named.values())
