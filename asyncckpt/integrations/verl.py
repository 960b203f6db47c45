"""A drop-in for verl's FSDP checkpoint manager that saves through asyncckpt.

verl's `FSDPCheckpointManager` `torch.save`s each rank's shards (pickled, not fsynced,
not committed atomically: a crash mid-save leaves a directory that looks complete), its
`hf_model` save gathers the whole model on rank 0, and its files load only at the world
size that wrote them. This class keeps verl's constructor and its `save_checkpoint` /
`load_checkpoint` calls, so verl's FSDP engine uses it unchanged; underneath, each rank
hands its DTensor shards to the node's asyncckpt writer (checksummed, compressed,
committed atomically, reshardable on load).

Layout, for verl's `local_path` = `DIR/global_step_N/actor`:

    DIR/asyncckpt/actor/step-0000000N/      the checkpoint (one asyncckpt root per role)
    DIR/global_step_N/actor/huggingface/    config + tokenizer (rank 0, at save); with
                                            "hf_model", the weights too, exported from
                                            the committed step one tensor at a time
    DIR/global_step_N/actor/asyncckpt.json  {"root", "step"}: written once committed
    DIR/latest_checkpointed_iteration.txt   with async_save: written here once committed

Two modes, chosen by verl's own `checkpoint.async_save` flag (the switch verl already
has for Megatron's asynchronous saves, which makes its trainer leave the tracker file to
the manager):
- False (verl's default): `save_checkpoint` returns once the step is committed, so the
  tracker the trainer writes next never names a step that is not on disk. The save is
  still one streaming pass, fsynced and atomic.
- True: it returns once the state is handed over (staging overlaps what follows; the
  optimizer fence holds the next `optimizer.step()` until it is copied). Rank 0 writes
  the tracker, exports `hf_model` and applies verl's retention to the old `local_path`s
  after the commit, on a thread of its own. A process that exits normally waits for the
  last save (atexit); one that is killed leaves the tracker at the last committed step.

Retention (`max_ckpt_to_keep`): the writer deletes old steps only after the new one is
committed; the old `local_path` directories go then too.

The one change for a verl user: in `verl/workers/engine/fsdp/transformer_impl.py`,
`from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager`
becomes `from asyncckpt.integrations.verl import FSDPCheckpointManager` (and
`actor_rollout_ref.actor.checkpoint.async_save=True` to save in the background).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import queue
import random
import re
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..checkpointer import Checkpointer, CheckpointerOptions
from ..errors import CheckpointError, CheckpointNotFoundError
from ..export import export_hf
from ..handle import SaveHandle
from ..launch import start_writer

TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "asyncckpt.json"
ROOTS = "asyncckpt"
log = logging.getLogger("asyncckpt.verl")


def _get(config: Any, name: str, default: Any = None) -> Any:
    """A field of verl's checkpoint config (DictConfig, dict or dataclass)."""
    if config is None:
        return default
    if hasattr(config, "get"):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


@dataclasses.dataclass
class _Job:
    step: int
    local_path: Path
    handle: SaveHandle
    max_keep: int | None
    hf_model: bool
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


class FSDPCheckpointManager:
    """verl's FSDP checkpoint manager, saving through asyncckpt (see the module docstring).

    Args (as verl's):
        model: the FSDP2 (`fully_shard`) model, a `transformers` model underneath.
        optimizer, lr_scheduler: saved and restored with it.
        processing_class: the tokenizer or processor, saved under `huggingface/`.
        checkpoint_config: verl's checkpoint config: `save_contents` / `load_contents`
            (any of "model", "optimizer", "extra", "hf_model"), `async_save`.
        trust_remote_code: accepted for compatibility (nothing is loaded from code here).
    Raises:
        RuntimeError: torch.distributed is not initialized.
        NotImplementedError: an FSDP1 model (verl's strategy=fsdp): its parameters are
            flat buffers, not DTensors, and only DTensor shards reshard on load.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Any = None, processing_class: Any = None,
                 checkpoint_config: Any = None, trust_remote_code: bool = False,
                 **kwargs: Any) -> None:
        if processing_class is None and "tokenizer" in kwargs:
            processing_class = kwargs.pop("tokenizer")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("asyncckpt's FSDPCheckpointManager needs torch.distributed "
                               "initialized (as verl's workers have it)")
        from torch.distributed.fsdp import FullyShardedDataParallel
        if isinstance(model, FullyShardedDataParallel):
            raise NotImplementedError("asyncckpt's FSDPCheckpointManager saves FSDP2 models "
                                      "(verl's strategy=fsdp2); this one is FSDP1")
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.processing_class = processing_class
        self.checkpoint_config = checkpoint_config
        self.trust_remote_code = trust_remote_code
        everything = ["model", "optimizer", "extra"]
        self.checkpoint_save_contents = list(_get(checkpoint_config, "save_contents", everything))
        self.checkpoint_load_contents = list(_get(checkpoint_config, "load_contents", everything))
        self.async_save = bool(_get(checkpoint_config, "async_save", False))
        if _get(checkpoint_config, "save_lora_only", False):
            log.warning("asyncckpt: save_lora_only is not implemented; the whole model is saved")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.previous_global_step: int | None = None
        self.previous_saved_paths: list[str] = []
        self._root: Path | None = None
        self._writer: Any = None
        self._ckpt: Checkpointer | None = None
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._pending: list[_Job] = []
        self._thread: threading.Thread | None = None
        atexit.register(self.wait_until_finished)

    # verl's predicates, same names
    should_save_model = property(lambda self: "model" in self.checkpoint_save_contents)
    should_save_optimizer = property(lambda self: "optimizer" in self.checkpoint_save_contents)
    should_save_extra = property(lambda self: "extra" in self.checkpoint_save_contents)
    should_save_hf_model = property(lambda self: "hf_model" in self.checkpoint_save_contents)
    should_load_model = property(lambda self: "model" in self.checkpoint_load_contents)
    should_load_optimizer = property(lambda self: "optimizer" in self.checkpoint_load_contents)
    should_load_extra = property(lambda self: "extra" in self.checkpoint_load_contents)

    # -- saving ---------------------------------------------------------------------

    def save_checkpoint(self, local_path: str | None, hdfs_path: str | None = None,
                        global_step: int = 0, max_ckpt_to_keep: int | None = None) -> None:
        """Save this rank's part of step `global_step` (every rank calls it).

        Args:
            local_path: verl's `DIR/global_step_N/<role>`; the checkpoint goes to
                `DIR/asyncckpt/<role>`.
            hdfs_path: ignored (verl's FSDP manager ignores it too).
            max_ckpt_to_keep: keep this many newest steps (None or 0: all).
        Raises:
            SaveFailedError: this save (sync mode) or an earlier one (async) failed.
            UnsupportedStateError: a value that cannot be saved (e.g. a scheduler state
                that is not JSON), named by its key.
        """
        if local_path is None:
            return
        if self.should_save_model and self.model is None:
            raise ValueError("save_contents includes 'model' but no model was given")
        if self.should_save_optimizer and self.optimizer is None:
            raise ValueError("save_contents includes 'optimizer' but no optimizer was given")
        path = Path(local_path)
        keep = max_ckpt_to_keep if isinstance(max_ckpt_to_keep, int) and max_ckpt_to_keep > 0 else None
        ckpt = self._checkpointer(_root_of(path))
        ckpt.options = dataclasses.replace(ckpt.options, keep_last=keep)
        self.previous_global_step = global_step
        path.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            self._save_hf_files(path / "huggingface")
        extra = self._extra() if self.should_save_extra else None
        handle = ckpt.save(global_step, extra=extra, force=True)
        assert handle is not None  # on_busy "block": never skipped
        job = _Job(global_step, path, handle, keep,
                   self.should_save_hf_model and self.should_save_model)
        if self.rank == 0:
            self._start_thread()
            self._pending.append(job)
            self._jobs.put(job)
        if not self.async_save:
            handle.wait()
            if self.rank == 0:
                job.done.wait()
            dist.barrier()

    def wait_until_finished(self) -> None:
        """Block until every save in flight is committed and its follow-up (tracker,
        hf export, retention) done. Called at exit too."""
        if self._ckpt is not None:
            try:
                self._ckpt.wait_until_finished()
            except CheckpointError as e:
                log.error("asyncckpt: a save failed: %s", e)
        for job in list(self._pending):
            job.done.wait()

    def _checkpointer(self, root: Path) -> Checkpointer:
        if self._ckpt is not None:
            if root != self._root:
                raise ValueError(f"this manager saves under {self._root}; {root} is another "
                                 "root (one manager per role)")
            return self._ckpt
        self._root = root
        address = self._start_node_writer(root)
        contents = tuple(c for c in ("model", "optimizer", "extra")
                         if c in self.checkpoint_save_contents)
        options = CheckpointerOptions(save_interval=1, contents=contents or ("extra",),
                                      on_busy="block")
        self._ckpt = Checkpointer(root, model=self.model, optimizer=self.optimizer,
                                  options=options, address=address,
                                  fence=self.optimizer is not None)
        return self._ckpt

    def _start_node_writer(self, root: Path) -> str:
        """The first rank of each host starts that host's writer on `root`; every rank
        learns its host's address through the process group's store."""
        host = socket.gethostname()
        hosts: list[Any] = [None] * self.world_size
        dist.all_gather_object(hosts, host)
        leader = hosts.index(host) == self.rank
        store = dist.distributed_c10d._get_default_store()
        key = f"asyncckpt-verl:{root}:{host}:{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        if leader:
            root.mkdir(parents=True, exist_ok=True)
            job = None if len(set(hosts)) == 1 else f"verl {os.environ.get('MASTER_ADDR')}:" \
                                                      f"{os.environ.get('MASTER_PORT')}"
            self._writer = start_writer(root, job=job, log_file=root.parent / f"{root.name}.writer.log")
            store.set(key, self._writer.address)
        return store.get(key).decode()

    def _save_hf_files(self, directory: Path) -> None:
        """Rank 0: the model's config (and generation config) and the tokenizer, as verl
        writes them whatever the contents, for its merger and for `asyncckpt export`."""
        directory.mkdir(parents=True, exist_ok=True)
        model = getattr(self.model, "_fsdp_wrapped_module", self.model)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)
        generation = getattr(model, "generation_config", None)
        can_generate = getattr(model, "can_generate", lambda: False)
        if generation is not None and can_generate():
            generation.save_pretrained(directory)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(directory)

    def _extra(self) -> dict[str, Any]:
        scheduler = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        return {"lr_scheduler": scheduler, "rng": _rng_state()}

    # -- after the commit (rank 0) ------------------------------------------------------

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._follow_up, name="asyncckpt-verl",
                                            daemon=True)
            self._thread.start()

    def _follow_up(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._committed(job)
            except Exception as e:  # noqa: BLE001 - the thread must go on with the next job
                log.error("asyncckpt: step %d: %s", job.step, e)
            finally:
                job.done.set()
                self._pending.remove(job)

    def _committed(self, job: _Job) -> None:
        try:
            job.handle.wait()
        except CheckpointError as e:
            log.error("asyncckpt: step %d was not committed (%s): the tracker keeps the "
                      "last committed step", job.step, e)
            return
        assert self._root is not None
        if job.hf_model:
            export_hf(self._root, job.local_path / "huggingface", step=job.step)
        _write_atomic(job.local_path / MARKER, json.dumps(
            {"root": os.path.relpath(self._root, job.local_path), "step": job.step}) + "\n")
        if self.async_save:
            _write_atomic(job.local_path.parent.parent / TRACKER, str(job.step))
        self.previous_saved_paths.append(str(job.local_path))
        if job.max_keep is not None and len(self.previous_saved_paths) > job.max_keep:
            cut = len(self.previous_saved_paths) - job.max_keep
            for old in self.previous_saved_paths[:cut]:
                shutil.rmtree(old, ignore_errors=True)
            self.previous_saved_paths = self.previous_saved_paths[cut:]

    # -- loading --------------------------------------------------------------------

    def load_checkpoint(self, local_path: str | None, hdfs_path: str | None = None,
                        del_local_after_load: bool = False) -> None:
        """Restore `load_contents` from the step `local_path` names (every rank calls it).

        Any world size: DTensor shards are read for this rank's own layout; rank-local
        values (RNG state) come from the same rank, or rank 0 beyond the saved world.
        Args:
            local_path: verl's `DIR/global_step_N/<role>`.
            hdfs_path, del_local_after_load: accepted; nothing is downloaded, so
                nothing is deleted.
        Raises:
            CheckpointNotFoundError: step N is not committed under `DIR/asyncckpt/<role>`.
            CorruptCheckpointError, StateMismatchError: as `Checkpointer.restore`.
        """
        if local_path is None:
            return
        root, step = _locate(Path(local_path))
        contents = tuple(c for c in ("model", "optimizer", "extra")
                         if c in self.checkpoint_load_contents)
        if not contents:
            return
        reader = Checkpointer(root, model=self.model, optimizer=self.optimizer, fence=False,
                              options=CheckpointerOptions(contents=contents))
        reader.restore(step=step)
        extra = reader.extra if self.should_load_extra else None
        if isinstance(extra, dict):
            if extra.get("rng") is not None:
                _set_rng_state(extra["rng"])
            if extra.get("lr_scheduler") is not None and self.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        dist.barrier()


def _root_of(local_path: Path) -> Path:
    """`DIR/global_step_N/<role>` -> `DIR/asyncckpt/<role>` (absolute)."""
    local_path = local_path.absolute()
    return local_path.parent.parent / ROOTS / local_path.name


def _locate(local_path: Path) -> tuple[Path, int]:
    """The root and step `local_path` stands for: its marker, else the layout's rule."""
    marker = local_path / MARKER
    if marker.is_file():
        body = json.loads(marker.read_text())
        return (local_path / body["root"]).resolve(), int(body["step"])
    match = re.fullmatch(r"global_step_(\d+)", local_path.absolute().parent.name)
    if match is None:
        raise CheckpointNotFoundError(f"{local_path} is neither an asyncckpt-saved verl step "
                                      f"(no {MARKER}) nor named DIR/global_step_N/<role>",
                                      file=str(local_path))
    return _root_of(local_path), int(match.group(1))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    """CPU, numpy, Python (and accelerator) RNG states as savable values (no pickle)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "cpu": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                  float(gauss)],
        "random": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, inner, gauss_next = state["random"]
    random.setstate((version, tuple(inner), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
