"""The fused pre-recurrence region under torch.compile: two custom ops around the same launches.

Dynamo cannot trace a Triton launch wrapper with Python-side choices, so under torch.compile
``fused_pre_gated_delta_rule`` calls ``pre_gdr_fwd_op`` (q, k, v, g, beta): opaque to the
compiler, shapes from register_fake, its gradient from register_autograd through
``pre_gdr_bwd_op``. The gate view is taken outside the op, as an ordinary slice, so the
compiled graph adds its gradient into the in_proj output's (no gradient sink there). Eager calls
use the autograd Function, which costs less host time than the dispatcher.
"""

from __future__ import annotations

from typing import Optional

import torch

from core.fusions.fused_pre_gated_delta_rule import (RegionShape, backward_impl, forward_impl,
                                                     output_gradients)


def _shape(sizes: list[int], conv_weight: torch.Tensor) -> RegionShape:
    return RegionShape(*sizes, conv_weight.shape[-1])


@torch.library.custom_op("gdn_fusions::pre_gated_delta_rule_fwd", mutates_args=())
def pre_gdr_fwd_op(
    qkvzba: torch.Tensor, conv_weight: torch.Tensor, conv_bias: Optional[torch.Tensor],
    A_log: torch.Tensor, dt_bias: torch.Tensor, seq_start: Optional[torch.Tensor],
    sizes: list[int], use_qk_l2norm: bool, conv_rounding: str, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v, g, beta; ``sizes`` = [key heads, value heads, key dim, value dim]."""
    return forward_impl(qkvzba, conv_weight, conv_bias, A_log, dt_bias,
                        _shape(sizes, conv_weight), seq_start, use_qk_l2norm, conv_rounding, eps)


@pre_gdr_fwd_op.register_fake
def _(qkvzba, conv_weight, conv_bias, A_log, dt_bias, seq_start, sizes, use_qk_l2norm,
      conv_rounding, eps):
    batch, seq, _ = qkvzba.shape
    hv, dk, dv = sizes[1], sizes[2], sizes[3]
    q = qkvzba.new_empty(batch, seq, hv, dk)
    return (q, torch.empty_like(q), qkvzba.new_empty(batch, seq, hv, dv),
            qkvzba.new_empty(batch, seq, hv, dtype=torch.float32),
            qkvzba.new_empty(batch, seq, hv))


@torch.library.custom_op("gdn_fusions::pre_gated_delta_rule_bwd", mutates_args=())
def pre_gdr_bwd_op(
    qkvzba: torch.Tensor, conv_weight: torch.Tensor, conv_bias: Optional[torch.Tensor],
    A_log: torch.Tensor, dt_bias: torch.Tensor, seq_start: Optional[torch.Tensor],
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dg: torch.Tensor, dbeta: torch.Tensor,
    sizes: list[int], use_qk_l2norm: bool, conv_rounding: str, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """d(qkvzba) (zero in the gate's slice), d(conv weight), d(conv bias) (empty without one),
    d(A_log), d(dt_bias)."""
    shape = _shape(sizes, conv_weight)
    dqkvzba, dweight, dbias, da_log, ddt_bias = backward_impl(
        qkvzba, conv_weight, conv_bias, A_log, dt_bias, shape, dq.contiguous(),
        dk.contiguous(), dv.contiguous(), dg.contiguous(), dbeta.contiguous(), seq_start,
        use_qk_l2norm, conv_rounding, eps)
    dqkvzba[..., shape.gate_slice].zero_()
    if dbias is None:
        dbias = conv_weight.new_empty(0)
    return dqkvzba, dweight, dbias, da_log, ddt_bias


@pre_gdr_bwd_op.register_fake
def _(qkvzba, conv_weight, conv_bias, A_log, dt_bias, seq_start, dq, dk, dv, dg, dbeta, sizes,
      use_qk_l2norm, conv_rounding, eps):
    return (torch.empty_like(qkvzba), torch.empty_like(conv_weight),
            conv_weight.new_empty(0) if conv_bias is None else torch.empty_like(conv_bias),
            torch.empty_like(A_log), torch.empty_like(dt_bias))


def _setup_context(ctx, inputs, output):
    qkvzba, conv_weight, conv_bias, A_log, dt_bias, seq_start, *options = inputs
    ctx.save_for_backward(qkvzba, conv_weight, conv_bias, A_log, dt_bias, seq_start)
    ctx.options = options


def _backward(ctx, dq, dk, dv, dg, dbeta):
    qkvzba, conv_weight, conv_bias, A_log, dt_bias, seq_start = ctx.saved_tensors
    grads = output_gradients(qkvzba, _shape(ctx.options[0], conv_weight), dq, dk, dv, dg, dbeta)
    dqkvzba, dweight, dbias, da_log, ddt_bias = pre_gdr_bwd_op(
        qkvzba, conv_weight, conv_bias, A_log, dt_bias, seq_start, *grads, *ctx.options)
    return (dqkvzba, dweight, None if conv_bias is None else dbias, da_log, ddt_bias, None,
            None, None, None, None)


pre_gdr_fwd_op.register_autograd(_backward, setup_context=_setup_context)
