"""The checksummed envelope of manifests and rank parts, and the strict JSON inside it.

Every file that describes a checkpoint (a manifest, a root manifest, a rank's part file
in a node directory) is one line

    {"xxh3":"<16 hex digits>","manifest":<body>}\\n

whose checksum covers the exact bytes of the body, not a re-serialisation: any language
checks it without canonical JSON, and a torn or edited file is caught before anything it
says is used. The body is strict JSON: no `NaN`/`Infinity` (nor a number beyond a double,
such as `1e400`, which Python would read as one), and no object repeating a key
(Python's parser keeps the last value where another reader may keep the first, and one
checkpoint must never read as two).
"""

from __future__ import annotations

import json
import math
from typing import Any

import xxhash

from asyncckpt.errors import CorruptCheckpointError

PREFIX = b'{"xxh3":"'
MIDDLE = b'","manifest":'
SUFFIX = b"}\n"


def seal(body: bytes) -> bytes:
    """`body` (JSON bytes) in the envelope."""
    digest = f"{xxhash.xxh3_64_intdigest(body):016x}".encode()
    return PREFIX + digest + MIDDLE + body + SUFFIX


def unseal(data: bytes, what: str) -> Any:
    """The JSON document inside the envelope `data`.

    Args:
        what: what the file is, for errors ("manifest", "node-00008/rank-00009.json").
    Raises:
        CorruptCheckpointError: not the envelope, a checksum mismatch, not strict JSON,
            or an object repeating a key.
    """
    head = len(PREFIX) + 16 + len(MIDDLE)
    if (len(data) < head + len(SUFFIX) or not data.startswith(PREFIX)
            or data[len(PREFIX) + 16:head] != MIDDLE or not data.endswith(SUFFIX)):
        raise CorruptCheckpointError(f"{what} does not have the checksummed envelope")
    digest = data[len(PREFIX):len(PREFIX) + 16].decode("ascii", "replace")
    body = data[head:-len(SUFFIX)]
    actual = f"{xxhash.xxh3_64_intdigest(body):016x}"
    if digest != actual:
        raise CorruptCheckpointError(f"{what} xxh3 mismatch (recorded {digest}, actual {actual})")
    try:
        return json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float,
                          object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{what} is not valid JSON: {e}") from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent, refused where it overflows a double:
    `1e400` is an infinity by another name, which strict JSON has not."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text:.40} is not finite as a double")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refused if it repeats a key."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"an object repeats the key {key!r:.80}")
            seen.add(key)
    return out
