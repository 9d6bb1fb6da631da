"""Measurement scripts (GPU) and their CPU-side report; see docs/benchmarks.md."""
