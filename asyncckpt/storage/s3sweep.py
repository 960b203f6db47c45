"""What a writer's first start and `asyncckpt gc` remove from an object-store root.

A prefix may hold more than asyncckpt's steps (another tool's files, a user's upload in
progress), and a bucket root holds the whole bucket, so a sweep never works by prefix
alone: it touches only keys of asyncckpt's layout (storage/s3keys.py `own_key`), and of
those only what no live writer may still commit:

- an attempt folder (`step-N/attempt-<writer><random>/`) that the step's manifest or
  retired marker does not name, whose writer holds no live lease (storage/lease.py): its
  objects are deleted and its unfinished multipart uploads aborted. A live writer's
  attempts are left alone whatever their age, a dead one's go at once;
- the folder a replacing manifest says it replaced (`asyncckpt-replaced`, and the node
  folders its `nodes.json` maps, while it is there), whoever wrote it: no manifest names
  it and none ever will again, so a crash between the replacing put and the deletion of
  the old folder leaves nothing for good, even while that folder's writer lives. A
  folder the manifest names is never one of these;
- the files of an earlier layout (`step-N/<data file>` of a step without a manifest, or
  of one whose manifest names an attempt folder: a step of that layout replaced, and
  uploads to such keys), which name no writer: by age, as before (`older_than`).

Every delete and abort passes the sweeping writer's fence first.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from asyncckpt.format.layout import MANIFEST_NAME, step_dir_name
from asyncckpt.storage import s3keys
from asyncckpt.storage.lease import live_ids

if TYPE_CHECKING:
    from asyncckpt.storage.s3 import S3Storage


def leftovers(storage: S3Storage) -> tuple[list[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
    """What saves left under `storage`'s root, of asyncckpt's layout only: (multipart
    uploads not completed, step -> the objects that are no committed or retired step's).

    Raises:
        OSError: the root cannot be listed.
    """
    prefix = storage._prefix
    uploads = [u for u in storage.uploads() if s3keys.own_key(u["Key"][len(prefix):])]
    committed, retired = storage._names()
    steps = committed | retired
    kept: dict[int, set[str]] = {}
    garbage: dict[int, list[dict[str, Any]]] = {}
    for item in storage._list(prefix):
        own = s3keys.own_key(item["Key"][len(prefix):])
        if own is None or (own.folder is None and own.name == MANIFEST_NAME):
            continue
        if own.step in steps:
            if own.step not in kept:
                kept[own.step] = _folders_of(storage, own.step)
            if own.folder in kept[own.step] or (own.folder is None and not kept[own.step]):
                continue  # the step's: in a folder it names, or an earlier layout's own
        garbage.setdefault(own.step, []).append(item)
    return uploads, garbage


def _folders_of(storage: S3Storage, step: int) -> set[str]:
    """The attempt folders committed (or retired) step `step` is made of."""
    head = storage._commit_head(step)
    if head is None:
        return set()
    folder = storage._folder_of(step, head)
    name = folder.rstrip("/").rsplit("/", 1)[-1]
    if s3keys.attempt_writer(name) is None:
        return set()
    return {name, *storage._nodes(step, folder).values()}


def _replaced_of(storage: S3Storage, step: int) -> set[str]:
    """The attempt folders that step `step`'s manifest (or marker) says it replaced (and
    the node folders the replaced one's map names, while it is there), less every folder
    the manifest itself names."""
    head = storage._commit_head(step)
    folder = s3keys.replaced_folder(None if head is None else head.get("Metadata"))
    if head is None or folder is None:
        return set()
    prefix = f"{storage._key(step_dir_name(step))}/{folder}/"
    try:
        nodes = set(storage._nodes(step, prefix).values())
    except OSError:  # a map that is no map: only the folder itself
        nodes = set()
    return ({folder} | nodes) - _folders_of(storage, step)


def sweep(storage: S3Storage, older_than: float) -> list[str]:
    """Abort and delete what `leftovers` finds that no live writer owns (earlier-layout
    keys once `older_than` seconds old; 0: all of them). Returns what was removed.

    Raises:
        LeaseLostError: the sweeping writer lost its lease (nothing more is removed).
        OSError: the store failed (what was removed stays removed).
    """
    storage.fence()
    live = live_ids(storage) | ({storage.owner} if storage._lease is not None else set())
    cutoff = storage.store_now() - datetime.timedelta(seconds=older_than)
    if older_than == 0:
        cutoff += datetime.timedelta(days=1)  # whatever the clocks say

    replacing: dict[int, set[str]] = {}

    def replaced(step: int) -> set[str]:
        if step not in replacing:
            replacing[step] = _replaced_of(storage, step)
        return replacing[step]

    def gone(relative: str, when: datetime.datetime) -> bool:
        own = s3keys.own_key(relative)
        if own is None:
            return False
        if own.folder is None:
            return when <= cutoff
        return s3keys.attempt_writer(own.folder) not in live or own.folder in replaced(own.step)

    removed = []
    uploads, garbage = leftovers(storage)
    for upload in uploads:
        relative = upload["Key"][len(storage._prefix):]
        if gone(relative, upload["Initiated"]):
            storage.abort_upload(upload)
            removed.append(f"upload of {relative}")
    for step, items in sorted(garbage.items()):
        groups: dict[str | None, list[dict[str, Any]]] = {}
        for item in items:
            own = s3keys.own_key(item["Key"][len(storage._prefix):])
            groups.setdefault(own.folder if own else None, []).append(item)
        for folder, group in sorted(groups.items(), key=lambda g: g[0] or ""):
            if all(gone(i["Key"][len(storage._prefix):], i["LastModified"]) for i in group):
                storage.delete_keys([i["Key"] for i in group])
                where = f"{step_dir_name(step)}/{folder + '/' if folder else ''}"
                removed.append(f"{where} ({len(group)} objects, no manifest)")
    return removed
