"""Restore from the memory tier: the newest generation every rank can read, or nothing.

`Checkpointer.restore()` asks this first. Each rank asks its own node writer which
generations it holds and where its replica server is; the ranks gather those listings
(which writer holds which rank's image of which step, whole) and agree on the newest
step that every rank of that step's world is held whole at by some writer of the job,
and that every rank can read: its own image, or the whole world to reshard, each from
its own writer or, at three nodes or more, fetched by its own writer from the writer
that holds it (writer/memory_fetch.py, over the replica transport; every frame
checked). Each rank opens its writer's images, the ranks exchange their manifest
entries so that every rank builds the whole world's manifest, and each loads, every
frame verified; an image its writer lacks is fetched when the load first opens it. Any
failure on any rank -- no writer, nothing held, a fetch refused, a frame that fails its
checksum -- makes every rank answer None together, each naming the step, the ranks that
failed and why, and the caller falls back to the durable tier: the ranks never resume
from different tiers or steps. Nor is any caller's state left half-made: each rank
loads into staging tensors (read/staging.py) and copies them into its targets only once
every rank said its load, every frame verified, succeeded. A generation older
than the newest durable step is not taken either, nor one of a writer whose listing
names another root (an address meant for another job's root, or a second root's).

Timelines: a generation saved after a restore carries the timeline its run began
(`TimelineStart`), which abandons the root's steps above its fork only at that run's
first durable commit. Until then the root's newest steps are of the history the run
left: a generation of a run that forked from the root's current timeline is newer than
every root step above its fork, whatever their numbers (a run that resumed from 4 and
saved 5 to memory holds the 5 to resume, not the abandoned run's committed 5), and the
restore carries its timeline on (`FromMemory.start`) so that the next commit abandons
them. A generation of a run whose fork another run overtook (the root's timeline moved
on since it read it: its commit would be refused) is not taken.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from asyncckpt.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.format.timeline import Timeline, TimelineStart
from asyncckpt.ipc.protocol import same_root
from asyncckpt.read import memory, staging
from asyncckpt.read.checkpoint import Checkpoint
from asyncckpt.storage.paths import Location
from asyncckpt.torchutil.agree import gather, outcome
from asyncckpt.torchutil.ranks import resolve_rank

__all__ = ["FromMemory", "restore_memory"]

log = logging.getLogger("asyncckpt.checkpointer")


@dataclass(frozen=True)
class Plan:
    """A step the ranks restore from memory, and where each image of it is held.

    step, world_size: the generation and its saved world.
    held: per writer (its key, `_view`), the ranks of the step it holds whole.
    sources: per saved rank, (its node's first rank, the replica server of a writer that
        holds that node whole): where a writer lacking it fetches it from.
    """

    step: int
    world_size: int
    held: dict[str, list[int]]
    sources: dict[int, tuple[int, str]]
    timeline: Any = None  # the generation's timeline as its writers list it (JSON)


class FromMemory(NamedTuple):
    """A generation restored: its step, the loaded state, and the timeline its run
    began (None: saved in the root's current timeline), which the restoring job's saves
    carry on."""

    step: int
    state: Any
    start: TimelineStart | None


def _view(address: str, found: memory.Listing) -> dict[str, Any]:
    """What a rank tells the others about its writer: a key naming the writer (this
    host and the writer's address: a replica server bound to loopback may have the same
    address on every host), where it can be fetched from, whether it can fetch, and its
    generations."""
    return {"writer": f"{socket.gethostname()}:{address}",
            "replica": found.replica, "fetch": found.fetch, "held": found.generations}


def _plan(views: list[dict[str, Any] | None], world: int, only: int | None = None) -> Plan | None:
    """The newest step every rank can restore (step `only`, if given), given every
    rank's `_view` (None: that rank has no writer listing), in rank order; None when
    there is none. The same on every rank: it depends on the gathered views only."""
    if not views or any(v is None for v in views):
        return None
    ranks_views = [v for v in views if v is not None]
    writers: dict[str, dict[str, Any]] = {}
    for v in ranks_views:
        writers.setdefault(v["writer"], v)
    steps = {g.get("step") for v in writers.values() for g in v["held"]}
    for step in sorted((s for s in steps if type(s) is int and only in (None, s)), reverse=True):
        plan = _plan_at(step, writers, ranks_views, world)
        if plan is not None:
            return plan
    return None


def _plan_at(step: int, writers: dict[str, dict[str, Any]], views: list[dict[str, Any]],
             world: int) -> Plan | None:
    """`step` as a `Plan`, when usable: every writer that lists it agrees on its world
    and timeline (never images of two runs), every rank of its world is held whole by
    some writer, and each rank `me` of this world can read what its load needs -- its
    own image when the worlds are the same, else every rank's -- from its own writer or
    fetched by it (its writer can fetch, and a writer holding that node has a server)."""
    gens = {key: g for key, v in writers.items() for g in v["held"] if g.get("step") == step}
    facts = {(g.get("world_size"), json.dumps(g.get("timeline"), sort_keys=True))
             for g in gens.values()}
    saved = next(iter(gens.values())).get("world_size")
    if len(facts) != 1 or type(saved) is not int or saved < 1:
        return None
    everyone = set(range(saved))
    held = {key: {r for r in g.get("ranks", ()) if type(r) is int} & everyone
            for key, g in gens.items()}
    if set().union(*held.values()) != everyone:
        return None
    sources: dict[int, tuple[int, str]] = {}
    for key, g in gens.items():
        replica = writers[key]["replica"]
        for node in g.get("nodes", ()) if replica else ():
            if (isinstance(node, list) and len(node) == 2 and all(type(x) is int for x in node)
                    and node[1] >= 1 and all(r in held[key] for r in range(*_span(node)))):
                for r in range(*_span(node)):
                    sources.setdefault(r, (node[0], replica))
    for me, v in enumerate(views):
        can = held.get(v["writer"], set()) | (set(sources) if v["fetch"] else set())
        if not ((saved == world and me in can) or can >= everyone):
            return None
    return Plan(step, saved, {k: sorted(h) for k, h in held.items()}, sources,
                next(iter(gens.values())).get("timeline"))


def _floor(plan: Plan, newest: int | None, current: Timeline | None
           ) -> tuple[int | None, bool, bool]:
    """(The oldest step `plan` may be, given the root's newest durable step `newest`;
    whether its timeline rules it out; whether it is of a run that forked from `current`
    and has not committed since) under the root's `current` timeline (None: not read).
    See the module docstring."""
    if plan.timeline is None:
        return newest, False, False
    try:
        start = TimelineStart.from_json(plan.timeline)
    except (ValueError, TypeError):  # a listing is another process's word
        return newest, True, False
    if current is None or start.id == current.id:
        return newest, False, False  # the root's current timeline already (committed)
    if start.based_on != current.gen:
        return newest, True, False  # another run's timeline overtook it: never committed
    return (None if newest is None else min(newest, start.at)), False, True


def _span(node: list[int]) -> tuple[int, int]:
    return node[0], node[0] + node[1]


def restore_memory(root: Location, address: str | None, rank: int | None, newest: int | None,
                   into: Callable[[], Any], keys: set[str], *,
                   expected: bool, only: int | None = None,
                   current: Timeline | None = None, forked_only: bool = False,
                   read: Callable[[Checkpoint], Any] | None = None) -> FromMemory | None:
    """Load the newest memory generation every rank holds, when it is at least `newest`
    (with `only`: generation `only`, or nothing).

    Every rank of the job must call it (it runs collectives whatever happens on it).

    Args:
        root: the checkpoint root (names the images' manifest, as a disk step would).
        address: this rank's node writer (None: none known; this rank holds nothing).
        rank: this rank (None: from torch.distributed or the environment).
        newest: the newest durable step (None: none); an older generation is not taken.
        into: makes the targets the load fills in place (as `load(into=)`); called only
            when a generation is loaded. They are written only after every rank loaded
            (into staging) and verified its part: a failure anywhere leaves them as
            they were. Hazard: making a sharded optimizer's state dict
            initialises its state (DCP's `get_optimizer_state_dict`), which changes the
            next steps of a fresh optimizer: never make it when nothing is loaded.
        keys: the top-level keys of the state to load.
        expected: memory saves were configured: say at WARNING when none is usable.
        only: the step to load (a framework that resumes at the step its own records
            name: the verl drop-in); None: the newest.
        current: the root's current timeline, read before the listings (None: timelines
            not judged): a generation of a run that forked from it is newer than the
            root's steps above its fork; one of a run overtaken is not taken.
        forked_only: take only a generation of such a run (the caller loads the root's
            copy of the step otherwise: `only` is committed there too).
        read: loads this rank's state from the opened generation instead of `load(into=)`
            of `into()` and `keys` (DCP's planner: integrations/dcp_memory.py); it must
            run no collective (the ranks agree on its outcome afterwards). What it
            writes in place is its own affair: to leave the caller's state untouched on
            a failure, load through `staging.stage` and return the `Staged`, which is
            committed once the ranks agree.
    Returns:
        The step, the loaded state and the timeline to carry on, the same on every
        rank; None on every rank when no
        usable generation is held everywhere or its load failed on any rank (said at
        WARNING, on every rank, with the step, the ranks that failed and their errors;
        the caller falls back to the durable tier), the targets then untouched --
        except those loaded in place (global tensors on an accelerator, staging.py),
        which the durable tier's load then writes whole.
    Raises:
        CheckpointError: copying the verified state into the targets failed on some
            rank, after every rank had agreed (on every rank alike); or a load that failed may have
            written targets loaded in place and there is no durable step (`newest`
            None) to write them whole: on every rank alike.
    """
    view = None
    if address is not None:
        try:
            found = memory.listing(address)
            if found.root and not same_root(found.root, str(root)):
                log.warning("asyncckpt: the writer at %s serves root %s, not %s: none of "
                            "its memory generations is restored", address, found.root, root)
            else:
                view = _view(address, found)
        except (CheckpointError, OSError, EOFError, ValueError) as e:
            log.warning("asyncckpt: restore cannot ask the writer at %s for memory "
                        "generations: %s", address, e)
    me, world = resolve_rank(rank)
    plan = _plan(gather(view), world, only)
    step = plan.step if plan is not None else None
    floor, overtaken, forked = (_floor(plan, newest, current) if plan is not None
                                else (newest, False, False))
    if forked_only and not forked:
        plan = None  # the caller loads the root's copy
    if plan is None or step is None or overtaken or (floor is not None and step < floor):
        if expected:
            log.warning("asyncckpt: no memory generation %s: restoring from the durable "
                        "tier (newest step %s)", (
                            "held for every rank" if only is None else
                            f"{only} held for every rank") if step is None
                        else f"newer than the durable step (memory {step})", newest)
        return None
    images, state = None, None
    error: BaseException | None = None
    fetched: list[memory.Images] = []
    try:
        assert address is not None and view is not None  # else no plan
        mine = plan.held.get(view["writer"], [])
        images = (memory.open_images(address, plan.step, mine) if mine
                  else memory.Images(plan.step, plan.world_size, {}))
        parts = images.parts
    except Exception as e:  # every rank must reach the gather below, whatever failed
        parts, error = {}, e
    # the ranks exchange their entries and whether their images opened: one that did
    # not (its writer gone, the generation dropped) fails the restore before any load
    exchanged = gather((parts, outcome(error), _cause(error)))
    failed = _failures([(verdict, cause) for _, verdict, cause in exchanged])
    if failed:
        if images is not None:
            images.close()
        _fall_back(plan.step, failed, newest)
        return None
    merged: dict[int, dict[str, Any]] = {}
    for theirs, _, _ in exchanged:
        merged.update(theirs)

    def fetch(wanted: int) -> dict[int, int]:
        """Rank `wanted`'s node's images, fetched by this rank's writer."""
        if wanted not in plan.sources or address is None:
            return {}
        node, source = plan.sources[wanted]
        got = memory.fetch_images(address, plan.step, node, source)
        fetched.append(got)
        if got.world_size != plan.world_size or wanted not in got.fds:
            raise CorruptCheckpointError(f"fetched node {node}'s images from {source}: of "
                                         f"world {got.world_size}, ranks {sorted(got.fds)}",
                                         step=plan.step, rank=wanted)
        log.info("asyncckpt: rank %d's image of memory generation %d fetched from %s",
                 wanted, plan.step, source)
        return dict(got.fds)
    touched = False  # a staged load of global tensors on an accelerator writes them in
    # place (staging.py): its failure cannot go unsaid (a `read`'s is its caller's affair)
    try:
        if error is None and images is not None:
            with memory.open_checkpoint(root, images, merged, fetch=fetch) as ckpt:
                # into staging: the caller's targets are written only once every rank
                # has loaded and verified its part (staging.py)
                if read is not None:
                    state = read(ckpt)
                else:
                    targets = into()
                    touched = staging.in_place(targets)
                    state = staging.stage(
                        targets, lambda staged: memory.load(ckpt, rank, staged, keys))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        error = e  # every rank must reach the agreement below, whatever failed here
    finally:
        for held in [images, *fetched]:
            if held is not None:
                held.close()
    reports = gather((outcome(error), _cause(error), touched))
    failed = _failures([(verdict, cause) for verdict, cause, _ in reports])
    if failed:
        if newest is None and any(t for _, _, t in reports):
            raise CheckpointError(
                f"restore from memory generation {plan.step} failed on {failed}, and the "
                "targets it loads in place (global tensors on an accelerator) may be partly "
                "written: with no durable step to restore them from, the state is not the "
                "one it was", step=plan.step, rank=me)
        _fall_back(plan.step, failed, newest)
        return None
    if isinstance(state, staging.Staged):  # the copy can still fail on one rank (a
        # target that cannot take it): the ranks hear each other's, and all raise alike
        try:
            state, error = state.commit(plan.step, me), None
        except CheckpointError as e:
            error = e
        failed = _failures(gather((outcome(error), _cause(error))))
        if failed:
            raise CheckpointError(
                f"copying memory generation {plan.step} into the targets failed on {failed}: "
                "the targets of the ranks that copied hold it, a failed rank's may be partly "
                "written", step=plan.step, rank=me) from error
    log.info("asyncckpt: restored step %d from the memory tier", plan.step)
    return FromMemory(plan.step, state, _start(plan.timeline))


def _fall_back(step: int, failed: str, newest: int | None) -> None:
    """Say that the restore of generation `step` failed (on every rank alike)."""
    log.warning("asyncckpt: restore from memory generation %d failed on %s: restoring "
                "from the durable tier (newest step %s)", step, failed, newest)


def _cause(error: BaseException | None) -> str:
    """What a rank tells the others of its load's failure ("": none)."""
    return "" if error is None else f"{type(error).__name__}: {error}"[:500]


def _failures(reports: list[tuple[int, str]]) -> str:
    """The ranks whose load failed and why, from every rank's (outcome, cause) in rank
    order ("": none failed); the same text on every rank."""
    return "; ".join(f"rank {r} ({cause or 'failed'})"
                     for r, (verdict, cause) in enumerate(reports) if verdict)


def _start(timeline: Any) -> TimelineStart | None:
    try:
        return None if timeline is None else TimelineStart.from_json(timeline)
    except (ValueError, TypeError):
        return None
