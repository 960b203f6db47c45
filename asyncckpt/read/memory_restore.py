"""Restore from the memory tier: the newest generation every rank can read, or nothing.

`Checkpointer.restore()` asks this first. Each rank asks its own node writer which
generations it holds; the ranks agree on the newest step that every one of them can
read (its own world's image of it, or a whole image of another world, to reshard); each
rank opens its writer's images, the ranks exchange their manifest entries so that every
rank builds the whole world's manifest, and each loads, every frame verified. Any
failure on any rank -- no writer, nothing held, a frame that fails its checksum -- makes
every rank answer None together, and the caller falls back to the durable tier: the
ranks never resume from different tiers or steps. A generation older than the newest
durable step is not taken either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from asyncckpt.errors import CheckpointError
from asyncckpt.read import memory
from asyncckpt.storage.paths import Location
from asyncckpt.torchutil.agree import gather, outcome, worst
from asyncckpt.torchutil.ranks import resolve_rank

__all__ = ["restore_memory"]

log = logging.getLogger("asyncckpt.checkpointer")


def _usable_steps(held: list[dict[str, Any]], me: int, world: int) -> set[int]:
    """The steps of `held` this rank can restore: its own world's generation holding its
    rank, or a generation whole for its own world (which a load reshards)."""
    return {g["step"] for g in held if type(g.get("step")) is int
            and ((g.get("world_size") == world and me in g.get("ranks", ()))
                 or sorted(g.get("ranks", ())) == list(range(g.get("world_size", 0))))}


def restore_memory(root: Location, address: str | None, rank: int | None, newest: int | None,
                   into: Callable[[], Any], keys: set[str], *,
                   expected: bool) -> tuple[int, Any] | None:
    """Load the newest memory generation every rank holds, when it is at least `newest`.

    Every rank of the job must call it (it runs collectives whatever happens on it).

    Args:
        root: the checkpoint root (names the images' manifest, as a disk step would).
        address: this rank's node writer (None: none known; this rank holds nothing).
        rank: this rank (None: from torch.distributed or the environment).
        newest: the newest durable step (None: none); an older generation is not taken.
        into: makes the targets the load fills in place (as `load(into=)`); called only
            when a generation is loaded. Hazard: making a sharded optimizer's state dict
            initialises its state (DCP's `get_optimizer_state_dict`), which changes the
            next steps of a fresh optimizer: never make it when nothing is loaded.
        keys: the top-level keys of the state to load.
        expected: memory saves were configured: say at WARNING when none is usable.
    Returns:
        (step, loaded state), the same step on every rank; None on every rank when no
        usable generation is held everywhere or its load failed on any rank (said at
        WARNING with the cause; the caller falls back to the durable tier).
    """
    held: list[dict[str, Any]] = []
    if address is not None:
        try:
            held = memory.generations(address)
        except (CheckpointError, OSError, EOFError, ValueError) as e:
            log.warning("asyncckpt: restore cannot ask the writer at %s for memory "
                        "generations: %s", address, e)
    me, world = resolve_rank(rank)
    common = set.intersection(*gather(_usable_steps(held, me, world)))
    step = max(common) if common else None
    if step is None or (newest is not None and step < newest):
        if expected:
            log.warning("asyncckpt: no memory generation %s: restoring from the durable "
                        "tier (newest step %s)", "held on every rank" if step is None
                        else f"newer than the durable step (memory {step})", newest)
        return None
    images, state, error = None, None, None
    try:
        images = memory.open_images(address or "", step)
        parts = images.parts
    except Exception as e:  # every rank must reach the gather below, whatever failed
        parts, error = {}, e
    merged: dict[int, dict[str, Any]] = {}
    for theirs in gather(parts):
        merged.update(theirs)
    try:
        if error is None and images is not None:
            with memory.open_checkpoint(root, images, merged) as ckpt:
                state = memory.load(ckpt, rank, into(), keys)
    except Exception as e:
        error = e
    finally:
        if images is not None:
            images.close()
    if worst(outcome(error)):
        log.warning("asyncckpt: restore from memory generation %d failed%s: restoring "
                    "from the durable tier (newest step %s)", step,
                    f": {error}" if error else " on another rank", newest)
        return None
    log.info("asyncckpt: restored step %d from the memory tier", step)
    return step, state
