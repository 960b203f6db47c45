"""The bytes of a rank's data file: a safetensors stream, cut into frames.

A rank's data is laid out exactly as one safetensors file (8-byte little-endian header
length, JSON header padded with spaces to 8 bytes, then every tensor's bytes back to
back in save order). Keeping that layout, rather than a format of our own, means a
raw-codec data file of a step without references *is* a safetensors file and a zstd one
decompresses (`zstd -d`) to one: any tool that reads safetensors reads our checkpoints,
no asyncckpt needed (an incremental step's file holds only the frames it did not
reference; `asyncckpt copy` makes a stand-alone one). The stream is cut into frames of
at most one ring slot, and at the edges of large tensors; each frame is encoded on its
own, so the writer streams and the reader can check and decode any frame independently.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from typing import NamedTuple

from asyncckpt.codec.registry import REGISTRY, codec_spec

FORMAT_NAME = "asyncckpt"
FORMAT_VERSION = 1        # what a manifest without references is written as
FORMAT_VERSION_REFS = 2   # a manifest holding reference frames (incremental saves)
FORMAT_VERSION_PARTS = 3  # a root manifest whose ranks are in rank parts (format/parts.py)
READABLE_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_REFS, FORMAT_VERSION_PARTS)
MANIFEST_NAME = "manifest.json"
RANK_PART_SUFFIX = ".json"  # a rank's part file in its node directory: rank-00009.json
METADATA_KEY = "__metadata__"  # the safetensors header's first key; never a tensor name
LATEST_NAME = "latest"
LOCK_NAME = ".asyncckpt.lock"
ROOT_ID_NAME = ".asyncckpt.root"

# safetensors dtype names and element sizes. Kept free of torch so that the writer
# process never imports it (torch alone is ~140 MiB of private memory).
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8,
    "F16": 2, "BF16": 2, "F32": 4, "F64": 8,
    "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1,
}

MAX_STEP = (1 << 62) - 1  # the manifest's integer bound
# the bound on a step's world size (so on its ranks and nodes): a manifest, a message, a
# rank or node directory name and the writer's step table all hold to this one name
MAX_WORLD = 1 << 20
# incremental saves cut frames at both edges of every tensor this large, so only such a
# tensor fills frames of its own that a later step can reference (or a client skip)
CUT_BYTES = 64 << 10

# Every number in a name is written one way: zero-padded to a width (8 digits for a
# step, 5 for a rank), and past that width in plain decimal, no leading zero. A name
# spelling a number another way (`step-000000100`), or one beyond the number's bound
# (a step from 2^62, a rank from 2^20), is not a name asyncckpt makes, so it is none of
# these things: otherwise two directories would be one step.
_STEP = r"([0-9]{8}|[1-9][0-9]{8,18})"
_RANK = r"([0-9]{5}|[1-9][0-9]{5,6})"
_SUFFIXES = "|".join(re.escape(spec.suffix) for spec in REGISTRY.values())
_STEP_DIR = re.compile(r"step-" + _STEP)
_RETIRED_DIR = re.compile(r"step-" + _STEP + r"\.retired")
RETIRED_SUFFIX = ".retired"
_TMP_DIR = re.compile(r"step-" + _STEP + r"\.tmp-[0-9a-f]+")
_REPLACED_DIR = re.compile(r"step-" + _STEP + r"\.replaced-[0-9a-f]+")
_DATA_FILE = re.compile(r"(?:(node-[0-9]{5,})/)?rank-" + _RANK
                        + r"\.safetensors(" + _SUFFIXES + ")")
_NODE_DIR = re.compile(r"node-" + _RANK)
_NODE_ENTRY = re.compile(r"rank-" + _RANK + "(" + re.escape(RANK_PART_SUFFIX)
                         + r"|\.safetensors(?:" + _SUFFIXES + "))")
_SUFFIX_CODECS = {spec.suffix: spec.name for spec in REGISTRY.values()}
_ATOMIC_TMP = re.compile(r"\.[^/]+\.tmp-[0-9a-f]+")


class TensorSpec(NamedTuple):
    """A tensor in a rank's stream: `begin`..`end` are absolute stream offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a committed directory name (one `step_dir_name` makes), else None."""
    return _number(_STEP_DIR.fullmatch(name), MAX_STEP)


def _number(m: re.Match[str] | None, bound: int) -> int | None:
    """The number a name's first group spells, if the pattern matched and it is within
    `bound` (the patterns admit only the one spelling of each number)."""
    if m is None:
        return None
    number = int(m.group(1))
    return number if number <= bound else None


def retired_dir_name(step: int) -> str:
    """`step-N.retired`: a deleted step whose data a kept step still references."""
    return step_dir_name(step) + RETIRED_SUFFIX


def parse_retired_dir(name: str) -> int | None:
    """The step of a retired directory name, else None."""
    return _number(_RETIRED_DIR.fullmatch(name), MAX_STEP)


def is_atomic_tmp_file(name: str) -> bool:
    """A `.NAME.tmp-<hex>` file that an interrupted atomic write (of `latest`) left."""
    return _ATOMIC_TMP.fullmatch(name) is not None


def parse_replaced_dir(name: str) -> int | None:
    """The step of a `step-N.replaced-<hex>` directory: a committed step set aside while
    a new save of the same step takes its name (only where the filesystem cannot swap
    two directories in one rename), else None."""
    return _number(_REPLACED_DIR.fullmatch(name), MAX_STEP)


def is_tmp_dir(name: str) -> bool:
    return tmp_step_of(name) is not None


def tmp_step_of(name: str) -> int | None:
    return _number(_TMP_DIR.fullmatch(name), MAX_STEP)


def data_file_name(rank: int, codec: str) -> str:
    """`rank-00000.safetensors` plus the codec's suffix (see codec.REGISTRY).

    Raises:
        CorruptCheckpointError: `codec` is not a stored codec.
    """
    return f"rank-{rank:05d}.safetensors" + codec_spec(codec).suffix


def node_dir_name(first: int) -> str:
    """`node-00008`: the directory of a step in parts holding the node part whose first
    rank is `first`: its ranks' part files and data files."""
    return f"node-{first:05d}"


def parse_node_dir(name: str) -> int | None:
    """The first rank of a node directory name `node_dir_name` could have made, else None
    (`node-000008`, with a zero `node_dir_name` would not write, is None)."""
    return _number(_NODE_DIR.fullmatch(name), MAX_WORLD - 1)


def is_node_dir_name(name: str) -> bool:
    """A name `node_dir_name` could have made."""
    return parse_node_dir(name) is not None


def node_data_file_name(first: int, rank: int, codec: str) -> str:
    """`node-00008/rank-00009.safetensors.zst`: rank `rank`'s data file in the node
    directory of the part beginning at rank `first`, relative to the step directory.

    Raises:
        CorruptCheckpointError: `codec` is not a stored codec.
    """
    return f"{node_dir_name(first)}/{data_file_name(rank, codec)}"


def rank_part_name(rank: int) -> str:
    """`rank-00009.json`: rank `rank`'s part file (its tables) in its node directory."""
    return f"rank-{rank:05d}{RANK_PART_SUFFIX}"


def parse_node_entry(name: str) -> tuple[int, bool] | None:
    """(rank, is its part file) of a name that may lie in a node directory: a rank's part
    file (`rank_part_name`) or data file (`data_file_name`, any stored codec), its rank
    written as those functions write it; else None (`rank-000009.json` is None)."""
    m = _NODE_ENTRY.fullmatch(name)
    rank = _number(m, MAX_WORLD - 1)
    if m is None or rank is None:
        return None
    return rank, m.group(2) == RANK_PART_SUFFIX


def is_data_file_name(name: str) -> bool:
    """A name a step's data file can have, relative to its step directory: one
    `data_file_name` could have made (any rank, any stored codec), or one
    `node_data_file_name` could have (one node directory, holding only ranks from its
    first on). Never any other path: no `..`, no absolute path, no other folder."""
    return data_file_codec(name) is not None


def data_file_codec(name: str) -> str | None:
    """The codec a data file name's suffix stands for (`rank-00000.safetensors.bg`,
    `node-00008/rank-00009.safetensors.bg`: bytegroup), or None if it is not a name
    `is_data_file_name` accepts."""
    m = _DATA_FILE.fullmatch(name)
    if m is None:
        return None
    rank = int(m.group(2))
    node = m.group(1)
    if rank >= MAX_WORLD:
        return None
    if node is not None:
        first = parse_node_dir(node)
        if first is None or rank < first:
            return None
    return _SUFFIX_CODECS[m.group(3)]


def element_size(dtype_name: str) -> int:
    return DTYPE_SIZES[dtype_name]


def layout(tensors: Iterable[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, list[TensorSpec]]:
    """Lay out a safetensors stream: its header bytes and each tensor's byte range.

    Args:
        tensors: (name, dtype name, shape) in stream order.
    Returns:
        (the 8-byte length prefix plus the padded JSON header, the specs with absolute
        offsets in the stream).
    """
    items = list(tensors)
    header: dict[str, object] = {METADATA_KEY: {"format": "pt", "writer": FORMAT_NAME}}
    offset = 0
    for name, dtype, shape in items:
        size = element_size(dtype)
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    base = len(prefix)
    specs = []
    for name, dtype, shape in items:
        begin, end = header[name]["data_offsets"]  # type: ignore[index]
        specs.append(TensorSpec(name, dtype, tuple(shape), base + begin, base + end))
    return prefix, specs
