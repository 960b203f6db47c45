"""The package's layers: imports run one way, no module imports itself round a circle,
only storage/ knows its backends, and the writer's side never imports torch.

Each part of `asyncckpt/` (a folder, or a top-level module) has a layer; a module may
import its own part and the parts of lower layers, never a peer of its layer or anything
above. Inside a part the modules form no circle either: an import inside a function
counts, only one under `if TYPE_CHECKING:` does not. Outside `storage/` no module names a
backend (a `Storage` subclass or a backend's own module) or tests a location's type: it
opens storage by URL and calls `Storage` methods, so a new backend is one new module. The
parts that the writer process loads never import torch, not even inside a function (only
under `if TYPE_CHECKING:`), so that the writer's memory stays small.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "asyncckpt"

LAYERS: list[set[str]] = [
    {"_version", "errors", "runtime"},
    {"codec"},
    {"config"},
    {"format", "torchutil"},
    {"ipc"},  # a begin carries a tensor table and tree: ipc checks them with format's rules
    {"storage"},
    {"net"},  # the replica transport between writers: the writer's memory tier uses it
    {"rank", "writer", "read"},
    {"checkpointer"},
    {"integrations"},
    {"cli_parser"},
    {"cli"},
    {"__main__", "__init__", "dcp"},
]
LAYER_OF = {part: i for i, parts in enumerate(LAYERS) for part in parts}
NO_TORCH = {"_version", "errors", "runtime", "codec", "config", "format", "ipc", "storage",
            "net", "writer"}


def part_of(module: str) -> str:
    """`writer.session` -> `writer`; the package's own `__init__` is `__init__`."""
    return module.split(".")[0] if module else "__init__"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def violations(module: str, source: str) -> list[str]:
    """What `module` (dotted, under asyncckpt) imports against the layers."""
    me = part_of(module)
    tree = ast.parse(source)
    typing_only = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [node.module]
            if node.module == "asyncckpt":
                targets = [f"asyncckpt.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append(f"{module}: relative import (write `from asyncckpt.… import`)")
            continue
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "torch" and me in NO_TORCH and id(node) not in typing_only:
                found.append(f"{module} imports torch (its part, {me}/, never does)")
            if target == "asyncckpt" or not target.startswith("asyncckpt."):
                continue
            other = part_of(target[len("asyncckpt."):])
            if other != me and LAYER_OF[other] >= LAYER_OF[me]:
                found.append(f"{module} imports {target} ({other} is not below {me})")
    return found


def _module_file(module: str) -> Path | None:
    """The file of `asyncckpt.<module>` (a package's `__init__.py`), or None."""
    base = PACKAGE.joinpath(*module.split(".")) if module else PACKAGE
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(module: str, source: str,
                     is_module: Callable[[str], bool] = lambda m: _module_file(m) is not None
                     ) -> set[str]:
    """The package's modules that `module` imports outside `if TYPE_CHECKING:` (dotted,
    under asyncckpt; `from asyncckpt.x import y` names `x.y` when `is_module("x.y")`)."""
    tree = ast.parse(source)
    typing_only = _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            names = [n if is_module(n[len("asyncckpt."):]) else node.module for n in names
                     if n.startswith("asyncckpt.")]
        else:
            continue
        found.update(n[len("asyncckpt."):] for n in names if n.startswith("asyncckpt."))
    found.discard(module)
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module in `graph` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            members = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                members.append(top)
                if top == node:
                    break
            if len(members) > 1:
                circles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def backend_names() -> tuple[set[str], set[str]]:
    """The backends' class names (every subclass of `Storage` defined in storage/, read from
    the source, and `ObjectPath`, a backend's location type) and their modules."""
    bases: dict[str, tuple[str, set[str]]] = {}
    for path in sorted((PACKAGE / "storage").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {ast.unparse(b).split(".")[-1].split("[")[0] for b in node.bases}
                bases[node.name] = (f"storage.{path.stem}", names)
    classes = {"Storage"}
    while True:
        more = {name for name, (_, parents) in bases.items() if parents & classes} - classes
        if not more:
            break
        classes |= more
    classes.discard("Storage")
    modules = {bases[name][0] for name in classes}
    return classes | {"ObjectPath"}, modules


def backend_checks(module: str, source: str, classes: set[str],
                   modules: set[str]) -> list[str]:
    """Where `module`, outside storage/, names a backend class or imports a backend's module
    (`s3*`, `posix*` and any module defining a `Storage` subclass)."""
    if part_of(module) == "storage":
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in classes:
            found.append(f"{module}:{node.lineno} names the backend {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in classes:
            found.append(f"{module}:{node.lineno} names the backend {node.attr}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names
                                            if _module_file(f"{node.module}.{a.name}"
                                                            [len("asyncckpt."):])])
            for name in names:
                short = name[len("asyncckpt."):] if name.startswith("asyncckpt.") else ""
                stem = short.split(".")[1] if short.startswith("storage.") and "." in short \
                    else ""
                if short in modules or stem.startswith(("s3", "posix")):
                    found.append(f"{module}:{node.lineno} imports the backend module {name}")
                if isinstance(node, ast.ImportFrom):
                    found += [f"{module}:{node.lineno} imports the backend {a.name}"
                              for a in node.names if a.name in classes]
    return sorted(set(found))


def test_every_part_has_a_layer():
    parts = {part_of(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert parts <= set(LAYER_OF), f"parts without a layer: {parts - set(LAYER_OF)}"


def test_imports_follow_the_layers():
    found = [v for p in sorted(PACKAGE.rglob("*.py"))
             for v in violations(_module_name(p), p.read_text())]
    assert not found, "\n".join(found)


def test_no_import_circles():
    graph = {_module_name(p): imported_modules(_module_name(p), p.read_text())
             for p in sorted(PACKAGE.rglob("*.py"))}
    circles = import_circles(graph)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_only_storage_knows_its_backends():
    classes, modules = backend_names()
    assert {"PosixStorage", "S3Storage"} <= classes
    found = [v for p in sorted(PACKAGE.rglob("*.py"))
             for v in backend_checks(_module_name(p), p.read_text(), classes, modules)]
    assert not found, "\n".join(found)


def test_the_circle_check_catches():
    def known(module: str) -> bool:
        return module in {"format.a", "format.b", "format.c", "format.d"}

    sources = {"format.a": "def f():\n    from asyncckpt.format import b\n",
               "format.b": "from asyncckpt.format.a import X\n",
               "format.c": "from typing import TYPE_CHECKING\n"
                           "if TYPE_CHECKING:\n    from asyncckpt.format import b\n",
               "format.d": "import asyncckpt.format.c\n"}
    graph = {name: imported_modules(name, source, known) for name, source in sources.items()}
    assert graph["format.a"] == {"format.b"} and graph["format.c"] == set()
    assert import_circles(graph) == [["format.a", "format.b"]]


@pytest.mark.parametrize("source, expected", [
    ("from asyncckpt.storage.s3 import S3Storage\n", "imports the backend"),
    ("import asyncckpt.storage.posix\n", "backend module"),
    ("from asyncckpt.storage import s3client\n", "backend module"),
    ("def f(x):\n    return isinstance(x, location.ObjectPath)\n", "names the backend"),
    ("def f(s):\n    return type(s).__name__ == 'S3' or isinstance(s, PosixStorage)\n",
     "names the backend PosixStorage"),
])
def test_the_backend_check_catches(source, expected):
    classes, modules = backend_names()
    assert any(expected in v for v in backend_checks("writer.commit", source, classes, modules))
    assert not backend_checks("storage.location", source, classes, modules)


@pytest.mark.parametrize("module, source, expected", [
    ("format.layout", "from asyncckpt.writer import commit\n", "not below format"),
    ("rank.client", "from asyncckpt.read.reader import RankReader\n", "not below rank"),
    ("read.loader", "def f():\n    from asyncckpt.writer.steps import Steps\n", "not below read"),
    ("codec.planes", "from asyncckpt import checkpointer\n", "not below codec"),
    ("writer.session", "def f():\n    import torch\n", "imports torch"),
    ("ipc.ring", "import torch.distributed as dist\n", "imports torch"),
    ("format.tree", "from . import layout\n", "relative import"),
    ("format.tree", "from asyncckpt.ipc.messages import parse\n", "not below format"),
])
def test_the_check_catches(module, source, expected):
    assert any(expected in v for v in violations(module, source))


def test_type_checking_imports_and_torch_on_the_rank_side_are_allowed():
    assert not violations("writer.session", "from typing import TYPE_CHECKING\n"
                          "if TYPE_CHECKING:\n    import torch\n")
    assert not violations("rank.stager", "import torch\nfrom asyncckpt.ipc.ring import Ring\n")


@pytest.mark.process  # a fresh interpreter
def test_writer_process_modules_load_without_torch():
    """Importing every module of the parts the writer loads leaves torch unloaded (the
    package's lazy `__init__` included), and so do the commands that only read bytes
    (verify, ls, inspect, copy: they start in a fraction of a second)."""
    modules = sorted(f"asyncckpt.{_module_name(p)}" for p in PACKAGE.rglob("*.py")
                     if part_of(_module_name(p)) in NO_TORCH and p.name != "__main__.py"
                     and _module_name(p))
    code = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "import asyncckpt.cli\nassert 'torch' not in sys.modules, 'the cli imports torch'\n"
            "import asyncckpt.read.verification, asyncckpt.read.copying\n"
            "assert 'torch' not in sys.modules, 'verify, ls, inspect or copy imports torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_code_map_names_every_module_in_its_folder():
    """docs/CODE.md gives each module one line under its folder: a module added, moved or
    removed without the map fails here."""
    text = (PACKAGE.parent / "docs" / "CODE.md").read_text()
    tree = text[text.index("```\nasyncckpt/"):].split("```")[1]
    listed, folder = set(), ""
    for line in tree.splitlines()[1:]:
        name = line.split()[0] if line.strip() else ""
        if name.endswith("/"):
            folder = name
        elif name.endswith(".py"):
            listed.add(folder + name if line.startswith("    ") else name)
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py", "_version.py")}
    modules.add("__init__.py")
    assert listed == modules, (f"missing from docs/CODE.md: {sorted(modules - listed)}; "
                               f"listed but absent: {sorted(listed - modules)}")


def test_dir_of_the_package_is_its_public_api():
    import asyncckpt
    assert dir(asyncckpt) == sorted(asyncckpt.__all__)
    assert {"load", "verify", "Checkpointer", "CheckpointerOptions", "export_hf"} \
        <= set(dir(asyncckpt))
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib"} & set(dir(asyncckpt))
