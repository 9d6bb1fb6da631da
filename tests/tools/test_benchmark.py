"""tools/benchmark.py: the shapes it measures."""

from __future__ import annotations

from tools import benchmark

def test_benchmark_shapes_include_tensor_parallel_ranks():
    rows = {s[0] * s[1] * s[2] for s in benchmark.SHAPES if s[3] == 128 and s[0] == 1}
    assert {16384, 32768, 65536, 131072, 262144} <= rows
    for heads in (4, 8, 16, 32):
        for seq in (4096, 8192):
            assert (1, seq, heads, 128) in benchmark.SHAPES
    for heads in (8, 16):
        assert (1, 4096, heads, 256) in benchmark.SHAPES
    assert len(benchmark.SHAPES) == len(set(benchmark.SHAPES))
