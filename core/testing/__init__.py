"""Test-side helpers: the no-GPU shims for megatron-core, the GDN harnesses of the tests and
tools, shared inputs; never imported by the library."""
