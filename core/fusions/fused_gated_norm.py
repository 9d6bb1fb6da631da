"""Fused output gated RMSNorm of the Gated DeltaNet layer.

    out = round(round(rms_norm(x) * w_eff) * act(gate))            (training, "megatron" rounding)

x and gate are ``[batch, sequence, head, dim]`` views that may be strided (a slice of a packed
projection, a transposed sbhd view); the kernels address them in place. The norm runs over
``dim`` with one weight of shape ``(dim,)`` shared by all heads.

Layers, top to bottom (docs/design.md has the picture):
  fused_gated_norm -> _FusedGatedNorm -> forward_impl / backward_impl
      -> gated_norm_fwd / gated_norm_bwd + gated_norm_dw_sum (through direct_launch.py)
The input rules, and ``validate_gated_norm`` (the host-side checks a Megatron module runs on
every fused forward, importable from here), are in ``gated_norm_validation``; launch parameters
come from ``gated_norm_launch``; numerics are explained in docs/numerics.md.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from core.fusions.direct_launch import DirectLauncher, PreparedLaunch
from core.fusions.gated_norm_launch import (BackwardLaunch, backward_launch, backward_programs,
                                            cdiv, forward_launch, next_power_of_2)
from core.fusions.gated_norm_validation import (  # noqa: F401 (validate_gated_norm: re-exported)
    FUSED_GATED_NORM, INTERPRETED, KEY_ERRORS, check_activation, check_bool, check_option,
    check_dependent_launch, check_gated_norm_inputs, check_gated_norm_tensors,
    check_launch_overrides, check_launch_tile,
    check_out_apart, check_positive_number, check_rstd, current_device, keep_checked, lookup_checked,
    tensor_signature, validate_gated_norm)

_TORCH_TO_TRITON = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
OUT_LAYOUTS = ("bshd", "sbhd")


# Kernel arguments that change with the token count (packed sequences of varying total length).
# They are never specialised (no divisibility or ==1 variants), so a new token count reuses the
# compiled kernel; tests/fusions/test_fused_gated_norm_compile.py checks the whole specialisation key.
PER_STEP_ARGS = ["ROWS", "SEQUENCE", "PROGRAMS"]


# ----------------------------------------------------------------------------------------------
# Triton kernel bodies
# ----------------------------------------------------------------------------------------------


@triton.jit
def _row_offset(row, SEQUENCE, HEADS: tl.constexpr, STRIDE_B, STRIDE_S, STRIDE_H,
                FLAT_TOKENS: tl.constexpr):
    """Element offset (int64) of logical row ``(b * SEQUENCE + s) * HEADS + h`` of a strided
    ``[B, S, H, D]`` view. FLAT_TOKENS: batch and sequence fold into one token stride
    (``STRIDE_B == SEQUENCE * STRIDE_S`` or B == 1), which saves a division per row.

    The index math stays in the row's integer type (int32 in the kernels: the host checks
    rows <= MAX_ROWS) and only the products with the strides are 64-bit (one wide multiply each):
    full 64-bit row math costs the forward more instructions (tools/kernel_ir.py counts them)."""
    token = row // HEADS
    head = row - token * HEADS
    if FLAT_TOKENS:
        offset = token.to(tl.int64) * STRIDE_S + head.to(tl.int64) * STRIDE_H
    else:
        batch = token // SEQUENCE
        seq = token - batch * SEQUENCE
        offset = (batch.to(tl.int64) * STRIDE_B + seq.to(tl.int64) * STRIDE_S
                  + head.to(tl.int64) * STRIDE_H)
    return offset


# The GPU's fp32->bf16 conversion (cvt.rn) is IEEE round-to-nearest-even; the interpreter's
# truncates. Decided once, like triton.jit's own choice between compiling and interpreting.
_EXACT_BF16_CAST = tl.constexpr(not INTERPRETED)
# exp(-g) as one flush-to-zero ex2 on the GPU (_exp_neg); the interpreter keeps numpy's exp.
_EXP2_FTZ = tl.constexpr(not INTERPRETED)


def interpreter_loop_problem() -> Optional[str]:
    """Why the installed Triton's interpreter cannot run the backward's row-block loop, or None
    (whether or not this process interprets). Triton 3.6's interpreter turns a loop bound (a
    one-element array) into an int with ``int()``, which newer NumPy releases refuse; Triton 3.7
    squeezes it first."""
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7):
        return None
    import numpy

    try:
        int(numpy.zeros(1, dtype=numpy.int32))
    except TypeError:
        return (f"the Triton {triton.__version__} interpreter (TRITON_INTERPRET=1) cannot run the "
                f"backward kernel's loop with NumPy {numpy.__version__}, which refuses int() of "
                "a one-element array; use triton >= 3.7 on the CPU (tools/constraints.txt pins "
                "3.7.1)")
    return None


INTERPRETER_LOOP_PROBLEM = interpreter_loop_problem() if INTERPRETED else None


@triton.jit
def _row_pointers(base, row0, rows, cols, SEQUENCE, HEADS: tl.constexpr, D: tl.constexpr,
                  STRIDES, FLAT_TOKENS: tl.constexpr, DENSE: tl.constexpr):
    """Pointers to the [BT, BLOCK_D] block of ``rows`` (the first is ``row0``) of a strided
    [B, S, H, D] view whose (batch, sequence, head) strides are the tuple STRIDES.

    DENSE (``dense_blocks`` on the host): the block's rows lie back to back, D apart. One
    64-bit offset for the block, then a [BT, D] tile of 32-bit offsets that the compiler sees
    as contiguous: no address math per row or element (docs/design.md, Launch choices: the
    forward's real cost is its addressing). Otherwise one
    64-bit offset per row, columns as 32-bit offsets from it."""
    if DENSE:
        first = _row_offset(row0, SEQUENCE, HEADS, STRIDES[0], STRIDES[1], STRIDES[2], FLAT_TOKENS)
        local = tl.arange(0, rows.shape[0])
        ptrs = (base + first) + ((local * D)[:, None] + cols[None, :])
    else:
        offsets = _row_offset(rows, SEQUENCE, HEADS, STRIDES[0], STRIDES[1], STRIDES[2],
                              FLAT_TOKENS)
        ptrs = (base + offsets)[:, None] + cols[None, :]
    return ptrs


@triton.jit
def _row_block(block, ROWS, BT: tl.constexpr, col_mask):
    """First row, row indices (int32: the host checks ROWS <= MAX_ROWS), row mask and element
    mask of row block ``block``."""
    row0 = block * BT
    rows = row0 + tl.arange(0, BT)
    row_mask = rows < ROWS
    return row0, rows, row_mask, row_mask[:, None] & col_mask[None, :]


@triton.jit
def _load_weight(weight, cols, col_mask, ZERO_CENTERED: tl.constexpr):
    """The effective weight in fp32: w, or 1 + w (zero-centred gamma; the 1 added in fp32)."""
    w = tl.load(weight + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    return w


@triton.jit
def _round_to(v, DTYPE: tl.constexpr):
    """Round fp32 ``v`` to the nearest-even value of DTYPE, kept in fp32.

    bf16 on the GPU: one hardware conversion (cvt.rn, RTNE, NaN stays NaN, overflow to inf),
    bit-identical to the integer rounding below and ~5 instructions per element cheaper, which
    matters: these kernels are close to issue-bound as well as memory-bound on the H200.
    bf16 in the interpreter: integer ops, because its own fp32->bf16 cast truncates; the later
    store of the exact value is then exact."""
    if DTYPE == tl.bfloat16 and _EXACT_BF16_CAST:
        rounded = v.to(tl.bfloat16).to(tl.float32)
    elif DTYPE == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        rounded = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))  # keep NaN a NaN
    elif DTYPE == tl.float16:
        rounded = v.to(tl.float16).to(tl.float32)
    else:
        rounded = v
    return rounded


@triton.jit
def _dependent_launch_entry(PDL: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr):
    """First step of a kernel that takes part in programmatic dependent launch (sm_90+; see
    gated_norm_launch). PDL (launched early): wait until the previous kernel in the stream has
    finished and its writes are visible, before any load (the weight included: an optimizer step
    may just have written it). LAUNCH_DEPENDENTS: then let the next kernel start launching. A
    kernel that starts early this way waits the same way before it reads anything, so it never
    sees a partial result of this one."""
    if PDL:
        gdc_wait()
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()


@triton.jit
def _exp_neg(g):
    """exp(-g) with the bits of tl.exp(-g) on an NVIDIA GPU, in 2 instructions instead of 6
    (SASS, sm_90). tl.exp(v) is ex2.approx(v * log2(e)) there: folding the negation into the
    constant changes no product, and the flush-to-zero ex2 differs only where e < 2^-126, which
    only ever meets 1 + e (= 1 either way)."""
    if _EXP2_FTZ:
        e = tl.exp2(g * -1.4426950408889634)
    else:
        e = tl.exp(-g)
    return e


@triton.jit
def _sigmoid(g):
    return 1.0 / (1.0 + _exp_neg(g))


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    # torch's formulas (silu = g / (1 + exp(-g))) with Triton's fast exp and division: their
    # fp32 values differ from torch's expf and IEEE division in the last bits, which flips the
    # gated output's bf16 rounding on about 1 element in 10^8 (docs/numerics.md). The exact
    # functions (libdevice.exp, tl.div_rn) remove that and slow the kernels, which are close to
    # issue-bound (docs/design.md, Activation arithmetic).
    if ACTIVATION == "sigmoid":
        act = _sigmoid(g)
    else:
        act = g / (1.0 + _exp_neg(g))
    return act


@triton.jit
def _activation_grad(g, ACTIVATION: tl.constexpr):
    sig = _sigmoid(g)
    if ACTIVATION == "sigmoid":
        grad = sig * (1.0 - sig)
    else:
        grad = sig * (1.0 + g * (1.0 - sig))  # torch's silu_backward formula
    return grad


@triton.jit(do_not_specialize=PER_STEP_ARGS)
def gated_norm_fwd(
    x, gate, weight, out, rstd,
    ROWS, HEADS: tl.constexpr, D: tl.constexpr, SEQUENCE,
    X_STRIDES, GATE_STRIDES, OUT_STRIDES,
    X_FLAT_TOKENS: tl.constexpr, GATE_FLAT_TOKENS: tl.constexpr, OUT_FLAT_TOKENS: tl.constexpr,
    X_DENSE: tl.constexpr, GATE_DENSE: tl.constexpr, OUT_DENSE: tl.constexpr,
    EPS, ZERO_CENTERED: tl.constexpr, BT: tl.constexpr, BLOCK_D: tl.constexpr,
    NORM_DTYPE: tl.constexpr, ACTIVATION: tl.constexpr = "silu",
    NORM_BEFORE_GATE: tl.constexpr = True, STORE_RSTD: tl.constexpr = True,
    PDL: tl.constexpr = False,
):
    """Writes out and (STORE_RSTD) one fp32 inverse RMS per row: program p handles rows
    [p * BT, (p + 1) * BT). One block per program, no grid-stride loop: many small programs keep
    enough loads in flight, and the loop was slower (docs/design.md, Launch choices).
    NORM_DTYPE: dtype the norm output is rounded to before the gate product (the unfused
    norm's output dtype); tl.float32 means no intermediate rounding (vLLM/FLA semantics).
    NORM_BEFORE_GATE=False normalises x * act(gate) instead (inference only). PDL: launched with
    programmatic dependent launch (_dependent_launch_entry)."""
    _dependent_launch_entry(PDL, PDL)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    w = _load_weight(weight, cols, col_mask, ZERO_CENTERED)
    OUT_DTYPE: tl.constexpr = out.dtype.element_ty
    row0, rows, row_mask, mask = _row_block(tl.program_id(0), ROWS, BT, col_mask)
    x_ptrs = _row_pointers(x, row0, rows, cols, SEQUENCE, HEADS, D, X_STRIDES, X_FLAT_TOKENS,
                           X_DENSE)
    g_ptrs = _row_pointers(gate, row0, rows, cols, SEQUENCE, HEADS, D, GATE_STRIDES,
                           GATE_FLAT_TOKENS, GATE_DENSE)
    xv = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    gv = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    act = _activation(gv, ACTIVATION)
    if not NORM_BEFORE_GATE:
        xv = xv * act
    r = tl.math.rsqrt(tl.sum(xv * xv, axis=1) / D + EPS)
    y = _round_to(xv * r[:, None] * w[None, :], NORM_DTYPE)
    if NORM_BEFORE_GATE:
        y = y * act
    o_ptrs = _row_pointers(out, row0, rows, cols, SEQUENCE, HEADS, D, OUT_STRIDES, OUT_FLAT_TOKENS,
                           OUT_DENSE)
    tl.store(o_ptrs, _round_to(y, OUT_DTYPE).to(OUT_DTYPE), mask=mask)
    if STORE_RSTD:
        tl.store(rstd + rows, r, mask=row_mask)


@triton.jit(do_not_specialize=PER_STEP_ARGS)
def gated_norm_bwd(
    x, gate, weight, rstd, dy, dx, dgate, dw_partial,
    ROWS, HEADS: tl.constexpr, D: tl.constexpr, SEQUENCE,
    X_STRIDES, GATE_STRIDES, DY_STRIDES,
    X_FLAT_TOKENS: tl.constexpr, GATE_FLAT_TOKENS: tl.constexpr, DY_FLAT_TOKENS: tl.constexpr,
    X_DENSE: tl.constexpr, GATE_DENSE: tl.constexpr, DY_DENSE: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, BT: tl.constexpr, BLOCK_D: tl.constexpr,
    NORM_DTYPE: tl.constexpr, ACTIVATION: tl.constexpr = "silu", STAGES: tl.constexpr = 1,
    EARLY_DEPENDENTS: tl.constexpr = False,
):
    """Persistent: program p handles row blocks p, p + P, ... and writes its fp32 partial dW to
    ``dw_partial[p]``; gated_norm_dw_sum adds the partials in a fixed order (deterministic, no
    atomics). STAGES: software pipelining of the block loop (the loads of the next blocks are in
    flight while one is computed). EARLY_DEPENDENTS: as it starts, a program lets the kernel
    after it (the dW sum, launched with programmatic dependent launch) launch, so that kernel is
    resident when this one ends; it still waits for this one's completion before it reads a
    partial.

    Reproduces the unfused autograd's roundings: the norm output's gradient is rounded to
    NORM_DTYPE before the norm backward, and dgate uses the rounded norm output.
    dx and dgate are written contiguous ``[ROWS, D]``; dy is read in place."""
    if EARLY_DEPENDENTS:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    w = _load_weight(weight, cols, col_mask, ZERO_CENTERED)
    dw_acc = tl.zeros((BT, BLOCK_D), dtype=tl.float32)
    for block in tl.range(pid, tl.cdiv(ROWS, BT), tl.num_programs(0), num_stages=STAGES):
        row0, rows, row_mask, mask = _row_block(block, ROWS, BT, col_mask)
        x_ptrs = _row_pointers(x, row0, rows, cols, SEQUENCE, HEADS, D, X_STRIDES, X_FLAT_TOKENS,
                               X_DENSE)
        g_ptrs = _row_pointers(gate, row0, rows, cols, SEQUENCE, HEADS, D, GATE_STRIDES,
                               GATE_FLAT_TOKENS, GATE_DENSE)
        d_ptrs = _row_pointers(dy, row0, rows, cols, SEQUENCE, HEADS, D, DY_STRIDES,
                               DY_FLAT_TOKENS, DY_DENSE)
        xv = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        gv = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(d_ptrs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(rstd + rows, mask=row_mask, other=0.0)

        x_hat = xv * r[:, None]
        y = _round_to(x_hat * w[None, :], NORM_DTYPE)
        dgate_v = dout * y * _activation_grad(gv, ACTIVATION)
        dnorm = _round_to(dout * _activation(gv, ACTIVATION), NORM_DTYPE)
        wdy = dnorm * w[None, :]
        c = tl.sum(x_hat * wdy, axis=1) / D
        dx_v = (wdy - x_hat * c[:, None]) * r[:, None]
        dw_acc += dnorm * x_hat

        # dx, dgate: contiguous [ROWS, D], so always a dense tile from a 64-bit block start.
        block_start = row0.to(tl.int64) * D
        tile = (tl.arange(0, BT) * D)[:, None] + cols[None, :]
        DX_DTYPE: tl.constexpr = dx.dtype.element_ty
        DG_DTYPE: tl.constexpr = dgate.dtype.element_ty
        tl.store((dx + block_start) + tile, _round_to(dx_v, DX_DTYPE).to(DX_DTYPE), mask=mask)
        tl.store((dgate + block_start) + tile, _round_to(dgate_v, DG_DTYPE).to(DG_DTYPE),
                 mask=mask)
    tl.store(dw_partial + pid.to(tl.int64) * D + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


@triton.jit(do_not_specialize=PER_STEP_ARGS)
def gated_norm_dw_sum(dw_partial, dweight, PROGRAMS, WEIGHT_GRAD_SCALE, D: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_COLS: tl.constexpr, PDL: tl.constexpr = False,
                      LAUNCH_DEPENDENTS: tl.constexpr = False):
    """``dweight = round(WEIGHT_GRAD_SCALE * sum_p dw_partial[p])``: program c sums columns
    [c * BLOCK_COLS, ...) of the [PROGRAMS, D] fp32 partials in one load and one fixed tree (the
    same bits every run), scales the fp32 sum and rounds once to the weight's dtype, so a power
    of two scale is exact (and 1.0 changes no bit). WEIGHT_GRAD_SCALE is a runtime fp32 argument
    (Triton never specialises a float's value): a new value compiles nothing. BLOCK_P covers the
    most partials any launch can have, so the token count never changes it. One kernel where
    torch's ``sum(0).to()`` is two.
    PDL: launched with programmatic dependent launch; LAUNCH_DEPENDENTS: lets the next kernel
    launch early (_dependent_launch_entry)."""
    _dependent_launch_entry(PDL, LAUNCH_DEPENDENTS)
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    parts = tl.arange(0, BLOCK_P)
    mask = (parts[:, None] < PROGRAMS) & (cols[None, :] < D)
    tile = tl.load(dw_partial + parts[:, None] * D + cols[None, :], mask=mask, other=0.0)
    W_DTYPE: tl.constexpr = dweight.dtype.element_ty
    dw = tl.sum(tile, axis=0) * WEIGHT_GRAD_SCALE
    tl.store(dweight + cols, _round_to(dw, W_DTYPE).to(W_DTYPE), mask=cols < D)


# ----------------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------------

# FP contraction (a * b + c as one FMA) on: Triton's default up to 3.9, and how the kernels are
# tested and timed. Off (TRITON_DEFAULT_FP_FUSION=0; Triton 3.10's default) they keep their
# accuracy but run up to 8 % slower at small row counts (docs/design.md, Launch choices), so
# every launch asks for it.
COMPILE_OPTIONS = {"enable_fp_fusion": True}

# Repeated calls skip JITFunction.run's binding (direct_launch.py; the host time it saves is in
# docs/benchmarks.md, Host cost).
launch_forward = DirectLauncher(gated_norm_fwd, **COMPILE_OPTIONS)
launch_backward = DirectLauncher(gated_norm_bwd, **COMPILE_OPTIONS)
launch_dw_sum = DirectLauncher(gated_norm_dw_sum, **COMPILE_OPTIONS)

# (batch, sequence, head) strides, flat tokens, dense blocks: how a kernel addresses a view.
Layout = tuple[tuple[int, int, int], bool, bool]


def _layout(t: torch.Tensor, bt: int) -> Layout:
    """(batch, sequence, head) strides of a [B, S, H, D] view, whether tokens are flat, and
    whether blocks of ``bt`` rows are dense (``dense_blocks``).

    With flat tokens the kernel never reads the batch stride: pass 0 so that its value (which
    grows with the sequence length) cannot change Triton's specialisation key, i.e. a new token
    count never compiles a new kernel."""
    batch, seq, heads, dim = t.shape
    sb, ss, sh, _ = t.stride()
    if seq == 1:  # one token per sequence: the batch stride is the token stride
        ss = sb
    flat = batch == 1 or sb == seq * ss
    return (0 if flat else sb, ss, sh), flat, dense_blocks(bt, heads, dim, ss, sh, flat)


def dense_blocks(bt: int, heads: int, dim: int, token_stride: int, head_stride: int,
                 flat: bool) -> bool:
    """Whether every block of ``bt`` consecutive rows (blocks start at multiples of ``bt``) lies
    back to back in memory, one row every ``dim`` elements: heads are ``dim`` apart and the block
    stays inside one token (``bt`` divides the head count), or tokens are dense too (flat
    tokens ``heads * dim`` apart). None of it involves the token count, so a new token count
    never changes the answer (no recompile). For Megatron's tensors: FLA's contiguous output
    always; the gate slice of the packed projection and the sbhd output buffer (B > 1) when
    ``bt`` divides the local head count (TP 4-8 ranks with few heads take the per-row path)."""
    if head_stride != dim:
        return False
    return heads % bt == 0 or (flat and token_stride == heads * dim)


@functools.lru_cache(maxsize=None)
def norm_dtype(x_dtype: torch.dtype, weight_dtype: torch.dtype):
    """Triton dtype of the unfused norm's output: the promotion of x's and the weight's dtype
    (a bf16 weight rounds to bf16, an fp32 weight does not round)."""
    return _TORCH_TO_TRITON[torch.promote_types(x_dtype, weight_dtype)]


def gated_norm_fwd_scalars(rows: int, heads: int, dim: int, seq: int,
                           layouts: tuple[Layout, Layout, Layout], eps: float,
                           zero_centered: bool, activation: str, rounding,
                           norm_before_gate: bool, store_rstd: bool, bt: int,
                           block_d: int, pdl: bool) -> tuple:
    """``gated_norm_fwd``'s scalar arguments in the kernel's parameter order, for the training
    entry (``forward_impl``) and the inference entry alike (tests/fusions/test_fused_gated_norm.py
    pins the order to the signature).

    layouts: the ``Layout`` of x, gate and out; rounding: NORM_DTYPE, the Triton dtype the norm
    output is rounded to before the gate product (tl.float32: none); store_rstd False stores no
    rstd (STORE_RSTD=False); pdl: PDL (launch with ``launch_pdl=pdl``)."""
    (x_strides, x_flat, x_dense), (g_strides, g_flat, g_dense), (o_strides, o_flat, o_dense) = layouts
    return (rows, heads, dim, seq, x_strides, g_strides, o_strides, x_flat, g_flat, o_flat,
            x_dense, g_dense, o_dense, eps, zero_centered, bt, block_d, rounding, activation,
            norm_before_gate, store_rstd, pdl)


def launch_gated_norm_fwd(x, gate, weight, out, rstd, rows: int, heads: int, dim: int, seq: int,
                          layouts: tuple[Layout, Layout, Layout], eps: float, zero_centered: bool,
                          activation: str, rounding, norm_before_gate: bool, bt: int,
                          block_d: int, warps: int, pdl: bool) -> None:
    """One launch of ``gated_norm_fwd`` (one row block of ``bt`` rows per program) with
    arguments built on the spot (the inference entry); rstd None stores nothing."""
    launch_forward(
        cdiv(rows, bt), (x, gate, weight, out, rstd),
        gated_norm_fwd_scalars(rows, heads, dim, seq, layouts, eps, zero_centered, activation,
                               rounding, norm_before_gate, rstd is not None, bt, block_d, pdl),
        warps, pdl,
    )


# Launch plans of the training entry: everything a launch needs that the tensors' metadata (shape,
# strides, dtypes, device) and the options decide, computed once per distinct signature and
# kept in a bounded table (a training run sees a handful: one per layer shape and token count).
MAX_PLANS = 256
_launch_plans: dict = {}


# A plan also keeps the shape of each buffer it allocates as a 4-byte tensor expanded to that
# shape: ``torch.empty_like`` of it is a contiguous buffer on the plan's device, about half the
# host time of ``new_empty(shape, dtype=...)``.


def buffer_template(like: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose ``torch.empty_like`` is a new contiguous ``shape`` buffer of ``dtype`` on
    ``like``'s device: one element, expanded (not dense, so empty_like lays the buffer out
    contiguously)."""
    return like.new_empty((), dtype=dtype).expand(shape)


class ForwardPlan(NamedTuple):
    grid: int
    launch: PreparedLaunch
    rstd: Optional[torch.Tensor]  # buffer_template of rstd; None when no rstd is stored


class BackwardPlan(NamedTuple):
    grid: int  # persistent programs, also the number of dW partials
    launch: PreparedLaunch
    dw_partials: torch.Tensor  # buffer_template of the [grid, D] fp32 partials
    dw_sum_grid: int
    dw_sum: PreparedLaunch


def _geometry(x, launch_rule, bt):
    """(rows, sequence, heads, dim, launch parameters, rows per block) of a [B, S, H, D] ``x``;
    ``bt`` overrides the rule's block when given."""
    batch, seq, heads, dim = x.shape
    cfg = launch_rule(dim, x.device)
    return batch * seq * heads, seq, heads, dim, cfg, bt or cfg.bt


# A plan is kept under everything its signature's checks read, as a checked signature
# (gated_norm_validation): each tensor's ``tensor_signature``, the current device, the options,
# eps and the dW scale with their types. The flags and launch overrides are checked on every
# call.


def _check_forward(x, gate, weight, out, eps, activation) -> None:
    check_gated_norm_tensors("forward_impl", x, gate, weight, (("out", out),))
    check_positive_number("forward_impl", "eps", eps)
    check_activation("forward_impl", activation)


def _check_backward(x, gate, weight, rstd, dy, activation, weight_grad_scale) -> None:
    check_gated_norm_tensors("backward_impl", x, gate, weight, (("dy", dy),))
    check_rstd("backward_impl", x, rstd)
    check_activation("backward_impl", activation)
    check_positive_number("backward_impl", "weight_grad_scale", weight_grad_scale)


def _forward_plan(x, gate, weight, out, eps, zero_centered, activation, bt, warps, pdl,
                  store_rstd) -> tuple[Optional[int], ForwardPlan]:
    """(the current device, the plan); the device is read once, for the key and the launch."""
    try:
        device = current_device()
        key = ("fwd", device, tensor_signature(x), tensor_signature(gate), tensor_signature(out),
               tensor_signature(weight),
               type(eps), eps, zero_centered, activation, bt, warps, pdl, store_rstd)
    except KEY_ERRORS:
        device = key = None
    plan = lookup_checked(_launch_plans, key)
    if plan is not None:
        return device, plan
    _check_forward(x, gate, weight, out, eps, activation)  # a new signature
    rows, seq, heads, dim, cfg, bt = _geometry(x, forward_launch, bt)
    check_launch_tile("forward_impl", "bt", bt, cfg.block_d, "a row padded to a power of two")
    if pdl:
        check_dependent_launch("forward_impl", "pdl", x.device)
    pdl = cfg.pdl if pdl is None else pdl
    x_dtype, w_dtype = x.dtype, weight.dtype
    # float(): the kernel takes eps as fp32; an int would specialise another variant (1, or
    # one past Triton's 64-bit binding).
    scalars = gated_norm_fwd_scalars(rows, heads, dim, seq,
                                     (_layout(x, bt), _layout(gate, bt), _layout(out, bt)), float(eps),
                                     zero_centered, activation, norm_dtype(x_dtype, w_dtype), True,
                                     store_rstd, bt, cfg.block_d, pdl)
    dtypes = (x_dtype, gate.dtype, w_dtype, out.dtype, torch.float32 if store_rstd else None)
    rstd = buffer_template(x, x.shape[:3], torch.float32) if store_rstd else None
    return device, keep_checked(_launch_plans, key, ForwardPlan(cdiv(rows, bt), launch_forward.prepare(
        dtypes, scalars, warps or cfg.warps, pdl), rstd), MAX_PLANS)


def _backward_plan(x, gate, weight, rstd, dy, zero_centered, activation, bt, warps, programs,
                   stages, weight_grad_scale, dw_sum_pdl) -> tuple[Optional[int], BackwardPlan]:
    """(the current device, the plan), as _forward_plan."""
    try:
        device = current_device()
        key = ("bwd", device, tensor_signature(x), tensor_signature(gate), tensor_signature(dy),
               tensor_signature(weight), tensor_signature(rstd),
               zero_centered, activation, type(weight_grad_scale), weight_grad_scale,
               bt, warps, programs, stages, dw_sum_pdl)
    except KEY_ERRORS:
        device = key = None
    plan = lookup_checked(_launch_plans, key)
    if plan is not None:
        return device, plan
    _check_backward(x, gate, weight, rstd, dy, activation, weight_grad_scale)  # a new signature
    if INTERPRETER_LOOP_PROBLEM:
        raise RuntimeError(f"backward_impl: {INTERPRETER_LOOP_PROBLEM}")
    rows, seq, heads, dim, cfg, bt = _geometry(x, backward_launch, bt)
    check_launch_tile("backward_impl", "bt", bt, cfg.block_d, "a row padded to a power of two")
    if programs is not None:  # the dW sum loads all partials of its columns as one tile
        check_launch_tile("backward_impl", "programs", programs, cfg.dw_sum_columns,
                          "the dW sum's columns per program")
    if dw_sum_pdl is not None:
        if dw_sum_pdl:
            check_dependent_launch("backward_impl", "dw_sum_pdl", x.device)
        cfg = cfg._replace(dw_sum_pdl=dw_sum_pdl)
    blocks = cdiv(rows, bt)
    programs = min(programs, blocks) if programs else backward_programs(cfg, blocks)
    x_strides, x_flat, x_dense = _layout(x, bt)
    g_strides, g_flat, g_dense = _layout(gate, bt)
    d_strides, d_flat, d_dense = _layout(dy, bt)
    x_dtype, w_dtype = x.dtype, weight.dtype
    scalars = (rows, heads, dim, seq,
               x_strides, g_strides, d_strides, x_flat, g_flat, d_flat, x_dense, g_dense, d_dense,
               zero_centered, bt, cfg.block_d, norm_dtype(x_dtype, w_dtype), activation,
               stages or cfg.stages, cfg.dw_sum_pdl)
    dtypes = (x_dtype, gate.dtype, w_dtype, torch.float32, dy.dtype, x_dtype, gate.dtype,
              torch.float32)
    return device, keep_checked(_launch_plans, key, BackwardPlan(
        programs, launch_backward.prepare(dtypes, scalars, warps or cfg.warps),
        buffer_template(x, (programs, dim), torch.float32),
        *_dw_sum_launch(programs, dim, w_dtype, cfg, float(weight_grad_scale))), MAX_PLANS)


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
    activation: str = "silu",
    pdl: Optional[bool] = None,
    store_rstd: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Launch ``gated_norm_fwd``; returns ``(out, rstd)``, rstd None when ``store_rstd`` is False
    (nothing to differentiate: the output's bits are the same). No input is copied.

    ``out``: optional [B, S, H, D] destination view (for example the transpose of an sbhd
    buffer); a new contiguous tensor when None. Its rows must not share memory with each other;
    it may be x or gate itself (computed in place), else it must not overlap them, nor the
    weight (ValueError). It counts as modified in place (its autograd version goes up, so a
    graph that saved it refuses to backward), and with grad mode on it must not require grad
    (ValueError: forward_impl has no autograd). ``bt``/``warps``/``pdl`` (programmatic
    dependent launch) override the heuristics of ``gated_norm_launch`` (tools/launch_sweep.py).
    ``zero_centered`` must be a bool (TypeError otherwise): it selects a compiled variant. The
    tensors, eps and the activation are checked (``fused_gated_norm``'s rules, TypeError /
    ValueError) when their launch signature (everything those checks read) is new, the same
    plan serving every later call that matches it; the flags and overrides on every call, and
    so are all the rules and the overlap of a given ``out`` (addresses are not in a
    signature)."""
    if out is None:
        return _forward_into(x, gate, weight, eps, zero_centered, out, activation, store_rstd, bt,
                             warps, pdl)
    _check_forward(x, gate, weight, out, eps, activation)
    check_out_apart("forward_impl", out, (("x", x), ("gate", gate)), weight)
    if out.requires_grad and torch.is_grad_enabled():
        raise ValueError("forward_impl: out requires grad with grad mode enabled; forward_impl has "
                         "no autograd (write into it under torch.no_grad(), or use fused_gated_norm)")
    result = _forward_into(x, gate, weight, eps, zero_centered, out, activation, store_rstd, bt,
                           warps, pdl)
    torch.autograd.graph.increment_version(out)  # written by the kernel, unseen by autograd
    return result


def _forward_into(x, gate, weight, eps, zero_centered, out, activation, store_rstd, bt=None,
                  warps=None, pdl=None):
    """forward_impl once a given ``out`` has passed its per-call checks; ``_forward_buffer``
    calls it with a buffer of its own."""
    check_bool("forward_impl", "zero_centered", zero_centered)
    check_bool("forward_impl", "store_rstd", store_rstd)
    if bt is not None or warps is not None or pdl is not None:  # checked on every call
        check_launch_overrides("forward_impl", (("bt", bt), ("warps", warps)), (("pdl", pdl),))
    if not isinstance(x, torch.Tensor) or x.dim() != 4:  # x's shape is read before the plan
        check_gated_norm_tensors("forward_impl", x, gate, weight)
    batch, seq, heads, dim = x.shape
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if batch * seq * heads == 0 or dim == 0:  # nothing to normalise (rstd of an empty row is never read)
        _check_forward(x, gate, weight, out, eps, activation)
        return out, x.new_empty((batch, seq, heads), dtype=torch.float32) if store_rstd else None
    device, plan = _forward_plan(x, gate, weight, out, eps, zero_centered, activation, bt, warps,
                                 pdl, store_rstd)
    rstd = torch.empty_like(plan.rstd) if store_rstd else None
    launch_forward.launch(plan.grid, (x, gate, weight, out, rstd), plan.launch, device)
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
    activation: str = "silu",
    programs: Optional[int] = None,
    stages: Optional[int] = None,
    weight_grad_scale: float = 1.0,
    dw_sum_pdl: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch ``gated_norm_bwd``; returns ``(dx, dgate, dweight)``.

    dx and dgate are contiguous [B, S, H, D]; dy is read in place (any strides with a unit last
    dim). dweight is the fixed-order sum of the per-program fp32 partials times
    ``weight_grad_scale`` (a Python float), rounded once to the weight's dtype. ``zero_centered``
    must be a bool (TypeError otherwise). ``bt``/``warps``/``programs``/``stages``/``dw_sum_pdl``
    override the heuristics of ``gated_norm_launch`` (tools/launch_sweep.py). The tensors (rstd
    as forward_impl returns it), the activation and the scale are checked when their launch
    signature is new, as in forward_impl; the flag and overrides on every call.
    """
    check_bool("backward_impl", "zero_centered", zero_centered)
    if not (bt is None and warps is None and programs is None and stages is None
            and dw_sum_pdl is None):  # checked on every call
        check_launch_overrides("backward_impl", (("bt", bt), ("warps", warps),
                                                 ("programs", programs), ("stages", stages)),
                               (("dw_sum_pdl", dw_sum_pdl),))
    if not isinstance(x, torch.Tensor) or x.dim() != 4:  # x's shape is read before the plan
        check_gated_norm_tensors("backward_impl", x, gate, weight, (("dy", dy),))
    batch, seq, heads, dim = x.shape
    if batch * seq * heads == 0 or dim == 0:  # no row contributes: dW is zero at any scale
        _check_backward(x, gate, weight, rstd, dy, activation, weight_grad_scale)
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(gate, memory_format=torch.contiguous_format),
                torch.zeros_like(weight))
    try:
        if dy.stride(-1) != 1:  # autograd may hand us anything; the kernel reads unit strides
            dy = dy.contiguous()
    except (*KEY_ERRORS, IndexError):  # not a dense tensor of rank >= 1: the rules name it
        pass
    device, plan = _backward_plan(x, gate, weight, rstd, dy, zero_centered, activation, bt, warps,
                                  programs, stages, weight_grad_scale, dw_sum_pdl)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dgate = torch.empty_like(gate, memory_format=torch.contiguous_format)
    dw_partial = torch.empty_like(plan.dw_partials)
    launch_backward.launch(plan.grid, (x, gate, weight, rstd, dy, dx, dgate, dw_partial),
                           plan.launch, device)
    dweight = torch.empty_like(weight)
    launch_dw_sum.launch(plan.dw_sum_grid, (dw_partial, dweight), plan.dw_sum, device)
    return dx, dgate, dweight


def _dw_sum_launch(programs: int, dim: int, dtype: torch.dtype, cfg: BackwardLaunch,
                   weight_grad_scale: float) -> tuple[int, PreparedLaunch]:
    """Grid and arguments of ``gated_norm_dw_sum`` for [programs, dim] fp32 partials and a dW of
    ``dtype``. The kernel's block is sized by ``cfg.max_programs`` (the launch heuristics' cap),
    so fewer partials (fewer rows) reuse the compiled kernel."""
    block_p = next_power_of_2(max(programs, cfg.max_programs))
    return cdiv(dim, cfg.dw_sum_columns), launch_dw_sum.prepare(
        (torch.float32, dtype),
        (programs, weight_grad_scale, dim, block_p, cfg.dw_sum_columns, cfg.dw_sum_pdl,
         cfg.dw_sum_pdl or cfg.dw_sum_dependents),
        cfg.dw_sum_warps, cfg.dw_sum_pdl)


# ----------------------------------------------------------------------------------------------
# Autograd glue and the public entry
# ----------------------------------------------------------------------------------------------


def _forward_buffer(x, gate, weight, eps, zero_centered, out_layout, activation,
                    store_rstd=True):
    """Run the forward into a new buffer that is contiguous in ``out_layout`` ([B, S, H, D] for
    "bshd", [S, B, H, D] for "sbhd"); returns ``(buffer, rstd)``."""
    if out_layout == "sbhd":
        batch, seq, heads, dim = x.shape
        buffer = x.new_empty((seq, batch, heads, dim))  # cheaper than torch.empty(..., device=)
        _, rstd = _forward_into(x, gate, weight, eps, zero_centered, buffer.transpose(0, 1),
                                activation, store_rstd)
        return buffer, rstd
    return _forward_into(x, gate, weight, eps, zero_centered, None, activation, store_rstd)


def _as_bshd(buffer: torch.Tensor, out_layout: str) -> torch.Tensor:
    return buffer.transpose(0, 1) if out_layout == "sbhd" else buffer


# The Function's non-tensor arguments travel as one tuple, (eps, zero_centered, out_layout,
# activation, weight_grad_scale): every argument of torch.autograd.Function.apply costs host time
# on every call.
Options = tuple[float, bool, str, str, float]


def _save_for_backward(ctx, x, gate, weight, rstd, options: Options) -> None:
    ctx.save_for_backward(x, gate, weight, rstd)
    ctx.options = options


def _gradients(ctx, dbuffer, backward) -> tuple:
    """``(dx, dgate, dweight)`` from the output buffer's gradient: ``backward`` is ``_backward``
    (eager) or the custom op wrapping it (torch.compile)."""
    x, gate, weight, rstd = ctx.saved_tensors
    _, zero_centered, out_layout, activation, weight_grad_scale = ctx.options
    return backward(x, gate, weight, rstd, _as_bshd(dbuffer, out_layout), zero_centered,
                    activation, weight_grad_scale)


def _backward(x, gate, weight, rstd, dy, zero_centered, activation, weight_grad_scale):
    return backward_impl(x, gate, weight, rstd, dy, zero_centered, activation=activation,
                         weight_grad_scale=weight_grad_scale)


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
        eps, zero_centered, out_layout, activation, _ = options
        buffer, rstd = _forward_buffer(x, gate, weight, eps, zero_centered, out_layout, activation)
        _save_for_backward(ctx, x, gate, weight, rstd, options)
        return buffer

    @staticmethod
    def backward(ctx, dbuffer):
        # create_graph=True: once_differentiable makes a second derivative through
        # ``.backward()`` raise; ``torch.autograd.grad`` of it reports x as unused instead.
        if torch.is_grad_enabled():
            return _once_differentiable_gradients(ctx, dbuffer)
        # The engine runs a backward with grad mode off unless create_graph is set: no need for
        # once_differentiable's no_grad block (~1 us of host time) on that path.
        dx, dgate, dweight = _gradients(ctx, dbuffer, _backward)
        return dx, dgate, dweight, None


@torch.autograd.function.once_differentiable
def _once_differentiable_gradients(ctx, dbuffer):
    dx, dgate, dweight = _gradients(ctx, dbuffer, _backward)
    return dx, dgate, dweight, None


# torch.compile path. Dynamo cannot trace into a Triton launch wrapper with Python-side
# heuristics, so under torch.compile the same two launch wrappers run inside two custom ops:
# opaque to the compiler, with output metadata from register_fake and the autograd formula
# from register_autograd (no graph break; the compiled backward calls gated_norm_bwd too).
# Eager calls skip the dispatcher and use _FusedGatedNorm: a custom op costs ~10+ us of host
# time per call, more than the whole launch. fused_gated_norm picks with is_compiling(). Both
# return the buffer; the [B, S, H, D] view is taken outside (apply_validated_gated_norm).
@torch.library.custom_op("gdn_fusions::gated_norm_fwd", mutates_args=())
def _gated_norm_fwd_op(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
    out_layout: str, activation: str, weight_grad_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_buffer(x, gate, weight, eps, zero_centered, out_layout, activation)


@_gated_norm_fwd_op.register_fake
def _(x, gate, weight, eps, zero_centered, out_layout, activation, weight_grad_scale):
    batch, seq, heads, dim = x.shape
    shape = (seq, batch, heads, dim) if out_layout == "sbhd" else (batch, seq, heads, dim)
    return x.new_empty(shape), x.new_empty((batch, seq, heads), dtype=torch.float32)


@torch.library.custom_op("gdn_fusions::gated_norm_bwd", mutates_args=())
def _gated_norm_bwd_op(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    dy: torch.Tensor, zero_centered: bool, activation: str, weight_grad_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(x, gate, weight, rstd, dy, zero_centered, activation, weight_grad_scale)


@_gated_norm_bwd_op.register_fake
def _(x, gate, weight, rstd, dy, zero_centered, activation, weight_grad_scale):
    return x.new_empty(x.shape), gate.new_empty(gate.shape), torch.empty_like(weight)


def _fwd_op_setup_context(ctx, inputs, output):
    x, gate, weight, *options = inputs
    _save_for_backward(ctx, x, gate, weight, output[1], tuple(options))


def _fwd_op_backward(ctx, dbuffer, _drstd):
    dx, dgate, dweight = _gradients(ctx, dbuffer, _gated_norm_bwd_op)
    return dx, dgate, dweight, None, None, None, None, None  # the op's five non-tensor inputs


_gated_norm_fwd_op.register_autograd(_fwd_op_backward, setup_context=_fwd_op_setup_context)


def fused_gated_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
    *,
    out_layout: str = "bshd",
    activation: str = "silu",
    weight_grad_scale: float = 1.0,
) -> torch.Tensor:
    """``round(round(rms_norm(x) * w_eff) * act(gate))`` over the last dim of [B, S, H, D] views.

    Args:
        x: [batch, sequence, heads, dim] activations (bf16, fp16 or fp32); any strides with a
            unit last-dim stride.
        gate: same shape and dtype as x; any strides with a unit last-dim stride (a slice of a
            packed projection is read in place).
        weight: (dim,) contiguous norm weight shared by all heads, fp32 or x's dtype.
        eps: added to mean(x^2); a finite Python float (or int) > 0.
        zero_centered: a bool; True: w_eff = 1 + weight (Megatron's zero-centred gamma), False:
            w_eff = weight.
        out_layout: "bshd" returns a contiguous tensor; "sbhd" returns a [B, S, H, D] view of a
            contiguous [S, B, H, D] buffer, so ``out.transpose(0, 1)`` is contiguous for free.
            Either may be modified in place (a residual ``add_``) before the backward.
        activation: "silu" (GDN) or "sigmoid".
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
    check_gated_norm_inputs(x, gate, weight, eps)
    check_bool(FUSED_GATED_NORM, "zero_centered", zero_centered)
    check_positive_number(FUSED_GATED_NORM, "weight_grad_scale", weight_grad_scale)
    check_option(FUSED_GATED_NORM, "out_layout", out_layout, OUT_LAYOUTS)
    check_activation(FUSED_GATED_NORM, activation)
    return apply_validated_gated_norm(x, gate, weight, eps, zero_centered, out_layout, activation,
                                      weight_grad_scale)


def apply_validated_gated_norm(x, gate, weight, eps, zero_centered, out_layout, activation,
                               weight_grad_scale=1.0):
    """``fused_gated_norm`` without its input checks, for a caller that has just run them (the
    Megatron module runs ``validate_gated_norm``, which includes them): they are not repeated on
    the hot path. Picks the eager autograd Function or, under torch.compile, the custom op, and
    takes the [B, S, H, D] view of the buffer either returns."""
    # float(): an int eps would compile another kernel variant (1 is specialised); the kernel's
    # weight_grad_scale is fp32.
    options = (float(eps), zero_centered, out_layout, activation, float(weight_grad_scale))
    if torch.compiler.is_compiling():
        buffer, _ = _gated_norm_fwd_op(x, gate, weight, *options)
    elif torch.is_grad_enabled() and (x.requires_grad or gate.requires_grad
                                      or weight.requires_grad):
        buffer = _FusedGatedNorm.apply(x, gate, weight, options)
    else:  # nothing to differentiate (inference, a recompute's first forward): no rstd, no ctx
        buffer, _ = _forward_buffer(x, gate, weight, *options[:4], store_rstd=False)
    return _as_bshd(buffer, out_layout)
