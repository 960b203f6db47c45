"""Where a step's objects lie in an object-store root, and which keys are asyncckpt's.

An object store has no rename, so a save cannot be written aside and moved into place:
its data objects are written where they stay. If every attempt at step N wrote them at
`step-N/<file>`, a failed attempt's cleanup (or a commit's deletion of what its manifest
does not name) would delete another attempt's objects, a committed one's included. So
each attempt writes in a folder of its own, `step-N/attempt-<writer id><random>/`
(`<writer id>`: the 12 hex digits of its writer's lease, storage/lease.py; `<random>`: 8
hex digits a save), and the manifest object `step-N/manifest.json`, the commit, names
that folder in its user metadata `asyncckpt-data`. A cleanup only ever deletes inside
its own attempt's folder; the files of the committed step are those of the folder its
manifest names, and a reader maps the manifest's file names there:

    step-N/manifest.json                  metadata asyncckpt-data: attempt-<id><random>
    step-N/attempt-<id><random>/rank-00000.safetensors.zst
    step-N/attempt-<id><random>/nodes.json   (a step in parts whose nodes wrote in
                                              folders of their own: node dir -> folder)
    step-N/attempt-<other>/...            another attempt's: never part of the step

A retired step's marker `step-N.retired` carries the same metadata. A manifest without
the metadata is one of an earlier layout (or `asyncckpt copy`'s upload): its files are
at `step-N/<file>` as the manifest names them.

A manifest that replaced a committed step (`S3Storage.publish(replace=True)`) also
names, in `asyncckpt-replaced`, the folder of the step it replaced: no manifest names
that folder any more, and its writer (alive or not) can never commit it again, so it is
garbage from the moment the manifest is put. The replacing writer deletes it right
after; a crash in between leaves it for the sweep, which removes it even while its
writer lives (storage/s3sweep.py).

The keys of asyncckpt's own layout, the only ones a sweep may touch: an attempt folder's
objects, and in a step prefix a data file, a node folder's entries or a manifest
(`own_key`). Any other key under the prefix is someone else's and is never deleted, and
an upload to it never aborted.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import NamedTuple

from asyncckpt.format.layout import (
    MANIFEST_NAME,
    is_data_file_name,
    parse_node_dir,
    parse_node_entry,
    parse_step_dir,
)

ATTEMPT_PREFIX = "attempt-"
DATA_META = "asyncckpt-data"  # user metadata of a manifest (or marker): its data folder
REPLACED_META = "asyncckpt-replaced"  # of a replacing manifest: the folder it replaced
NODES_NAME = "nodes.json"  # in the committing attempt's folder: node dir -> its folder
_ATTEMPT = re.compile(r"attempt-([0-9a-f]{12})[0-9a-f]{8}")


def attempt_name(writer: str) -> str:
    """A new attempt folder's name for writer id `writer` (12 hex digits)."""
    return f"{ATTEMPT_PREFIX}{writer}{secrets.token_hex(4)}"


def attempt_writer(name: str) -> str | None:
    """The writer id of attempt folder name `name`, else None (not an attempt folder)."""
    m = _ATTEMPT.fullmatch(name)
    return m.group(1) if m else None


class OwnKey(NamedTuple):
    """A key of asyncckpt's layout in a step prefix."""

    step: int
    folder: str | None  # its attempt folder; None: directly in the step prefix
    name: str  # the rest, relative to the folder (or to the step prefix)


def own_key(relative: str) -> OwnKey | None:
    """`relative` (a key relative to the root's prefix) as a key of asyncckpt's layout:
    anything under an attempt folder of a step, or in a step prefix a manifest, a data
    file or a node folder's entry. None for every other key (someone else's)."""
    head, _, rest = relative.partition("/")
    step = parse_step_dir(head)
    if step is None or not rest:
        return None
    folder, _, name = rest.partition("/")
    if attempt_writer(folder) is not None and name:
        return OwnKey(step, folder, name)
    if rest == MANIFEST_NAME or is_data_file_name(rest):
        return OwnKey(step, None, rest)
    node, _, entry = rest.partition("/")
    if parse_node_dir(node) is not None and parse_node_entry(entry) is not None:
        return OwnKey(step, None, rest)
    return None


def parse_nodes(data: bytes) -> dict[str, str]:
    """The node map of a step in parts (node dir -> attempt folder), checked: every entry
    a node directory name and an attempt folder name, nothing that could leave the step.

    Raises:
        ValueError: it is not such a map.
    """
    doc = json.loads(data)
    if not isinstance(doc, dict) or not all(
            isinstance(k, str) and parse_node_dir(k) is not None and isinstance(v, str)
            and attempt_writer(v) is not None for k, v in doc.items()):
        raise ValueError("not a map of node directories to attempt folders")
    return doc


def nodes_bytes(nodes: dict[str, str]) -> bytes:
    return json.dumps(dict(sorted(nodes.items())), separators=(",", ":")).encode()


def data_folder(metadata: dict[str, str] | None) -> str | None:
    """The attempt folder a manifest's (or marker's) metadata names; None when it names
    none (an earlier layout: the files are in the step prefix itself).

    Raises:
        ValueError: the metadata names something that is not an attempt folder.
    """
    folder = (metadata or {}).get(DATA_META)
    if folder is None:
        return None
    if attempt_writer(folder) is None:
        raise ValueError(f"{DATA_META} {folder!r:.60} is not an attempt folder name")
    return folder


def replaced_folder(metadata: dict[str, str] | None) -> str | None:
    """The attempt folder a replacing manifest's (or its marker's) metadata says it
    replaced; None when it names none, or names something that is not an attempt folder
    (a hint for the sweep only: a value that is not one is never acted on)."""
    folder = (metadata or {}).get(REPLACED_META)
    return folder if folder is not None and attempt_writer(folder) is not None else None


def is_attempt_name(name: str) -> bool:
    """`name` is an attempt folder's (what a node announces for a step on a bucket)."""
    return attempt_writer(name) is not None
