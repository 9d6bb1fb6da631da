"""Inputs shared by the gated norm's tests and GPU checks: the device they run on, the eps, and
random [B, S, H, D] activations, gate and weight (make_inputs; make_grad_inputs for a backward
at GPU sizes), plus the strided layouts Megatron hands the kernels (a gate sliced from a packed
projection, a [B, S, H, D] view of an [S, B, H, D] buffer, an address off 16-byte alignment).

Import it as ``tests.gated_norm_inputs`` from the repository root (``python -m pytest`` puts it
on sys.path; tests/__init__.py makes ``tests`` a regular package, so no other installed
``tests`` package can shadow it).
"""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def make_inputs(shape, dtype=torch.bfloat16, weight_dtype=None, seed=0):
    """x ~ N(0, 1) and gate ~ N(0, 4) of ``shape`` (contiguous) and a weight ~ 1 + N(0, 0.04) of
    shape (shape[-1],), on DEVICE; the same values on every device for a seed."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    gate = (2 * torch.randn(shape, generator=gen)).to(DEVICE, dtype)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(DEVICE, weight_dtype or dtype)
    return x, gate, weight


def make_grad_inputs(shape, variant="plain", dtype=torch.bfloat16, seed=0, device=None):
    """Inputs of a forward and backward at any size (the GPU checks, up to 2**31 elements and
    more; the benchmark tools too, through tools/bench_common.py): x ~ N(0, 1), gate ~ N(0, 4),
    weight ~ 1 + N(0, 0.04) and dy ~ N(0, 1), drawn in ``dtype`` on ``device`` (default DEVICE)
    by a private generator (no host copy of a large tensor; the default CUDA generator is tied
    to graph capture state). The values differ from make_inputs's.

    variant "plain": x, gate and weight are the leaves that require grad; "strided_gate": the
    gate is the second half of a packed [B, S, 2 * H * D] projection (read in place by the
    kernels), and that projection is the leaf. Returns (x, gate, weight, dy, leaves)."""
    if variant not in ("plain", "strided_gate"):
        raise ValueError(f"make_grad_inputs: variant must be 'plain' or 'strided_gate', got {variant!r}")
    device = device or DEVICE
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


def packed_projection_gate(shape, dtype, seed=0, misalign=0):
    """A gate of [B, S, H, D] ``shape`` as the middle slice of a packed [B, S, 3 * H * D +
    misalign] projection: token-strided, read in place by the kernels; ``misalign`` elements
    later than H * D (1: an address that is not 16-byte aligned, another compiled kernel)."""
    batch, seq, heads, dim = shape
    gen = torch.Generator().manual_seed(seed + 100)
    proj = torch.randn(batch, seq, 3 * heads * dim + misalign, generator=gen).to(DEVICE, dtype)
    start = heads * dim + misalign
    return proj[..., start: start + heads * dim].view(batch, seq, heads, dim)


def shifted(t, elements=1):
    """A contiguous copy of ``t`` that starts ``elements`` past the start of its buffer (1: not
    16-byte aligned)."""
    buffer = t.new_empty(t.numel() + elements)
    view = buffer[elements:].view(t.shape)
    view.copy_(t)
    return view


def sbhd_view(t):
    """The values of ``t`` as a [B, S, H, D] view of a contiguous [S, B, H, D] buffer."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)
