"""Benchmarks: `make bench-memory` (and, with the benchmark issue, `make bench`)."""
