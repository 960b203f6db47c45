"""runtime/faults.py: the crash points and I/O operations a test may arm are exactly the
ones the code names, and a variable arming any other is refused when it is read.

A misspelt point would never fire: a test arming it would pass without testing anything,
and the torture scripts, which draw from `CRASH_POINTS`, would never reach a point the
code has but the tuple lacks. So the names the package passes to `faults.point` and
`faults.io` are read from its source (a string literal at the call, or a parameter of
the enclosing function whose every caller passes one) and compared with the tuples.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from asyncckpt.runtime import faults

PACKAGE = Path(__file__).resolve().parents[2] / "asyncckpt"
ENV_VARS = ("ASYNCCKPT_CRASH_AT", "ASYNCCKPT_SLOW_AT", "ASYNCCKPT_FAIL_IO")


def _hook(call: ast.Call) -> str | None:
    """"point" or "io" if `call` is `faults.point(...)` or `faults.io(...)`."""
    func = call.func
    if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id == "faults" and func.attr in ("point", "io")):
        return func.attr
    return None


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else (
        func.attr if isinstance(func, ast.Attribute) else None)


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _argument(call: ast.Call, function: ast.FunctionDef | ast.AsyncFunctionDef,
              param: str) -> ast.AST | None:
    """What `call` (a call of `function`) passes for parameter `param`."""
    for keyword in call.keywords:
        if keyword.arg == param:
            return keyword.value
    params = [a.arg for a in function.args.posonlyargs + function.args.args]
    index = params.index(param) if param in params else -1
    if params and params[0] in ("self", "cls") and isinstance(call.func, ast.Attribute):
        index -= 1  # a method called on an object: its first parameter is not passed
    return call.args[index] if 0 <= index < len(call.args) else None


def _owners(tree: ast.AST) -> dict[int, ast.FunctionDef | ast.AsyncFunctionDef | None]:
    """Each call in `tree` (by id) -> the innermost function it is written in, or None."""
    owner: dict[int, ast.FunctionDef | ast.AsyncFunctionDef | None] = {}

    def visit(node: ast.AST, function: ast.FunctionDef | ast.AsyncFunctionDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Call):
                owner[id(child)] = function
            visit(child, child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                  else function)

    visit(tree, None)
    return owner


def named_in(sources: dict[str, str]) -> tuple[dict[str, set[str]], list[str]]:
    """The names `sources` (file name -> text) pass to `faults.point` and `faults.io`,
    by hook, and what could not be read as a name (each "file:line: why")."""
    found: dict[str, set[str]] = {"point": set(), "io": set()}
    unread: list[str] = []
    trees = {name: ast.parse(text) for name, text in sources.items()}
    calls = [(name, node) for name, tree in trees.items() for node in ast.walk(tree)
             if isinstance(node, ast.Call)]
    for name, tree in trees.items():
        owners = _owners(tree)
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            hook = _hook(call)
            if hook is None:
                continue
            arg = call.args[0] if call.args else None
            literal, function = _literal(arg), owners[id(call)]
            if literal is not None:
                found[hook].add(literal)
                continue
            params = set() if function is None else {
                a.arg for a in function.args.posonlyargs + function.args.args
                + function.args.kwonlyargs}
            if function is None or not (isinstance(arg, ast.Name) and arg.id in params):
                shown = ast.unparse(arg) if arg is not None else "nothing"
                unread.append(f"{name}:{call.lineno}: faults.{hook} of {shown}")
                continue
            assert isinstance(arg, ast.Name)
            # its callers: in its own module, or (none there) wherever a call names it
            callers = [(n, c) for n, c in calls if _called_name(c) == function.name
                       and n == name] or [(n, c) for n, c in calls
                                          if _called_name(c) == function.name]
            if not callers:
                unread.append(f"{name}:{call.lineno}: {function.name}() passes {arg.id} on, "
                              "and nothing calls it")
            for caller_file, caller in callers:
                passed = _literal(_argument(caller, function, arg.id))
                if passed is None:
                    unread.append(f"{caller_file}:{caller.lineno}: {function.name}() is not "
                                  f"given {arg.id} as a string literal")
                else:
                    found[hook].add(passed)
    return found, unread


def package_sources() -> dict[str, str]:
    return {p.relative_to(PACKAGE).as_posix(): p.read_text()
            for p in sorted(PACKAGE.rglob("*.py")) if p.name != "faults.py"}


def test_crash_points_are_the_points_the_code_names():
    found, unread = named_in(package_sources())
    assert unread == []
    points = set(faults.CRASH_POINTS)
    assert found["point"] == points, (
        f"named in the code, not in CRASH_POINTS: {sorted(found['point'] - points)}; "
        f"in CRASH_POINTS, named nowhere: {sorted(points - found['point'])}")
    assert len(set(faults.CRASH_POINTS)) == len(faults.CRASH_POINTS)
    assert found["io"] == set(faults.IO_OPS), (
        f"named in the code: {sorted(found['io'])}; IO_OPS: {sorted(faults.IO_OPS)}")
    doc = faults.__doc__ or ""
    assert [p for p in faults.CRASH_POINTS if p not in doc] == []  # each point explained


def test_the_check_catches_a_misspelt_or_unreadable_point():
    source = '''
from asyncckpt.runtime import faults

def commit():
    faults.point("manifest_writen")
    faults.io("fsynk", None)

def delete(storage, step, point):
    faults.point(point)

def prune(storage):
    delete(storage, 1, "prunning")
    delete(storage, 2, point="retiring")
    delete(storage, 3, storage.name)

class Steps:
    def end(self, where):
        faults.point(where)

    def run(self):
        self.end("step_renamed")

def guess(names):
    faults.point(names[0])
'''
    found, unread = named_in({"x.py": source})
    assert found == {"point": {"manifest_writen", "prunning", "retiring", "step_renamed"},
                     "io": {"fsynk"}}
    assert unread == ["x.py:14: delete() is not given point as a string literal",
                      "x.py:24: faults.point of names[0]"]


@pytest.fixture
def rearm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], object]]:
    """Reads the variables again as a starting writer does (the module's import); after
    the test, with its variables gone, once more."""
    for variable in ENV_VARS:
        monkeypatch.delenv(variable, raising=False)
    try:
        yield lambda: importlib.reload(faults)
    finally:
        monkeypatch.undo()
        importlib.reload(faults)


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("ASYNCCKPT_CRASH_AT", "manifest_writen",
     "ASYNCCKPT_CRASH_AT='manifest_writen': 'manifest_writen' is not a point asyncckpt has; "
     "it names one of frame_written, data_fsynced,"),
    ("ASYNCCKPT_CRASH_AT", "frame_writen:3", "'frame_writen' is not a point"),
    ("ASYNCCKPT_SLOW_AT", "parts_gatherd:3.5", "'parts_gatherd' is not a point"),
    ("ASYNCCKPT_SLOW_AT", "parts_gathered", "ASYNCCKPT_SLOW_AT='parts_gathered' is not "
     "<point>:<seconds>"),
    ("ASYNCCKPT_SLOW_AT", "parts_gathered:soon", "is not <point>:<seconds>"),
    ("ASYNCCKPT_SLOW_AT", "parts_gathered:-1", "is not <point>:<seconds>"),
    ("ASYNCCKPT_FAIL_IO", "fsynk:EIO", "'fsynk' is not an operation asyncckpt has; it names "
     "one of write, fsync, rename, fsync_root"),
    ("ASYNCCKPT_FAIL_IO", "fsync:EIOO", "'EIOO' is not an errno name"),
])
def test_arming_an_unknown_name_is_refused_when_read(rearm, monkeypatch, variable, value,
                                                    message):
    """The variables are read when the module is imported (in the writer, as it starts):
    one that names nothing fails there, naming the variable and what it accepts."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError) as info:
        rearm()
    assert str(info.value).startswith(f"{variable}=") and message in str(info.value)


@pytest.mark.parametrize(("variable", "value"), [
    ("ASYNCCKPT_CRASH_AT", "frame_written:3"), ("ASYNCCKPT_CRASH_AT", "retired_deleting"),
    ("ASYNCCKPT_SLOW_AT", "parts_gathered:3.5"), ("ASYNCCKPT_FAIL_IO", "fsync_root:EIO"),
    ("ASYNCCKPT_FAIL_IO", "rename:EROFS:2"), ("ASYNCCKPT_FAIL_IO", "write"),
])
def test_every_known_name_is_armed(rearm, monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    rearm()
    if variable == "ASYNCCKPT_SLOW_AT":
        assert faults._slow == ("parts_gathered", 3.5)
    else:
        armed = faults._crash if variable == "ASYNCCKPT_CRASH_AT" else faults._fail
        assert armed is not None
        name, code, count = armed
        assert name == value.split(":")[0] and count == (int(value[-1]) if value[-1].isdigit()
                                                         else 1)
        assert code == ("EIO" if "EIO" in value else "EROFS" if "EROFS" in value else "")
