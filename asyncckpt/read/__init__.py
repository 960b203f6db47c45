"""The read side: opening, verifying, loading (at any world size), exporting and copying
committed checkpoints. It needs no writer and never writes into a root it reads."""
