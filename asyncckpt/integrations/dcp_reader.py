"""asyncckpt as PyTorch DCP's storage layer, loading side: `dcp.load` of any asyncckpt
checkpoint, whether DCP or asyncckpt's own API saved it.

DCP's load planner matches the target state dict against the checkpoint's metadata by
flattened key and reshards by chunks; so the metadata is built from the manifest: each
tensor's saved boxes become its chunks, and every other value becomes a bytes item.
Keys are what DCP's own flattening makes of the saved structure (`_nested_dict`, the
running torch's rules), so a target flattens to the same keys whichever API saved it.
A global tensor's boxes come from every rank; a plain tensor or an object from the
lowest rank that saved one at that key (DCP has no rank-local values).

Nothing unverified is returned: tensor ranges are read through the verified reader (the
frames they overlap are checked), bytes values too, and objects come from the
manifest, which is checksummed. DCP's planner takes every object as bytes and loads
them with `torch.load(weights_only=False)`, which runs whatever a pickle names; so no
byte of the checkpoint reaches it. An object asyncckpt saved (JSON) is handed over as
`torch.save` of it. An object DCP pickled (a "pickled" node) is first loaded here with
torch's `weights_only` unpickler, which builds only plain values, tensors and `io.BytesIO`
buffers (plus any class the user admitted with `torch.serialization.add_safe_globals`) and
never runs code, and handed over as `torch.save` of what it built. One that needs more (a class
of the user's own, a namedtuple, an enum) is an `UntrustedPickleError` naming its key,
raised before the planner sees a byte of it: it loads only with
`StorageReader(..., trust_pickles=True)`, which hands its pickle to the planner as it
was written, running its code, and is for checkpoints whose every writer is trusted.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from asyncckpt.config import ReadLimits
from asyncckpt.errors import CheckpointError, UntrustedPickleError
from asyncckpt.format.layout import step_dir_name
from asyncckpt.format.tree import unflatten
from asyncckpt.integrations.dcp_ids import STEP_ID, checkpoint_location
from asyncckpt.integrations.dcp_plan import key_path_of
from asyncckpt.integrations.dcp_timeline import record_load
from asyncckpt.read.checkpoint import Checkpoint, Leaf
from asyncckpt.storage.location import Location, is_dir
from asyncckpt.storage.registry import storage_at

MAX_LIST_INDEX = 1 << 20  # a path's int beyond it stays flat (DCP rebuilds a list that long)


class _Value:
    """A placeholder for a leaf while DCP's flattening names the keys."""

    def __init__(self, leaf: Leaf, raw: str | None = None) -> None:
        self.leaf, self.raw = leaf, raw  # raw: "bytes" or "pickled" for a bytes leaf


class _Index:
    """An opened checkpoint's values by DCP key: a tensor leaf, a bytes leaf or an object."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.values: dict[str, Any] = {}
        self.paths: dict[str, tuple[str | int, ...]] = {}  # DCP key -> its path in the state
        recorded: dict[str, tuple[str | int, ...]] = {}
        for rank in range(ckpt.world_size):
            flat, paths = _flat_rank(ckpt, rank)
            for key, value in flat.items():
                self.values.setdefault(key, value)
                self.paths.setdefault(key, paths[key])
            for key, path in _recorded_paths(ckpt.tree(rank)).items():
                recorded.setdefault(key, path)
        if recorded:  # a step DCP saved flat: nest it as DCP's planner_data said
            self.paths = _nested_paths(self.paths, recorded)

    def metadata(self) -> Metadata:
        entries: dict[str, Any] = {}
        for key, value in self.values.items():
            if not isinstance(value, _Value) or value.raw is not None:
                entries[key] = BytesStorageMetadata()
                continue
            leaf = value.leaf
            g = leaf.tensor
            chunks = ([ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.spec.shape))
                       for b in g.boxes] if leaf.view is None
                      else [ChunkStorageMetadata(torch.Size([0] * len(leaf.shape)),
                                                 torch.Size(leaf.shape))])
            entries[key] = TensorStorageMetadata(TensorProperties(dtype=leaf.dtype),
                                                 torch.Size(leaf.shape), chunks)
        # planner_data: each key's path in the saved structure, as DCP's save planner
        # records it, so a planner that builds the state from the metadata alone
        # (`_EmptyStateDictLoadPlanner`, format_utils' conversions) nests it as saved
        return Metadata(state_dict_metadata=entries, planner_data=dict(self.paths))


def _flat_rank(ckpt: Checkpoint, rank: int
               ) -> tuple[dict[str, Any], dict[str, tuple[str | int, ...]]]:
    """Rank `rank`'s saved structure flattened as DCP flattens a state dict: DCP key ->
    `_Value` for tensors and bytes, the object itself for anything else (tensors inside
    a terminal object, e.g. a tuple, are `_Value`s too); and DCP key -> its path."""
    leaves = {leaf.path: leaf for leaf in ckpt.leaves(rank)}
    by_name = {leaf.tensor.name: leaf for leaf in leaves.values() if leaf.view is None}

    def tensor(leaf: Leaf) -> torch.Tensor:
        meta = torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
        placeholders[id(meta)] = _Value(leaf)
        return meta

    placeholders: dict[int, _Value] = {}
    skeleton = unflatten(ckpt.tree(rank), lambda name: tensor(by_name[name]),
                         lambda path, view: tensor(leaves[path]),
                         lambda name, kind: _Value(by_name[name], raw=kind))
    if not isinstance(skeleton, dict):
        raise CheckpointError("the saved state is not a dict: DCP loads only dicts",
                              step=ckpt.step, rank=rank)
    flat, paths = flatten_state_dict(skeleton)
    return ({key: _placeholders_in(value, placeholders) for key, value in flat.items()},
            {key: tuple(path) for key, path in paths.items()})


def _recorded_paths(tree: Any) -> dict[str, tuple[str | int, ...]]:
    """The key paths a DCP save recorded for the tensors of a flat tree (the dtensor
    nodes' `key_path`), each checked to be a path DCP's flattening makes of its key;
    any other is ignored (the key then stays flat)."""
    if not isinstance(tree, dict) or not isinstance(tree.get("dict"), list):
        return {}
    out: dict[str, tuple[str | int, ...]] = {}
    for entry in tree["dict"]:
        key, node = entry
        body = node.get("dtensor") if isinstance(node, dict) and len(node) == 1 else None
        path = body.get("key_path") if isinstance(body, dict) else None
        if isinstance(key, str) and isinstance(path, list) and key_path_of(key, tuple(path)) \
                and all(type(k) is not int or k < MAX_LIST_INDEX for k in path):
            out[key] = tuple(path)
    return out


def _nested_paths(flat: dict[str, tuple[str | int, ...]],
                  recorded: dict[str, tuple[str | int, ...]]) -> dict[str, tuple[str | int, ...]]:
    """Every key's path: a tensor's as recorded; an object's (DCP records none in the
    tree) under the deepest container a recorded path names that its key begins with,
    the rest of the key split at `.` (digits an int: a list position or an int key, as
    DCP's flattening makes them), or the whole key so split where no container prefixes
    it (DCP records no more: a dotted key of a dict of objects comes back nested). A path
    that would put a value inside another value is not nested (the key stays flat)."""
    containers: dict[str, tuple[str | int, ...]] = {}
    for path in recorded.values():
        for n in range(1, len(path)):
            containers.setdefault(".".join(map(str, path[:n])), path[:n])
    out: dict[str, tuple[str | int, ...]] = {}
    for key in flat:
        if key in recorded:
            out[key] = recorded[key]
            continue
        head = max((c for c in containers if key.startswith(c + ".")), key=len, default="")
        rest = key[len(head) + 1:] if head else key
        out[key] = containers.get(head, ()) + tuple(
            _position(p) for p in rest.split("."))
    leaves = set(out.values())
    return {key: path if not any(path[:n] in leaves for n in range(1, len(path)))
            else flat[key] for key, path in out.items()}


def _position(part: str) -> str | int:
    """`part` of a dotted key as DCP's path holds it: an int if it is one's digits."""
    if part.isascii() and part.isdigit() and str(int(part)) == part and int(part) < MAX_LIST_INDEX:
        return int(part)
    return part


def _placeholders_in(value: Any, placeholders: dict[int, _Value]) -> Any:
    if isinstance(value, torch.Tensor):
        return placeholders[id(value)]
    if isinstance(value, (list, tuple)):
        return type(value)(_placeholders_in(v, placeholders) for v in value)
    if isinstance(value, dict):
        return {k: _placeholders_in(v, placeholders) for k, v in value.items()}
    return value


class StorageReader(dcp.StorageReader):
    """`dcp.load(sd, storage_reader=StorageReader(root, step))` loads an asyncckpt
    checkpoint into `sd`, DCP's planner resharding, every byte verified."""

    def __init__(self, root: str | os.PathLike[str] | None = None, step: int | None = None, *,
                 limits: ReadLimits | None = None, trust_pickles: bool = False,
                 restore: bool = True) -> None:
        """Args:
            root: a root (its newest step, or `step`) or a checkpoint directory; a
                `checkpoint_id` given to `dcp.load` replaces it (ROOT/step-N, a root,
                whose step is then `step` or its newest, or a step directory; a
                `file://` URL of this machine is its path).
            limits: reader limits (default `ReadLimits.from_env()`).
            trust_pickles: hand objects DCP pickled to the planner as they were
                written (its `torch.load(weights_only=False)` runs their code). Only for
                checkpoints whose every writer you trust. Default: they are loaded with
                torch's `weights_only` unpickler, and one that needs more is an
                `UntrustedPickleError` naming its key (inside DCP's CheckpointException).
            restore: a load through this reader is a restore: a `StorageWriter` save to
                the same root later in this process continues from the step loaded,
                abandoning the root's steps above it (dcp_timeline.py). False for a
                read that is no resume (a conversion, an evaluation of an older step).
        """
        self.root = None if root is None else checkpoint_location(root)
        self.restore = restore
        self.step = step
        self.limits = limits
        self.trust_pickles = trust_pickles
        self._target: tuple[Location | None, int | None] = (self.root, step)
        self._index: _Index | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_index": None}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._close()
        if checkpoint_id is None:
            self._target = (self.root, self.step)
            return
        path = checkpoint_location(checkpoint_id)
        m = STEP_ID.fullmatch(path.name)
        if m is not None and not is_dir(path):  # torchtitan's ROOT/step-N, unpadded
            self._target = (path.parent, int(m.group(1)))
        elif m is not None:  # a step directory
            self._target = (path, None)
        else:  # a root: the step given to this reader, else its newest
            self._target = (path, self.step)

    def read_metadata(self) -> Metadata:
        """The checkpoint's metadata, built from its (verified) manifest. No `**kwargs`:
        DCP would then retry a failed read as "rank-local metadata" without collectives.
        DCP reports a failure here by message (an AssertionError), not by type."""
        return self._open().metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of `plan` (verified) into the planner's targets.

        Raises:
            CorruptCheckpointError: any byte fails its check; no target is committed
                with unverified data (targets read so far may hold verified bytes).
            UntrustedPickleError: an object DCP pickled needs more than torch's
                `weights_only` unpickler builds (and `trust_pickles` is False); raised
                before any target is written.
        """
        index = self._open()
        ckpt = index.ckpt
        try:
            with ckpt.reading():
                reads = ckpt.plan()
                # every object first: one refused (an untrusted pickle) fails the load
                # before any target has changed
                objects = [(item, _object_bytes(ckpt, index.values[item.storage_index.fqn],
                                                item.storage_index.fqn, self.trust_pickles))
                           for item in plan.items if item.type == LoadItemType.BYTE_IO]
                tensors = []
                for item in plan.items:
                    value = index.values[item.storage_index.fqn]
                    if item.type == LoadItemType.BYTE_IO:
                        continue
                    target = planner.resolve_tensor(item).detach()
                    leaf = value.leaf
                    chunk = item.storage_index.offset or torch.Size([0] * len(leaf.shape))
                    offsets = tuple(c + o for c, o in zip(chunk, item.storage_offsets))
                    if leaf.view is None:
                        reads.add(leaf.tensor, offsets, target)
                    else:
                        view = leaf.view.of_tensor(ckpt.read_full(leaf.tensor))
                        target.copy_(view[tuple(slice(o, o + n)
                                                for o, n in zip(offsets, item.lengths))])
                    tensors.append((item, target))
                reads.flush()
                for item, data in objects:
                    planner.load_bytes(item, io.BytesIO(data))
                for item, target in tensors:
                    planner.commit_tensor(item, target)
            if self.restore:
                _record_load(ckpt)
        finally:
            self._close()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            path = checkpoint_location(checkpoint_id)
        except CheckpointError:
            return False
        storage = storage_at(path)
        try:
            return storage.is_file(path / "manifest.json") or (storage.is_dir(path) and any(
                STEP_ID.fullmatch(name) for name in storage.entries(path)))
        except OSError:
            return True  # a store not reached now: ours to open (errors then say why)

    def _open(self) -> _Index:
        if self._index is None:
            root, step = self._target
            if root is None:
                raise ValueError("StorageReader needs a root (or a checkpoint_id)")
            self._index = _Index(Checkpoint.open(root, step, limits=self.limits))
        return self._index

    def _close(self) -> None:
        if self._index is not None:
            self._index.ckpt.close()
            self._index = None


def _record_load(ckpt: Checkpoint) -> None:
    """Remember that this process restored `ckpt` (a step directory of a root)."""
    directory = ckpt.directory
    if directory.name == step_dir_name(ckpt.step):
        record_load(directory.parent, ckpt.step)


def _object_bytes(ckpt: Checkpoint, value: Any, key: str, trust_pickles: bool) -> bytes:
    """The bytes DCP's planner loads (running any code they name) for a non-tensor value:
    `torch.save` of it (its tensors read in full, verified); of an object DCP pickled,
    what torch's `weights_only` unpickler builds of it, or, trusted, its pickle as
    written."""
    if isinstance(value, _Value) and value.raw == "pickled":
        data = ckpt.read_full(value.leaf.tensor).numpy().tobytes()
        if trust_pickles:
            return data
        obj = _safe_object(data, key, ckpt)
    else:
        obj = _materialised(ckpt, value)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _safe_object(data: bytes, key: str, ckpt: Checkpoint) -> Any:
    """The object DCP pickled into `data`, built by torch's `weights_only` unpickler,
    which here also builds `io.BytesIO` (a Stateful's buffer, which DCP pickles as the
    object itself): a byte buffer, its bytes, position and attributes, whose attributes
    are built by the same unpickler (so an attribute that would run code is refused).

    Hazard: torch keeps its admitted globals process-wide; BytesIO is admitted for the
    length of this load (under a lock, where the caller has not admitted it already),
    so a `weights_only` load on another thread meanwhile admits it too."""
    try:
        with _bytesio_admitted():
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the unpickler's refusal, or bytes it cannot read
        text = " ".join(str(e).split())
        named = re.search(r"GLOBAL ([\w.]+)", text)
        why = (f"it needs {named.group(1)}, which torch's weights_only unpickler does not build"
               if named else f"torch's weights_only unpickler refused it ({type(e).__name__}: "
               f"{text[-160:]})")
        raise UntrustedPickleError(
            f"object {key!r:.120}: {why}; nothing of it was run. Load it with "
            "StorageReader(..., trust_pickles=True) only if you trust every writer of this "
            "checkpoint (or admit its classes with torch.serialization.add_safe_globals)",
            step=ckpt.step, file=str(ckpt.directory), key=key) from None


_admit_lock = threading.Lock()


@contextlib.contextmanager
def _bytesio_admitted() -> Iterator[None]:
    """torch's `weights_only` unpickler builds `io.BytesIO` inside the block."""
    with _admit_lock:
        if io.BytesIO in torch.serialization.get_safe_globals():
            yield  # the caller's own admission: leave it as it is
            return
        with torch.serialization.safe_globals([io.BytesIO]):
            yield


def _materialised(ckpt: Checkpoint, value: Any) -> Any:
    if isinstance(value, _Value):
        leaf = value.leaf
        if value.raw is not None:
            return ckpt.read_full(leaf.tensor).numpy().tobytes()
        full = ckpt.read_full(leaf.tensor)
        return full if leaf.view is None else leaf.view.of_tensor(full).clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_materialised(ckpt, v) for v in value)
    if isinstance(value, dict):
        return {k: _materialised(ckpt, v) for k, v in value.items()}
    return value

