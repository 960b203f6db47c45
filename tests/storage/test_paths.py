"""Locations (storage/paths.py): a store's path joins and resolves as a local one does,
and is never taken for a local path."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncckpt.storage.paths import ObjectPath, scheme_of
from asyncckpt.storage.registry import parse


class OtherPath(ObjectPath):
    scheme = "other"


def test_a_store_path_resolves_dot_dot_lexically_and_keeps_its_class():
    root = parse("s3://bucket/runs/a")
    assert (root / ".." / "b").resolve() == parse("s3://bucket/runs/b")
    assert (root / "x" / "..").resolve() is not root and (root / "x" / "..").resolve() == root
    assert root.resolve() is root  # nothing to resolve: itself
    other = OtherPath("/", "bucket", "a") / ".." / "b"
    assert type(other.resolve()) is OtherPath and str(other.resolve()) == "other://bucket/b"


def test_the_scheme_is_the_location_class_s():
    assert scheme_of(parse("s3://b/r")) == "s3" and scheme_of(Path("/tmp/r")) == ""
    assert scheme_of(OtherPath("/", "b") / "k") == "other"
    assert str(OtherPath("/", "b", "k")) == "other://b/k"
    with pytest.raises(TypeError, match="not a local path"):
        open(OtherPath("/", "b", "k"))  # noqa: SIM115
