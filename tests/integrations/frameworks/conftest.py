"""Framework tests run the real packages (transformers, accelerate, peft, lightning,
torchtune) in subprocesses with the locked frameworks venv's python, which
`make frameworks-setup` builds; ASYNCCKPT_FRAMEWORKS_PYTHON names another. Without it
every test here skips, saying so."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).parents[3]
FRAMEWORKS_PYTHON = os.environ.get("ASYNCCKPT_FRAMEWORKS_PYTHON",
                                   str(REPO / ".venv-frameworks" / "bin" / "python"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if Path(FRAMEWORKS_PYTHON).exists():
        return
    skip = pytest.mark.skip(reason=f"no frameworks venv at {FRAMEWORKS_PYTHON}: run "
                                   "`make frameworks-setup`")
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)
