"""Launch plans of the training kernels: the tensors' metadata and the options turned into the
kernels' arguments (``ForwardArgs``, ``BackwardArgs``, ``DwSumArgs``) with the heuristics of
``gated_norm_launch``, prepared for ``direct_launch`` once and kept in a bounded table.

Nothing here checks an input. ``run_forward``, ``forward_buffer`` and ``run_backward`` take
inputs that passed a checking station (gated_norm_checks) and ``checked``, the number the
station gave their signature: a plan is kept under that number and the options the signature
does not hold. For ``checked`` None (a signature no memo keeps) the plan is built for the call.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton.language as tl

from core.fusions.direct_launch import DirectLauncher, PreparedLaunch
from core.fusions.gated_norm_kernels import (INTERPRETER_LOOP_PROBLEM, BackwardArgs, DwSumArgs,
                                             ForwardArgs, gated_norm_bwd, gated_norm_dw_sum,
                                             gated_norm_fwd)
from core.fusions.gated_norm_launch import (BackwardLaunch, backward_launch, backward_programs,
                                            cdiv, forward_launch, keep_bounded,
                                            next_power_of_2)
from core.fusions.gated_norm_validation import current_device

# FP contraction (a * b + c as one FMA) on: Triton's default up to 3.9, and how the kernels are
# tested and timed. Off (TRITON_DEFAULT_FP_FUSION=0; Triton 3.10's default) they keep their
# accuracy but run slower at small row counts (docs/design.md, Launch choices), so every launch
# asks for it.
COMPILE_OPTIONS = {"enable_fp_fusion": True}

# Repeated calls skip JITFunction.run's binding (direct_launch.py).
launch_forward = DirectLauncher(gated_norm_fwd, **COMPILE_OPTIONS)
launch_backward = DirectLauncher(gated_norm_bwd, **COMPILE_OPTIONS)
launch_dw_sum = DirectLauncher(gated_norm_dw_sum, **COMPILE_OPTIONS)

_TORCH_TO_TRITON = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                    torch.float32: tl.float32}

# (batch, sequence, head, element) strides, flat tokens, dense blocks: how a kernel addresses a
# view.
Layout = tuple[tuple[int, int, int, int], bool, bool]


def layout(t: torch.Tensor, bt: int) -> Layout:
    """(batch, sequence, head, element) strides of a [B, S, H, D] view, whether tokens are flat,
    and whether blocks of ``bt`` rows are dense (``dense_blocks``). Any strides: zero ones
    (an expanded gate or dy) and a last-dim stride other than 1 included.

    With flat tokens the kernel never reads the batch stride: pass 0 so that its value (which
    grows with the sequence length) cannot change Triton's specialisation key, i.e. a new token
    count never compiles a new kernel. A last dim of one element is read at offset 0: its stride
    passes as 1, the unit-stride kernel's."""
    batch, seq, heads, dim = t.shape
    sb, ss, sh, sd = t.stride()
    if seq == 1:  # one token per sequence: the batch stride is the token stride
        ss = sb
    if dim == 1:
        sd = 1
    flat = batch == 1 or sb == seq * ss
    return (0 if flat else sb, ss, sh, sd), flat, dense_blocks(bt, heads, dim, ss, sh, sd, flat)


def dense_blocks(bt: int, heads: int, dim: int, token_stride: int, head_stride: int,
                 element_stride: int, flat: bool) -> bool:
    """Whether every block of ``bt`` consecutive rows (blocks start at multiples of ``bt``) lies
    back to back in memory, one row every ``dim`` elements: elements are adjacent (unit
    ``element_stride``), heads are ``dim`` apart and the block stays inside one token (``bt``
    divides the head count), or tokens are dense too (flat tokens ``heads * dim`` apart). None of
    it involves the token count, so a new token count never changes the answer (no recompile).
    For Megatron's tensors: FLA's contiguous output always; the gate slice of the packed
    projection and the sbhd output buffer (B > 1) when ``bt`` divides the local head count (TP
    4-8 ranks with few heads take the per-row path)."""
    if element_stride != 1 or head_stride != dim:
        return False
    return heads % bt == 0 or (flat and token_stride == heads * dim)


@functools.lru_cache(maxsize=None)
def norm_dtype(x_dtype: torch.dtype, weight_dtype: torch.dtype):
    """Triton dtype of the unfused norm's output: the promotion of x's and the weight's dtype
    (a bf16 weight rounds to bf16, an fp32 weight does not round)."""
    return _TORCH_TO_TRITON[torch.promote_types(x_dtype, weight_dtype)]


def buffer_template(like: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose ``torch.empty_like`` is a new contiguous ``shape`` buffer of ``dtype`` on
    ``like``'s device: one element, expanded (not dense, so empty_like lays the buffer out
    contiguously); about half the host time of ``new_empty(shape, dtype=...)``."""
    return like.new_empty((), dtype=dtype).expand(shape)


class ForwardPlan(NamedTuple):
    grid: int
    launch: PreparedLaunch
    rstd: Optional[torch.Tensor]  # buffer_template of rstd; None when no rstd is stored
    device: Optional[int]  # the current CUDA device the signature was checked on


class BackwardPlan(NamedTuple):
    grid: int  # persistent programs, also the number of dW partials
    launch: PreparedLaunch
    dw_partials: torch.Tensor  # buffer_template of the [grid, D] fp32 partials
    dw_sum_grid: int
    dw_sum: PreparedLaunch
    device: Optional[int]


def forward_plan(x, gate, weight, out, eps, zero_centered, gate_activation, store_rstd,
                 bt=None, warps=None, pdl=None) -> ForwardPlan:
    """The launch of ``gated_norm_fwd`` for these tensors and options; ``bt``/``warps``/``pdl``
    override the heuristics."""
    batch, seq, heads, dim = x.shape
    cfg = forward_launch(dim, x.device)
    bt = bt or cfg.bt
    pdl = cfg.pdl if pdl is None else pdl
    rows = batch * seq * heads
    (x_strides, x_flat, x_dense), (g_strides, g_flat, g_dense), (o_strides, o_flat, o_dense) = (
        layout(x, bt), layout(gate, bt), layout(out, bt))
    args = ForwardArgs(
        ROWS=rows, HEADS=heads, D=dim, SEQUENCE=seq,
        X_STRIDES=x_strides, GATE_STRIDES=g_strides, OUT_STRIDES=o_strides,
        X_FLAT_TOKENS=x_flat, GATE_FLAT_TOKENS=g_flat, OUT_FLAT_TOKENS=o_flat,
        X_DENSE=x_dense, GATE_DENSE=g_dense, OUT_DENSE=o_dense,
        # float(): the kernel takes eps as fp32; an int would specialise another variant (1, or
        # one past Triton's 64-bit binding).
        EPS=float(eps), ZERO_CENTERED=zero_centered, BT=bt, BLOCK_D=cfg.block_d,
        NORM_DTYPE=norm_dtype(x.dtype, weight.dtype), ACTIVATION=gate_activation,
        NORM_BEFORE_GATE=True, STORE_RSTD=store_rstd, PDL=pdl)
    dtypes = (x.dtype, gate.dtype, weight.dtype, out.dtype, torch.float32 if store_rstd else None)
    return ForwardPlan(cdiv(rows, bt),
                       launch_forward.prepare(dtypes, args, warps or cfg.warps, pdl),
                       buffer_template(x, x.shape[:3], torch.float32) if store_rstd else None,
                       current_device())


def backward_plan(x, gate, weight, rstd, dy, zero_centered, gate_activation, weight_grad_scale,
                  bt=None, warps=None, programs=None, stages=None,
                  dw_sum_pdl=None, dgate_out=None) -> BackwardPlan:
    """The launches of ``gated_norm_bwd`` and ``gated_norm_dw_sum`` for these tensors and
    options; ``bt``/``warps``/``programs``/``stages``/``dw_sum_pdl`` override the heuristics.
    ``dgate_out``: where dgate goes, through its strides (None: a new contiguous tensor)."""
    if INTERPRETER_LOOP_PROBLEM:
        raise RuntimeError(f"backward_impl: {INTERPRETER_LOOP_PROBLEM}")
    batch, seq, heads, dim = x.shape
    cfg = backward_launch(dim, x.device)
    if dw_sum_pdl is not None:
        cfg = cfg._replace(dw_sum_pdl=dw_sum_pdl)
    bt = bt or cfg.bt
    rows = batch * seq * heads
    blocks = cdiv(rows, bt)
    programs = min(programs, blocks) if programs else backward_programs(cfg, blocks)
    (x_strides, x_flat, x_dense), (g_strides, g_flat, g_dense), (d_strides, d_flat, d_dense) = (
        layout(x, bt), layout(gate, bt), layout(dy, bt))
    # the strides of a contiguous dgate never reach the kernel (DGATE_STRIDED False)
    dg_strides, dg_flat, dg_dense = ((0, 0, 0, 1), True, True) if dgate_out is None else (
        layout(dgate_out, bt))
    args = BackwardArgs(
        ROWS=rows, HEADS=heads, D=dim, SEQUENCE=seq,
        X_STRIDES=x_strides, GATE_STRIDES=g_strides, DY_STRIDES=d_strides,
        DGATE_STRIDES=dg_strides,
        X_FLAT_TOKENS=x_flat, GATE_FLAT_TOKENS=g_flat, DY_FLAT_TOKENS=d_flat,
        DGATE_FLAT_TOKENS=dg_flat,
        X_DENSE=x_dense, GATE_DENSE=g_dense, DY_DENSE=d_dense,
        DGATE_DENSE=dg_dense, DGATE_STRIDED=dgate_out is not None,
        ZERO_CENTERED=zero_centered, BT=bt, BLOCK_D=cfg.block_d,
        NORM_DTYPE=norm_dtype(x.dtype, weight.dtype), ACTIVATION=gate_activation,
        STAGES=stages or cfg.stages, EARLY_DEPENDENTS=cfg.dw_sum_pdl)
    dtypes = (x.dtype, gate.dtype, weight.dtype, torch.float32, dy.dtype, x.dtype, gate.dtype,
              torch.float32)
    return BackwardPlan(programs, launch_backward.prepare(dtypes, args, warps or cfg.warps),
                        buffer_template(x, (programs, dim), torch.float32),
                        *dw_sum_launch(programs, dim, weight.dtype, cfg, float(weight_grad_scale)),
                        current_device())


def dw_sum_launch(programs: int, dim: int, dtype: torch.dtype, cfg: BackwardLaunch,
                  weight_grad_scale: float) -> tuple[int, PreparedLaunch]:
    """Grid and launch of ``gated_norm_dw_sum`` for [programs, dim] fp32 partials and a dW of
    ``dtype``. The kernel's block is sized by ``cfg.max_programs`` (the launch heuristics' cap),
    so fewer partials (fewer rows) reuse the compiled kernel."""
    args = DwSumArgs(PROGRAMS=programs, WEIGHT_GRAD_SCALE=weight_grad_scale, D=dim,
                     BLOCK_P=next_power_of_2(max(programs, cfg.max_programs)),
                     BLOCK_COLS=cfg.dw_sum_columns, PDL=cfg.dw_sum_pdl,
                     LAUNCH_DEPENDENTS=cfg.dw_sum_pdl or cfg.dw_sum_dependents)
    return cdiv(dim, cfg.dw_sum_columns), launch_dw_sum.prepare((torch.float32, dtype), args,
                                                                cfg.dw_sum_warps, cfg.dw_sum_pdl)


# ----------------------------------------------------------------------------------------------
# The plan table and the launches
# ----------------------------------------------------------------------------------------------

# Plans kept by (checked signature number, the options it does not hold): a training run sees a
# handful (one per layer shape and token count).
MAX_PLANS = 256
_launch_plans: dict = {}


def _keep(key: tuple, plan):
    """Keeps ``plan`` under ``key`` unless its checked number (``key[0]``) is None; a full table
    starts over. A key with no number is never kept, so never found either."""
    if key[0] is not None:
        keep_bounded(_launch_plans, key, plan, MAX_PLANS)
    return plan


def run_forward(x, gate, weight, out, eps, zero_centered, gate_activation, store_rstd,
                checked, out_layout=None, bt=None, warps=None, pdl=None) -> Optional[torch.Tensor]:
    """Launch ``gated_norm_fwd`` into ``out``; returns rstd (None when not ``store_rstd``).
    ``out_layout`` names an ``out`` that ``forward_buffer`` made ("bshd" / "sbhd"), None a
    caller's (whose signature ``checked`` holds)."""
    batch, seq, heads, dim = x.shape
    if batch * seq * heads == 0 or dim == 0:  # nothing to normalise (no rstd is ever read)
        return x.new_empty((batch, seq, heads), dtype=torch.float32) if store_rstd else None
    key = (checked, out_layout, zero_centered, gate_activation, store_rstd, bt, warps, pdl)
    plan = _launch_plans.get(key)
    if plan is None:
        plan = _keep(key, forward_plan(x, gate, weight, out, eps, zero_centered, gate_activation,
                                       store_rstd, bt, warps, pdl))
    rstd = torch.empty_like(plan.rstd) if store_rstd else None
    launch_forward.launch(plan.grid, (x, gate, weight, out, rstd), plan.launch, plan.device)
    return rstd


def forward_buffer(x, gate, weight, eps, zero_centered, out_layout, gate_activation, checked,
                   store_rstd=True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``run_forward`` into a new buffer, contiguous in ``out_layout`` ([B, S, H, D] for "bshd",
    [S, B, H, D] for "sbhd"); returns ``(buffer, rstd)``."""
    if out_layout == "sbhd":
        batch, seq, heads, dim = x.shape
        buffer = x.new_empty((seq, batch, heads, dim))  # cheaper than torch.empty(..., device=)
        out = buffer.transpose(0, 1)
    else:
        buffer = out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return buffer, run_forward(x, gate, weight, out, eps, zero_centered, gate_activation,
                               store_rstd, checked, out_layout)


def as_bshd(buffer: torch.Tensor, out_layout: str) -> torch.Tensor:
    """The [B, S, H, D] view of a ``forward_buffer`` buffer (or of its gradient)."""
    return buffer.transpose(0, 1) if out_layout == "sbhd" else buffer


def run_backward(x, gate, weight, rstd, dy, zero_centered, gate_activation, weight_grad_scale,
                 checked, bt=None, warps=None, programs=None, stages=None,
                 dw_sum_pdl=None, dgate_out=None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch ``gated_norm_bwd`` and ``gated_norm_dw_sum``; returns ``(dx, dgate, dweight)``,
    dx and dgate contiguous in x's and the gate's dtype. dy is read in place (any strides).
    ``dgate_out`` (the gate's shape and dtype, elements apart): dgate is written there instead,
    through its strides, and returned."""
    batch, seq, heads, dim = x.shape
    if batch * seq * heads == 0 or dim == 0:  # no row contributes: dW is zero at any scale
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(gate, memory_format=torch.contiguous_format)
                if dgate_out is None else dgate_out,
                torch.zeros_like(weight))
    key = (checked, zero_centered, gate_activation, bt, warps, programs, stages, dw_sum_pdl,
           None if dgate_out is None else dgate_out.stride())
    plan = _launch_plans.get(key)
    if plan is None:
        plan = _keep(key, backward_plan(x, gate, weight, rstd, dy, zero_centered, gate_activation,
                                        weight_grad_scale, bt, warps, programs, stages,
                                        dw_sum_pdl, dgate_out))
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dgate = (torch.empty_like(gate, memory_format=torch.contiguous_format) if dgate_out is None
             else dgate_out)
    dw_partial = torch.empty_like(plan.dw_partials)
    launch_backward.launch(plan.grid, (x, gate, weight, rstd, dy, dx, dgate, dw_partial),
                           plan.launch, plan.device)
    dweight = torch.empty_like(weight)
    launch_dw_sum.launch(plan.dw_sum_grid, (dw_partial, dweight), plan.dw_sum, plan.device)
    return dx, dgate, dweight
