"""Inputs shared by the gated norm's tests and GPU checks: the device they run on, the eps, and
random [B, S, H, D] activations, gate and weight, plus the strided layouts Megatron hands the
kernels (a gate sliced from a packed projection, a [B, S, H, D] view of an [S, B, H, D] buffer).

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


def packed_projection_gate(shape, dtype, seed=0):
    """A gate of [B, S, H, D] ``shape`` as the middle slice of a packed [B, S, 3 * H * D]
    projection: token-strided, read in place by the kernels."""
    batch, seq, heads, dim = shape
    gen = torch.Generator().manual_seed(seed + 100)
    proj = torch.randn(batch, seq, 3 * heads * dim, generator=gen).to(DEVICE, dtype)
    return proj[..., heads * dim: 2 * heads * dim].view(batch, seq, heads, dim)


def sbhd_view(t):
    """The values of ``t`` as a [B, S, H, D] view of a contiguous [S, B, H, D] buffer."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)
