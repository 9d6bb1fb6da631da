"""Test-side helpers (no-GPU shims for megatron-core); never imported by the library."""
