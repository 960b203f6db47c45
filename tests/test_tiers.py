"""The test tiers: which tests read as starting a process, and the guard that fails a test
outside the `process` tier that starts one anyway."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import running_writer
from tiers import ProcessGuard, starts_process


def _quiet_helper() -> int:
    return sum(range(3))


def _runs_python() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def _calls_a_helper_that_runs_python() -> None:
    _quiet_helper()
    _runs_python()


def _imports_its_helper() -> None:
    from test_tiers import _runs_python as run
    run()


class _Saver:
    def go(self, base) -> None:
        with running_writer(base):
            pass


# in a table, so that the test reading them is not itself read as starting a process
STARTING = [_runs_python, _calls_a_helper_that_runs_python, _imports_its_helper, _Saver,
            lambda base: [running_writer(b) for b in base]]
QUIET = [_quiet_helper, lambda: os.getpid()]


def test_code_that_names_a_way_to_start_a_process_is_in_the_tier():
    """Directly, through a helper, a helper imported inside the function, a helper class's
    method, a comprehension."""
    assert [starts_process(f) for f in STARTING] == [True] * len(STARTING)
    assert [starts_process(f) for f in QUIET] == [False] * len(QUIET)


def test_a_fixture_that_starts_a_process_puts_every_test_using_it_in_the_tier(
        pytester: pytest.Pytester):
    pytester.makeconftest("""
        from tiers import *  # noqa: F401,F403
        import pytest
        import subprocess

        @pytest.fixture(scope="module")
        def spawner():
            return subprocess

        @pytest.fixture
        def through(spawner):
            return spawner
    """)
    pytester.makepyfile(test_tiered="""
        def test_through_a_fixture(through): pass
        def test_quiet(tmp_path): pass
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "--collect-only",
                                          "-m", "not process")
    result.stdout.fnmatch_lines(["test_tiered.py::test_quiet", "1/2 tests collected (1 deselected)*"])


@pytest.mark.process
def test_a_process_the_reading_missed_fails_the_test_outside_the_tier(pytester: pytest.Pytester):
    pytester.makeconftest("from tiers import *  # noqa: F401,F403")
    pytester.makepyfile(test_hidden="""
        import os
        import sys

        def test_hidden():
            getattr(__import__("subpro" + "cess"), "run")([sys.executable, "-c", "pass"])

        def test_quiet():
            os.getpid()
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([("*test_hidden started 1 process(es) but is not in the "
                                  "`process` tier*mark it @pytest.mark.process*")])
    assert pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "not process"
                                        ).ret == pytest.ExitCode.TESTS_FAILED


def test_the_guard_counts_every_route_and_restores_them():
    guard = ProcessGuard()
    real_fork = os.fork
    guard.install()
    try:
        assert os.fork is not real_fork
    finally:
        guard.uninstall()
    assert os.fork is real_fork and guard.started == 0


def test_only_the_repositorys_tests_scripts_and_benchmarks_are_followed():
    """A virtualenv inside the checkout is library code, not ours: reading torch or pytest
    as our own would put every test in the process tier."""
    from tiers import REPO, _own_file
    assert _own_file(str(REPO / "tests" / "conftest.py"))
    assert _own_file(str(REPO / "scripts" / "faults" / "torture.py"))
    assert not _own_file(str(REPO / ".venv" / "lib" / "python3.11" / "site-packages" / "x.py"))
    assert not _own_file(str(REPO / "asyncckpt" / "rank" / "launch.py"))
