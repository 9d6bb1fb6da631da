"""The unfused pre-recurrence region in torch operations, megatron-core 0.19's order and
rounding points: the reference of ``fused_pre_gated_delta_rule`` (tests, benchmark).

``conv`` decides the convolution: None runs torch's, "once" in fp32 with one rounding after the
SiLU (what FLA's ``causal_conv1d`` computes), "twice" in the activation dtype with the SiLU after
it (megatron's ``deterministic_mode`` path); or pass FLA's ``causal_conv1d`` itself as
``causal_conv1d``. ``l2norm``: FLA's, or None for the same formula in torch (fp32, one
rounding).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F


def torch_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm formula: ``x * (1 / sqrt(sum(x^2) + eps))`` in fp32 (float64 for float64
    input), one rounding."""
    xf = x.to(_compute_dtype(x))
    return (xf * (1 / torch.sqrt(xf.square().sum(-1, keepdim=True) + eps))).to(x.dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for the low-precision dtypes, float64 stays float64 (a float64 reference)."""
    return torch.promote_types(x.dtype, torch.float32)


def _torch_conv(qkv, weight, bias, conv_rounding, cu_seqlens):
    """[B, S, C] -> SiLU(causal depthwise conv), each packed sequence on its own."""
    width = weight.shape[-1]
    w = weight.reshape(weight.shape[0], 1, width)

    def segment(x):
        if conv_rounding == "once":
            wide = _compute_dtype(x)
            y = F.conv1d(x.transpose(1, 2).to(wide), w.to(wide),
                         None if bias is None else bias.to(wide), padding=width - 1,
                         groups=w.shape[0])
            return F.silu(y[..., :x.shape[1]]).to(x.dtype).transpose(1, 2)
        y = F.conv1d(x.transpose(1, 2).contiguous(), w, bias, padding=width - 1,
                     groups=w.shape[0])
        return F.silu(y[..., :x.shape[1]]).transpose(1, 2)

    if cu_seqlens is None:
        return segment(qkv)
    bounds = cu_seqlens.tolist()
    return torch.cat([segment(qkv[:, s:e]) for s, e in zip(bounds[:-1], bounds[1:])], dim=1)


def unfused_pre_gated_delta_rule(qkvzba, conv_weight, conv_bias, A_log, dt_bias, *,
                                 num_key_heads, key_head_dim, num_value_heads, value_head_dim,
                                 cu_seqlens=None, use_qk_l2norm=True, conv_rounding="once",
                                 eps=1e-6, causal_conv1d: Optional[Callable] = None,
                                 l2norm: Optional[Callable] = None):
    """megatron's operations from the bshd in_proj output to (q, k, v, gate, g, beta)."""
    batch, seq, _ = qkvzba.shape
    qk = num_key_heads * key_head_dim
    vd = num_value_heads * value_head_dim
    qkv, gate, beta, alpha = torch.split(qkvzba, (2 * qk + vd, vd, num_value_heads,
                                                  num_value_heads), dim=-1)
    gate = gate.reshape(batch, seq, -1, value_head_dim)
    if causal_conv1d is not None:
        qkv, _ = causal_conv1d(x=qkv, weight=conv_weight.reshape(conv_weight.shape[0], -1),
                               bias=conv_bias, activation="silu", cu_seqlens=cu_seqlens)
    else:
        qkv = _torch_conv(qkv, conv_weight, conv_bias, conv_rounding, cu_seqlens)
    query_key, value = torch.split(qkv, (2 * qk, vd), dim=-1)
    query_key = query_key.reshape(batch, seq, -1, key_head_dim)
    value = value.reshape(batch, seq, -1, value_head_dim)
    if use_qk_l2norm:
        query_key = (l2norm or torch_l2norm)(query_key.contiguous())
    query, key = torch.split(query_key, (num_key_heads, num_key_heads), dim=2)
    repeat = num_value_heads // num_key_heads
    if repeat > 1:
        query = query.repeat_interleave(repeat, dim=2)
        key = key.repeat_interleave(repeat, dim=2)
    g = -A_log.exp() * F.softplus(alpha.float() + dt_bias)
    return (query.contiguous(), key.contiguous(), value.contiguous(), gate, g,
            beta.contiguous().sigmoid())
