"""The version and the changelog move together: the package, its build metadata and the
newest section of CHANGELOG.md name one version."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import tomllib

import asyncckpt
from asyncckpt._version import __version__

REPO = Path(__file__).resolve().parents[1]


def changelog_versions() -> list[str]:
    """The versions CHANGELOG.md has a section for, newest first."""
    text = (REPO / "CHANGELOG.md").read_text()
    return re.findall(r"^## (\d+\.\d+\.\d+)\b", text, flags=re.M)


def test_the_newest_changelog_section_is_this_version():
    versions = changelog_versions()
    assert versions and versions[0] == __version__, (versions[:1], __version__)
    assert len(set(versions)) == len(versions), "a version with two sections"
    keyed = [tuple(map(int, v.split("."))) for v in versions]
    assert keyed == sorted(keyed, reverse=True), "sections are not newest first"


def test_the_build_reads_the_version_from_the_package():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"], "a second copy of the version"
    assert project["project"]["dynamic"] == ["version"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "asyncckpt._version.__version__"
    assert metadata.version("asyncckpt") == __version__ == asyncckpt.__version__
