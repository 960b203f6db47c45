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
from typing import Iterable, NamedTuple

from asyncckpt.codec.registry import REGISTRY, codec_spec

FORMAT_NAME = "asyncckpt"
FORMAT_VERSION = 1        # what a manifest without references is written as
FORMAT_VERSION_REFS = 2   # a manifest holding reference frames (incremental saves)
READABLE_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_REFS)
MANIFEST_NAME = "manifest.json"
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
MAX_WORLD = 1 << 20  # the manifest's bound on world_size
# incremental saves cut frames at both edges of every tensor this large, so only such a
# tensor fills frames of its own that a later step can reference (or a client skip)
CUT_BYTES = 64 << 10

_STEP_DIR = re.compile(r"step-([0-9]{8,})")
_RETIRED_DIR = re.compile(r"step-([0-9]{8,})\.retired")
RETIRED_SUFFIX = ".retired"
_TMP_DIR = re.compile(r"step-([0-9]{8,})\.tmp-[0-9a-f]+")
_REPLACED_DIR = re.compile(r"step-([0-9]{8,})\.replaced-[0-9a-f]+")
_DATA_FILE = re.compile(r"rank-[0-9]{5,}\.safetensors(%s)" % "|".join(
    re.escape(spec.suffix) for spec in REGISTRY.values()))
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
    """The step of a committed directory name, else None."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def retired_dir_name(step: int) -> str:
    """`step-N.retired`: a deleted step whose data a kept step still references."""
    return step_dir_name(step) + RETIRED_SUFFIX


def parse_retired_dir(name: str) -> int | None:
    """The step of a retired directory name, else None."""
    m = _RETIRED_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def is_atomic_tmp_file(name: str) -> bool:
    """A `.NAME.tmp-<hex>` file that an interrupted atomic write (of `latest`) left."""
    return _ATOMIC_TMP.fullmatch(name) is not None


def parse_replaced_dir(name: str) -> int | None:
    """The step of a `step-N.replaced-<hex>` directory: a committed step set aside while
    a new save of the same step takes its name (only where the filesystem cannot swap
    two directories in one rename), else None."""
    m = _REPLACED_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def is_tmp_dir(name: str) -> bool:
    return _TMP_DIR.fullmatch(name) is not None


def tmp_step_of(name: str) -> int | None:
    m = _TMP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def data_file_name(rank: int, codec: str) -> str:
    """`rank-00000.safetensors` plus the codec's suffix (see codec.REGISTRY).

    Raises:
        CorruptCheckpointError: `codec` is not a stored codec.
    """
    return f"rank-{rank:05d}.safetensors" + codec_spec(codec).suffix


def is_data_file_name(name: str) -> bool:
    """A name `data_file_name` could have made (any rank, any stored codec): a plain
    name, never a path."""
    return data_file_codec(name) is not None


def data_file_codec(name: str) -> str | None:
    """The codec a data file name's suffix stands for (`rank-00000.safetensors.bg`:
    bytegroup), or None if `data_file_name` could not have made it."""
    m = _DATA_FILE.fullmatch(name)
    return None if m is None else _SUFFIX_CODECS[m.group(1)]


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
    header: dict[str, object] = {"__metadata__": {"format": "pt", "writer": FORMAT_NAME}}
    offset = 0
    for name, dtype, shape in items:
        size = element_size(dtype)
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
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
