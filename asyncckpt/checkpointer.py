"""Checkpointer: the manager a training loop talks to.

It decides when to save (`save_interval`), what to save (`contents`: model, optimizer,
extra), what to keep (`keep_last` / `keep_every`, applied by the writer after each
commit, judged from the disk, so a crash between commit and deletion only delays a
deletion), what to do when a save is asked for while the last one is still in flight
(`on_busy`), and how to restore. The optional fence hooks `optimizer.step()`: a save
returns at once, its staging overlaps the next forward/backward, and the loop waits
only if staging has not finished when the optimizer is about to change the weights.

A sharded model (DTensor parameters: FSDP2, tensor parallel; or FSDP1) is saved and
restored through torch.distributed.checkpoint's state-dict functions
(torchutil/state_dicts.py), so each rank saves only its shards as boxes of global
tensors, and a restore at another world size, or into the other FSDP, reshards.

`restore()` without a step resumes from the newest step that loads cleanly, every rank
agreeing before any state is applied, a damaged step skipped with a WARNING (read/resume.py:
the memory tier first, then the durable steps from the newest down). `strict_restore` (or
`restore(strict=True)`) makes the damaged newest step an error. What `on_busy` does with
a save asked for while others are in flight is rank/in_flight.py's.

Given no writer (no address, no ASYNCCKPT_ADDRESS), the first due save starts the
node's writer (rank/node_writer.py) and `close()` stops it: a loop needs no writer code.
The client a Checkpointer makes for itself gets a ring sized from the first state it
saves (ringsize.py: as large as the state when a bounded share of MemAvailable allows,
logged). A `transformers` model's config travels with each step (integrations/hf.py), so
an export is a directory `from_pretrained` opens as it is.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Literal

import torch
import torch.distributed as dist

from asyncckpt.errors import CheckpointError, WriterRootMismatchError
from asyncckpt.format.timeline import TimelineStart, new_timeline_id
from asyncckpt.ipc.options import SaveOptions
from asyncckpt.ipc.protocol import same_root
from asyncckpt.rank.client import Client
from asyncckpt.rank.handle import SaveHandle
from asyncckpt.rank.in_flight import SavesInFlight
from asyncckpt.rank.launch import WriterProcess
from asyncckpt.rank.node_writer import check_reachable, given_address, node_writer
from asyncckpt.rank.ringsize import ring_for, state_bytes
from asyncckpt.read import hf
from asyncckpt.read.loader import load_parts
from asyncckpt.read.resume import resume
from asyncckpt.storage.location import root_path, storage_for
from asyncckpt.storage.paths import Location
from asyncckpt.storage.timeline import live_steps
from asyncckpt.torchutil.dtensor import unwrapped
from asyncckpt.torchutil.state_dicts import apply_training_state, load_targets, training_state

__all__ = ["Checkpointer", "CheckpointerOptions"]

CONTENTS = ("model", "optimizer", "extra")
log = logging.getLogger("asyncckpt.checkpointer")


@dataclasses.dataclass(frozen=True)
class CheckpointerOptions:
    """How a Checkpointer saves and keeps checkpoints.

    Attributes:
        save_interval: `should_save(step)` is true every this many steps.
        keep_last: keep the newest this many committed steps, or every one with
            `KEEP_ALL` (0). None (the default): this Checkpointer names no retention
            and the writer's own `keep_last` knob applies (which keeps all unless set).
        keep_every: also keep steps that are multiples of this (0: none).
        contents: which of "model", "optimizer", "extra" go into a checkpoint.
        on_busy: a save asked for while earlier ones are still in flight: "block" waits
            for them to commit, "skip" warns and skips, "queue" lets up to
            `max_in_flight` saves be in flight at once (then blocks).
        max_in_flight: the bound for "queue".
        strict_restore: `restore()` raises CorruptCheckpointError when the newest step is
            damaged, instead of falling back to the newest step that loads.
        memory_interval: also save to the node writers' memory tier every this many
            steps (0: never; docs/MEMORY_TIER.md): a step due for both is durable. A
            memory save blocks as a durable one does (the staging copy) and waits for
            no durable save in flight; `restore()` then resumes from the newest memory
            generation when it is at least the newest durable step.
    """

    save_interval: int = 1000
    keep_last: int | None = None
    keep_every: int = 0
    contents: tuple[str, ...] = CONTENTS
    on_busy: Literal["block", "skip", "queue"] = "block"
    max_in_flight: int = 2
    strict_restore: bool = False
    memory_interval: int = 0

    def __post_init__(self) -> None:
        def require(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}; got {getattr(self, name)!r}")
        require(self.save_interval >= 1, "save_interval", "at least 1")
        SaveOptions(self.keep_last, self.keep_every)  # the save's own rule (0 keeps all)
        require(set(self.contents) <= set(CONTENTS) and bool(self.contents), "contents",
                f"a non-empty subset of {CONTENTS}")
        require(self.on_busy in ("block", "skip", "queue"), "on_busy", '"block", "skip" or "queue"')
        require(self.max_in_flight >= 1, "max_in_flight", "at least 1")
        require(self.memory_interval >= 0, "memory_interval", "0 (never) or more")


class Checkpointer:
    """Saves a model/optimizer/extra state every `save_interval` steps through a writer.

    Example:
        ckpt = Checkpointer("ckpts/run1", model=model, optimizer=opt,   # fence installed:
                            options=CheckpointerOptions(save_interval=100, keep_last=3))
        start = ckpt.restore() or 0              # resume from the newest checkpoint, if any
        for step in range(start + 1, steps + 1):
            train_step()
            if ckpt.should_save(step):
                ckpt.save(step, extra={"data": loader_state})
        ckpt.close()
    """

    def __init__(self, root: str | Location, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 options: CheckpointerOptions | None = None, client: Client | None = None,
                 fence: bool = True, hf_config: Any = None,
                 generation_config: Any = None, ring_size: int | None = None,
                 address: str | None = None) -> None:
        """
        Args:
            root: the checkpoint root the writer owns (read here for restore and listing).
            model, optimizer: saved and restored by their state dicts.
            client: the rank's writer connection (default: `asyncckpt.connect()` from the
                environment, created on the first save).
            ring_size: bytes of the ring of the client made here (a multiple of the
                slot size). Default: the ASYNCCKPT_RING_SIZE knob when set, else sized
                from the first saved state and the host's free memory (see
                `auto_ring_size`: as large as the state when a bounded share of
                MemAvailable allows, so staging is one memcpy and the fence barely
                waits). Ignored with `client`, whose ring already exists.
            address: the writer the client made here connects to (default:
                ASYNCCKPT_ADDRESS), at once: a writer that is not there fails here, not
                at the first due save. With neither, the first due save starts the node's
                writer (rank/node_writer.py: the first rank of each host starts it,
                every rank of the job taking part, its log beside the root) and
                `close()` stops it once every rank is done; `writer` is it, on the rank
                that started it.
            fence: install the optimizer fence (see `install_fence`) when an optimizer
                is given. Without it, wait for `handle.staged()` yourself before
                `optimizer.step()`, or saves fail as torn.
            hf_config, generation_config: a Hugging Face config (object or mapping) to
                store with the model; by default a `transformers` model's own. Stored as
                JSON text under the state's "hf" key, it lets `asyncckpt export` write a
                directory `from_pretrained` opens as it is.
        Raises:
            TypeError: a config that is not JSON.
            WriterUnavailableError: an address given (or in the environment) where no
                writer answers.
        """
        self.root = root_path(root)
        self.model = model
        self.optimizer = optimizer
        self.options = options or CheckpointerOptions()
        self._client = client
        self._own_client = client is None
        self._ring_request = ring_size
        self._address = address
        self.writer: WriterProcess | None = None  # the node's writer, if started here
        self._node_writers = False  # this job's ranks started their nodes' writers
        self._told_interval = False
        self._not_due = 0  # save() calls that saved nothing because the step was not due
        self._saves = 0
        self._in_flight = SavesInFlight(self.options.on_busy, self.options.max_in_flight)
        self.timeline: TimelineStart | None = None  # made by restore(); carried by save()
        self.restored_tier: str | None = None  # where restore() found its step
        self._fences: list[Any] = []  # one hook per fenced optimizer
        self._fenced: set[int] = set()  # their ids
        self.fence_blocked_seconds = 0.0
        self.extra: Any = None
        self.hf_metadata = hf.hf_metadata(unwrapped(model), hf_config, generation_config)
        given = given_address(address) if client is None else None
        if given is not None:
            check_reachable(given)  # now, not at the first due save
        if fence and optimizer is not None:
            self.install_fence()

    # -- saving ---------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """`step` is due for a durable save, or (memory_interval) a memory save."""
        return step % self.options.save_interval == 0 or self._memory_due(step)

    def _memory_due(self, step: int) -> bool:
        interval = self.options.memory_interval
        return bool(interval) and step % interval == 0

    def save(self, step: int, *, extra: Any = None, force: bool = False, replace: bool = False,
             keep_from: int | None = None,
             keep_steps: tuple[int, ...] = ()) -> SaveHandle | None:
        """Save `step` (if `should_save(step)` or `force`) and return its handle at once.

        Returns None when the step is not due (said once at INFO on logger
        "asyncckpt.checkpointer"), or when a save is still in flight and on_busy is
        "skip". `handle.stats.blocked_seconds` is the whole time spent here: waiting for
        earlier saves (on_busy), collecting the state dicts, flattening.
        Args:
            replace: when `step` is already committed, this save replaces it (the old
                one stays loadable until the new one is durable); without it such a
                save fails with StepAlreadyCommittedError. As `Client.save`. A step
                of a timeline abandoned by `restore()` is replaced without it.
            keep_from: retention after this save deletes no step from this one on (a
                step that something outside the root, e.g. a framework's tracker file,
                still names). As `Client.save`.
            keep_steps: retention after this save deletes none of these steps, and
                does not count them in `keep_last` (a framework's "best" checkpoint; at
                most 64). As `Client.save`.
        Raises:
            UnsupportedStateError, WriterUnavailableError: as `Client.save`.
            WriterRootMismatchError: the writer reached (the address given,
                ASYNCCKPT_ADDRESS, the client given) serves another root.
            SaveFailedError (or its subclass, e.g. StepAlreadyCommittedError): an
                earlier save failed and its error has not reached the caller (no
                `handle.wait()`/`exception()` took it): raised once, naming that save's
                step, before anything of this one is done; or, with on_busy="block", the
                failure of the save this one waited for.
        """
        entered = time.perf_counter()
        if not (force or self.should_save(step)):
            self._not_due += 1
            if not self._told_interval:
                self._told_interval = True
                log.info("asyncckpt: save(%d) saves nothing: step %d is not a multiple of "
                         "save_interval=%d (pass force=True, or save_interval=1 when the "
                         "framework decides when to save); said once", step, step,
                         self.options.save_interval)
            return None
        tier = ("durable" if force or step % self.options.save_interval == 0 else "memory")
        if not self._in_flight.make_room(step, tier):
            return None
        state: dict[str, Any] = {"step": step, **self._state_dicts()}
        if "extra" in self.options.contents and extra is not None:
            state["extra"] = extra
        if "model" in state and self.hf_metadata is not None:
            state[hf.HF_KEY] = self.hf_metadata
        if self._client is None:
            address = given_address(self._address)
            if address is None:
                address, self.writer = node_writer(self.root)
                self._node_writers = True  # every rank: close() meets the others
            self._client = Client(address, root=self.root,  # the writer must serve it
                                  ring_size=ring_for(state_bytes(state), self._ring_request, log))
        elif not self._own_client:
            self._check_root(self._client)
        # keep_last None sends no retention: the writer's own keep_last knob applies
        handle = self._client.save(step, state, keep_last=self.options.keep_last,
                                   keep_every=self.options.keep_every, keep_from=keep_from,
                                   replace=replace, timeline=self.timeline, tier=tier,
                                   keep_steps=keep_steps)
        handle.stats.blocked_seconds = time.perf_counter() - entered  # what the loop waited
        self._in_flight.add(handle, tier)
        self._saves += 1
        return handle

    def install_fence(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Make `optimizer.step()` wait until every save in flight is staged.

        Without the fence, call `handle.wait_staged()` yourself before the optimizer
        changes the weights. The time spent waiting adds up in `fence_blocked_seconds`.
        Several optimizers may be fenced (each once; a second call for one is a no-op);
        `close()` removes every hook.
        """
        optimizer = optimizer or self.optimizer
        if optimizer is None:
            raise ValueError("install_fence needs an optimizer")
        if id(optimizer) in self._fenced:
            return

        def hook(*_: Any) -> None:
            self.fence_blocked_seconds += self._in_flight.wait_staged()

        self._fences.append(optimizer.register_step_pre_hook(hook))
        self._fenced.add(id(optimizer))

    def wait_until_finished(self) -> None:
        """Block until every save in flight is done; raise the first failure that has
        not reached the caller yet (once: a failure `handle.wait()` raised, or that an
        earlier call raised, is not raised again; a second one is left for the next
        call)."""
        self._in_flight.settle()

    def close(self) -> None:
        """Wait for saves in flight, remove the fence, close the client if we made it
        and stop the writer if we started it. Warns when `save()` was called but no
        step was ever due (a save_interval larger than the run).

        Raises:
            SaveFailedError (or a subclass), WriterUnavailableError: a save that
                failed and whose error has not reached the caller (as
                `wait_until_finished`), after everything above is done.
        """
        if self._not_due and not self._saves:
            log.warning("asyncckpt: %d save() call(s) and no checkpoint written: no step was a "
                        "multiple of save_interval=%d (pass force=True, or a smaller "
                        "save_interval)", self._not_due, self.options.save_interval)
            self._not_due = 0
        try:
            self.wait_until_finished()
        except BaseException:
            self._release(quiet=True)
            raise
        self._release(quiet=False)

    def _release(self, quiet: bool) -> None:
        """Remove the fence, close our client, meet the other ranks and stop our
        writer, whatever fails. `quiet`: an error is already on its way, so a further
        failure the client raises at close is not (each was logged when it failed)."""
        for fence in self._fences:
            fence.remove()
        self._fences.clear()
        self._fenced.clear()
        try:
            if self._own_client and self._client is not None:
                client, self._client = self._client, None
                try:
                    client.close()
                except CheckpointError:
                    if not quiet:
                        raise
        finally:
            if self._node_writers and dist.is_available() and dist.is_initialized():
                self._node_writers = False
                dist.barrier()  # every rank's client is closed before the writers stop
            if self.writer is not None:
                self.writer.stop()
                self.writer = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self._address, root=self.root)
        return self._client

    def _check_root(self, client: Client) -> None:
        """A client given to this Checkpointer must reach the writer of its root."""
        mine = str(self.root.resolve())
        if not same_root(mine, str(client.root)):
            raise WriterRootMismatchError(
                f"the client given reaches the writer of {client.root}, not {mine}: give a "
                f"client of a writer on {mine} (or none: the Checkpointer then starts "
                "one)", rank=client.rank)

    # -- reading --------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps on disk, oldest first (of abandoned timelines too)."""
        return storage_for(self.root).committed_steps()

    def latest_step(self) -> int | None:
        """The newest live committed step (never one of a timeline the root abandoned)."""
        storage = storage_for(self.root)
        steps = live_steps(storage, storage.committed_steps())
        return steps[-1] if steps else None

    def restore(self, step: int | None = None, *, rank: int | None = None,
                strict: bool | None = None) -> int | None:
        """Load `step` (default: the newest that loads cleanly) into the model and optimizer.

        The model's tensors are filled in place (shapes and dtypes checked first); the
        optimizer gets `load_state_dict`. The loaded `extra` is kept in `self.extra`.
        Without `step`, each damaged step from the newest down is skipped with a
        warning (logger "asyncckpt.checkpointer"), unless `strict` (default
        `options.strict_restore`). Under torch.distributed every rank must call it:
        the ranks agree on each attempt's outcome before any state is applied. Hazard:
        a skipped attempt may have partly filled the model's tensors; the step finally
        restored overwrites every one of them.
        A restore begins a new timeline (docs/API.md, "Timelines"): every later `save()`
        of this Checkpointer carries `self.timeline` (the same on every rank: rank 0's,
        broadcast), and the first to commit abandons the root's committed steps above
        the restored one: never the newest again, replaced by saves of their numbers,
        deleted by retention. Without `step`, the candidates are the live steps only.
        Returns:
            The restored step, or None when the root holds no step at all.
        Raises (every rank raises when any does):
            CheckpointNotFoundError: `step` is not committed.
            CorruptCheckpointError: `step` (or, strict, the newest step) is damaged, or
                no step loads.
            StateMismatchError: as `load`.
        """
        strict = self.options.strict_restore if strict is None else strict
        address = (self._client.address if self._client is not None
                   else given_address(self._address))
        self.restored_tier = None
        found = resume(self.root, step, rank, strict=strict, try_load=self._try_load,
                       memory_address=address, memory_into=self._into,
                       memory_keys={"step", "extra", *self.options.contents},
                       memory_expected=bool(self.options.memory_interval))
        if found is None:
            return None
        restored = self._apply(found.state)
        self.restored_tier = found.tier
        if found.carry is not None:
            self.timeline = found.carry  # the run that saved it forked: go on in its timeline
        if found.fork_gen is None:
            return restored  # a memory generation newer than every durable step
        return self._begin_timeline(restored, found.fork_gen)

    def _begin_timeline(self, step: int, based_on: int) -> int:
        """Make `self.timeline`, which this Checkpointer's saves carry from now on: a
        timeline forked at restored `step`, its id drawn on rank 0 and broadcast under
        torch.distributed so that every rank carries the same. Returns `step`."""
        start = [TimelineStart(new_timeline_id(), step, based_on).to_json()]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(start, src=0)
        self.timeline = TimelineStart.from_json(start[0])
        return step

    def _try_load(self, step: int | None, rank: int | None) -> tuple[Any, Exception | None]:
        """The loaded state or the error, whatever it is (an OSError, a DCP error too):
        every rank must reach the agreement that follows, or the others wait forever."""
        try:
            return self._load(step, rank), None
        except Exception as e:
            return None, e

    def _load(self, step: int | None, rank: int | None) -> Any:
        return load_parts(self.root, step, rank, self._into(),
                          {"step", "extra", *self.options.contents})

    def _into(self) -> Any:
        """The targets a load fills in place (None: none)."""
        return load_targets(self.model, self.optimizer, self.options.contents)

    def _apply(self, state: Any) -> int:
        apply_training_state(self.model, self.optimizer, state)
        self.extra = state.get("extra")
        return int(state["step"])

    def _state_dicts(self) -> dict[str, Any]:
        """The model/optimizer state dicts `contents` asks for (DTensor-aware)."""
        return training_state(self.model, self.optimizer, self.options.contents)
