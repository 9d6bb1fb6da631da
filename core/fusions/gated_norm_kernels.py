"""Triton kernels of the fused output gated RMSNorm, and their launch arguments.

A row is one head of one token of a [B, S, H, D] view (D elements). With w_eff = w, or 1 + w
(zero-centred gamma), act = silu (g / (1 + exp(-g))) or sigmoid, and round_T the rounding to
the nearest-even value of dtype T (NORM: the unfused norm's output dtype; fp32 for none):

  gated_norm_fwd     rstd = 1 / sqrt(mean(x^2) + eps)
                     y    = round_NORM(x * rstd * w_eff)
                     out  = round_out(y * act(gate))
                     (NORM_BEFORE_GATE False, for inference: the same norm of x * act(gate),
                     out = round_out(y))
  gated_norm_bwd     x^ = x * rstd, dn = round_NORM(dy * act(gate))
                     dgate = dy * y * act'(gate)
                     dx    = rstd * (dn * w_eff - x^ * mean(x^ * dn * w_eff))
                     dw_partial[p] = sum of dn * x^ over the rows of program p
  gated_norm_dw_sum  dweight = round_w(WEIGHT_GRAD_SCALE * sum_p dw_partial[p]), a fixed order

x, gate and dy are read through all four strides of their [B, S, H, D] views (any strides:
a slice of a packed projection, an sbhd view, a last dim of stride 2, an expanded gate or dy);
dx and dgate are written contiguous, out through its own strides.

Each kernel's scalar parameters, in its own order, are a named structure at the end
(``ForwardArgs``, ``BackwardArgs``, ``DwSumArgs``): filled by keyword, passed by position. The
launch parameters are chosen in ``gated_norm_launch``; docs/numerics.md explains the roundings.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Optional

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Triton compiles for the GPU; on the CPU its interpreter runs the kernels (TRITON_INTERPRET=1,
# read when triton is imported).
INTERPRETED = bool(triton.knobs.runtime.interpret)

# Kernel arguments that change with the token count (packed sequences of varying total length).
# They are never specialised (no divisibility or ==1 variants), so a new token count reuses the
# compiled kernel; tests/fusions/test_gated_norm_compile.py checks the whole specialisation key.
PER_STEP_ARGS = ["ROWS", "SEQUENCE", "PROGRAMS"]


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


@triton.jit
def _column_offsets(cols, STRIDE_D):
    """Element offsets of columns ``cols`` within a row whose elements are STRIDE_D apart.

    A unit stride reaches the kernel as the constant 1 (Triton specialises an integer argument
    equal to 1, tuple elements included): the offsets are ``cols`` themselves, 32-bit, and the
    compiled code is that of a kernel with no stride argument. Any other stride (2, 0 for an
    expanded last dim, the large one of a permuted view) is a runtime value, and the offsets
    are 64-bit: (D - 1) * STRIDE_D may pass 2**31."""
    if isinstance(STRIDE_D, tl.constexpr):
        tl.static_assert(STRIDE_D == 1, "Triton specialises an integer argument equal to 1 only")
        offsets = cols
    else:
        offsets = cols.to(tl.int64) * STRIDE_D
    return offsets


@triton.jit
def _row_pointers(base, row0, rows, cols, SEQUENCE, HEADS: tl.constexpr, D: tl.constexpr,
                  STRIDES, FLAT_TOKENS: tl.constexpr, DENSE: tl.constexpr):
    """Pointers to the [BT, BLOCK_D] block of ``rows`` (the first is ``row0``) of a strided
    [B, S, H, D] view whose (batch, sequence, head, element) strides are the tuple STRIDES.

    DENSE (``dense_blocks`` on the host, which requires a unit element stride): the block's rows
    lie back to back, D apart. One 64-bit offset for the block, then a [BT, D] tile of 32-bit
    offsets that the compiler sees as contiguous: no address math per row or element
    (docs/design.md, Launch choices: the forward's real cost is its addressing). Otherwise one
    64-bit offset per row, and the columns' offsets from it (``_column_offsets``)."""
    if DENSE:
        first = _row_offset(row0, SEQUENCE, HEADS, STRIDES[0], STRIDES[1], STRIDES[2], FLAT_TOKENS)
        local = tl.arange(0, rows.shape[0])
        ptrs = (base + first) + ((local * D)[:, None] + cols[None, :])
    else:
        offsets = _row_offset(rows, SEQUENCE, HEADS, STRIDES[0], STRIDES[1], STRIDES[2],
                              FLAT_TOKENS)
        ptrs = (base + offsets)[:, None] + _column_offsets(cols, STRIDES[3])[None, :]
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
    X_STRIDES, GATE_STRIDES, DY_STRIDES, DGATE_STRIDES,
    X_FLAT_TOKENS: tl.constexpr, GATE_FLAT_TOKENS: tl.constexpr, DY_FLAT_TOKENS: tl.constexpr,
    DGATE_FLAT_TOKENS: tl.constexpr,
    X_DENSE: tl.constexpr, GATE_DENSE: tl.constexpr, DY_DENSE: tl.constexpr,
    DGATE_DENSE: tl.constexpr, DGATE_STRIDED: tl.constexpr,
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
    dx is written contiguous ``[ROWS, D]``, dgate too unless DGATE_STRIDED (then through its
    DGATE_STRIDES: the gate's slice of a caller's gradient buffer), each in its input's dtype
    (dgate in fp32 for an fp32 gate); dy is read in place."""
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
        if DGATE_STRIDED:
            dg_ptrs = _row_pointers(dgate, row0, rows, cols, SEQUENCE, HEADS, D, DGATE_STRIDES,
                                    DGATE_FLAT_TOKENS, DGATE_DENSE)
        else:
            dg_ptrs = (dgate + block_start) + tile
        tl.store(dg_ptrs, _round_to(dgate_v, DG_DTYPE).to(DG_DTYPE), mask=mask)
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
# Launch arguments
# ----------------------------------------------------------------------------------------------


def scalar_arguments(name: str, kernel, tensors: tuple[str, ...]) -> type:
    """A NamedTuple class of ``kernel``'s parameters after its pointers ``tensors``, named and
    ordered as the kernel's own signature (``arg_names``), defaults included: filled by keyword,
    passed by position after the tensors (``direct_launch.DirectLauncher``)."""
    names = tuple(kernel.arg_names)
    if names[:len(tensors)] != tensors:
        raise TypeError(f"{name}: the kernel's first parameters are {names[:len(tensors)]}, not "
                        f"the pointers {tensors}")
    return namedtuple(name, names[len(tensors):])


FORWARD_TENSORS = ("x", "gate", "weight", "out", "rstd")
BACKWARD_TENSORS = ("x", "gate", "weight", "rstd", "dy", "dx", "dgate", "dw_partial")
DW_SUM_TENSORS = ("dw_partial", "dweight")
ForwardArgs = scalar_arguments("ForwardArgs", gated_norm_fwd, FORWARD_TENSORS)
BackwardArgs = scalar_arguments("BackwardArgs", gated_norm_bwd, BACKWARD_TENSORS)
DwSumArgs = scalar_arguments("DwSumArgs", gated_norm_dw_sum, DW_SUM_TENSORS)
