"""Framework tests run the real packages (transformers, accelerate, peft, lightning,
torchtune) in subprocesses with the locked frameworks venv's python, which
`make frameworks-setup` builds; ASYNCCKPT_FRAMEWORKS_PYTHON names another. Without it
every test here skips, saying so. A test marked `full` (more launches of 2 ranks than
`make test`'s time allows) runs only with ASYNCCKPT_FRAMEWORKS_FULL=1: `make
test-frameworks` runs them all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).parents[3]
FRAMEWORKS_PYTHON = os.environ.get("ASYNCCKPT_FRAMEWORKS_PYTHON",
                                   str(REPO / ".venv-frameworks" / "bin" / "python"))


FULL = os.environ.get("ASYNCCKPT_FRAMEWORKS_FULL") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    mine = [item for item in items if here in Path(str(item.fspath)).parents]
    if not FULL:
        full = pytest.mark.skip(reason="past make test's time budget: "
                                       "ASYNCCKPT_FRAMEWORKS_FULL=1 (make test-frameworks)")
        for item in mine:
            if item.get_closest_marker("full"):
                item.add_marker(full)
    if Path(FRAMEWORKS_PYTHON).exists():
        return
    skip = pytest.mark.skip(reason=f"no frameworks venv at {FRAMEWORKS_PYTHON}: run "
                                   "`make frameworks-setup`")
    for item in mine:
        item.add_marker(skip)
