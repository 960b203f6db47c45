"""What the Lightning tests check on disk: the `.ckpt` markers Lightning keeps and the
asyncckpt steps they name (shared by the DDP and the sharded-strategy tests)."""

from __future__ import annotations

import json
from pathlib import Path

from asyncckpt.storage.location import storage_for


def markers(ckpts: Path, pending: bool = False) -> dict[str, int]:
    """Lightning's files in `ckpts` whose markers are final (`pending`: still pending, a
    save that never completed) and the steps they name."""
    docs = {p.name: json.loads(p.read_text()) for p in ckpts.glob("*.ckpt")}
    return {name: doc["step"] for name, doc in docs.items()
            if (doc.get("pending") is True) == pending}


def assert_rotation(ckpts: Path, files: int = 3, never_completed: int = 0) -> None:
    """Top 2 + last (and `files` - 3 of an abandoned timeline): each final marker names a
    committed step, and no other step is kept; `never_completed` pending markers (of
    saves a kill cut short: Lightning does not know those files, as it does not know a
    torn one of its own IO) name steps that are not committed."""
    named = markers(ckpts)
    assert len(named) == files and "last.ckpt" in named, named
    committed = set(storage_for(ckpts / "asyncckpt").committed_steps())
    assert committed == set(named.values())
    cut_short = markers(ckpts, pending=True)
    assert len(cut_short) == never_completed and not set(cut_short.values()) & committed
