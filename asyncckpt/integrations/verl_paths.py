"""Where the verl drop-in puts a step, and how the ranks of one save agree on it.

Everything a save writes stays under the directory the user gave, so that removing that
directory removes the checkpoint, and two runs in two directories never share a root.
For verl's trainer layout, `local_path` = `DIR/global_step_N/<role>` (DIR is verl's
`default_local_dir`), the root is `DIR/asyncckpt/<role>`: one root per role for every
step, so steps can reference each other's bytes and retention sees them all. Any other
`local_path` (verl's own test saves to `tempfile.mkdtemp()/checkpoint`) holds its root
inside itself, `local_path/asyncckpt`; there is no trainer layout, so no tracker file.
The writer's log sits beside its root (`<root>.writer.log`, `start_writer`'s default),
never inside it.

The directory may be an object-store prefix (`s3://bucket/run/global_step_N/actor`):
the same layout, with objects for the marker, the tracker and `huggingface/` (written
locally, then uploaded), and the writer's log in the temporary directory.

One path per save. The ranks of one save (or load) may name different `local_path`s:
verl's test calls `tempfile.mkdtemp()` on every rank, and verl's manager copes because
each rank writes its own files into its own path. An asyncckpt step is one root written
by one writer per node, so it lives in one place only: the ranks agree on rank 0's path
(one `all_gather_object`, before anything is written or read) and a WARNING names the
paths that differ. Agreeing rather than failing keeps verl's own test, and launchers
that compute per-rank scratch paths, running as they run with verl's manager; failing
would leave them no way to comply short of editing them. What cannot be agreed on fails
on every rank at once with the same message (`agree`): ranks saving different steps, or
some ranks passing None. Hazard: rank 0's path must be reachable from every node, as
any root of a several-node job is (a node whose root is not the shared directory is
detected by the writers' coordination).
"""

from __future__ import annotations

import json
import posixpath
import re
from pathlib import PurePosixPath

from asyncckpt.errors import CheckpointError, CheckpointNotFoundError, SaveFailedError
from asyncckpt.storage.location import Location, is_dir, read_bytes, root_path

TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "asyncckpt.json"
ROOTS = "asyncckpt"
_STEP_DIR = re.compile(r"global_step_(\d+)")

# what each rank of a save or load gathers: (absolute path, step, keep_from, failures)
Gathered = tuple[str | None, int | None, int | None, list[str]]


def agree(verb: str, everyone: list[Gathered]) -> tuple[Location | None, str]:
    """What the ranks of one save (`verb` "save") or load agree on, from each rank's
    (absolute local_path or None, step, anything): rank 0's path (None when no rank
    has one), and a description of the paths that differ from it ("" when none do).

    Every rank calls it on the same gathered list, so every rank returns or raises alike.
    Raises:
        SaveFailedError (save), CheckpointError (load): the ranks name different steps,
            or some ranks passed None and others a path.
    """
    failed = SaveFailedError if verb == "save" else CheckpointError
    first, step = everyone[0][0], everyone[0][1]
    if any(entry[1] != step for entry in everyone):
        shown = ", ".join(f"rank {r}: {entry[1]}" for r, entry in enumerate(everyone))
        raise failed(f"the ranks {verb} different steps ({shown}); every rank must {verb} "
                     "the same global_step", step=step)
    given = [r for r, entry in enumerate(everyone) if entry[0] is not None]
    if given and len(given) < len(everyone):
        none = [r for r, entry in enumerate(everyone) if entry[0] is None]
        raise failed(f"local_path is None on rank(s) {_ranks(none)} but rank {given[0]} names "
                     f"{everyone[given[0]][0]}: every rank must {verb} the same step", step=step)
    if first is None:
        return None, ""
    differ = [(r, entry[0]) for r, entry in enumerate(everyone) if entry[0] != first]
    if not differ:
        return root_path(first), ""
    shown = "; ".join(f"rank {r}: {p}" for r, p in differ[:3])
    more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
    return root_path(first), (f"the ranks name different local paths for one {verb} "
                              f"({shown}{more}); every rank uses rank 0's, {first}")


def _ranks(ranks: list[int]) -> str:
    more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    return ", ".join(map(str, ranks[:8])) + more


def trainer_dir(local_path: Location) -> Location | None:
    """verl's `default_local_dir` (DIR) of `DIR/global_step_N/<role>`, else None."""
    local_path = local_path.absolute()
    return local_path.parent.parent if _STEP_DIR.fullmatch(local_path.parent.name) else None


def root_of(local_path: Location) -> Location:
    """The asyncckpt root a save to `local_path` writes (absolute): `DIR/asyncckpt/<role>`
    for verl's `DIR/global_step_N/<role>`, else `local_path/asyncckpt`."""
    local_path = local_path.absolute()
    base = trainer_dir(local_path)
    return base / ROOTS / local_path.name if base is not None else local_path / ROOTS


def relative_root(root: Location, local_path: Location) -> str:
    """`root` as the marker in `local_path` names it: relative, so that the directory
    can be moved with its root."""
    return posixpath.relpath(_posix(root), _posix(local_path))


def _posix(path: Location) -> str:
    return str(PurePosixPath(*path.parts))  # an object store's too: its bucket first


def _joined(local_path: Location, relative: str) -> Location:
    return (local_path / relative).resolve()  # an object store's: `..` taken lexically


def locate(local_path: Location) -> tuple[Location, int | None]:
    """The root and step `local_path` stands for: its marker, else the layout's rule
    (step None: the root's newest, for a directory not named DIR/global_step_N/<role>).

    Raises:
        CheckpointNotFoundError: no marker, no root inside, and not verl's layout; or a
            marker that does not parse.
    """
    marker = local_path / MARKER
    text = read_bytes(marker)
    if text is not None:
        try:
            body = json.loads(text)
            return _joined(local_path, body["root"]), int(body["step"])
        except (OSError, ValueError, KeyError, TypeError) as e:  # one message on every rank
            raise CheckpointNotFoundError(f"{marker} is not an asyncckpt marker "
                                          f"({type(e).__name__}: {e})", file=str(marker)) from None
    match = _STEP_DIR.fullmatch(local_path.absolute().parent.name)
    if match is not None:
        return root_of(local_path), int(match.group(1))
    if is_dir(local_path / ROOTS):
        return root_of(local_path), None
    raise CheckpointNotFoundError(f"{local_path} holds no asyncckpt-saved verl step (no {MARKER}, "
                                  f"no {ROOTS}/) and is not named DIR/global_step_N/<role>",
                                  file=str(local_path))


def holds(path: Location, root: Location | None) -> bool:
    """Whether removing `path` would remove `root` (it is the root or above it)."""
    if root is None:
        return False
    path, root = path.absolute(), root.absolute()
    return path == root or path in root.parents


def read_tracker(local_path: Location) -> int | None:
    """The step verl's tracker file beside `local_path`'s step names, if it names one."""
    base = trainer_dir(local_path)
    try:
        text = read_bytes(base / TRACKER) if base is not None else None
        return int(text.decode().strip()) if text is not None else None
    except (OSError, ValueError):
        return None

