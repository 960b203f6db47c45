"""Which tests start a process, found from their code so that nobody has to mark them.

`make test-fast` runs the tests that start no process (no writer, no torchrun, no
subprocess): they need seconds, where the whole suite needs minutes. Marking by hand would
drift; a marker per folder would put the pure tests of `read/` with the writer's. So a test
is in the `process` tier when its own code, a fixture it uses (directly or through another
fixture), or a helper any of them calls names one of `PROCESS_NAMES`; helpers are followed into
the repository's own code outside the package (tests, scripts, benchmarks), never into
`asyncckpt/` or other libraries, whose process starts are `start_writer`, a Checkpointer's
first save without a writer, and `export_hf(jobs > 1)`. The reading is
static and can miss a start hidden behind an attribute it cannot resolve, so `ProcessGuard`
counts every process actually started: a test outside the tier that starts one fails, in
`make test` too, saying to mark it `@pytest.mark.process`.
"""

from __future__ import annotations

import _posixsubprocess
import dis
import functools
import importlib
import importlib.util
import inspect
import os
import subprocess
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
PROCESS_NAMES = frozenset({
    "start_writer", "running_writer", "subprocess", "Popen", "multiprocessing", "torchrun",
    "fork", "forkpty", "posix_spawn", "posix_spawnp", "spawn", "system", "small_tmpfs",
    "runpytest_subprocess",
})
# folders whose tests start processes inside library code the reading does not follow
# (verl's manager starts its writer) or in every test (torchrun workers)
PROCESS_FOLDERS = frozenset({"multiprocess", "integrations"})
MARKER = "process"
_verdicts: dict[int, bool] = {}  # id of a function, class or module read -> starts a process
_modules: dict[str, types.ModuleType | None] = {}


OWN_FOLDERS = tuple(REPO / name for name in ("tests", "scripts", "benchmarks"))


@functools.cache
def _own_file(path: str) -> bool:
    """In the repository's tests, scripts or benchmarks (not the package, not a venv)."""
    resolved = Path(path).resolve()
    return any(resolved.is_relative_to(folder) for folder in OWN_FOLDERS)


def _own_code(obj: Any) -> bool:
    """Whether `obj` is defined in this repository, outside the package."""
    try:
        return _own_file(inspect.getfile(obj))
    except (TypeError, OSError):
        return False


def _unwrap(fn: Any) -> Any:
    inner = getattr(getattr(fn, "hypothesis", None), "inner_test", None)  # @given
    return inspect.unwrap(inner or fn)


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    """`code` and the code of every function, lambda and comprehension inside it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _imported_here(code: types.CodeType) -> dict[str, types.ModuleType]:
    """The repository's own modules that `import` statements inside `code` load (a
    helper imported in the function's body is in no global namespace)."""
    found: dict[str, types.ModuleType] = {}
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            if ins.argval not in _modules:
                _modules[ins.argval] = _own_module(ins.argval)
            if (module := _modules[ins.argval]) is not None:
                found[ins.argval.rpartition(".")[2]] = module
    return found


def _own_module(name: str) -> types.ModuleType | None:
    try:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.has_location or not _own_file(spec.origin):
            return None
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 (a helper that cannot be imported here is not followed)
        return None


def starts_process(obj: Any, seen: set[int] | None = None) -> bool:
    """Whether function, class or module `obj` names a way to start a process, itself or
    through the repository's own helpers it uses.

    Args:
        obj: a test, a fixture's function, a helper class or module.
        seen: ids being read further up this call (a cycle stops there).

    Returns:
        True where some code reachable from `obj` names one of PROCESS_NAMES.
    """
    seen = set() if seen is None else seen
    obj = _unwrap(obj)
    if id(obj) in _verdicts:
        return _verdicts[id(obj)]
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    _verdicts[id(obj)] = verdict = _reads_as_starting(obj, seen)
    return verdict


def _reads_as_starting(obj: Any, seen: set[int]) -> bool:
    if isinstance(obj, (type, types.ModuleType)):
        return any(starts_process(v, seen) for v in vars(obj).values()
                   if (inspect.isfunction(v) or isinstance(v, type)) and _own_code(v))
    code = getattr(obj, "__code__", None)
    if code is None:
        return False
    codes = list(_codes(code))
    names = {n for c in codes for n in c.co_names}
    if names & PROCESS_NAMES:
        return True
    space = getattr(obj, "__globals__", {})
    local = {k: v for c in codes for k, v in _imported_here(c).items()}
    for name in names:
        target = local.get(name, space.get(name))
        if isinstance(target, types.ModuleType) and _own_code(target):
            # `helpers.run(...)`: the attributes of an own module that the code names
            targets = [getattr(target, n) for n in names if hasattr(target, n)]
        else:
            targets = [target]
        for t in targets:
            if (inspect.isfunction(t) or isinstance(t, type)) and _own_code(t) \
                    and starts_process(t, seen):
                return True
    return False


def item_starts_process(item: pytest.Item) -> bool:
    """Whether collected test `item` starts a process (its folder, its code, its fixtures)."""
    path = Path(str(item.path)).resolve()
    if path.is_relative_to(REPO / "tests") and \
            PROCESS_FOLDERS & set(path.relative_to(REPO / "tests").parts[:-1]):
        return True
    seen: set[int] = set()
    if starts_process(getattr(item, "obj", None), seen):
        return True
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs if info is not None else {}
    return any(starts_process(d[-1].func, seen) for name in item.fixturenames
               if (d := defs.get(name)))


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
                            "subprocess); set at collection, `make test-fast` leaves these out")
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
                    f"`{MARKER}` tier (tests/tiers.py did not see how): mark it "
                    f"@pytest.mark.{MARKER} so that `make test-fast` leaves it out", pytrace=False)
