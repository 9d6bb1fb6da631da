"""tools/bench_common.py, the measurement scripts' shared helpers, on the CPU: shapes, byte
counts, rates, the benchmark's inputs and its same-bytes copy."""

from __future__ import annotations

import pytest
import torch

from tools.bench_common import (bytes_moved, gbps, make_inputs, parse_blocks,
                                parse_positive_ints, parse_shape, pct_of_ceiling, same_bytes_copy,
                                shape_label)

def test_parse_shape():
    assert parse_shape("1x4096x32x128") == (1, 4096, 32, 128)
    for bad in ("1x4096x32", "1x0x32x128", "1x4096x32xD", "-1x2x3x4"):
        with pytest.raises(ValueError, match="BxSxHxD"):
            parse_shape(bad)


@pytest.mark.parametrize("text", ["4,8,16", "12"])
def test_parse_positive_ints(text):
    assert parse_positive_ints("--stages", text) == tuple(int(t) for t in text.split(","))


@pytest.mark.parametrize("text", ["", "4,,8", "0", "-1", "2.5", "three"])
def test_parse_positive_ints_rejects_anything_else(text):
    with pytest.raises(ValueError, match="--stages"):
        parse_positive_ints("--stages", text)


def test_parse_blocks():
    assert parse_blocks("8x1, 16X2") == ((8, 1), (16, 2))
    for bad in ("8x3", "8", "0x1", "8x1x2", "8x1,,4x1", "ax1"):
        with pytest.raises(ValueError, match="ROWSxWARPS pairs of powers of two"):
            parse_blocks(bad)


def test_shape_label():
    assert shape_label((2, 8192, 32, 128)) == "2x8192x32x128"
    assert shape_label((2, 8192, 32, 128), "sbhd") == "2x8192x32x128 sbhd"


def test_bytes_moved_and_rates():
    elements, rows = 1 * 4096 * 32 * 128, 1 * 4096 * 32
    moved = bytes_moved((1, 4096, 32, 128))
    assert moved == {"fwd": 6 * elements + 4 * rows, "bwd": 10 * elements + 4 * rows, "infer": 6 * elements}
    assert gbps(4_000_000, 1000.0) == pytest.approx(4.0)  # 4 MB in 1 ms
    assert pct_of_ceiling(4_000_000, 1000.0, 8.0) == pytest.approx(50.0)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.interpreter
def test_same_bytes_copy_moves_each_phase_s_bytes(backward):
    """The yardstick kernel reads two tensors and writes one (forward), or reads three and
    writes two (backward), over elements past one block."""
    n = 2048 + 5
    a, b, c = (torch.randn(n, dtype=torch.bfloat16) for _ in range(3))
    summed, copied = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    same_bytes_copy((a, b, c, summed, copied), backward)
    torch.testing.assert_close(summed, a + b)  # rounded (GPU) or truncated (interpreter)
    assert torch.equal(copied, c if backward else torch.zeros_like(c))


def test_strided_gate_is_a_slice_of_the_packed_projection():
    x, gate, weight, dy, leaves = make_inputs((2, 3, 4, 8), "strided_gate", device="cpu")
    packed = leaves[1]
    assert packed.shape == (2, 3, 64) and gate._base is packed
    assert gate.shape == x.shape == dy.shape and weight.shape == (8,)
    assert torch.equal(gate, packed[..., 32:].unflatten(-1, (4, 8)))
    assert all(t.requires_grad for t in leaves)
    again = make_inputs((2, 3, 4, 8), "strided_gate", device="cpu")
    assert torch.equal(again[0], x)  # seeded
