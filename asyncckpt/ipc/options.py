"""A save's options, as one value from `save()` to the committer.

What a caller asks of one save besides its state -- how many committed steps to keep,
which to protect, whether to replace a committed step, which timeline it begins --
travels unchanged from the
rank's `save()` through the begin message to the writer's step table and its committer.
Carried as loose parameters it was re-declared in five constructors and checked in
three places, each slightly differently; here it is one frozen value, checked once when
it is made, so every holder can trust it. Both processes import this module.

The step-range rule (`check_step`) lives here too: a step number, `keep_from`, and
retention's counts are all bounded by the manifest's integer bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncckpt.format.layout import MAX_STEP
from asyncckpt.format.timeline import TimelineStart

MAX_KEEP_STEPS = 64  # keep_steps: a few pointers at steps, not a listing of the root
TIERS = ("durable", "memory")  # where a save goes: the root, or the writers' memory tier


def is_step(value: Any) -> bool:
    """True for an int in 0..MAX_STEP (not a bool)."""
    return type(value) is int and 0 <= value <= MAX_STEP


def check_step(value: Any, name: str = "step") -> int:
    """`value`, if it is a step number (an int in 0..MAX_STEP).

    Raises:
        ValueError: not an int, a bool, or out of range; the message names `name`, the
            rule and the value received.
    """
    if not is_step(value):
        raise ValueError(f"{name} must be an int in 0..{MAX_STEP}; got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SaveOptions:
    """What one save asks besides its state.

    Attributes:
        keep_last: after the commit, delete all but the newest `keep_last` committed
            steps (0 keeps all); None leaves it to the writer's own `keep_last` knob.
        keep_every: with `keep_last`: steps that are multiples of it are kept (0: none);
            without `keep_last` it is ignored (read as 0).
        keep_from: retention after this commit deletes no step from this one on.
        keep_steps: retention after this commit deletes none of these steps, whatever
            their age (a framework's "best" checkpoint), abandoned ones neither; they
            are not counted in `keep_last`. At most MAX_KEEP_STEPS.
        replace: a committed step of this number is replaced by this save (a committed
            step of an abandoned timeline is replaced without it: format/timeline.py).
        timeline: this save begins the timeline a restore started, if that is not the
            root's current one yet (None: the save continues the root's current one).
        tier: "durable" (a committed step in the root) or "memory" (a generation held
            in the node writer's memory tier, writer/memory_tier.py; retention, replace
            and the keeps do not apply to it).
    Raises:
        ValueError: a count or step that is not an int in 0..MAX_STEP, more than
            MAX_KEEP_STEPS `keep_steps`, a `replace`
            that is not a bool, a `timeline` that is not a TimelineStart, or a `tier`
            not in TIERS (made from a caller's values: checked once, here).
    """

    keep_last: int | None = None
    keep_every: int = 0
    keep_from: int | None = None
    replace: bool = False
    timeline: TimelineStart | None = None
    tier: str = "durable"
    keep_steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.keep_last is not None:
            check_step(self.keep_last, "keep_last")
        check_step(self.keep_every, "keep_every")
        if self.keep_from is not None:
            check_step(self.keep_from, "keep_from")
        if not isinstance(self.keep_steps, tuple) or len(self.keep_steps) > MAX_KEEP_STEPS:
            raise ValueError(f"keep_steps must be a tuple of at most {MAX_KEEP_STEPS} steps; "
                             f"got {self.keep_steps!r:.80}")
        for kept in self.keep_steps:
            check_step(kept, "keep_steps")
        if type(self.replace) is not bool:
            raise ValueError(f"replace must be a bool; got {self.replace!r}")
        if self.timeline is not None and not isinstance(self.timeline, TimelineStart):
            raise ValueError(f"timeline must be a TimelineStart or None; got "
                             f"{self.timeline!r:.80}")
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}; got {self.tier!r:.80}")
        if self.keep_last is None and self.keep_every:  # no retention of its own: ignored
            object.__setattr__(self, "keep_every", 0)

    @property
    def retention(self) -> tuple[int, int] | None:
        """(keep_last, keep_every) when this save names its own retention, else None."""
        return None if self.keep_last is None else (self.keep_last, self.keep_every)

    def with_retention(self, default: tuple[int, int]) -> tuple[int, int]:
        """(keep_last, keep_every) to apply after the commit: this save's, else `default`
        (the writer's knobs)."""
        return self.retention or default


NO_OPTIONS = SaveOptions()  # a save that asks nothing beyond its state
