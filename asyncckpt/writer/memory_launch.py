"""Which launch of the job saves on this node: a new launch taking over a writer's rule.

A new launch of the job (a relaunch after a node loss, shrunk below MIN_NODES or
not) need not run a commit, and a lead's greeting cannot take over a session's tag
(a stale lead's could). But its saves can: a node lead's memory begin names its
launch (a hash of its coordination session, as a session tag's first part names its
own: `tag_launch`), and only a launch that runs saves its ranks' memory now -- a stale
lead's ranks are killed. So a begin under a launch other than the one whose session
this writer runs ends that session's rule at once (`launched`): the writer takes the
greeting that new launch's lead sent it, if one came (the job-wide rule under it,
until its session's tag or its LOCAL), else the node-local rule; the old launch's
word is ignored from then on (`_left`). The step committed under the old session is
kept until a generation of the new launch covers it (`kept`), never dropped for an
older launch's uncommitted one.

This is the writer's bookkeeping of launches -- which one saves, which ones newer ones
replaced, the greetings and LOCALs their leads sent while another ran, the step kept
across the change -- and how a tag names its launch (`tag_launch`). It is a base of
memory_commit.JobCommit, apart from the session's word (what a lead says a session
committed and settled), which it only resets when a launch takes over.
"""

from __future__ import annotations

import hashlib
import logging
import re

log = logging.getLogger("asyncckpt.writer")
STALE_KEPT = 8  # sessions left behind by a rerun (launches left, greetings), whose word is ignored
GREET = "greet/"  # the tag a lead greets its writer under (rank/memory_commit.py `_greet`)
OLD_GREET = "start/"  # the tag a lead of 0.4.5 greets its writer under (its LOCAL has no scope)
_SESSION = re.compile("[0-9a-f]{16}")  # a coordination session (rank/coordination.py)
_LAUNCH = re.compile("[0-9a-f]{1,64}")  # a begin's launch (ipc/messages.py)


class Launches:
    """The launches a writer saw save (a base of memory_commit.JobCommit, which owns the
    session's word declared here; no lock: the tier's is held)."""

    session: str | None
    settled: int
    committed: int | None
    _newest: int
    _held_back: float | None
    _word: tuple[int, int]
    _fell: list[str]
    _fell_word: dict[str, tuple[int, int]]

    def __init__(self) -> None:
        self._saving: str | None = None  # the launch this node's memory saves began under
        self._left: list[str] = []  # launches a newer one's saves replaced (`launched`)
        self._greets: dict[str, str] = {}  # launch -> the greeting its lead sent, ignored
        self._locals: list[str] = []  # scopes of the LOCALs ignored (`local_for`)
        self.kept: int | None = None  # the step committed when a new launch took over
        self._fresh: set[int] = set()  # the steps this node began since then

    def running(self) -> str | None:
        raise NotImplementedError

    def launched(self, launch: str | None) -> bool:
        """A rank of this node began a memory save under `launch` (its node lead's
        begin names it; None: another rank's, or a rank of 0.4.6 or older: nothing
        known). A launch other than the one whose session (or launch-named greeting)
        this writer runs is saving now, so that one is over: its word is ignored from
        now on, and the writer takes the greeting this launch's lead sent it (unless
        that lead's LOCAL came too), else the node-local rule, keeping the step
        committed so far until a generation begun from now on covers it (`kept`). A
        begin under a launch some newer launch replaced changes nothing (a stale rank).
        Whether the rule changed (the tier then prunes under its new rule)."""
        if launch is None or launch in self._left:
            return False
        before, self._saving = self._saving, launch
        if before is not None and before != launch:
            self._leave(before)
        current = self.running()
        own = tag_launch(current)
        if own is None or own == launch:  # its own launch's save, or nothing to tell by
            return False
        self._leave(own)
        greeting = self._greets.pop(launch, None)
        if greeting in self._locals:
            greeting = None  # its lead's LOCAL came first: the node-local rule
        self.session, self.settled, self._newest = greeting, -1, -1
        self._held_back, self._word = None, (-1, -1)
        if self.committed is not None:
            self.kept, self._fresh = self.committed, set()
        log.warning("asyncckpt: memory tier: a memory save began under launch %s, not the "
                    "one whose job-wide commit this writer ran (%r): a new launch of the "
                    "job saves now; %s (step %s, committed so far, kept until a newer "
                    "generation covers it)", launch, current,
                    f"its lead's greeting {greeting!r} taken" if greeting is not None
                    else "the node-local rule holds", self.committed)
        return True

    def keeps(self, step: int, newer: int) -> bool:
        """Whether `step`, covered by whole generation `newer` under the node-local
        rule, stays: the step committed before a new launch took over, while `newer`
        is not one that launch began (`launched`)."""
        return step == self.kept and newer not in self._fresh

    def _leave(self, launch: str) -> None:
        """`launch`'s saves were replaced by a newer launch's: its word goes."""
        if launch not in self._left:
            self._left = [*self._left, launch][-STALE_KEPT:]
        self._greets.pop(launch, None)
        self._fell = [s for s in self._fell if tag_launch(s) != launch]
        self._fell_word = {s: w for s, w in self._fell_word.items() if s in self._fell}

    def _gone(self, tag: str) -> bool:
        """Whether `tag` names a launch whose saves a newer launch's replaced."""
        launch = tag_launch(tag)
        return launch is not None and launch in self._left

    def _greeted(self, greeting: str) -> None:
        """A lead's greeting was ignored (`JobCommit.told`): taken if its launch's saves
        begin (`launched`)."""
        launch = tag_launch(greeting)
        if launch is not None:
            self._greets.pop(launch, None)
            self._greets[launch] = greeting
            while len(self._greets) > STALE_KEPT:
                del self._greets[next(iter(self._greets))]

    def _local_ignored(self, scope: str) -> None:
        """A LOCAL of `scope` was ignored (`JobCommit.told`): its launch's saves may begin
        next (`launched`)."""
        if scope:
            self._locals = [*self._locals, scope][-STALE_KEPT:]


def tag_launch(tag: str | None) -> str | None:
    """The launch a tag names (None: none known): a session's ("<session>/<run>"), the
    begin's `launch` of that coordination session (rank/client.py `launch_of`); a
    lead's greeting's, the launch it names ("greet/<nonce>/<launch>": a lead of 0.4.6
    names none)."""
    if tag is None:
        return None
    if tag.startswith(GREET):
        _, _, launch = tag[len(GREET):].partition("/")
        return launch if _LAUNCH.fullmatch(launch) else None
    session = tag.partition("/")[0]
    if not _SESSION.fullmatch(session):
        return None
    return hashlib.blake2b(f"asyncckpt launch {session}".encode(), digest_size=8).hexdigest()


def is_greeting(tag: str | None) -> bool:
    """Whether `tag` is a lead's greeting, this version's or 0.4.5's, or none at all: a
    tag of no session, which a greeting may replace (`JobCommit.told`)."""
    return tag is None or tag.startswith((GREET, OLD_GREET))
