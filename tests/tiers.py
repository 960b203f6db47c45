"""Which tests start a process: marked by the fixtures they use and by hand, and guarded.

`make test-fast` runs the tests that start no process (no writer, no torchrun, no
subprocess): they need seconds, where the whole suite needs minutes. A test is in the
`process` tier when
- it carries `@pytest.mark.process` (or its module's `pytestmark` does): the tests that
  start a process in their own code or in a fixture of their module;
- it uses, directly or through another fixture, a fixture decorated `@process_fixture`
  (the writer, client and shared-writer fixtures, the S3 servers): the fixture that
  applies to the test decides, so a folder that overrides one with a quiet fixture of the
  same name is not marked by it;
- it lives in a folder of `PROCESS_FOLDERS`, whose every test starts one (torchrun
  workers, verl's manager starting its writer).
A mark is a statement that can be wrong, so `ProcessGuard` counts every process actually
started: a test outside the tier that starts one fails, in `make test` too, saying how to
mark it. A test that only needs committed checkpoints uses the in-process writer
(tests/inprocess.py) and stays out of the tier.
"""

from __future__ import annotations

import _posixsubprocess
import inspect
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[1]
# folders whose every test starts a process: torchrun workers, several writers, and library
# code that starts the writer itself (verl's manager)
PROCESS_FOLDERS = frozenset({"multiprocess", "integrations"})
MARKER = "process"
_STARTS = "_asyncckpt_starts_process"  # set on the function of a fixture that starts one
_F = TypeVar("_F", bound=Callable[..., Any])


def process_fixture(fn: _F) -> _F:
    """Declare that fixture function `fn` starts a process: every test that uses it, itself
    or through another fixture, is in the `process` tier. Put it below `@pytest.fixture`
    (pytest keeps the function it wraps, which is what this marks).

    Raises:
        TypeError: `fn` is already a pytest fixture (the decorators are the wrong way up).
    """
    if not inspect.isfunction(fn):
        raise TypeError(f"@process_fixture goes below @pytest.fixture, on the function "
                        f"itself (got {fn!r})")
    setattr(fn, _STARTS, True)
    return fn


def in_process_folder(path: Path) -> bool:
    """Whether test file `path` lies in one of the folders whose every test starts one."""
    path = path.resolve()
    tests = REPO / "tests"
    return path.is_relative_to(tests) and bool(
        PROCESS_FOLDERS & set(path.relative_to(tests).parts[:-1]))


def process_fixtures(item: pytest.Item) -> list[str]:
    """The fixtures of `item` (its own and those they use) that start a process, by the
    definition that applies to it."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    defs = info.name2fixturedefs
    return [name for name in getattr(item, "fixturenames", ())
            if (d := defs.get(name)) and getattr(d[-1].func, _STARTS, False)]


def item_starts_process(item: pytest.Item) -> bool:
    """Whether collected test `item` is in the `process` tier: its mark, a fixture it uses,
    its folder."""
    return (item.get_closest_marker(MARKER) is not None or bool(process_fixtures(item))
            or in_process_folder(Path(str(item.path))))


class ProcessGuard:
    """Counts the processes this interpreter starts, by every route Python has: subprocess
    (its own binding of `_posixsubprocess.fork_exec`, or posix_spawn), multiprocessing's
    spawn (`_posixsubprocess.fork_exec`), fork, posix_spawn and system."""

    ROUTES = ((subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"),
              (os, "forkpty"), (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"))

    def __init__(self) -> None:
        self.started = 0
        self._originals: list[tuple[Any, str, Callable]] = []

    def install(self) -> None:
        for owner, name in self.ROUTES:
            original = getattr(owner, name, None)
            if original is not None:
                self._originals.append((owner, name, original))
                setattr(owner, name, self._counting(original))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def _counting(self, original: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.started += 1
            return original(*args, **kwargs)
        return counted


# -- the hooks (tests/conftest.py imports them) ------------------------------------------

_GUARD = pytest.StashKey[ProcessGuard]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: starts a process (a writer, torchrun, a "
                            "subprocess); set by hand or by a @process_fixture the test "
                            "uses, `make test-fast` leaves these out")
    config.stash[_GUARD] = guard = ProcessGuard()
    guard.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    if (guard := config.stash.get(_GUARD, None)) is not None:
        guard.uninstall()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker(MARKER) is None and item_starts_process(item):
            item.add_marker(MARKER)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.config.stash[_GUARD].started = 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    # counted in setup and call only: this teardown also finalizes the fixtures of its
    # module or session, which other tests set up
    started = item.config.stash[_GUARD].started
    yield
    if started and item.get_closest_marker(MARKER) is None:
        pytest.fail(f"{item.nodeid} started {started} process(es) but is not in the "
                    f"`{MARKER}` tier: mark it @pytest.mark.{MARKER}, or the fixture that "
                    f"starts it @process_fixture (tests/tiers.py), so that `make test-fast` "
                    f"leaves it out", pytrace=False)
