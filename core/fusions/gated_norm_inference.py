"""Inference entry point of the GDN output gated RMSNorm, with vLLM's ``fused_gdn_gated_rms_norm``
contract, running the training kernel ``gated_norm_fwd`` (no second copy of the kernel body).

    norm_before_gate=True :  out = round(rms_norm(x) * w * act(z))
    norm_before_gate=False:  out = round(rms_norm(x * act(z)) * w)

fp32 math with ONE rounding at the store (vLLM's and FLA's semantics). The training path rounds
twice, like Megatron's unfused module; docs/inference.md explains the difference.

The kernel is selected by compile-time switches: NORM_DTYPE=tl.float32 (no intermediate
rounding), ACTIVATION, NORM_BEFORE_GATE, STORE_RSTD=False (nothing saved for a backward). The
2-D ``(num_tokens, num_v_heads * head_v_dim)`` tensors are addressed as ``[1, T, H, D]`` views
by passing their strides: no copy, no allocation, no host sync, so the call can be captured in
a CUDA graph. Element offsets are 64-bit inside the kernel; row indices (token * head) are 32-bit.
"""

from __future__ import annotations

import torch
import triton.language as tl

from core.fusions.direct_launch import PreparedLaunch
from core.fusions.gated_norm_kernels import ForwardArgs
from core.fusions.gated_norm_launch import cdiv, forward_launch, keep_bounded
from core.fusions.gated_norm_plans import dense_blocks, launch_forward
from core.fusions.gated_norm_validation import (check_bool, check_head_dim, check_last_dim_stride,
                                                check_operands, check_option,
                                                check_positive_number, check_rows, check_tensors)
from core.fusions.memory_overlap import overlap

# vLLM spells silu "swish"; both name the same kernel branch.
_ACTIVATIONS = {"swish": "silu", "silu": "silu", "sigmoid": "sigmoid"}
_NAME = "fused_gdn_gated_rms_norm"


def fused_gdn_gated_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    num_v_heads: int,
    head_v_dim: int,
    norm_before_gate: bool = True,
    activation: str = "swish",
) -> None:
    """Gated RMSNorm over each head of ``x``, written into ``out``; one rounding at the store.

    Args:
        x: (num_tokens, num_v_heads * head_v_dim), bf16/fp16/fp32, last dim contiguous (any
            token stride).
        z: the gate, x's shape and dtype, last dim contiguous; typically a token-strided slice of
            a packed input projection, read in place.
        weight: (head_v_dim,) contiguous, shared by all heads; fp32 or x's dtype.
        out: x's shape and dtype, last dim contiguous, rows not overlapping each other. May be x
            itself (or z itself): each row is read completely before it is written, by the same
            program. Any partial overlap with x, z or weight is rejected. Written in place: its
            autograd version goes up, as with any in-place op.
        eps: finite Python float (or int) > 0, added to mean(x^2).
        num_v_heads, head_v_dim: the head split of the last dim; head_v_dim <= MAX_HEAD_DIM.
        norm_before_gate: a bool; True: rms_norm(x) * act(z); False: rms_norm(x * act(z)).
        activation: "swish" / "silu" or "sigmoid".

    Raises TypeError for an argument of the wrong type and ValueError for a value that breaks a
    rule, before any launch: the same rules, types and messages as ``fused_gated_norm`` where the
    two share a rule (gated_norm_validation.py).

    No autograd: call it under ``torch.no_grad()`` / ``torch.inference_mode()`` (as vLLM does);
    with grad mode on, inputs that require grad are rejected rather than silently detached. Use
    ``fused_gated_norm`` to train. ``num_tokens == 0`` returns without a launch.
    """
    gate_activation = _check_inputs(
        x, z, weight, out, eps, num_v_heads, head_v_dim, norm_before_gate, activation
    )
    tokens = x.shape[0]
    if tokens == 0:
        return
    eps = float(eps)
    strides = (x.stride(0), z.stride(0), out.stride(0))
    key = (tokens, num_v_heads, head_v_dim, strides, x.dtype, weight.dtype, x.device, eps,
           gate_activation, norm_before_gate)
    grid, prepared = _launches.get(key) or _prepare(key)
    launch_forward.launch(grid, (x, z, weight, out, None), prepared)
    # Written by the kernel, unseen by autograd: a graph that saved out (x itself, say) then
    # refuses to backward, as after any in-place op. Inference tensors have no version.
    torch.autograd.graph.increment_version(out)


# Prepared launches by everything that decides them (the token count included), kept for the
# calls that repeat them (a serving loop's decode steps) and bounded as the training plans are.
MAX_LAUNCHES = 256
_launches: dict = {}


def _prepare(key: tuple) -> tuple[int, PreparedLaunch]:
    """Grid and prepared arguments of ``gated_norm_fwd`` for [tokens, heads * dim] tensors with
    token strides ``strides`` (x, z, out) and the rest of ``key``, kept in ``_launches``.

    The 2-D tensors are [1, T, H, D] views, described by their layout directly instead of
    through view objects (cheaper on the host). Batch is 1, so tokens are flat and the batch
    stride is unused: 0 keeps the compile cache key independent of num_tokens. Elements are
    adjacent (the unit last-dim stride this entry's rules require)."""
    (tokens, heads, dim, strides, dtype, weight_dtype, device, eps, gate_activation,
     norm_before_gate) = key
    cfg = forward_launch(dim, device)
    bt = cfg.bt
    x_tokens, z_tokens, out_tokens = strides
    args = ForwardArgs(
        ROWS=tokens * heads, HEADS=heads, D=dim, SEQUENCE=tokens,
        X_STRIDES=(0, x_tokens, dim, 1), GATE_STRIDES=(0, z_tokens, dim, 1),
        OUT_STRIDES=(0, out_tokens, dim, 1),
        X_FLAT_TOKENS=True, GATE_FLAT_TOKENS=True, OUT_FLAT_TOKENS=True,
        X_DENSE=dense_blocks(bt, heads, dim, x_tokens, dim, 1, True),
        GATE_DENSE=dense_blocks(bt, heads, dim, z_tokens, dim, 1, True),
        OUT_DENSE=dense_blocks(bt, heads, dim, out_tokens, dim, 1, True),
        EPS=eps, ZERO_CENTERED=False, BT=bt, BLOCK_D=cfg.block_d,
        NORM_DTYPE=tl.float32,  # no intermediate rounding: one rounding at the store
        ACTIVATION=gate_activation, NORM_BEFORE_GATE=norm_before_gate,
        STORE_RSTD=False,  # nothing is saved for a backward (rstd: a null pointer)
        PDL=cfg.pdl)
    launch = (cdiv(tokens * heads, bt),
              launch_forward.prepare((dtype, dtype, weight_dtype, dtype, None), args, cfg.warps,
                                     cfg.pdl))
    return keep_bounded(_launches, key, launch, MAX_LAUNCHES)


# ----------------------------------------------------------------------------------------------
# Validation: host-side metadata only (no tensor reads, no CUDA synchronisation)
# ----------------------------------------------------------------------------------------------


def _check_inputs(x, z, weight, out, eps, num_v_heads, head_v_dim, norm_before_gate,
                  activation) -> str:
    """Raise TypeError/ValueError naming the argument and the rule; return the kernel's name of
    the gate activation. Rules shared with the training entry come from gated_norm_validation;
    the device rule comes before the overlap rules, which read addresses."""
    check_tensors(_NAME, (("x", x), ("z", z), ("weight", weight), ("out", out)))
    for name, v in (("num_v_heads", num_v_heads), ("head_v_dim", head_v_dim)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{_NAME}: {name} must be an int, got {type(v).__name__}")
        if v <= 0:
            raise ValueError(f"{_NAME}: {name} must be > 0, got {v}")
    check_head_dim(_NAME, "head_v_dim", head_v_dim)
    check_bool(_NAME, "norm_before_gate", norm_before_gate)
    check_option(_NAME, "activation", activation, tuple(_ACTIVATIONS))

    # Each metadata read is a call into torch: read each once, compare locals.
    width = num_v_heads * head_v_dim
    shape = x.shape
    if len(shape) != 2 or shape[1] != width:
        raise ValueError(
            f"{_NAME}: x must have shape (num_tokens, num_v_heads * head_v_dim) = (T, {width}), "
            f"got {tuple(shape)}"
        )
    for name, t in (("z", z), ("out", out)):
        if t.shape != shape:
            raise ValueError(f"{_NAME}: {name} must have x's shape {tuple(shape)}, got "
                             f"{tuple(t.shape)}")
    tokens = shape[0]
    check_operands(_NAME, x, (("z", z), ("out", out)), weight, head_v_dim)
    check_rows(_NAME, "num_tokens * num_v_heads", tokens * num_v_heads)
    check_positive_number(_NAME, "eps", eps)
    if tokens:
        _check_strides_and_overlap(x, z, weight, out, tokens, width, head_v_dim)
    if torch.is_grad_enabled():
        for name, t in (("x", x), ("z", z), ("weight", weight), ("out", out)):
            if t.requires_grad:
                raise ValueError(
                    f"{_NAME}: {name} requires grad with grad mode enabled, and this entry has no "
                    "autograd; call it under torch.no_grad() or torch.inference_mode(), or use "
                    "fused_gated_norm to train")
    return _ACTIVATIONS[activation]


def _check_strides_and_overlap(x, z, weight, out, tokens: int, width: int,
                               head_v_dim: int) -> None:
    """Unit last-dim strides, then: rows of out do not overlap each other, and out is x or z
    itself or does not overlap them; it never overlaps the weight's span (ValueError). The
    messages of memory_overlap.check_out_apart, computed from the token strides of the
    2-D tensors read once, which costs the per-call host path less than the general check."""
    x_strides, z_strides, out_strides = check_last_dim_stride(
        _NAME, (("x", x), ("z", z), ("out", out)))
    token_strides = {"x": x_strides[0], "z": z_strides[0], "out": out_strides[0]}
    # Rows of out written by different programs must not share memory (an expanded view).
    if tokens > 1 and token_strides["out"] < width:
        raise ValueError(
            f"{_NAME}: out rows must not overlap each other: token stride {token_strides['out']} "
            f"< row width {width}"
        )
    # Byte spans first (cheap, from the strides read above); the exact test only when they meet.
    size = x.element_size()
    out_lo = out.data_ptr()
    out_hi = out_lo + ((tokens - 1) * token_strides["out"] + width) * size
    for name, t in (("x", x), ("z", z)):
        if t is out:  # the common in-place call
            continue
        lo = t.data_ptr()
        hi = lo + ((tokens - 1) * token_strides[name] + width) * size
        if lo < out_hi and out_lo < hi and overlap(out, t) == "partial":
            raise ValueError(
                f"{_NAME}: out must either be {name} itself (same data_ptr, shape and strides) "
                f"or not overlap it; it partially overlaps {name}"
            )
    weight_lo = weight.data_ptr()
    if weight_lo < out_hi and out_lo < weight_lo + head_v_dim * weight.element_size():
        raise ValueError(f"{_NAME}: out must not overlap weight (every program reads weight)")
