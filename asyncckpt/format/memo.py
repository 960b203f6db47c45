"""Small bounded memos of the format's pure checks, keyed by exactly what was checked.

The writer checks every rank's object tree and tensor table with the reader's rules at
the begin of each save, and again in the manifest it is about to commit; a job's saves
repeat the same structures save after save, so the same pure function runs on the same
input again and again. A memo here remembers that an input passed, keyed by its exact
content, so a repeat costs a serialisation and a hash instead of the check.

The key is exact: the input is pickled (fast mode: no memo of shared objects, so only
structure, types and values matter) by a pickler that refuses anything but None, bools
and exact int, float, str, bytes, list, tuple and dict, whose pickle says type and value
in full (a tuple is not a list, 1 is not 1.0 nor True nor an IntEnum, a key 1 is not
"1"); the key is that pickle's length and its BLAKE2b-256 digest. Anything else
(another type, a cycle, nesting too deep to pickle) has no key and is checked every
time. Only passes are remembered, as immutable values, never the input object: an
object changed after its check has another key. Each memo holds a few entries, the
most recently used.
"""

from __future__ import annotations

import collections
import hashlib
import io
import pickle
import threading
from typing import Any, Generic, TypeVar

Key = tuple[int, bytes]
V = TypeVar("V")


class _PlainPickler(pickle.Pickler):
    """Pickles only what its own fast paths take (exact builtin types): everything else
    reaches `reducer_override`, which refuses it."""

    def reducer_override(self, obj: Any) -> Any:
        raise TypeError(f"{type(obj).__name__} has no exact key")


def exact_key(value: Any) -> Key | None:
    """`value`'s exact key (module docstring), or None where it has none."""
    buffer = io.BytesIO()
    pickler = _PlainPickler(buffer, protocol=5)
    pickler.fast = True  # no memo: equal values pickle alike however they share objects
    try:
        pickler.dump(value)
    except (TypeError, ValueError, RecursionError, pickle.PicklingError):
        return None
    data = buffer.getbuffer()
    return len(data), hashlib.blake2b(data, digest_size=32).digest()


class Memo(Generic[V]):
    """The last `size` passes of one check, by exact key; safe across threads."""

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._entries: collections.OrderedDict[Key, V] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Key | None) -> V | None:
        if key is None:
            return None
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Key | None, value: V) -> None:
        if key is None:
            return
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
