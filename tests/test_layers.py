"""The package's layers: imports run one way, and the writer's side never imports torch.

Each part of `asyncckpt/` (a folder, or a top-level module) has a layer; a module may
import its own part and the parts of lower layers, never a peer of its layer or anything
above. The parts that the writer process loads never import torch, not even inside a
function (only under `if TYPE_CHECKING:`), so that the writer's memory stays small.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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
    {"rank", "writer", "read"},
    {"checkpointer"},
    {"integrations"},
    {"cli"},
    {"__main__", "__init__", "dcp"},
]
LAYER_OF = {part: i for i, parts in enumerate(LAYERS) for part in parts}
NO_TORCH = {"_version", "errors", "runtime", "codec", "config", "format", "ipc", "storage",
            "writer"}


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


def test_every_part_has_a_layer():
    parts = {part_of(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert parts <= set(LAYER_OF), f"parts without a layer: {parts - set(LAYER_OF)}"


def test_imports_follow_the_layers():
    found = [v for p in sorted(PACKAGE.rglob("*.py"))
             for v in violations(_module_name(p), p.read_text())]
    assert not found, "\n".join(found)


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
    assert {"load", "verify", "Checkpointer", "CheckpointerOptions", "export_hf"} <= set(dir(asyncckpt))
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib"} & set(dir(asyncckpt))
