"""The environments the tests run in are exactly their locks.

`make setup`, `verl-setup` and `titan-setup` sync each venv to a lock in locks/ (uv pip
sync: the lock's versions, nothing else). A venv that takes packages it was never resolved
against fails on the day the registry moves: the verl venv once saw the main venv's
`kernels` through a .pth file, and its own transformers could not import it. These tests
hold the locks to pyproject.toml's ranges, and each venv to its lock.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "locks"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")
# lock -> the extras of pyproject.toml it holds (besides the package's own dependencies)
EXTRAS = {
    "test": ["test"],
    "bench": ["test", "s3", "bench", "realweights", "dcpbench", "s3bench", "incremental"],
    "verl": ["verl"],
    "titan": ["torchtitan"],
    "frameworks": ["frameworks"],
    "torchtune": ["torchtune-env"],
}
# a side venv, its lock, and the package installed there without its dependencies
SIDE_VENVS = {"verl": (REPO / ".venv-verl", "verl"), "titan": (REPO / ".venv-titan", "torchtitan"),
              "frameworks": (REPO / ".venv-frameworks", "lightning"),
              "torchtune": (REPO / ".venv-torchtune", "torchtune")}
# what a venv holds besides its lock: asyncckpt itself (editable) and the venv's own pip
NOT_LOCKED = {"asyncckpt", "pip"}


def pins(lock: str) -> dict[str, str]:
    """{canonical name: version} of every line of locks/<lock>.txt that is a requirement;
    a requirement line that is not an exact pin fails."""
    out = {}
    for line in (LOCKS / f"{lock}.txt").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = PIN.match(line.strip())
        assert match, f"locks/{lock}.txt: {line!r} is not an exact pin (name==version)"
        out[canonicalize_name(match[1])] = match[2]
    return out


def requirements(extras: list[str]) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate()]


@pytest.mark.parametrize("lock", sorted(EXTRAS))
def test_lock_pins_every_requirement_within_its_range(lock):
    locked = pins(lock)
    for req in requirements(EXTRAS[lock]):
        name = canonicalize_name(req.name)
        assert name in locked, f"locks/{lock}.txt lacks {req.name} (run `make lock`)"
        assert req.specifier.contains(Version(locked[name]), prereleases=True), (
            f"locks/{lock}.txt pins {name}=={locked[name]}, outside pyproject.toml's "
            f"{req} (run `make lock`)")


def test_build_lock_pins_the_build_backend_within_its_range():
    """asyncckpt's editable install is built by locks/build.txt's setuptools, not whatever
    the venv or the index has that day (python -m venv's setuptools cannot build it)."""
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    for req in map(Requirement, build):
        version = pins("build")[canonicalize_name(req.name)]
        assert req.specifier.contains(Version(version)), f"locks/build.txt: {req.name}=={version}"


def test_every_lock_pins_the_torch_the_makefile_names():
    makefile = (REPO / "Makefile").read_text()
    spec = re.search(r"^TORCH_SPEC\s*\?=\s*(\S+)", makefile, re.M)[1]
    assert (LOCKS / "torch.in").read_text().splitlines()[-1] == spec
    torch_version = Version(spec.split("==")[1])
    for lock in EXTRAS:
        assert Version(pins(lock)["torch"]).public == torch_version.public, lock


def test_bench_lock_agrees_with_the_test_lock():
    """The benchmarks' venv is the test venv plus their extras, never other versions."""
    test, bench = pins("test"), pins("bench")
    assert {name: bench.get(name) for name in test} == test


def test_makefile_installs_nothing_outside_a_lock():
    """Every venv is synced from a lock; the only plain install is uv's own pinned one."""
    installs = [line.strip() for line in (REPO / "Makefile").read_text().splitlines()
                if re.search(r"\bpip install\b", line)]
    assert installs == ['$(UV_VENV)/bin/pip install -q "uv==$(UV_VERSION)"']


def _unlocked(installed: dict[str, str], locked: dict[str, str]) -> dict[str, tuple]:
    """{name: (installed, locked)} wherever the venv and its lock differ."""
    names = (set(installed) | set(locked)) - NOT_LOCKED
    return {n: (installed.get(n), locked.get(n)) for n in sorted(names)
            if installed.get(n) != locked.get(n)}


@pytest.mark.skipif(os.environ.get("ASYNCCKPT_UNLOCKED") == "1",
                    reason="make test-latest runs on the newest releases, not the locks")
def test_this_venv_is_exactly_its_lock():
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    # `make bench-setup` syncs the same venv to the bench lock (a superset of the test lock)
    diffs = {lock: _unlocked(installed, pins(lock)) for lock in ("test", "bench")}
    assert not all(diffs.values()), (f"{sys.prefix} is not synced to a lock (make setup): "
                                     f"{diffs['test']}")


SHOW_VENV = ("import json, sys; from importlib import metadata; "
             "print(json.dumps({'path': sys.path, 'dists': "
             "{d.metadata['Name']: d.version for d in metadata.distributions()}}))")


@pytest.mark.process  # runs the side venv's python
@pytest.mark.skipif(os.environ.get("ASYNCCKPT_UNLOCKED") == "1",
                    reason="make test-latest runs on the newest releases, not the locks")
@pytest.mark.parametrize("side", sorted(SIDE_VENVS))
def test_side_venv_is_exactly_its_lock_and_sees_nothing_else(side):
    venv, package = SIDE_VENVS[side]
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"no {venv.name}: run `make {side}-setup`")
    shown = json.loads(subprocess.run([str(venv / "bin" / "python"), "-I", "-c", SHOW_VENV],
                                      check=True, capture_output=True, text=True).stdout)
    main_site = Path(metadata.distribution("pytest").locate_file("")).resolve()
    leaked = [p for p in shown["path"] if p and Path(p).resolve() == main_site]
    assert not leaked, f"{venv.name} sees the main venv's packages: {leaked}"
    installed = {canonicalize_name(n): v for n, v in shown["dists"].items()}
    assert package in installed, f"{venv.name} lacks {package}"
    assert not _unlocked(installed, pins(side)), _unlocked(installed, pins(side))
