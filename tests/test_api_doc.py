"""docs/API.md stays complete: every public name, every public method and property of
the public classes, every CLI subcommand with each of its options and its exit
statuses. A name added to the API without a word in the reference fails here."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

import asyncckpt
from asyncckpt import errors
from asyncckpt.cli_parser import EXIT_STATUS, parser

API = (Path(__file__).resolve().parents[1] / "docs" / "API.md").read_text()


def test_dir_is_the_public_api():
    assert dir(asyncckpt) == sorted(asyncckpt.__all__)
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib"} & set(dir(asyncckpt))


@pytest.mark.parametrize("name", [n for n in asyncckpt.__all__ if n != "__version__"])
def test_every_public_name_has_an_entry(name):
    assert re.search(rf"`{re.escape(name)}[`(]", API), f"docs/API.md does not describe {name}"


@pytest.mark.parametrize("cls", ["Checkpointer", "Client", "SaveHandle", "WriterProcess"])
def test_every_public_method_is_described(cls):
    members = [n for n, m in inspect.getmembers(getattr(asyncckpt, cls))
               if not n.startswith("_") and (inspect.isfunction(m) or isinstance(m, property))]
    missing = [n for n in members if f"`{n}" not in API]
    assert not missing, f"docs/API.md does not describe {cls}.{missing}"


def test_every_checkpointer_option_is_described():
    import dataclasses
    fields = [f.name for f in dataclasses.fields(asyncckpt.CheckpointerOptions)]
    assert [f for f in fields if f"`{f}`" not in API] == []


def test_every_subcommand_option_and_exit_status_is_in_the_reference():
    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    rows = {line.split("`")[1].split()[0]: line for line in API.splitlines()
            if line.startswith("| `") and line.split("`")[1].split()[0] in commands.choices}
    assert set(rows) == set(commands.choices)
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if action.help == argparse.SUPPRESS or not action.option_strings:
                continue
            flag = max(action.option_strings, key=len)
            if flag != "--help":
                assert f"`{flag}" in rows[name] or f"{flag} " in rows[name], (name, flag)
        codes = re.findall(r"(\d) ", EXIT_STATUS[name].removeprefix("exit status: "))
        assert all(f"{c} " in rows[name].split("|")[-2] for c in codes), name


ERROR_ROWS = re.findall(r"^\| `(\w+)` \|", API.split("## Errors", 1)[1].split("\n## ", 1)[0],
                        re.M)


def test_every_error_in_the_reference_is_exported():
    # the table is what users are told to catch: each name there is importable from the
    # package, as the very class the code raises
    assert "StepAlreadyCommittedError" in ERROR_ROWS
    assert [n for n in ERROR_ROWS if n not in asyncckpt.__all__] == []
    assert all(getattr(asyncckpt, n) is getattr(errors, n) for n in ERROR_ROWS)


def test_every_error_class_is_in_the_reference():
    defined = [n for n, c in vars(errors).items() if isinstance(c, type)
               and issubclass(c, errors.CheckpointError) and c.__module__ == errors.__name__]
    assert sorted(defined) == sorted(ERROR_ROWS)
