"""Hugging Face metadata in a checkpoint, and what `export` needs to make a model directory.

A `from_pretrained` directory is weights plus `config.json` (plus `generation_config.json`
and the tokenizer's files). The weights are the checkpoint's tensors; the config exists
only in the training process, next to the model object. So the Checkpointer stores it,
as JSON text, in the saved state itself under the top-level key "hf":

    {"config": "<config.json text>", "generation_config": "<generation_config.json text>"}

The state tree already carries strings exactly, so this needs no new manifest field, is
committed atomically with the step's tensors, and any reader loads it as plain values.
JSON text rather than a nested tree: it round-trips byte for byte, whatever it holds.

transformers is imported only where a model class must be built (to learn which weights
it ties); everything else here works on JSON alone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections import defaultdict
from collections.abc import Iterable, Mapping
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch

from asyncckpt.storage.durable import fsync_path, write_atomic

HF_KEY = "hf"
TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                      "merges.txt", "*.model", "*.tiktoken", "chat_template*")
log = logging.getLogger("asyncckpt.hf")


def hf_metadata(model: torch.nn.Module | None, config: Any = None,
                generation_config: Any = None) -> dict[str, str] | None:
    """The "hf" entry to save with `model`: its config (and generation config) as JSON text.

    Args:
        model: a `transformers` PreTrainedModel (also wrapped by FSDP2's `fully_shard`),
            or any module (then only `config` counts).
        config, generation_config: given explicitly (a transformers config object or a
            mapping); they win over the model's own.
    Returns:
        {"config": ..., "generation_config": ...} (the latter only when there is one), or
        None when there is no config at all.
    Raises:
        TypeError: a config that is neither a config object nor a mapping.
    """
    if config is None and model is not None and _is_hf_model(model):
        config = getattr(model, "config", None)
    if config is None:
        return None
    if not _is_config(config):
        raise TypeError(f"a Hugging Face config must be a config object or a mapping, not "
                        f"{type(config).__name__}")
    meta = {"config": _config_json(config, _architecture(model))}
    if generation_config is None and model is not None and _is_hf_model(model):
        generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and _is_config(generation_config):
        meta["generation_config"] = _config_json(generation_config, None)
    return meta


def read_hf_metadata(tree: Any) -> dict[str, str]:
    """The "hf" entry of a rank's saved tree (manifest JSON), or {} when it has none.

    Only string values of the entry are returned: a damaged or foreign "hf" key never
    ends up in a written config.
    """
    if not (isinstance(tree, dict) and isinstance(tree.get("dict"), list)):
        return {}
    for item in tree["dict"]:
        if isinstance(item, list) and len(item) == 2 and item[0] == HF_KEY:
            node = item[1]
            if isinstance(node, dict) and isinstance(node.get("dict"), list):
                pairs = (i for i in node["dict"] if isinstance(i, list) and len(i) == 2)
                return {k: v for k, v in pairs if isinstance(k, str) and isinstance(v, str)}
    return {}


def write_model_files(out: Path, meta: Mapping[str, str], dtype_name: str | None) -> list[str]:
    """Write `config.json` (its dtype set to `dtype_name`, the floating dtype the weights
    were written in) and `generation_config.json` when `meta` holds one.

    Both dtype keys are written: `torch_dtype` for transformers 4.x, `dtype` for 5.x
    (each reads the one it knows and accepts the other).
    Returns:
        The file names written.
    """
    written = []
    if "config" in meta:
        config = json.loads(meta["config"])
        if dtype_name is not None:
            config["torch_dtype"] = config["dtype"] = dtype_name
        _write_json(out / "config.json", config)
        written.append("config.json")
    if "generation_config" in meta:
        _write_json(out / "generation_config.json", json.loads(meta["generation_config"]))
        written.append("generation_config.json")
    return written


def copy_tokenizer(source: str | os.PathLike[str], out: Path) -> list[str]:
    """Copy the tokenizer files of directory `source` (tokenizer*.json, vocab, merges,
    sentencepiece models, chat templates) into `out`.

    Returns:
        The file names copied.
    Raises:
        ValueError: `source` is not a directory, or holds no tokenizer file.
    """
    source = Path(source)
    if not source.is_dir():
        raise ValueError(f"tokenizer directory {source} does not exist")
    names = sorted(p.name for p in source.iterdir() if p.is_file()
                   and any(fnmatch(p.name, pattern) for pattern in TOKENIZER_PATTERNS))
    if not names:
        raise ValueError(f"{source} holds no tokenizer file "
                         f"(looked for {', '.join(TOKENIZER_PATTERNS)})")
    for name in names:
        shutil.copyfile(source / name, out / name)
        fsync_path(out / name)  # durable before the index that makes `out` complete
    return names


def tied_duplicates(config_text: str, names: Iterable[str]) -> set[str]:
    """The names among `names` that the config's model class ties to another of them and
    that `save_pretrained` would leave out (e.g. `lm_head.weight` tied to the embeddings).

    The model class is built on the meta device (no memory, no download) to see which
    parameters are one object. Returns an empty set when transformers or the class is
    not available: every tensor is then exported, which `from_pretrained` also accepts.
    """
    names = set(names)
    try:
        import transformers
        config = json.loads(config_text)
        arch = (config.get("architectures") or [None])[0]
        cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
        if cls is None:
            return set()
        with torch.device("meta"):
            model = cls(cls.config_class.from_dict(config))
    except Exception as e:  # noqa: BLE001 - an optional refinement; say why it was skipped
        log.info("asyncckpt export: tied weights not looked up (%s: %s); every tensor is exported",
                 type(e).__name__, e)
        return set()
    declared = set()
    for prefix, module in model.named_modules():
        for key in getattr(module, "_tied_weights_keys", None) or ():
            declared.add(f"{prefix}.{key}" if prefix else key)
    groups: dict[int, list[str]] = defaultdict(list)
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups[id(tensor)].append(name)
    drop: set[str] = set()
    for group in groups.values():
        present = [n for n in group if n in names]
        if len(present) < 2:
            continue
        kept = [n for n in present if not _declared(n, declared)] or present[:1]
        drop.update(n for n in present if n != kept[0])
    return drop


def _declared(name: str, patterns: set[str]) -> bool:
    if name in patterns:
        return True
    for pattern in patterns:
        try:
            if re.fullmatch(pattern, name):
                return True
        except re.error:
            continue
    return False


def _is_config(obj: Any) -> bool:
    return isinstance(obj, Mapping) or callable(getattr(obj, "to_dict", None))


def _is_hf_model(model: Any) -> bool:
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
               for c in type(model).__mro__)


def _architecture(model: Any) -> str | None:
    """The transformers class a model is (FSDP2's dynamic `FSDP<Name>` subclass and user
    subclasses are skipped: the name must be one `from_pretrained` can build)."""
    if model is None or not _is_hf_model(model):
        return None
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.models."):
            return cls.__name__
    return None


def _config_json(config: Any, architecture: str | None) -> str:
    if isinstance(config, Mapping):
        body = dict(config)
    else:
        body = (json.loads(config.to_json_string(use_diff=False))
                if hasattr(config, "to_json_string") else dict(config.to_dict()))
    if architecture is not None and not body.get("architectures"):
        body["architectures"] = [architecture]
    try:
        return json.dumps(body, sort_keys=True)
    except TypeError as e:
        raise TypeError(f"the Hugging Face config is not JSON: {e}") from None


def _write_json(path: Path, body: Any) -> None:
    """Write `body` to `path` durably, by rename (a unique tmp: two export parts that
    finish at once write the same file side by side), before the index that makes the
    directory complete."""
    write_atomic(path, (json.dumps(body, indent=2, sort_keys=True) + "\n").encode())
