"""The memory generations committed across the whole job: what a writer knows of it.

With two nodes, a writer that holds a newer whole generation of both nodes may drop the
older one: it holds the whole job. With three or more in a ring it may not: its own node
and the partner whose replicas it keeps are held at N+1, but another node's replica of
N+1 may still be on its way, and that node lost leaves no step that every rank can
restore from memory. So a generation is *committed* once every node of the job holds it
in two places -- its own writer's images, acked by its partner -- and a writer drops a
generation only once a newer one is committed (docs/MEMORY_TIER.md "Committed across
the job").

The writer cannot see the other nodes (it never talks to the job's store): each node's
lead rank asks it, after each memory save, how its node's generation of that step ended
(`JobCommit.report`), records that in the store, and tells the writer what the job
agreed (`told`): `committed`, the newest step every node holds in two places, and
`settled`, the newest step whose outcome is final on every node (rank/memory_commit.py).
A writer never told keeps the node-local rule (old ranks, one node, two nodes), and so
does one whose lead tells it LOCAL (the job runs no commit) -- taken only from the lead
whose tag it runs (`JobCommit.local_for`), and a lead's greeting never replaces a
session's tag, so a stale lead cannot turn a session off.

Per step of its own node the writer keeps one outcome: "pending" from the node's first
begin, then once and for all "two" (the partner acked the replica) or "not" (skipped,
failed, dropped, superseded before it was sent, no partner, the send failed). A final
outcome never changes, so what a lead reported stays true: a step reported "two" is
*promised* -- held here until a newer step is committed, never given up to make room --
and so is a generation holding a partner's replica received whole (its sender may have
reported it). A step that some node settled as "not" can never be committed: once
`settled` reaches it, it is no longer promised (else every node could wait for ever on a
step one of them skipped). This module holds that state; memory_tier.py applies it,
under the tier's lock.

A word that never comes (a node's lead that never reports: its node gone while the job
goes on, its rank or writer of an older version, its thread stopped) would hold a
promised generation for ever and skip every later save of this node. So once this node's
saves have been held back by a promise alone for SILENT_S with the job's word not moving,
the writer falls back to the node-local rule for that session (`fall_back`, logged at
WARNING): it keeps no promise, takes no word of the session, and answers its lead as a
writer without the job-wide commit does -- nothing held in two places, every step
settled -- so that the other nodes give its steps up instead of waiting for them. What
is lost then: a step committed across the job may be dropped here before a newer one is
(docs/MEMORY_TIER.md "Committed across the job").

A new launch of the job (a relaunch after a node loss, shrunk or not) ends the rule of
the session it replaces once its saves begin: memory_launch.py, a base of `JobCommit`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from asyncckpt.ipc.memory_messages import LOCAL, MAX_COMMIT_WAIT_S
from asyncckpt.writer.memory_launch import OLD_GREET, STALE_KEPT, Launches, is_greeting
from asyncckpt.writer.memory_launch import tag_launch as tag_launch  # this module's name too

if TYPE_CHECKING:
    from asyncckpt.writer.memory_generation import Generation

log = logging.getLogger("asyncckpt.writer")
PENDING, TWO, NOT = "pending", "two", "not"
OUTCOMES_KEPT = 32  # final outcomes remembered (pending ones are always kept)
# how long saves may be held back by a promise while the job's word does not move, before
# the writer falls back to the node-local rule: the longest a lead's report may wait for
# its step to settle, so several of its rounds at the defaults (each at most its 120 s
# wait plus 2 x node_timeout for the word)
SILENT_S = MAX_COMMIT_WAIT_S
RERUN = "rerun"  # the session while the leads have not yet tagged a rerun's run


class JobCommit(Launches):
    """One writer's view of the job-wide commit (no lock: the tier's is held); which
    launch saves, and what a new one changes, Launches (memory_launch.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.session: str | None = None  # None: never told; the node-local rule holds
        self.committed: int | None = None
        self.settled = -1
        self.outcomes: dict[int, str] = {}  # this node's step -> outcome
        self._stale: list[str] = []  # sessions of runs abandoned by a rerun
        self._newest = -1  # the newest step this node began while the session was told
        self._held_back: float | None = None  # when a promise first held a save back
        self._fell: list[str] = []  # sessions this writer fell back from (`fall_back`)
        self._word = (-1, -1)  # the session's last word as told: (committed, settled)
        self._fell_word: dict[str, tuple[int, int]] = {}  # that word when it fell back

    @property
    def on(self) -> bool:
        return self.session is not None

    def began(self, step: int) -> None:
        """This node's ranks began `step` (an image made): pending until final."""
        self.outcomes.setdefault(step, PENDING)
        self._newest = max(self._newest, step)
        if self.kept is not None:  # (the newest only: `keeps` asks of generations held)
            self._fresh = {*sorted(self._fresh)[-OUTCOMES_KEPT:], step}
        self._trim()

    def final(self, step: int, two: bool) -> bool:
        """This node's `step` ended held in two places (`two`) or not; a final outcome
        never changes. Whether it changed now."""
        if self.outcomes.get(step, PENDING) != PENDING:
            return False
        self.outcomes[step] = TWO if two else NOT
        self._newest = max(self._newest, step)
        self._trim()
        return True

    def dropped(self, step: int) -> bool:
        """Generation `step` was dropped here: a pending own outcome is "not"."""
        if step == self.kept:
            self.kept, self._fresh = None, set()
        self._fresh.discard(step)
        return self.outcomes.get(step) == PENDING and self.final(step, False)

    def outcome(self, step: int) -> str:
        return self.outcomes.get(step, NOT)

    def told(self, session: str, committed: int, settled: int,
             held_whole: set[int], scope: str = "") -> bool:
        """A lead's word (-1: none known), checked against what this node knows: a
        committed step is taken only if it is one this node holds whole and reported
        held in two places (every node did, or it is no word of the job's: a hostile
        or corrupt one, from the future, would stall the writer), a settled step only
        up to this node's own (the job's is the oldest node's).

        Another session starts its word afresh, but the committed step stays kept
        until a newer one is committed (a restart: the step the job committed last
        is the one to fall back on, and the new session's first word cannot speak of
        it: a replaced node's fresh writer reports nothing). The outcomes stay too:
        they are facts of this node's generations, and the new run's first saves may
        end before its lead first speaks. The word of a session a rerun left behind is
        ignored. LOCAL is taken only from the lead that runs this writer's commit now
        (`local_for`, with `scope`). A lead's greeting replaces no session's tag, only
        none or another greeting: a stale lead's (of a killed launch, or paused before
        it greeted) comes after the session's and would then make its LOCAL match; the
        cost is a restarted job whose leads agree to run no commit, on a writer that
        ran a session: its LOCAL is not taken either, and the writer keeps that
        session's rule until that launch's saves begin (`launched`: the greeting, and
        a LOCAL of its scope, are remembered for then), or it falls back (`fall_back`).
        The word of a launch whose saves a newer launch's replaced is ignored. Whether
        it was taken."""
        if session in self._stale or self._gone(session) or (
                session == LOCAL and self._gone(scope)):
            return False
        if session in self._fell:  # its word moving on again: its leads came back
            before = self._fell_word.get(session, (-1, -1))
            if committed <= before[0] and settled <= before[1]:
                return False
            self._fell = [s for s in self._fell if s != session]
            self._fell_word.pop(session, None)
            self.session, self._word = session, before
            log.warning("asyncckpt: memory tier: the job's word on its memory commit moves "
                        "again (committed %d, settled %d): the job-wide rule holds again",
                        committed, settled)
        if session == LOCAL:  # the leads run no commit (rank/memory_commit.py): as never told
            if not self.local_for(scope):
                log.info("asyncckpt: memory tier: a 'local' memory_commit for %r ignored: "
                         "this writer runs the job-wide commit of %r", scope, self.session)
                self._local_ignored(scope)  # its launch's saves may begin next
                return False
            self.session, self.settled, self._held_back = None, -1, None
            return True
        if session != self.session and is_greeting(session) and not is_greeting(self.running()):
            log.info("asyncckpt: memory tier: a lead's greeting %r ignored: this writer runs "
                     "the job-wide commit of %r (its committed step kept until that session, "
                     "or another, commits a newer one, or the greeting's launch saves)",
                     session, self.session)
            self._greeted(session)  # taken if its launch's saves begin (`launched`)
            return False
        if session != self.session:
            self.session, self.settled, self._newest = session, -1, -1
            self._held_back, self._word = None, (-1, -1)
        self._word = (max(self._word[0], committed), max(self._word[1], settled))
        moved = (self.committed, self.settled)
        # both only move on: a word read late (two rounds published at once) must not
        # pair an older committed step with a newer settled one (`doomed` would then
        # give up a step that is committed)
        if (committed > (-1 if self.committed is None else self.committed)
                and self.outcomes.get(committed) == TWO and committed in held_whole):
            self.committed = committed
        self.settled = max(self.settled, min(settled, self.report(held_whole)[1]))
        if (self.committed, self.settled) != moved:
            self._held_back = None
        return True

    def local_for(self, scope: str) -> bool:
        """Whether a LOCAL of `scope` (the tag its lead greeted this writer under; "":
        a lead of 0.4.5, which names none) hands back the node-local rule: only while
        this writer runs that tag still (its lead has met no session since, or a rerun
        came before it did), or no tag at all. A stale lead -- of a launch killed while
        its agreement waited -- then cannot turn off the session that runs now, which
        would drop the step committed across the job; nor by greeting first, as a
        greeting never replaces a session's tag (`told`). A 0.4.5 lead tells LOCAL
        right after its own greeting, so a LOCAL of no scope is taken while the writer
        runs a 0.4.5 greeting (OLD_GREET): under a session's tag, or a newer lead's
        greeting, it is a stale client's."""
        current = self.running()
        if current is None:
            return True
        return current == scope if scope else current.startswith(OLD_GREET)

    def running(self) -> str | None:
        """The tag this writer runs (None: none, the node-local rule): a rerun's, before
        its leads tag it, is the one the rerun left."""
        if self.session == RERUN and self._stale:
            return self._stale[-1]
        return self.session

    def fell(self, session: str) -> bool:
        """Whether this writer fell back from `session`'s job-wide commit (`fall_back`)."""
        return session in self._fell

    def held_back(self, now: float) -> float:
        """A save was held back by a promise alone (memory_tier.py `_admit`): for how long
        saves have been, with the job's word not moving since."""
        if self._held_back is None:
            self._held_back = now
        return now - self._held_back

    def fall_back(self) -> str:
        """Give up the session's job-wide commit: the node-local rule from now on, until
        another session's word (a restarted job, a rerun's run) or a word of this one
        that moves past the last it gave (its leads were slow, not gone). Returns the
        session."""
        session = self.session or ""
        self._fell = [*self._fell, session][-STALE_KEPT:]
        self._fell_word = {s: w for s, w in self._fell_word.items() if s in self._fell}
        self._fell_word[session] = self._word
        self.session, self.settled, self._held_back = None, -1, None
        return session

    def rerun(self, step: int) -> None:
        """The job went back to `step`: what was known of `step` and newer belongs to
        the abandoned run, and so does the session's word when the abandoned steps were
        saved under it (its leads, seeing their steps go back, tag the rerun's anew). A
        new job that resumes below the old one's steps went back too, but under its own
        session, already told: that one stays (its leads see no step go back)."""
        for s in [s for s in self.outcomes if s >= step]:
            del self.outcomes[s]
        if self.session is not None and self._newest >= step:
            self._stale = [*self._stale, self.session][-STALE_KEPT:]
            self.session = RERUN  # on, until the leads' next word
        self._newest = min(self._newest, step - 1)
        self._held_back = None
        if self.committed is not None and self.committed >= step:
            self.committed = None  # a step committed below it is the rerun's too
        self.settled = -1

    def promised(self, step: int, replica_received: bool) -> bool:
        """Whether generation `step` may have been reported held in two places (this
        node's acked, or a partner's replica received whole) and can still commit."""
        return (self.outcomes.get(step) == TWO or replica_received) and not self.doomed(step)

    def doomed(self, step: int) -> bool:
        """`step` can never be committed: every node's outcome of it is final and it is
        newer than the committed step, so some node's was "not"."""
        return self.settled >= step and (self.committed is None or step > self.committed)

    def report(self, held_whole: set[int]) -> tuple[list[int], int]:
        """(This node's steps held in two places and still held whole here, the newest
        step whose outcome and every older one's are final, -1: none), for the lead."""
        two = sorted(s for s, o in self.outcomes.items() if o == TWO and s in held_whole)
        pending = [s for s, o in self.outcomes.items() if o == PENDING]
        settled = min(pending) - 1 if pending else max(self.outcomes, default=-1)
        return two[-8:], settled

    def _trim(self) -> None:
        done = sorted(s for s, o in self.outcomes.items() if o != PENDING)
        for s in done[:-OUTCOMES_KEPT]:
            del self.outcomes[s]


class Committing:
    """The memory tier's side of the job-wide commit (a base of memory_tier.MemoryTier,
    which owns these attributes and `_prune`)."""

    _lock: threading.Lock
    _gens: dict[int, Generation]
    job: JobCommit
    _settling: threading.Condition

    _closing = False  # the tier is closing: a waiting `commit_state` answers now

    def _prune(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._settling.notify_all()
        super().close()  # type: ignore[misc]  # Held.close, next in MemoryTier's order

    def replica_outcome(self, step: int, acked: bool) -> None:
        """The sender's last word on this node's generation `step` (memory_replicator.py):
        the partner acked it whole, or it was not sent (failed, refused, superseded by a
        newer one before its turn, dropped here meanwhile)."""
        with self._lock:
            self._final(step, acked)

    def commit_state(self, session: str, step: int, wait: float, committed: int,
                     settled: int, scope: str = "") -> tuple[str, list[int], int]:
        """A node lead's `memory_commit` (memory_commit.py): take the job's word, then
        wait up to `wait` s for this node's outcome of `step` (-1: none) to be final.
        `scope`: a LOCAL's (`JobCommit.local_for`). Returns (that outcome, "" for none;
        the node's steps held in two places; the newest step settled here)."""
        deadline = time.monotonic() + wait
        with self._lock:
            taken = self.job.told(session, committed, settled,
                                  {s for s, g in self._gens.items() if g.whole}, scope)
            if self.job.fell(session):  # as a writer without it: nothing two, all settled
                return (NOT if step >= 0 else ""), [], max([step, *self.job.outcomes])
            if taken:
                self._prune()
            outcome = ""
            if step >= 0:
                if step not in self.job.outcomes:  # never begun here (a writer restarted)
                    self.job.final(step, False)
                while (outcome := self.job.outcome(step)) == "pending":
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closing:
                        break
                    self._settling.wait(left)
            held = {s for s, g in self._gens.items() if g.whole}
            two, here = self.job.report(held)
            return outcome, two, here

    def _fall_back(self, first: int, step: int, cause: str) -> bool:
        """Node `first`'s `step` is held back by a promise alone (the node-local rule would
        take it): once that has lasted SILENT_S with the job's word not moving, fall back
        to the node-local rule (module docstring) and say so. Under the lock."""
        silent = self.job.held_back(time.monotonic())
        if silent < SILENT_S:
            return False
        session = self.job.fall_back()
        log.warning("memory step %d of node %d: the job-wide commit of session %s gave no "
                    "word for %.0f s while %s; this writer falls back to the node-local "
                    "rule for that session (a step committed across the job may be dropped "
                    "here before a newer one is; its memory saves are held again)",
                    step, first, session, silent, cause)
        self._prune()
        return True

    def generations(self) -> list[dict[str, Any]]:
        """Every generation held, oldest first (`Generation.describe`), with `committed`:
        whether it is the newest step committed across the job (False while no lead
        told this writer: the node-local rule)."""
        with self._lock:
            committed = self.job.committed if self.job.on else None
            return [{**self._gens[s].describe(), "committed": s == committed}
                    for s in sorted(self._gens)]

    def _final(self, step: int, two: bool) -> None:
        """This node's outcome of `step` is final (memory_commit.py). Under the lock."""
        if self.job.final(step, two):
            self._settling.notify_all()
            if two and self.job.on:
                log.info("memory generation %d held in two places (the partner acked it)",
                         step)
