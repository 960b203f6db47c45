"""The writer process: one per node, serving every local rank. It frames, encodes,
checksums and appends each rank's bytes and commits the step; it never imports torch."""
