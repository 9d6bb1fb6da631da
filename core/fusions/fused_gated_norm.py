"""Fused output gated RMSNorm of the Gated DeltaNet layer, for training.

    out = round(round(rms_norm(x) * w_eff) * gate_activation(gate))      ("megatron" rounding)

x and gate are ``[batch, sequence, head, dim]`` views with any strides (a slice of a packed
projection, a transposed sbhd view, every second element of a wider buffer, a gate expanded over
heads); the kernels address them, and the incoming gradient, in place. The norm runs over
``dim`` with one weight of shape ``(dim,)`` shared by all heads.

From the top (docs/design.md has the picture):
  fused_gated_norm: its inputs checked at one station (gated_norm_checks, by the rules of
      gated_norm_validation), then _FusedGatedNorm, or under torch.compile the custom ops of
      gated_norm_compile
  -> gated_norm_plans: the launches, planned once per checked signature (gated_norm_launch's
      heuristics) and made through direct_launch
  -> gated_norm_kernels: gated_norm_fwd; gated_norm_bwd and gated_norm_dw_sum.
``forward_impl`` / ``backward_impl`` are the launches with their own checks and launch
overrides; ``validate_gated_norm`` checks a Megatron GatedDeltaNet and its inputs, for
``apply_validated_gated_norm``. Numerics: docs/numerics.md.
"""

from __future__ import annotations

from typing import Optional

import torch

from core.fusions.gated_norm_checks import (FUSED_GATED_NORM, check_backward_impl,
                                            check_forward_impl, check_gated_norm_inputs)
from core.fusions.gated_norm_compile import autograd_backward, gated_norm_fwd_op
from core.fusions.gated_norm_kernels import _row_offset, gated_norm_bwd, gated_norm_fwd
# Where the seed names are, tests/conftest.py asks whether the interpreter runs the backward.
from core.fusions.gated_norm_kernels import interpreter_loop_problem  # noqa: F401
from core.fusions.gated_norm_plans import as_bshd, forward_buffer, run_backward, run_forward
from core.fusions.gated_norm_validation import (GATE_ACTIVATIONS, GDN_MODULE_ARGS, check_bool,
                                                check_normalization, check_option,
                                                check_positive_number, check_tensors)

__all__ = ["gated_norm_fwd", "gated_norm_bwd", "_row_offset", "forward_impl", "backward_impl",
           "_FusedGatedNorm", "fused_gated_norm", "validate_gated_norm"]

OUT_LAYOUTS = ("bshd", "sbhd")


def forward_impl(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
    bt: Optional[int] = None,
    warps: Optional[int] = None,
    *,
    out: Optional[torch.Tensor] = None,
    gate_activation: str = "silu",
    pdl: Optional[bool] = None,
    store_rstd: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Launch ``gated_norm_fwd``; returns ``(out, rstd)``, rstd None when ``store_rstd`` is False
    (nothing to differentiate: the output's bits are the same). No input is copied.

    ``out``: optional [B, S, H, D] destination view with any strides (for example the transpose
    of an sbhd buffer); a new contiguous tensor when None. Its elements must not share memory;
    it may be x or gate itself (computed in place), else it must not overlap them, nor the
    weight (ValueError). It counts as modified in place (its autograd version goes up, so a
    graph that saved it refuses to backward), and with grad mode on it must not require grad
    (ValueError: forward_impl has no autograd). ``bt``/``warps``/``pdl`` (programmatic
    dependent launch) override the heuristics of ``gated_norm_launch`` (tools/launch_sweep.py).
    Every argument is checked before the launch (``check_forward_impl``: ``fused_gated_norm``'s
    rules, TypeError / ValueError); ``zero_centered`` must be a bool (it selects a compiled
    variant)."""
    checked = check_forward_impl(x, gate, weight, eps, zero_centered, out, gate_activation,
                                 store_rstd, bt, warps, pdl)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        return out, run_forward(x, gate, weight, out, eps, zero_centered, gate_activation,
                                store_rstd, checked, "bshd", bt, warps, pdl)
    rstd = run_forward(x, gate, weight, out, eps, zero_centered, gate_activation, store_rstd,
                       checked, None, bt, warps, pdl)
    torch.autograd.graph.increment_version(out)  # written by the kernel, unseen by autograd
    return out, rstd


def backward_impl(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dy: torch.Tensor,
    zero_centered: bool = False,
    bt: Optional[int] = None,
    warps: Optional[int] = None,
    *,
    gate_activation: str = "silu",
    programs: Optional[int] = None,
    stages: Optional[int] = None,
    weight_grad_scale: float = 1.0,
    dw_sum_pdl: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch ``gated_norm_bwd`` and ``gated_norm_dw_sum``; returns ``(dx, dgate, dweight)``.

    dx and dgate are contiguous [B, S, H, D] in x's and the gate's dtype; dy is read in place
    (any strides, zero ones included). dweight is the fixed-order sum of the per-program fp32
    partials times ``weight_grad_scale`` (a Python float), rounded once to the weight's dtype.
    ``bt``/``warps``/``programs``/``stages``/``dw_sum_pdl`` override the heuristics of
    ``gated_norm_launch`` (tools/launch_sweep.py). Every argument is checked before the launch
    (``check_backward_impl``; rstd as forward_impl returns it)."""
    checked = check_backward_impl(x, gate, weight, rstd, dy, zero_centered, gate_activation,
                                  weight_grad_scale, bt, warps, programs, stages, dw_sum_pdl)
    return run_backward(x, gate, weight, rstd, dy, zero_centered, gate_activation,
                        weight_grad_scale, checked, bt, warps, programs, stages, dw_sum_pdl)


# The Function's non-tensor arguments travel as one tuple, (eps, zero_centered, out_layout,
# gate_activation, weight_grad_scale, checked, dgate_sink): every argument of
# torch.autograd.Function.apply costs host time on every call. ``dgate_sink``: None, or an
# object whose ``gate_gradient()`` returns where dgate is to be written (the gate's slice of
# the fused pre-recurrence region's gradient buffer, core.fusions.fused_pre_gated_delta_rule).
Options = tuple[float, bool, str, str, float, Optional[int], Optional[object]]


class _FusedGatedNorm(torch.autograd.Function):
    """First-order autograd of the fused gated norm (the eager path):
    ``apply(x, gate, weight, options)`` with ``options`` as described at ``Options``. Saves x,
    gate (the caller's tensors, not copies), the weight and one fp32 rstd per row.

    Returns the output *buffer* (contiguous in ``out_layout``), never a view of it: the caller
    takes the [B, S, H, D] view outside the Function, as an ordinary autograd view, so the result
    takes in-place ops (a residual ``add_``, in-place dropout) like any tensor. (A view made
    inside a custom Function may not be modified in place.)"""

    @staticmethod
    def forward(ctx, x, gate, weight, options: Options):
        eps, zero_centered, out_layout, gate_activation, _, checked, _ = options
        buffer, rstd = forward_buffer(x, gate, weight, eps, zero_centered, out_layout,
                                      gate_activation, checked)
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.options = options
        return buffer

    @staticmethod
    def backward(ctx, dbuffer):
        # create_graph=True: once_differentiable makes a second derivative through
        # ``.backward()`` raise; ``torch.autograd.grad`` of it reports x as unused instead.
        if torch.is_grad_enabled():
            return _once_differentiable_gradients(ctx, dbuffer)
        # The engine runs a backward with grad mode off unless create_graph is set: no need for
        # once_differentiable's no_grad block (~1 us of host time) on that path.
        dx, dgate, dweight = _gradients(ctx, dbuffer)
        return dx, dgate, dweight, None


@torch.autograd.function.once_differentiable
def _once_differentiable_gradients(ctx, dbuffer):
    dx, dgate, dweight = _gradients(ctx, dbuffer)
    return dx, dgate, dweight, None


def _gradients(ctx, dbuffer) -> tuple:
    """``(dx, dgate, dweight)`` from the output buffer's gradient (its dy new to the checks)."""
    x, gate, weight, rstd = ctx.saved_tensors
    _, zero_centered, out_layout, gate_activation, weight_grad_scale, _, sink = ctx.options
    return autograd_backward(x, gate, weight, rstd, as_bshd(dbuffer, out_layout), zero_centered,
                             gate_activation, weight_grad_scale,
                             None if sink is None else sink.gate_gradient())


def fused_gated_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
    gate_activation: str = "silu",
    *,
    out_layout: str = "bshd",
    weight_grad_scale: float = 1.0,
) -> torch.Tensor:
    """``round(round(rms_norm(x) * w_eff) * gate_activation(gate))`` over the last dim of
    [B, S, H, D] views.

    Args:
        x: [batch, sequence, heads, dim] activations (bf16, fp16 or fp32); any strides.
        gate: x's shape, in x's dtype or fp32 (its gradient comes in its own dtype); any
            strides: a slice of a packed projection, or a view expanded over heads (zero
            strides), is read in place.
        weight: (dim,) contiguous norm weight shared by all heads, fp32 or x's dtype.
        eps: added to mean(x^2); a finite Python float (or int) > 0.
        zero_centered: a bool; True: w_eff = 1 + weight (Megatron's zero-centred gamma), False:
            w_eff = weight.
        gate_activation: "silu" (GDN) or "sigmoid".
        out_layout: "bshd" returns a contiguous tensor; "sbhd" returns a [B, S, H, D] view of a
            contiguous [S, B, H, D] buffer, so ``out.transpose(0, 1)`` is contiguous for free.
            Either may be modified in place (a residual ``add_``) before the backward.
        weight_grad_scale: the factor the weight's gradient is multiplied by, e.g. the TP size
            for a weight shared by TP ranks whose gradient is averaged over TP. A finite Python
            float (or int) > 0, applied in fp32 before dW's single rounding (exact for powers
            of two).
    Returns:
        [B, S, H, D] tensor in x's dtype; differentiable once w.r.t. x, gate and weight (no
        second derivative: ``.backward()`` through the gradients raises).
    Raises:
        TypeError for an argument of the wrong type (x, gate or weight not a tensor, an
        unsupported dtype, a non-bool ``zero_centered``, a non-number ``eps`` or
        ``weight_grad_scale``), ValueError for a value that breaks a rule (shapes, strides,
        devices, limits, ranges, options); before any launch.
    """
    checked = check_gated_norm_inputs(x, gate, weight, eps)
    check_bool(FUSED_GATED_NORM, "zero_centered", zero_centered)
    check_option(FUSED_GATED_NORM, "gate_activation", gate_activation, GATE_ACTIVATIONS)
    check_option(FUSED_GATED_NORM, "out_layout", out_layout, OUT_LAYOUTS)
    check_positive_number(FUSED_GATED_NORM, "weight_grad_scale", weight_grad_scale)
    return apply_validated_gated_norm(x, gate, weight, eps, zero_centered, out_layout,
                                      gate_activation, weight_grad_scale, checked)


def apply_validated_gated_norm(x, gate, weight, eps, zero_centered, out_layout, gate_activation,
                               weight_grad_scale=1.0, checked=None, dgate_sink=None):
    """``fused_gated_norm`` without its checks, for a caller that has just run them:
    ``checked`` is what ``validate_gated_norm`` returned for these inputs (the launch plan is
    kept under it; None builds it for this call alone). Picks the eager autograd Function or,
    under torch.compile, the custom op, and takes the [B, S, H, D] view of the buffer either
    returns."""
    # float(): an int eps would compile another kernel variant (1 is specialised); the kernel's
    # weight_grad_scale is fp32.
    if torch.compiler.is_compiling():
        buffer, _ = gated_norm_fwd_op(x, gate, weight, float(eps), zero_centered, out_layout,
                                      gate_activation, float(weight_grad_scale))
    elif torch.is_grad_enabled() and (x.requires_grad or gate.requires_grad
                                      or weight.requires_grad):
        buffer = _FusedGatedNorm.apply(x, gate, weight, (
            float(eps), zero_centered, out_layout, gate_activation, float(weight_grad_scale),
            checked, dgate_sink))
    else:  # nothing to differentiate (inference, a recompute's first forward): no rstd, no ctx
        buffer, _ = forward_buffer(x, gate, weight, float(eps), zero_centered, out_layout,
                                   gate_activation, checked, store_rstd=False)
    return as_bshd(buffer, out_layout)


# The gate activation's name as megatron's GatedDeltaNet keeps it (``activation_func.__name__``),
# by kernel name; megatron's own GDN kernels also spell silu "swish".
MODULE_ACTIVATIONS = {"silu": "silu", "swish": "silu", "sigmoid": "sigmoid"}


def validate_gated_norm(module, x: torch.Tensor, gate: torch.Tensor,
                        gate_activation: str = "silu") -> Optional[int]:
    """Check that a Megatron GatedDeltaNet ``module`` can take the fused output norm for these
    inputs, with ``gate_activation`` as the gate's activation; the layer runs it on every fused
    forward, recomputation included. Host-side metadata only; ValueError / TypeError before any
    launch.

    Reads ``module.config`` (RMSNorm normalization, ``linear_value_head_dim``,
    ``layernorm_epsilon``), ``module.activation`` (the name of the gate activation, as
    megatron's GatedDeltaNet sets it: "silu" / "swish" or "sigmoid", equal to
    ``gate_activation``) and ``module.out_norm`` (a weight of shape (linear_value_head_dim,), no
    bias, its eps equal to the config's); x and gate take ``fused_gated_norm``'s rules with
    that weight and eps. Messages name the module's tensors (``core_attn_out``, ``gate``,
    ``out_norm.weight``) and ``config.layernorm_epsilon``. Returns the checked signature's
    number, which ``apply_validated_gated_norm`` takes (None while torch.compile traces)."""
    config = module.config
    check_normalization(config.normalization)
    name = module.activation
    activation = MODULE_ACTIVATIONS.get(name) if isinstance(name, str) else None
    if activation is None:
        raise ValueError(
            "fused_gated_norm requires module.activation (the GDN gate activation, "
            f"config.activation_func's name) to be one of {tuple(MODULE_ACTIVATIONS)}, got "
            f"{name!r}")
    check_option(FUSED_GATED_NORM, "gate_activation", gate_activation, GATE_ACTIVATIONS)
    if activation != gate_activation:
        raise ValueError(f"fused_gated_norm requires gate_activation ({gate_activation!r}) to be "
                         f"the module's activation ({name!r})")
    norm = module.out_norm
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError("fused_gated_norm requires out_norm to have a weight")
    if getattr(norm, "bias", None) is not None:
        raise ValueError("fused_gated_norm requires out_norm without a bias (RMSNorm has none)")
    head_dim = config.linear_value_head_dim
    if tuple(weight.shape) != (head_dim,):
        raise ValueError(f"fused_gated_norm requires out_norm.weight of shape ({head_dim},) "
                         f"(linear_value_head_dim), got {tuple(weight.shape)}")
    norm_eps = norm_epsilon(norm)
    if norm_eps is not None and norm_eps != config.layernorm_epsilon:
        raise ValueError(f"fused_gated_norm requires out_norm eps ({norm_eps}) to equal "
                         f"config.layernorm_epsilon ({config.layernorm_epsilon})")
    names = GDN_MODULE_ARGS
    check_tensors(FUSED_GATED_NORM, ((names.x, x), (names.gate, gate)))
    for label, t in ((names.x, x), (names.gate, gate)):
        if t.dim() != 4 or t.shape[3] != head_dim:
            raise ValueError(f"fused_gated_norm requires {label} of shape [batch, seq, heads, "
                             f"{head_dim}] (linear_value_head_dim), got {tuple(t.shape)}")
    return check_gated_norm_inputs(x, gate, weight, config.layernorm_epsilon, names)


def norm_epsilon(norm) -> Optional[float]:
    """The eps a norm module was built with (TE and torch modules spell it differently)."""
    for attr in ("eps", "epsilon", "variance_epsilon"):
        value = getattr(norm, attr, None)
        if isinstance(value, (float, int)):
            return float(value)
    return None
