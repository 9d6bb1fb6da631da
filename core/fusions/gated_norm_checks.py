"""One checking station per call of the fused gated norm, and one memo of what passed.

Each training entry runs the input rules (gated_norm_validation) at one station:
``fused_gated_norm`` and ``validate_gated_norm`` at ``check_gated_norm_inputs``, ``forward_impl``
at ``check_forward_impl``, ``backward_impl`` at ``check_backward_impl`` (its tensors through
``check_backward_inputs``, which the compiled backward uses too). The tensor rules run for a
signature (everything they read) that has not passed yet; one that passed is kept and passes
again after one lookup (docs/design.md, Host cost). A station returns the signature's number,
which keys the launch plans (gated_norm_plans): no plan is ever consulted for a check.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch

from core.fusions.gated_norm_launch import backward_launch, keep_bounded, next_power_of_2
from core.fusions.gated_norm_validation import (GATE_ACTIVATIONS, KERNEL_ARGS, ArgNames,
                                                check_bool, check_dependent_launch,
                                                check_gated_norm_tensors, check_launch_overrides,
                                                check_launch_tile, check_option,
                                                check_positive_number, check_rstd,
                                                current_device)
from core.fusions.memory_overlap import check_out_apart

FUSED_GATED_NORM, FORWARD_IMPL, BACKWARD_IMPL = "fused_gated_norm", "forward_impl", "backward_impl"

# A signature holds everything a station's rules read (each tensor's type, shape, strides, dtype,
# device, negative bit and layout, the current device, eps and the dW scale with their types,
# since True == 1 to a dict), so one kept after the rules passed passes for exactly these
# values. Building one fails for an argument that is not a tensor or has no strides (sparse
# CSR), where no CUDA device can be asked which one is current (no driver, a torch without
# CUDA), and for values no dict takes (symbolic sizes): the rules then run and name the fault.
KEY_ERRORS = (AttributeError, TypeError, RuntimeError, AssertionError)
MAX_CHECKED_SIGNATURES = 256
_checked_signatures: dict = {}  # signature -> its number, never reused
_signature_numbers = itertools.count()


def tensor_signature(t: torch.Tensor) -> tuple:
    """What the rules read of one tensor: its type, shape, strides, dtype, device, negative bit
    and layout (an mkldnn tensor reports a dense tensor's strides)."""
    return type(t), t.shape, t.stride(), t.dtype, t.device, t.is_neg(), t.layout


def _keep(signature: Optional[tuple]) -> Optional[int]:
    """Keeps a signature whose rules just passed under a new number; a full memo starts over."""
    if signature is None:
        return None
    return keep_bounded(_checked_signatures, signature, next(_signature_numbers),
                        MAX_CHECKED_SIGNATURES)


def check_gated_norm_inputs(x, gate, weight, eps, names: ArgNames = KERNEL_ARGS,
                            entry: str = FUSED_GATED_NORM, out=None) -> Optional[int]:
    """The tensor and eps rules of ``fused_gated_norm`` (with forward_impl's ``out`` where one is
    given), messages naming the inputs as ``names`` spells them; returns the checked signature's
    number. Every call that torch.compile traces goes through the rules (returns None: no kept
    signature holds traced sizes)."""
    signature = None
    if not torch.compiler.is_compiling():
        try:
            signature = (current_device(), tensor_signature(x), tensor_signature(gate),
                         tensor_signature(weight), type(eps), eps)
            if out is not None:
                signature += (tensor_signature(out),)
            number = _checked_signatures.get(signature)
        except KEY_ERRORS:
            signature = number = None
        if number is not None:
            return number
    check_gated_norm_tensors(entry, x, gate, weight, () if out is None else (("out", out),), names)
    check_positive_number(entry, names.eps, eps)
    return _keep(signature)


def check_forward_impl(x, gate, weight, eps, zero_centered, out, gate_activation, store_rstd,
                       bt, warps, pdl) -> Optional[int]:
    """forward_impl's rules: the flags and launch overrides, then check_gated_norm_inputs, then
    what needs the tensors (an override's tile, programmatic dependent launch on x's device; an
    ``out``'s overlap, read from addresses, and that it does not require grad)."""
    check_bool(FORWARD_IMPL, "zero_centered", zero_centered)
    check_bool(FORWARD_IMPL, "store_rstd", store_rstd)
    check_option(FORWARD_IMPL, "gate_activation", gate_activation, GATE_ACTIVATIONS)
    if bt is not None or warps is not None or pdl is not None:
        check_launch_overrides(FORWARD_IMPL, (("bt", bt), ("warps", warps)), (("pdl", pdl),))
    checked = check_gated_norm_inputs(x, gate, weight, eps, KERNEL_ARGS, FORWARD_IMPL, out)
    if bt is not None:
        check_launch_tile(FORWARD_IMPL, "bt", bt, next_power_of_2(x.shape[3]),
                          "a row padded to a power of two")
    if pdl:
        check_dependent_launch(FORWARD_IMPL, "pdl", x.device)
    if out is not None:
        check_out_apart(FORWARD_IMPL, out, (("x", x), ("gate", gate)), weight)
        if out.requires_grad and torch.is_grad_enabled():
            raise ValueError("forward_impl: out requires grad with grad mode enabled; forward_impl "
                             "has no autograd (write into it under torch.no_grad(), or use "
                             "fused_gated_norm)")
    return checked


def check_backward_inputs(x, gate, weight, rstd, dy, weight_grad_scale) -> Optional[int]:
    """backward_impl's tensor rules (x, gate, weight and dy as check_gated_norm_inputs's, rstd
    as forward_impl returns it) and the dW scale's; kept and numbered as there."""
    try:
        signature = (BACKWARD_IMPL, current_device(), tensor_signature(x), tensor_signature(gate),
                     tensor_signature(weight), tensor_signature(rstd), tensor_signature(dy),
                     type(weight_grad_scale), weight_grad_scale)
        number = _checked_signatures.get(signature)
    except KEY_ERRORS:
        signature = number = None
    if number is not None:
        return number
    check_gated_norm_tensors(BACKWARD_IMPL, x, gate, weight, (("dy", dy),))
    check_rstd(BACKWARD_IMPL, x, rstd)
    check_positive_number(BACKWARD_IMPL, "weight_grad_scale", weight_grad_scale)
    return _keep(signature)


def check_backward_impl(x, gate, weight, rstd, dy, zero_centered, gate_activation,
                        weight_grad_scale, bt, warps, programs, stages,
                        dw_sum_pdl) -> Optional[int]:
    """backward_impl's rules: the flags and launch overrides, check_backward_inputs, then what
    needs the tensors (an override's tile, programmatic dependent launch on x's device)."""
    check_bool(BACKWARD_IMPL, "zero_centered", zero_centered)
    check_option(BACKWARD_IMPL, "gate_activation", gate_activation, GATE_ACTIVATIONS)
    overrides = not (bt is None and warps is None and programs is None and stages is None
                     and dw_sum_pdl is None)
    if overrides:
        check_launch_overrides(BACKWARD_IMPL, (("bt", bt), ("warps", warps), ("programs", programs),
                                               ("stages", stages)), (("dw_sum_pdl", dw_sum_pdl),))
    checked = check_backward_inputs(x, gate, weight, rstd, dy, weight_grad_scale)
    if overrides:
        dim = x.shape[3]
        if bt is not None:
            check_launch_tile(BACKWARD_IMPL, "bt", bt, next_power_of_2(dim),
                              "a row padded to a power of two")
        if programs is not None:  # the dW sum loads all partials of its columns as one tile
            check_launch_tile(BACKWARD_IMPL, "programs", programs,
                              backward_launch(dim, x.device).dw_sum_columns,
                              "the dW sum's columns per program")
        if dw_sum_pdl:
            check_dependent_launch(BACKWARD_IMPL, "dw_sum_pdl", x.device)
    return checked
