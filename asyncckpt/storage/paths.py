"""Locations: a directory of this machine, or a place in a store named by a URL.

A root or a step is named by text. A path without a scheme is a local directory (a
`pathlib.Path`); `scheme://rest` is a place in the store of that scheme, held as an
`ObjectPath`: a pure path, so the code that joins step and file names onto a root is the
same for every backend, but never `os.fspath`-able, so a local file call handed one by
mistake fails loudly instead of writing `./s3:/bucket` in the working directory.

This module knows no backend: which schemes exist, and which `Storage` serves each, is
the registry's (storage/registry.py). It sits below every backend, which is what keeps
the backends and the registry out of an import circle.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path, PurePath, PurePosixPath

from asyncckpt.errors import CheckpointError

URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.DOTALL)


class ObjectPath(PurePosixPath):
    """`<scheme>://bucket/key/...`, held as the pure path `/bucket/key/...`.

    The scheme is the class's: `ObjectPath` is `s3`; another backend's locations are a
    subclass naming its own (`class MemoryPath(ObjectPath): scheme = "mem"`), and every
    path joined onto one is of the same class.
    """

    scheme = "s3"

    def __str__(self) -> str:
        return f"{self.scheme}:/{super().__str__()}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __fspath__(self) -> str:
        raise TypeError(f"{self} is an object-store location, not a local path")

    @property
    def bucket(self) -> str:
        return self.parts[1]

    @property
    def key(self) -> str:
        """The object key (or key prefix, without a trailing slash) in the bucket."""
        return "/".join(self.parts[2:])

    def resolve(self) -> ObjectPath:
        """`..` segments taken lexically: a store has no links to follow (never above
        the bucket)."""
        if ".." not in self.parts:
            return self
        return type(self)(posixpath.normpath(PurePosixPath(*self.parts)))

    def absolute(self) -> ObjectPath:
        return self


# A root, a step or a file: what every `Storage` method takes. Both kinds are pure paths
# (name, parent, `/`); only the backend that owns a kind does more with it.
Location = Path | ObjectPath


def scheme_of(location: PurePath) -> str:
    """The scheme of `location`: "" for a local path."""
    return getattr(location, "scheme", "") if isinstance(location, ObjectPath) else ""


def split_url(text: str) -> tuple[str, str] | None:
    """(scheme lowercased, the rest) of `scheme://rest`, else None (a local path)."""
    match = URL.match(text)
    return None if match is None else (match.group(1).lower(), match.group(2))


def object_path(cls: type[ObjectPath], text: str, rest: str) -> ObjectPath:
    """`rest` (of URL `text`) as a location of class `cls`.

    Raises:
        ValueError: no bucket, or an empty, `.` or `..` segment.
    """
    segments = rest.rstrip("/").split("/")
    if not segments[0] or any(s in ("", ".", "..") for s in segments):
        raise ValueError(f"{text!r} is not {cls.scheme}://bucket/prefix (a bucket, then "
                         "segments without empty, '.' or '..' parts)")
    return cls("/", *segments)


def local_path(path: str | os.PathLike[str]) -> Path:
    """`path` as a path of this machine's filesystem.

    Raises:
        CheckpointError: `path` is a URL (`s3://bucket/run`, `gs://`, `file://`...). Taken
            as a path it would be a relative directory named `s3:` quietly written in
            the working directory: refused instead, wherever a root or step is given.
        TypeError: `path` is an object-store location.
    """
    text = os.fspath(path)
    url = split_url(text) if isinstance(text, str) else None
    if url is not None:
        scheme = text.split("://", 1)[0]
        raise CheckpointError(f"{text!r} is a {scheme}:// URL: a root is a directory of a local "
                              f"or mounted filesystem here ({scheme}:// roots are not supported)",
                              file=text)
    return Path(text)
