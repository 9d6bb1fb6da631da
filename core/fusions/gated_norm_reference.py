"""Plain-torch references of the gated norm, the one definition used by tests and benchmarks;
``rms_norm`` is also the forward of the no-TE output norm (``core.transformer.RMSNorm``).

``unfused_gated_norm`` is what Megatron's unfused GDN path computes (a TE-style RMSNorm with one
rounding, then the fp32 gate product, then a second rounding): the training kernels must equal
it bit for bit. ``one_rounding_gated_norm`` is vLLM's / FLA's semantics (fp32 throughout, one
rounding at the end), used by the inference entry point (``inference_gated_norm`` on its
[tokens, heads * head_dim] tensors). Called with float64 tensors, both are
the exact references for error measurements. ``ulp_distance`` is the one ulp measure,
``bitwise_share`` the one share of equal elements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _activation(gate: torch.Tensor, activation: str) -> torch.Tensor:
    return torch.sigmoid(gate) if activation == "sigmoid" else F.silu(gate)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False,
             rstd: torch.Tensor | None = None):
    """TE-style RMSNorm: fp32 (or wider) math, one rounding to promote_types(x, weight).

    ``rstd``: use these inverse RMS values (one per row) instead of computing them, to separate
    the order of the sum of squares from everything else (tools/parity_sources.py)."""
    compute = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    xf = x.to(compute)
    w = weight.to(compute) + 1 if zero_centered else weight.to(compute)
    if rstd is None:
        rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return (xf * rstd.to(compute)[..., None] * w).to(torch.promote_types(x.dtype, weight.dtype))


def unfused_gated_norm(x, gate, weight, eps, zero_centered=False, gate_activation="silu",
                       rstd=None):
    """Megatron's ``_apply_gated_norm``: ``(out_norm(x) * act(gate.float())).to(x.dtype)``."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    y = rms_norm(x, weight, eps, zero_centered, rstd)
    return (y * _activation(gate.to(compute), gate_activation)).to(x.dtype)


def one_rounding_gated_norm(x, gate, weight, eps, norm_before_gate=True, activation="silu"):
    """vLLM / FLA semantics: fp32 math end to end, one rounding to x's dtype at the store."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf, act = x.to(compute), _activation(gate.to(compute), activation)
    if not norm_before_gate:
        xf = xf * act
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute)
    if norm_before_gate:
        y = y * act
    return y.to(x.dtype)


def inference_gated_norm(x, z, weight, eps, head_dim, norm_before_gate=True, activation="swish"):
    """The inference entry's contract (``fused_gdn_gated_rms_norm``): ``one_rounding_gated_norm``
    over each ``head_dim`` group of [tokens, heads * head_dim] tensors; vLLM's "swish" is silu."""
    def split(t):
        return t.unflatten(-1, (-1, head_dim))

    act = "sigmoid" if activation == "sigmoid" else "silu"
    return one_rounding_gated_norm(split(x), split(z), weight, eps, norm_before_gate,
                                   act).flatten(-2)


# Integer type of the same width, and a wider one for the differences.
_BITS = {torch.bfloat16: (torch.int16, torch.int32), torch.float16: (torch.int16, torch.int32),
         torch.float32: (torch.int32, torch.int64)}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place between two tensors of one dtype (bf16,
    fp16 or fp32): the bit patterns mapped to monotone integers, so a distance across zero
    counts the values in between and +0 / -0 are 0 apart."""
    if a.dtype not in _BITS or b.dtype != a.dtype:
        raise TypeError(f"ulp_distance: a and b must have one dtype, bf16, fp16 or fp32; got "
                        f"{a.dtype} and {b.dtype}")
    bits, wide = _BITS[a.dtype]
    lowest = torch.iinfo(bits).min

    def ordered(t):
        i = t.view(bits).to(wide)
        return torch.where(i < 0, lowest - i, i)  # sign-magnitude -> monotone integers

    return (ordered(a) - ordered(b)).abs()


def bitwise_share(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The share of elements of ``out`` bitwise equal to ``ref`` (a NaN equals a NaN)."""
    return ((out == ref) | (out.isnan() & ref.isnan())).float().mean().item()


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| in float64 (the accuracy measure of the tests and GPU
    checks: "no less accurate than the unfused path against a float64 reference")."""
    exact = exact.double()
    return ((approx.double() - exact).norm() / exact.norm().clamp_min(1e-30)).item()
