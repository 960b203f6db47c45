"""zstd frames of Huffman-coded literals: the entropy coder of the byte planes.

An exponent plane's redundancy is in its byte distribution, not in repeated strings: a
Huffman code of its bytes is what it wants (ZipNN codes it so). zstd's fast strategy
still takes the 7-byte matches it finds, and on such data a match costs more as a
sequence than the literals it replaces. Asked to skip ahead between match attempts (a
target length, zstd's "acceleration"), it leaves almost every byte a literal, but then
by default stops Huffman-coding the literals too, unless its experimental literal
compression mode is "enable". python-zstandard's `ZstdCompressionParameters` lacks that
parameter; its cffi backend (the `cffi` extra of zstandard) exposes the whole API of the
same bundled libzstd, so this module sets it there. The output is ordinary zstd frames:
any zstd decoder reads them, and only the encoder depends on this module.

Blocks of 64 KiB (a window of 2^16) give each 64 KiB of a plane its own Huffman table,
which follows the distribution along a tensor better than zstd's largest blocks for a
few more tables; smaller blocks store hardly less and encode markedly slower. Where runs
of one byte matter (Adam moments that are zero in an embedding's unseen rows), Huffman's
bit per byte loses to matches: a plane that literals shrink below `runs_below` of its
size is compressed with matches too, and the smaller frame kept, which stores as little
as trying matches on every plane at much less of their encode cost. The measurements:
docs/design/literals.md.
"""

from __future__ import annotations

from typing import Any, Protocol

import zstandard


class Compressor(Protocol):
    def compress(self, data: Any) -> bytes:
        """One zstd frame of the contiguous buffer `data`, its content size declared."""
        ...


def _backend() -> Any:
    """zstandard's cffi backend module, or None (imported on first use: only a writer
    codes planes)."""
    global _cffi
    if _cffi is False:
        try:
            from zstandard import backend_cffi
        except ImportError:
            _cffi = None
        else:  # the parameter is experimental: a libzstd without it counts as missing
            known = hasattr(backend_cffi.lib, "ZSTD_c_literalCompressionMode")
            _cffi = backend_cffi if known else None
    return _cffi


_cffi: Any = False  # not looked for yet
WINDOW_LOG = 16  # 64 KiB blocks, a Huffman table each (see the module docstring)


def available() -> bool:
    """Whether zstandard's cffi backend is importable (`pip install 'zstandard[cffi]'`)."""
    return _backend() is not None


class LiteralsCompressor:
    """Compresses buffers into zstd frames of Huffman-coded literals (few or no matches).
    Not thread-safe: one per thread, like the codecs that hold one.

    Args:
        window_log: log2 of the window and block size (each block has its own Huffman
            table; zstd's blocks are at most 128 KiB).
        target_length: zstd fast's acceleration: larger skips further between match
            attempts (fewer matches).
        matches: a compressor with matches, tried where literals shrink a buffer below
            `runs_below` of its size; the smaller frame is kept. None: never tried.
    Raises:
        RuntimeError: zstandard's cffi backend is missing (see `available`).
    """

    def __init__(self, window_log: int = WINDOW_LOG, target_length: int = 256,
                 matches: Compressor | None = None, runs_below: float = 0.2) -> None:
        backend = _backend()
        if backend is None:
            raise RuntimeError("zstandard's cffi backend is missing: "
                               "pip install 'zstandard[cffi]'")
        self._lib, self._ffi = lib, ffi = backend.lib, backend.ffi
        self._cctx = ffi.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
        for param, value in ((lib.ZSTD_c_strategy, lib.ZSTD_fast),
                             (lib.ZSTD_c_windowLog, window_log),
                             (lib.ZSTD_c_hashLog, 6),
                             (lib.ZSTD_c_minMatch, 7),
                             (lib.ZSTD_c_targetLength, target_length),
                             (lib.ZSTD_c_literalCompressionMode, lib.ZSTD_ps_enable),
                             (lib.ZSTD_c_contentSizeFlag, 1),
                             (lib.ZSTD_c_checksumFlag, 0)):
            self._check(lib.ZSTD_CCtx_setParameter(self._cctx, param, value))
        self._matches = matches
        self._runs_below = runs_below
        self._out = bytearray()  # reused: a fresh one would pay first-touch page faults

    def compress(self, data: Any) -> bytes:
        """One zstd frame of `data` (any contiguous buffer), its content size declared."""
        size = memoryview(data).nbytes
        bound = self._lib.ZSTD_compressBound(size)
        if len(self._out) < bound:
            self._out = bytearray(bound)
        out, source = self._ffi.from_buffer(self._out), self._ffi.from_buffer(data)
        written = self._check(self._lib.ZSTD_compress2(self._cctx, out, bound, source, size))
        if self._matches is not None and written < self._runs_below * size:
            matched = self._matches.compress(data)
            if len(matched) < written:
                return matched
        return memoryview(self._out)[:written].tobytes()

    def _check(self, code: int) -> int:
        if self._lib.ZSTD_isError(code):
            name = self._ffi.string(self._lib.ZSTD_getErrorName(code))
            raise zstandard.ZstdError(name.decode())
        return code
