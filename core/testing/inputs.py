"""Inputs of a forward and backward of the gated norm at any size, shared by the GPU tests
(through tests/gated_norm_inputs.py) and the measurement tools (tools/bench_common.py)."""

from __future__ import annotations

import torch


def make_grad_inputs(shape, variant="plain", dtype=torch.bfloat16, seed=0, device=None):
    """Inputs of a forward and backward at any size (the GPU checks, up to 2**31 elements and
    more; the benchmark tools): x ~ N(0, 1), gate ~ N(0, 4), weight ~ 1 + N(0, 0.04) and
    dy ~ N(0, 1), drawn in ``dtype`` on ``device`` (default: the GPU where there is one) by a
    private generator (no host copy of a large tensor; the default CUDA generator is tied to
    graph capture state). The values differ from tests/gated_norm_inputs.make_inputs's.

    variant "plain": x, gate and weight are the leaves that require grad; "strided_gate": the
    gate is the second half of a packed [B, S, 2 * H * D] projection (read in place by the
    kernels), and that projection is the leaf. Returns (x, gate, weight, dy, leaves)."""
    if variant not in ("plain", "strided_gate"):
        raise ValueError("make_grad_inputs: variant must be 'plain' or 'strided_gate', "
                         f"got {variant!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    batch, seq, heads, dim = shape

    def randn(*size):
        return torch.randn(size, device=device, dtype=dtype, generator=gen)

    x = randn(*shape).requires_grad_()
    if variant == "strided_gate":
        packed = (2 * randn(batch, seq, 2 * heads * dim)).requires_grad_()
        gate = packed[..., heads * dim:].unflatten(-1, (heads, dim))
        leaves = (x, packed)
    else:
        gate = (2 * randn(*shape)).requires_grad_()
        leaves = (x, gate)
    weight = (1 + 0.2 * randn(dim)).requires_grad_()
    dy = randn(*shape)
    return x, gate, weight, dy, (*leaves, weight)
