"""Frame codecs (raw, zstd, bytegroup) and the byte-plane and literal coders under them.

Pure bytes in, bytes out: no torch, no files. Both the writer (encode) and the read side
(decode) use them, so they sit below both."""
