"""The fused gated norm under torch.compile: two custom ops around the same launches, and the
backward for autograd's gradient that they share with the eager Function.

Dynamo cannot trace into a Triton launch wrapper with Python-side heuristics, so under
torch.compile ``fused_gated_norm`` calls ``gated_norm_fwd_op``: opaque to the compiler, with
output metadata from register_fake and its gradient from register_autograd, which calls
``gated_norm_bwd_op`` (no graph break; the compiled backward launches gated_norm_bwd too).
Eager calls skip the dispatcher and use ``_FusedGatedNorm`` (fused_gated_norm.py): a custom op
costs ~10+ us of host time per call, more than the whole launch. The ops' impls run with the
real tensors, each through its checking station (gated_norm_checks). Both return the output
buffer; the [B, S, H, D] view is taken outside (``apply_validated_gated_norm``).
"""

from __future__ import annotations

from typing import Optional

import torch

from core.fusions.gated_norm_checks import check_backward_inputs, check_gated_norm_inputs
from core.fusions.gated_norm_plans import as_bshd, forward_buffer, run_backward


@torch.library.custom_op("gdn_fusions::gated_norm_fwd", mutates_args=())
def gated_norm_fwd_op(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
    out_layout: str, gate_activation: str, weight_grad_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, rstd)``: the forward into a new buffer contiguous in ``out_layout``."""
    checked = check_gated_norm_inputs(x, gate, weight, eps)
    return forward_buffer(x, gate, weight, eps, zero_centered, out_layout, gate_activation,
                          checked)


@gated_norm_fwd_op.register_fake
def _(x, gate, weight, eps, zero_centered, out_layout, gate_activation, weight_grad_scale):
    batch, seq, heads, dim = x.shape
    shape = (seq, batch, heads, dim) if out_layout == "sbhd" else (batch, seq, heads, dim)
    return x.new_empty(shape), x.new_empty((batch, seq, heads), dtype=torch.float32)


def autograd_backward(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    dy: torch.Tensor, zero_centered: bool, gate_activation: str, weight_grad_scale: float,
    dgate_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dgate, dweight)`` for the gradient autograd hands the forward's output, in the
    eager Function (fused_gated_norm.py) and in ``gated_norm_bwd_op`` alike. Everything but the
    backward's own tensors passed the forward's station; those go through
    ``check_backward_inputs``. dy is read in place, whatever strides autograd hands it (the
    expanded gradient of ``sum()`` has only zero ones). ``dgate_out``: where dgate is written
    (the eager Function's gate-gradient sink; the gate's shape and dtype), else a new tensor."""
    checked = check_backward_inputs(x, gate, weight, rstd, dy, weight_grad_scale)
    return run_backward(x, gate, weight, rstd, dy, zero_centered, gate_activation,
                        weight_grad_scale, checked, dgate_out=dgate_out)


@torch.library.custom_op("gdn_fusions::gated_norm_bwd", mutates_args=())
def gated_norm_bwd_op(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    dy: torch.Tensor, zero_centered: bool, gate_activation: str, weight_grad_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``autograd_backward`` into new tensors (an op's outputs may not alias its inputs)."""
    return autograd_backward(x, gate, weight, rstd, dy, zero_centered, gate_activation,
                             weight_grad_scale)


@gated_norm_bwd_op.register_fake
def _(x, gate, weight, rstd, dy, zero_centered, gate_activation, weight_grad_scale):
    return x.new_empty(x.shape), gate.new_empty(gate.shape), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, gate, weight, _, zero_centered, out_layout, gate_activation, weight_grad_scale = inputs
    ctx.save_for_backward(x, gate, weight, output[1])
    ctx.options = (zero_centered, out_layout, gate_activation, weight_grad_scale)


def _backward(ctx, dbuffer, _drstd):
    x, gate, weight, rstd = ctx.saved_tensors
    zero_centered, out_layout, gate_activation, weight_grad_scale = ctx.options
    dx, dgate, dweight = gated_norm_bwd_op(x, gate, weight, rstd, as_bshd(dbuffer, out_layout),
                                           zero_centered, gate_activation, weight_grad_scale)
    return dx, dgate, dweight, None, None, None, None, None  # the op's five non-tensor inputs


gated_norm_fwd_op.register_autograd(_backward, setup_context=_setup_context)
