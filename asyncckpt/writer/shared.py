"""One tmp directory a save of several nodes shares, so the leader renames one directory.

Without it the leader's writer moves every node's folder into its own tmp directory
(one rename a node) and lists each (one listing a node): at 1000 nodes that is 2000
metadata operations on the commit's path, serial on one writer, most of the commit
(docs/design/several_nodes.md). With it every node puts its folder into one directory
of the save itself, in parallel, and the leader renames that directory once.

The name. Every node computes it alone, before any byte is written:
`step-N.tmp-<24 hex>`, a hash of the step, the save's id on its ranks (their client's
save counter, which is the same on every rank: the ranks of a job make the same saves,
a failed save included), the world size and the launch (`shared_name`). A retry, or a
timeline's rerun of the same step, is a new save: a new id, a new name, never an
abandoned attempt's directory. The counter restarts with the job, so a relaunch that
redoes a step would count to the killed launch's id again, and find its slot taken by
the folder a still-live writer of that launch put there: the begin's `launch` tells the
launches apart. A node's lead sends a hash of its coordination session (the nonce the
leader draws at its start and every node's lead joins, rank/coordination.py; its first
save waits for the join its client began at start: rank/client.py `launch_of`), and the
node's writer names the directory from its lead's begin. Not the launcher's restart
count: torchelastic counts a restart only on the agent whose workers failed. A begin
without it (an older rank's, or a lead that could not join in time) names the directory
as before. Nothing depends on the nodes agreeing: a node whose name differs from the
leader's node's (its ranks counted their saves differently, or an older client) is
moved in by the leader as before (`commit.gather_nodes`), one rename for that node.

The node's side (`place`). Its ranks' data files and part files are written into its
own tmp directory as before (`step-N.tmp-<owner id><random>/node-F/`, so a writer
killed mid-write leaves only what its owner's sweep removes, owners.py); once they are
all durable, the node `mkdir`s the shared directory (a node that finds it made goes on:
every node races to make it), renames its folder into it in one rename, and only then
is its lead told (crash point `part_written` is after the rename). A folder already in
the slot (an abandoned attempt's, whose name could only be the same by a collision of
the hash, or a relaunch whose lead could not join its session in time) makes the rename
fail (a directory is never renamed over a non-empty one): that node's save fails, and
the retry has a new name. The node's own tmp directory stays, empty, until it hears the
outcome: it is the mark that a live writer still has step N under way (below).

The leader's side (`commit.gather_nodes`). It commits from the directory its own node
announced (its writer checks that it is where its node's folder went). It lists that
directory once: it must hold exactly the announced nodes' folders and nothing else.
Each node checked its own folder's files (a part file and one data file a rank, nothing
else) before it moved it, and the root manifest carries each part file's size and
checksum, which a reader checks, as it checks every data file against its part. Then
the manifest, one rename to `step-N/`, the root's fsync: the leader's work no longer
grows with nodes.

Failure and sweeping. Once a node's folder is in the shared directory, its node never
deletes it (the leader may hold the claim to commit it: a node told of a failure by a
watch that gave up on a slow leader must not pull a folder out from under its rename).
The leader's writer removes the shared directory when the save fails (`drop`: renamed
to a fresh tmp name first, then deleted, so that no deletion can reach a directory that
has become the step), and any writer's sweep of dead writers' leftovers
(`owners.sweep_dead`: at its start, after a commit, after each failed coordinated step)
removes a shared directory of step N once no tmp directory of step N of a live writer is
left in the root: every node with the save under way holds one, from its first rank's
begin until it hears the outcome. So a job restarted after a crash, whose first saves
have the ids and so the names of the crashed job's, finds them gone. A node that wakes late
from an aborted save and puts its folder into the aborted save's shared directory
(making it again) is swept the same way; it can never reach a step: the committed
save's directory had another name.

The committed layout is unchanged (`step-N/manifest.json`, `step-N/node-F/...`): what a
reader sees does not say whether the nodes shared a tmp directory. Only a root that is
a local (or network-mounted) directory shares one; an object store has no rename, and
each node writes where its files stay (storage/s3keys.py).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

from asyncckpt.errors import SaveFailedError
from asyncckpt.format.layout import step_dir_name, tmp_step_of
from asyncckpt.runtime import faults
from asyncckpt.storage.base import Storage
from asyncckpt.storage.paths import Location

SHARED_HEX = 24  # hex digits after `.tmp-`: a writer's own tmp dirs have 16, others 8
_SHARED = re.compile(r"step-[0-9]+\.tmp-[0-9a-f]{" + str(SHARED_HEX) + "}")


def shared_name(step: int, save: int, world_size: int, launch: str | None = None) -> str:
    """The shared tmp directory's name for save `save` (its ranks' save id) of `step` by
    launch `launch` of the job (the begin's; None: an older rank's begin, without it)."""
    text = f"asyncckpt {step} {save} {world_size}" + (f" {launch}" if launch else "")
    digest = hashlib.blake2b(text.encode(), digest_size=SHARED_HEX // 2).hexdigest()
    return f"{step_dir_name(step)}.tmp-{digest}"


def is_shared(name: str, step: int | None = None) -> bool:
    """`name` is a shared tmp directory's (of `step`, if given)."""
    if _SHARED.fullmatch(name) is None:
        return False
    return tmp_step_of(name) is not None and (step is None or tmp_step_of(name) == step)


def place(storage: Storage, tmp_dir: Location, step: int, node_dir: str,
          shared: str | None) -> str:
    """A node's side: move its durable folder `node_dir` from its own tmp directory
    `tmp_dir` into the save's shared directory `shared` (made if no node made it yet),
    in one rename. Returns the name the node's lead announces: `shared`, or `tmp_dir`'s
    own name where nothing is shared (no name given, or a root that is not a directory).

    Raises:
        SaveFailedError: the shared name is unusable (not a directory of this step, or a
            symlink or file there), or the node's slot in it is taken.
        OSError: the directory cannot be made or the folder moved.
    """
    root = storage.local_dir()
    if root is None or shared is None:
        return tmp_dir.name
    if not is_shared(shared, step):
        raise SaveFailedError(f"{shared!r:.80} is not a shared tmp directory of step {step}",
                              step=step)
    target = root / shared
    try:
        os.mkdir(target)
    except FileExistsError:  # another node made it first
        if not stat.S_ISDIR(os.lstat(target).st_mode):
            raise SaveFailedError(f"{target} is not a directory", step=step,
                                  file=str(target)) from None
    faults.io("rename", target / node_dir)
    try:
        os.rename(Path(os.fspath(tmp_dir)) / node_dir, target / node_dir)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise SaveFailedError(f"{target / node_dir} is taken (an abandoned save's folder "
                              "of the same name): this save fails, its retry has a new name",
                              step=step, file=str(target / node_dir)) from None
    return shared


def check_listing(names: set[str], folders: set[str], step: int, directory: Location) -> None:
    """The leader's one check of the shared directory: it holds exactly the announced
    nodes' `folders`.

    Raises:
        SaveFailedError: a folder is missing, or something else is there.
    """
    missing, other = sorted(folders - names), sorted(names - folders)
    if missing or other:
        raise SaveFailedError(
            f"{directory} does not hold exactly the announced nodes' folders"
            + (f": missing {missing[:5]!r}" if missing else "")
            + (f"; it also holds {other[:5]!r}" if other else ""),
            step=step, file=str(directory))


def drop(storage: Storage, step: int, name: str) -> None:
    """Remove shared directory `name` of `step` (a failed save's, on the leader's
    writer): renamed to a fresh tmp name, then deleted, so that the deletion cannot reach
    a directory that became the step meanwhile. Gone already: nothing to do."""
    root = storage.local_dir()
    if root is not None and is_shared(name, step):
        remove(root, name)


def remove(root: Path, name: str) -> bool:
    """Rename `root`/`name` aside (a tmp name of its step, 8 hex) and delete it; False
    if it was not there."""
    aside = root / f"{name.rsplit('.tmp-', 1)[0]}.tmp-{secrets.token_hex(4)}"
    try:
        os.rename(root / name, aside)
    except FileNotFoundError:
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True
