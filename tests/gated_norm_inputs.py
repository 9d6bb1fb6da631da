"""Inputs shared by the gated norm's tests and GPU checks: the device they run on, the eps, and
random [B, S, H, D] activations, gate and weight (make_inputs; make_grad_inputs, from
core.testing.inputs, which the measurement tools use too, for a backward at GPU sizes), plus
the strided layouts Megatron hands the kernels (a gate sliced from a packed projection, a
[B, S, H, D] view of an [S, B, H, D] buffer, an address off 16-byte alignment).

Import it as ``tests.gated_norm_inputs`` from the repository root (``python -m pytest`` puts it
on sys.path; tests/__init__.py makes ``tests`` a regular package, so no other installed
``tests`` package can shadow it).
"""

from __future__ import annotations

import torch

from core.testing.inputs import make_grad_inputs  # noqa: F401  (shared with tools/)

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


def sequence_slice(t, extra=3):
    """The values of ``t`` as a [B, S, H, D] view of the first S tokens of a [B, S + extra, H, D]
    buffer: with B > 1, batch and sequence do not fold into one token stride."""
    batch, seq, heads, dim = t.shape
    buffer = t.new_zeros(batch, seq + extra, heads, dim)
    buffer[:, :seq].copy_(t)
    return buffer[:, :seq]
