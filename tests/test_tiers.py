"""The test tiers: which tests are in the `process` tier (their mark, the fixtures they use,
their folder), and the guard that fails a test outside the tier that starts one anyway."""

from __future__ import annotations

import os

import pytest
from tiers import REPO, ProcessGuard, in_process_folder, process_fixture

_CONFTEST = """
    from tiers import *  # noqa: F401,F403
    from tiers import process_fixture
    import pytest
    import subprocess
    import sys

    @pytest.fixture(scope="module")
    @process_fixture
    def spawner():
        return subprocess.run([sys.executable, "-c", "pass"], check=True)

    @pytest.fixture
    def through(spawner):
        return spawner

    @pytest.fixture
    def quiet(tmp_path):
        return tmp_path
"""


def _collected(pytester: pytest.Pytester, *tier: str) -> list[str]:
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "--collect-only",
                                          "-m", *tier)
    return sorted(line for line in result.stdout.lines if "::" in line)


def test_a_fixture_that_starts_a_process_puts_every_test_using_it_in_the_tier(
        pytester: pytest.Pytester):
    pytester.makeconftest(_CONFTEST)
    pytester.makepyfile(test_tiered="""
        def test_through_a_fixture(through): pass
        def test_quiet(tmp_path): pass
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "--collect-only",
                                          "-m", "not process")
    result.stdout.fnmatch_lines(["test_tiered.py::test_quiet",
                                 "1/2 tests collected (1 deselected)*"])


def test_a_mark_a_fixture_or_a_folder_puts_a_test_in_the_tier_and_nothing_else_does(
        pytester: pytest.Pytester):
    """By hand (the test or its module), directly or through another fixture, a folder of
    PROCESS_FOLDERS; a fixture of the same name overridden by a quiet one in a folder's
    conftest marks nothing there, and a quiet fixture using nothing that starts one
    marks nothing."""
    pytester.makeconftest(_CONFTEST)
    pytester.makepyfile(test_one="""
        import pytest
        def test_direct(spawner): pass
        def test_through(through): pass
        def test_quiet(quiet): pass
        @pytest.mark.process
        def test_by_hand(): pass
    """, test_all="""
        import pytest
        pytestmark = pytest.mark.process
        def test_in_a_marked_module(): pass
    """)
    pytester.mkpydir("quiet_folder").joinpath("conftest.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef spawner():\n    return None\n")
    pytester.path.joinpath("quiet_folder", "test_over.py").write_text(
        "def test_overridden(through): pass\n")
    marked = _collected(pytester, "process")
    quiet = _collected(pytester, "not process")
    assert marked == ["test_all.py::test_in_a_marked_module", "test_one.py::test_by_hand",
                      "test_one.py::test_direct", "test_one.py::test_through"]
    assert quiet == ["quiet_folder/test_over.py::test_overridden", "test_one.py::test_quiet"]


def test_the_process_folders_put_their_tests_in_the_tier():
    assert in_process_folder(REPO / "tests" / "multiprocess" / "test_fsdp.py")
    assert in_process_folder(REPO / "tests" / "integrations" / "sub" / "test_x.py")
    assert not in_process_folder(REPO / "tests" / "read" / "test_reader.py")
    assert not in_process_folder(REPO / "tests" / "multiprocess.py")
    assert not in_process_folder(REPO / "scripts" / "multiprocess" / "test_x.py")


def test_process_fixture_goes_below_the_fixture_decorator():
    """Above `@pytest.fixture` it would mark pytest's wrapper, which collection never sees:
    refused, so that the mistake is not a test silently left in the fast tier."""
    def fixture_function():
        return None

    assert process_fixture(fixture_function) is fixture_function
    with pytest.raises(TypeError, match="below @pytest.fixture"):
        process_fixture(pytest.fixture(lambda: None))


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


@pytest.mark.process
def test_a_process_fixture_left_unmarked_fails_the_tests_that_use_it(pytester: pytest.Pytester):
    """A fixture that starts a process but is not declared: the test that set it up fails,
    naming the decorator too."""
    pytester.makeconftest("""
        from tiers import *  # noqa: F401,F403
        import pytest
        import subprocess
        import sys

        @pytest.fixture
        def undeclared():
            subprocess.run([sys.executable, "-c", "pass"], check=True)
    """)
    pytester.makepyfile(test_undeclared="def test_uses_it(undeclared): pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_uses_it started 1 process(es)*@process_fixture*"])


def test_the_guard_counts_every_route_and_restores_them():
    guard = ProcessGuard()
    real_fork = os.fork
    guard.install()
    try:
        assert os.fork is not real_fork
    finally:
        guard.uninstall()
    assert os.fork is real_fork and guard.started == 0
