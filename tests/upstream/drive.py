"""Run one upstream test module with unittest and write each outcome as a JSON line.

    python drive.py MODULE OUT.jsonl

A line is written (and flushed) when a test starts and when it ends, so a run killed by
its timeout still says which tests finished and which one was running. The runner
(run.py) starts this with the module's folder and swap.py's on PYTHONPATH, so the
processes that torch's MultiProcessTestCase spawns import the same swapped module.
"""

from __future__ import annotations

import json
import sys
import traceback
import unittest
from typing import Any, TextIO

TAIL_LINES = 25  # lines of a failure's traceback kept in its record


class _Recorder(unittest.TextTestResult):
    def __init__(self, out: TextIO, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.out = out

    def _record(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        self.out.write(json.dumps({"id": test.id(), "outcome": outcome,
                                   "detail": "\n".join(detail.splitlines()[-TAIL_LINES:])}))
        self.out.write("\n")
        self.out.flush()

    def startTest(self, test: unittest.TestCase) -> None:  # noqa: N802 - unittest's name
        super().startTest(test)
        self._record(test, "started")

    def addSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        super().addSuccess(test)
        self._record(test, "pass")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        super().addFailure(test, err)
        self._record(test, "fail", "".join(traceback.format_exception(*err)))

    def addError(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        super().addError(test, err)
        self._record(test, "error", "".join(traceback.format_exception(*err)))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:  # noqa: N802
        super().addSkip(test, reason)
        self._record(test, "skip", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        super().addExpectedFailure(test, err)
        self._record(test, "xfail")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        super().addUnexpectedSuccess(test)
        self._record(test, "xpass")


def main() -> int:
    module, path = sys.argv[1], sys.argv[2]
    del sys.argv[1:]  # torch's common_utils reads the command line at import
    with open(path, "w") as out:
        try:
            suite = unittest.defaultTestLoader.loadTestsFromName(module)
        except Exception:  # noqa: BLE001 - an import error is this module's outcome
            out.write(json.dumps({"id": module, "outcome": "import-error",
                                  "detail": traceback.format_exc()[-4000:]}) + "\n")
            return 2
        runner = unittest.TextTestRunner(verbosity=2, stream=sys.stderr,
                                         resultclass=lambda *a, **k: _Recorder(out, *a, **k))
        return 0 if runner.run(suite).wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
