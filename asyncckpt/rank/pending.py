"""A save between `save()` and its result, and the checks that keep its bytes whole.

A rank's tensors stay the training loop's own while they are staged: nothing is copied
in `save()`. So each tensor's version counter is taken at `save()` and checked after its
own copy (`Sources`): a tensor changed in place meanwhile fails the save instead of
landing torn in a checkpoint. With `skip_unchanged`, the same counter plus the storage's
identity (`fingerprint`) say which tensors cannot have changed since the newest
committed save, so the writer may reference their frames instead of receiving them.
The begin message is encoded here, up front, so that a state JSON cannot carry fails in
`save()` itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from asyncckpt.errors import UnsupportedStateError
from asyncckpt.format.layout import CUT_BYTES
from asyncckpt.format.tree import show_path
from asyncckpt.ipc import messages, protocol
from asyncckpt.ipc.messages import NodeRanks
from asyncckpt.ipc.options import SaveOptions
from asyncckpt.rank.flatten import TensorEntry, flatten
from asyncckpt.rank.handle import SaveHandle
from asyncckpt.rank.stager import ready_event


class Fingerprint(NamedTuple):
    """What must be equal for a tensor's bytes not to have changed between two looks:
    its storage (held by a weak reference, so its address is not reused meanwhile), the
    storage's address and size, the tensor's view of it, and its version counter."""

    storage: StorageWeakRef
    data_ptr: int
    nbytes: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    version: int


class Basis(NamedTuple):
    """A client's newest committed save: its step, and its tensors' fingerprints by name
    (skip_unchanged compares a new save's tensors with these)."""

    step: int
    fingerprints: dict[str, Fingerprint]


@dataclass(frozen=True)
class Route:
    """Who takes part in a save: the world, and for a save coordinated across nodes its
    name in the store and the ranks of this rank's node.

    Attributes:
        world_size: the ranks that save the step.
        key: a coordinated save's name (coordination.py); None: the node's writer sees
            every rank and commits alone.
        node: coordinated: this rank's node.
        launch: coordinated: this launch of the job (the begin's `launch`).
    """

    world_size: int
    key: str | None = None
    node: NodeRanks | None = None
    launch: str | None = None


@dataclass(frozen=True)
class Flat:
    """A state already flattened the way `flatten` flattens it: its tree and its tensor
    leaves, in stream order. A saver that knows its state's structure from one save to
    the next (DCP's cached plan: integrations/dcp_flat.py) hands this to `Client.save`
    instead of the state, and the walk is not repeated. It must equal `flatten(state)`."""

    tree: Any
    entries: list[TensorEntry]


class Torn(Exception):
    """A tensor was modified in place while it was being staged."""


class Sources:
    """The tensors a save copies, in stream order (those the writer took from the basis
    left out), and the check that each was not modified in place (its version counter)
    between `save()` and the end of its own copy: a torn tensor fails the save rather
    than landing in a checkpoint. Changes after a tensor's copy are harmless; the
    stager checks tensors once their bytes are all in the ring (`stage`'s `copied`),
    which may be a few tensors after their copy."""

    def __init__(self, pending: PendingSave) -> None:
        kept = [i for i in range(len(pending.entries)) if i not in pending.skipped]
        self.tensors = [pending.entries[i].tensor for i in kept]
        self._expected = [pending.versions[i] for i in kept]
        self._paths = [pending.entries[i].path for i in kept]
        self._checked = 0

    def check(self, count: int) -> None:
        """The first `count` tensors are copied: raise Torn if one of them changed.

        Raises:
            Torn: the first such tensor, named by its key path.
        """
        for i in range(self._checked, count):
            if _version(self.tensors[i]) != self._expected[i]:
                raise Torn(f"{show_path(self._paths[i])} was modified in place while it was "
                           "being staged; wait for handle.staged() before changing the state "
                           "(e.g. call handle.wait_staged() before optimizer.step())")
        self._checked = max(self._checked, count)


def _version(t: torch.Tensor) -> int | None:
    """In-place writes bump it (optimizer steps too); writes through `.data`, numpy or
    another process do not, and inference-mode tensors have none: those go undetected."""
    try:
        return t._version
    except RuntimeError:
        return None


def fingerprint(t: torch.Tensor) -> Fingerprint | None:
    """Equal for two looks at a tensor only if its bytes cannot have changed in between,
    short of writes that bypass the version counter. The storage is named by a weak
    reference: while it is held, the storage's address cannot be reused by another one."""
    version = _version(t)
    if version is None:
        return None
    storage = t.untyped_storage()
    return Fingerprint(StorageWeakRef(storage), storage.data_ptr(), storage.nbytes(),
                       int(t.storage_offset()), tuple(t.shape), t.stride(), t.dtype, t.device,
                       version)


class PendingSave:
    """A save between `save()` and its result; the begin message is encoded up front so
    that anything JSON cannot carry fails in `save()` itself.

    Args:
        save_id: the client's id of this save (unique per connection).
        step: the step saved.
        state: the state dict (flattened here; its tensors stay the caller's), or a
            `Flat` one.
        handle: the caller's SaveHandle.
        options: the save's SaveOptions, sent in the begin.
        route: the world, and the store key and node of a coordinated save.
        basis: with skip_unchanged, the newest committed save to compare against.
        skip_unchanged: fingerprint the tensors (they may be the basis of later saves).
    Raises:
        UnsupportedStateError: a value that cannot be saved, or a state JSON cannot
            carry or that exceeds the message bound.
    """

    def __init__(self, save_id: int, step: int, state: Any, handle: SaveHandle,
                 options: SaveOptions, route: Route, basis: Basis | None = None,
                 skip_unchanged: bool = False) -> None:
        self.id = save_id
        self.step = step
        self.handle = handle
        self.key = route.key  # the name of a save coordinated across nodes (coordination.py)
        self.settled = False         # coordinated: the outcome is known and acted on
        tree, self.entries = ((state.tree, state.entries) if isinstance(state, Flat)
                              else flatten(state))
        self.versions = [_version(e.tensor) for e in self.entries]
        self.ready = ready_event(e.tensor for e in self.entries)
        self.fingerprints = [fingerprint(e.tensor) if skip_unchanged else None
                             for e in self.entries]
        self.unchanged = [] if basis is None else [
            i for i, (e, fp) in enumerate(zip(self.entries, self.fingerprints))
            if fp is not None and basis.fingerprints.get(e.name) == fp
            and e.tensor.numel() * e.tensor.element_size() >= CUT_BYTES]
        self.skipped: set[int] = set()  # what the writer took from the basis step
        self.planned = threading.Event()
        since = basis.step if basis is not None and self.unchanged else None
        try:
            self.begin = messages.Begin(
                save_id, step, route.world_size,
                tuple((e.name, e.dtype_name, tuple(e.tensor.shape)) for e in self.entries), tree,
                options, coordinated=route.key is not None, since=since,
                unchanged=None if since is None else tuple(self.unchanged),
                node=route.node, launch=route.launch).encode()
        except (ValueError, RecursionError) as e:
            raise UnsupportedStateError(f"state cannot be encoded as JSON: {e}",
                                        step=step) from None
        if len(self.begin) > protocol.MAX_MESSAGE:
            raise UnsupportedStateError(
                f"the state's tensor table and objects take {len(self.begin)} bytes as JSON, "
                f"over the {protocol.MAX_MESSAGE}-byte message bound ({len(self.entries)} "
                "tensors); save fewer, larger tensors or split the state", step=step)

    def remembered(self) -> Basis:
        """This save, once committed, as the basis of later saves."""
        return Basis(self.step, {e.name: fp for e, fp in zip(self.entries, self.fingerprints)
                                 if fp is not None})
