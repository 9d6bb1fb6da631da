"""Triton kernels of the fused GDN pre-recurrence region (``fused_pre_gated_delta_rule``).

The input ``x`` is the in_proj output in bshd, [B, S, W] with unit last stride, its W features
``[q | k | v | gate | beta_in | alpha]`` (q, k: Hk heads of Dk; v, gate: Hv heads of Dv; beta_in,
alpha: Hv each). Channel c < C = 2 Hk Dk + Hv Dv of the causal depthwise convolution (width K,
weight w[c, j], optional bias b[c]) reads token s of x and the K - 1 before it within its
sequence (``seq_start[s]``: the first token of s's packed sequence; 0 without packing):

  pre[s, c] = sum_j w[c, j] x[s - K + 1 + j, c] + b[c]        (j = 0 .. K-1, fp32, in this order)
  act       = round(silu(pre))                    CONV_ROUNDING "once"  (FLA's causal_conv1d)
            = round(silu(round(pre)))             CONV_ROUNDING "twice" (torch conv1d, then silu)
  q/k head: y = round(act * rstd), rstd = 1 / sqrt(sum over the head of act^2 + eps)
            (FLA's l2norm; y = act without USE_QK_L2NORM), stored for value heads h r .. h r + r - 1
  v head:   v = act
  g    = -round_P(exp(A_log)) * softplus(alpha + dt_bias)    (fp32; P: the parameters' dtype)
  beta = round(sigmoid(beta_in))

Backward (fp32 inside; ``round`` where the unfused autograd graph rounds):
  dy_k  = round(sum_{i<r} dq[h r + i])            (the head repeat's gradient, autograd's sum)
  dact  = round(dy rstd - (dy . y) y rstd)        (q/k: the l2norm backward; v: dact = dv)
  dpre  = dact silu'(pre)
  dx[s] = round(sum_j w[c, K-1-j] dpre[s + j])    over the same sequence
  dw_partial[p, c, j] = sum over chunk p's tokens s of dpre[s] x[s - K + 1 + j]   (in order)
  dalpha = round(dg (-A) sigmoid(alpha + dt_bias)),  dbeta_in = round(dbeta beta (1 - beta))
  dA_partial[p, h] = sum dg (-A) softplus(..),  ddt_partial[p, h] = sum dg (-A) sigmoid(..)
The partials are summed in a fixed order by ``pre_gdr_bwd_sums`` (deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from core.fusions.gated_norm_kernels import (INTERPRETED, _activation, _exp_neg, _round_to,
                                             _sigmoid)

# torch's expf / log1pf / IEEE division for g and beta (a few values per token, where bitwise
# agreement with the unfused path is cheap); the interpreter has no libdevice log1p.
_LIBDEVICE = tl.constexpr(not INTERPRETED)


@triton.jit
def _exact_exp(v):
    if _LIBDEVICE:
        e = libdevice.exp(v)
    else:
        e = tl.exp(v)
    return e


@triton.jit
def _exact_sigmoid(v):
    if _LIBDEVICE:
        s = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-v))
    else:
        s = 1.0 / (1.0 + tl.exp(-v))
    return s


@triton.jit
def _reciprocal(v):
    """1 / v for v >= 1 with the bits of Triton's division up to 2^126, in 1 instruction instead
    of 5 (SASS, sm_90): div.full.f32 is MUFU.RCP with its operand scaled above 2^126 only;
    div.approx (fast_dividef) is MUFU.RCP alone, 0 above 2^126 (1 + exp(-p) there: p < -87)."""
    if _LIBDEVICE:
        r = libdevice.fast_dividef(1.0, v)
    else:
        r = 1.0 / v
    return r


@triton.jit
def _softplus(v):
    """torch's softplus (beta 1, threshold 20): v above 20, else log1p(exp(v))."""
    e = _exact_exp(v)
    if _LIBDEVICE:
        lp = libdevice.log1p(e)
    else:  # log1p(e) from log: exact where 1 + e rounds to 1, else corrected for that rounding
        u = 1.0 + e
        lp = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.where(v > 20.0, v, lp)


@triton.jit
def _silu_once(pre):
    # FLA's causal_conv1d: pre * sigmoid(pre) with Triton's exp
    return pre * _sigmoid(pre)


@triton.jit
def _conv_act(pre, DTYPE: tl.constexpr, CONV_ROUNDING: tl.constexpr):
    """act of the module docstring, rounded to DTYPE, kept in fp32."""
    if CONV_ROUNDING == "twice":
        act = _activation(_round_to(pre, DTYPE), "silu")  # torch's silu formula
    else:
        act = _silu_once(pre)
    return _round_to(act, DTYPE)


@triton.jit
def _l2_rstd(y, EPS: tl.constexpr, HEAD_AXIS: tl.constexpr):
    """FLA's l2norm: 1 / sqrt(sum over the head (``HEAD_AXIS``) of y^2 + eps)."""
    return 1 / tl.sqrt(tl.sum(y * y, HEAD_AXIS) + EPS)


@triton.jit
def _token_rows(block, S, BT: tl.constexpr):
    t = block * BT + tl.arange(0, BT)
    return t, t < S


@triton.jit
def _conv_pre(x_b, rows, row_mask, start, chans, chan_mask, w, w_stride_c, w_stride_k, bias, ss,
              K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """pre[rows, chans] (fp32): the causal convolution over the K tokens up to each row, tokens
    before ``start`` (the row's sequence start) read as 0; rows off ``row_mask`` read nothing."""
    pre = tl.zeros((rows.shape[0], chans.shape[0]), dtype=tl.float32)
    for j in tl.static_range(K):
        src = rows - (K - 1) + j
        m = ((src >= start) & row_mask)[:, None] & chan_mask[None, :]
        xv = tl.load(x_b + src.to(tl.int64)[:, None] * ss + chans[None, :], mask=m, other=0.0)
        wj = tl.load(w + chans * w_stride_c + j * w_stride_k, mask=chan_mask, other=0.0)
        pre += xv.to(tl.float32) * wj.to(tl.float32)[None, :]
    if HAS_BIAS:
        pre += tl.load(bias + chans, mask=chan_mask, other=0.0).to(tl.float32)[None, :]
    return pre


@triton.jit
def _sequence_start(seq_start, rows, row_mask, VARLEN: tl.constexpr):
    if VARLEN:
        start = tl.load(seq_start + rows, mask=row_mask, other=0)
    else:
        start = tl.zeros_like(rows)
    return start


@triton.jit
def _fwd_key_head(x_b, w, bias, out, t, t_mask, tok, start, head, kh, ss, w_stride_c,
                  w_stride_k, HV: tl.constexpr, DK: tl.constexpr, K: tl.constexpr,
                  R: tl.constexpr, BDK: tl.constexpr, EPS: tl.constexpr,
                  USE_QK_L2NORM: tl.constexpr, CONV_ROUNDING: tl.constexpr,
                  HAS_BIAS: tl.constexpr):
    """q or k of key head ``kh`` (conv channels from ``head * DK``), stored for its R value
    heads."""
    DTYPE: tl.constexpr = out.dtype.element_ty
    d = tl.arange(0, BDK)
    d_mask = d < DK
    pre = _conv_pre(x_b, t, t_mask, start, head * DK + d, d_mask, w, w_stride_c, w_stride_k,
                    bias, ss, K, HAS_BIAS)
    y = _conv_act(pre, DTYPE, CONV_ROUNDING)
    if USE_QK_L2NORM:
        y = _round_to(y * _l2_rstd(y, EPS, 1)[:, None], DTYPE)
    m = t_mask[:, None] & d_mask[None, :]
    for i in tl.static_range(R):
        tl.store(out + (tok * HV + kh * R + i) * DK + d[None, :], y.to(DTYPE), mask=m)


@triton.jit
def _fwd_value_head(x_b, w, bias, v, t, t_mask, tok, start, vh, ss, w_stride_c, w_stride_k,
                    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    K: tl.constexpr, BDV: tl.constexpr, CONV_ROUNDING: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
    DTYPE: tl.constexpr = v.dtype.element_ty
    d = tl.arange(0, BDV)
    d_mask = d < DV
    pre = _conv_pre(x_b, t, t_mask, start, 2 * HK * DK + vh * DV + d, d_mask, w, w_stride_c,
                    w_stride_k, bias, ss, K, HAS_BIAS)
    y = _conv_act(pre, DTYPE, CONV_ROUNDING)
    tl.store(v + (tok * HV + vh) * DV + d[None, :], y.to(DTYPE),
             mask=t_mask[:, None] & d_mask[None, :])


@triton.jit
def _decay_inputs(x_b, a_log, dt_bias, t, t_mask, ss, HK: tl.constexpr, HV: tl.constexpr,
                  DK: tl.constexpr, DV: tl.constexpr, BH: tl.constexpr):
    """beta_in, alpha + dt_bias and round_P(exp(A_log)) of every value head (fp32), the mask."""
    h = tl.arange(0, BH)
    h_mask = h < HV
    m = t_mask[:, None] & h_mask[None, :]
    rows = x_b + t.to(tl.int64)[:, None] * ss + (2 * HK * DK + 2 * HV * DV)
    beta_in = tl.load(rows + h[None, :], mask=m, other=0.0).to(tl.float32)
    alpha = tl.load(rows + HV + h[None, :], mask=m, other=0.0).to(tl.float32)
    P_DTYPE: tl.constexpr = a_log.dtype.element_ty
    a = _round_to(_exact_exp(tl.load(a_log + h, mask=h_mask, other=0.0).to(tl.float32)),
                  P_DTYPE)
    z = alpha + tl.load(dt_bias + h, mask=h_mask, other=0.0).to(tl.float32)[None, :]
    return beta_in, z, a, h, h_mask, m


@triton.jit
def _fwd_decay(x_b, a_log, dt_bias, g, beta, t, t_mask, tok, ss, HK: tl.constexpr,
               HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BH: tl.constexpr):
    DTYPE: tl.constexpr = beta.dtype.element_ty
    beta_in, z, a, h, h_mask, m = _decay_inputs(x_b, a_log, dt_bias, t, t_mask, ss, HK, HV, DK,
                                                DV, BH)
    out_off = tok * HV + h[None, :]
    tl.store(g + out_off, -a[None, :] * _softplus(z), mask=m)
    tl.store(beta + out_off, _round_to(_exact_sigmoid(beta_in), DTYPE).to(DTYPE), mask=m)


@triton.jit
def pre_gdr_fwd(
    x, w, bias, a_log, dt_bias, seq_start, q, k, v, g, beta,
    S, sb, ss, w_stride_c, w_stride_k,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BH: tl.constexpr,
    EPS: tl.constexpr, USE_QK_L2NORM: tl.constexpr, CONV_ROUNDING: tl.constexpr,
    HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr,
):
    """Program (head, token block, batch): head < 2 HK a q/k head, < 2 HK + HV a v head, the
    last g and beta of every value head."""
    head = tl.program_id(0)
    t, t_mask = _token_rows(tl.program_id(1), S, BT)
    b = tl.program_id(2).to(tl.int64)
    x_b = x + b * sb
    R: tl.constexpr = HV // HK
    start = _sequence_start(seq_start, t, t_mask, VARLEN)
    tok = (b * S + t.to(tl.int64))[:, None]  # the outputs' token index
    if head < HK:
        _fwd_key_head(x_b, w, bias, q, t, t_mask, tok, start, head, head, ss, w_stride_c,
                      w_stride_k, HV, DK, K, R, BDK, EPS, USE_QK_L2NORM, CONV_ROUNDING, HAS_BIAS)
    elif head < 2 * HK:
        _fwd_key_head(x_b, w, bias, k, t, t_mask, tok, start, head, head - HK, ss, w_stride_c,
                      w_stride_k, HV, DK, K, R, BDK, EPS, USE_QK_L2NORM, CONV_ROUNDING, HAS_BIAS)
    elif head < 2 * HK + HV:
        _fwd_value_head(x_b, w, bias, v, t, t_mask, tok, start, head - 2 * HK, ss, w_stride_c,
                        w_stride_k, HK, HV, DK, DV, K, BDV, CONV_ROUNDING, HAS_BIAS)
    else:
        _fwd_decay(x_b, a_log, dt_bias, g, beta, t, t_mask, tok, ss, HK, HV, DK, DV, BH)


@triton.jit
def _bwd_conv_head(x_b, w, bias, grad, dx_b, partial_row, seq_start, first, last, S, tok0,
                   chan0, grad_head, ss, dx_ss, w_stride_c, w_stride_k, dgate_b, dgate_ss,
                   gate0, C: tl.constexpr, HV: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
                   R: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr,
                   STAGES: tl.constexpr, EPS: tl.constexpr, KEY: tl.constexpr,
                   USE_QK_L2NORM: tl.constexpr, CONV_ROUNDING: tl.constexpr,
                   HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr, COPY_GATE: tl.constexpr):
    """The backward of one q/k (``KEY``) or v head (channels from ``chan0``) over the program's
    tokens [first, last), streamed one token at a time (ROWS per loop step, their loads first;
    STAGES > 1: the loads of the next STAGES - 1 steps in flight, through shared memory).
    Token s's dpre needs x at s - K + 1 .. s, and dx[t] needs dpre at t .. t + K - 1: both are
    windows of the last K tokens, kept in registers and shifted by renaming (no value moves
    between threads). The loop runs K - 1 tokens past ``last`` for dx's window (dpre only); dw / db
    accumulate over the own tokens and are stored once (row ``partial_row``: dw as [C, K], then
    db). COPY_GATE (v heads): also copies the incoming gate gradient's rows of this head (channels
    from ``gate0``) into dx."""
    DTYPE: tl.constexpr = dx_b.dtype.element_ty
    d = tl.arange(0, BD)
    d_mask = d < D
    chans = chan0 + d
    taps = ()  # w[c, j], fp32
    for j in tl.static_range(K):
        taps = taps + (tl.load(w + chans * w_stride_c + j * w_stride_k, mask=d_mask,
                               other=0.0).to(tl.float32),)
    if HAS_BIAS:
        b_c = tl.load(bias + chans, mask=d_mask, other=0.0).to(tl.float32)
    zero = tl.zeros((BD,), dtype=tl.float32)
    x_win = ()  # x at s - K + 1 .. s - 1
    for j in tl.static_range(K - 1):
        row = first - (K - 1) + j
        x_win = x_win + (tl.load(x_b + row.to(tl.int64) * ss + chans,
                                 mask=d_mask & (row >= 0), other=0.0).to(tl.float32),)
    dpre_win = ()  # dpre at s - K + 1 .. s - 1, and their sequence starts
    start_win = ()
    dw = ()
    for j in tl.static_range(K - 1):
        dpre_win = dpre_win + (zero,)
        start_win = start_win + (0,)
    for j in tl.static_range(K):
        dw = dw + (zero,)
    db = zero
    # the rows of the loop step's first token, moved on by each step
    x_rows = x_b + first.to(tl.int64) * ss + chans
    grad_rows = grad + ((tok0 + first) * HV + grad_head) * D + d
    for s0 in tl.range(first, last + K - 1, ROWS, num_stages=STAGES):
        # loads of ROWS tokens first: the dx stores below could alias them for the compiler
        xs = ()
        starts = ()
        dys = ()
        for u in tl.static_range(ROWS):
            s = s0 + u
            inside = s < S
            xs = xs + (tl.load(x_rows + u * ss, mask=d_mask & inside, other=0.0).to(tl.float32),)
            if VARLEN:
                starts = starts + (tl.load(seq_start + s, mask=inside, other=S),)
            else:
                starts = starts + (0,)
            g_row = grad_rows + u * (HV * D)
            dy = tl.load(g_row, mask=d_mask & inside, other=0.0).to(tl.float32)
            for i in tl.static_range(1, R):  # the head repeat's gradient, autograd's order
                dy += tl.load(g_row + i * D, mask=d_mask & inside, other=0.0).to(tl.float32)
            if R > 1:
                dy = _round_to(dy, DTYPE)
            dys = dys + (dy,)
        for u in tl.static_range(ROWS):
            s = s0 + u
            window = x_win + (xs[u],)  # x at s - K + 1 .. s
            pre = zero
            masked = ()
            for j in tl.static_range(K):
                xj = window[j]
                if VARLEN:  # tokens before s's sequence read as 0
                    xj = tl.where(s - (K - 1) + j >= starts[u], xj, 0.0)
                masked = masked + (xj,)
                pre += xj * taps[j]
            if HAS_BIAS:
                pre += b_c
            # the SiLU's input p and sigmoid(p), as _conv_act takes them (p * sig: its act)
            p = _round_to(pre, DTYPE) if CONV_ROUNDING == "twice" else pre
            sig = _reciprocal(1.0 + _exp_neg(p))
            dact = dys[u]
            if KEY and USE_QK_L2NORM:
                y = _round_to(p * sig, DTYPE)
                rstd = _l2_rstd(y, EPS, 0)
                y = y * rstd
                dact = _round_to(dact * rstd - tl.sum(dact * y, 0) * y * rstd, DTYPE)
            dpre = dact * (sig * (1.0 + p * (1.0 - sig)))  # torch's silu_backward formula
            owned = tl.where(s < last, dpre, 0.0)
            new_dw = ()
            for j in tl.static_range(K):
                new_dw = new_dw + (dw[j] + owned * masked[j],)
            dw = new_dw
            db += owned
            # dx[t], t = s - K + 1: dpre at t + i reaches it only within t's sequence
            t = s - (K - 1)
            dpres = dpre_win + (dpre,)
            seq_starts = start_win + (starts[u],)
            dxs = zero
            for i in tl.static_range(K):
                di = dpres[i]
                if VARLEN:
                    di = tl.where(seq_starts[i] <= t, di, 0.0)
                dxs += di * taps[K - 1 - i]
            tl.store(dx_b + t.to(tl.int64) * dx_ss + chans, _round_to(dxs, DTYPE).to(DTYPE),
                     mask=d_mask & (t >= first) & (t < last))
            if COPY_GATE:
                rows_ok = d_mask & (s < last)
                in_gate = chan0 - gate0 + d  # this head's gate channels
                dgate = tl.load(dgate_b + s.to(tl.int64) * dgate_ss + in_gate, mask=rows_ok,
                                other=0.0)
                tl.store(dx_b + s.to(tl.int64) * dx_ss + C + in_gate, dgate, mask=rows_ok)
            x_win = window[1:]
            dpre_win = dpres[1:]
            start_win = seq_starts[1:]
        x_rows += ROWS * ss
        grad_rows += ROWS * HV * D
    for j in tl.static_range(K):
        tl.store(partial_row + chans * K + j, dw[j], mask=d_mask)
    if HAS_BIAS:
        tl.store(partial_row + C * K + chans, db, mask=d_mask)


@triton.jit
def _bwd_decay(x_b, a_log, dt_bias, dg, dbeta, dx_b, partial_row, first, last, tok0, ss, dx_ss,
               HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BT: tl.constexpr, BH: tl.constexpr):
    """dbeta_in, dalpha of tokens [first, last) in blocks of BT, and their dA / ddt_bias
    partials (block sums added in order) at ``partial_row`` and HV after it."""
    DTYPE: tl.constexpr = dx_b.dtype.element_ty
    da_sum = tl.zeros((BH,), dtype=tl.float32)
    ddt_sum = tl.zeros((BH,), dtype=tl.float32)
    for t0 in tl.range(first, last, BT):
        t = t0 + tl.arange(0, BT)
        t_mask = t < last
        beta_in, z, a, h, h_mask, m = _decay_inputs(x_b, a_log, dt_bias, t, t_mask, ss, HK, HV,
                                                    DK, DV, BH)
        grad_off = (tok0 + t.to(tl.int64))[:, None] * HV + h[None, :]
        dg_v = tl.load(dg + grad_off, mask=m, other=0.0).to(tl.float32)
        dz = dg_v * -a[None, :] * _exact_sigmoid(z)  # d g / d (alpha + dt_bias)
        sb_ = _exact_sigmoid(beta_in)
        dbeta_v = tl.load(dbeta + grad_off, mask=m, other=0.0).to(tl.float32)
        dx_decay = dx_b + t.to(tl.int64)[:, None] * dx_ss + (2 * HK * DK + 2 * HV * DV)
        tl.store(dx_decay + h[None, :], _round_to(dbeta_v * sb_ * (1.0 - sb_), DTYPE).to(DTYPE),
                 mask=m)
        tl.store(dx_decay + HV + h[None, :], _round_to(dz, DTYPE).to(DTYPE), mask=m)
        # dA_log = exp(A_log) * sum(dg * -softplus): pre_gdr_bwd_sums multiplies by -exp(A_log)
        da_sum += tl.sum(tl.where(m, dg_v * _softplus(z), 0.0), 0)
        ddt_sum += tl.sum(tl.where(m, dz, 0.0), 0)
    h = tl.arange(0, BH)
    tl.store(partial_row + h, da_sum, mask=h < HV)
    tl.store(partial_row + HV + h, ddt_sum, mask=h < HV)


@triton.jit
def pre_gdr_bwd(
    x, w, bias, a_log, dt_bias, seq_start, dq, dk, dv, dg, dbeta, dgate, dx, partial,
    S, sb, ss, w_stride_c, w_stride_k, dx_sb, dx_ss, dgate_sb, dgate_ss, chunk,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr,
    ROWS: tl.constexpr, STAGES: tl.constexpr, BT: tl.constexpr, BDK: tl.constexpr,
    BDV: tl.constexpr, BH: tl.constexpr, EPS: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    CONV_ROUNDING: tl.constexpr, HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr,
    COPY_GATE: tl.constexpr,
):
    """Program (head, chunk of ``chunk`` tokens, batch), heads as in ``pre_gdr_fwd``. q/k and v
    heads: dx of their channels and the chunk's dw / db partials; the last: dbeta_in, dalpha
    and the chunk's dA / ddt_bias partials. ``partial``: one fp32 row per (batch, chunk),
    ``_partial_columns`` wide (``pre_gdr_bwd_sums`` adds the rows). COPY_GATE: the v heads also copy
    ``dgate`` ([B, S, HV * DV], unit last stride) into dx's gate slice."""
    head = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    first = tl.program_id(1) * chunk
    last = tl.minimum(first + chunk, S)
    x_b = x + b * sb
    dx_b = dx + b * dx_sb
    R: tl.constexpr = HV // HK
    C: tl.constexpr = 2 * HK * DK + HV * DV
    row = b * tl.num_programs(1) + tl.program_id(1)
    partial_row = partial + row * _partial_columns(C, K, HV, HAS_BIAS)
    tok0 = b * S
    if head < 2 * HK:  # q or k: one copy of the code, its gradient picked at run time
        grad = tl.where(head < HK, dq, dk)
        kh = head % HK
        _bwd_conv_head(x_b, w, bias, grad, dx_b, partial_row, seq_start, first, last, S, tok0,
                       head * DK, kh * R, ss, dx_ss, w_stride_c, w_stride_k, dgate, dgate_ss, 0,
                       C, HV, DK, K, R, BDK, ROWS, STAGES, EPS, True, USE_QK_L2NORM,
                       CONV_ROUNDING, HAS_BIAS, VARLEN, False)
    elif head < 2 * HK + HV:
        vh = head - 2 * HK
        _bwd_conv_head(x_b, w, bias, dv, dx_b, partial_row, seq_start, first, last, S, tok0,
                       2 * HK * DK + vh * DV, vh, ss, dx_ss, w_stride_c, w_stride_k,
                       dgate + b * dgate_sb, dgate_ss, 2 * HK * DK, C, HV, DV, K, 1, BDV, ROWS,
                       STAGES, EPS, False, USE_QK_L2NORM, CONV_ROUNDING, HAS_BIAS, VARLEN,
                       COPY_GATE)
    else:
        _bwd_decay(x_b, a_log, dt_bias, dg, dbeta, dx_b,
                   partial_row + _decay_column(C, K, HAS_BIAS), first, last, tok0, ss, dx_ss,
                   HK, HV, DK, DV, BT, BH)


@triton.jit
def _partial_columns(C: tl.constexpr, K: tl.constexpr, HV: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
    """Columns of a partial row: dw [C, K], db [C] (with a bias), dA [HV], ddt_bias [HV]."""
    return _decay_column(C, K, HAS_BIAS) + 2 * HV


@triton.jit
def _decay_column(C: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The partial row's first dA column: past dw [C, K] and db [C] (with a bias)."""
    return C * K + (C if HAS_BIAS else 0)


@triton.jit
def pre_gdr_bwd_sums(partial, a_log, dw, db, da_log, ddt_bias, rows, C: tl.constexpr,
                     K: tl.constexpr, HV: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ROWS_PER_STEP: tl.constexpr, BLOCK: tl.constexpr):
    """The parameters' gradients from ``pre_gdr_bwd``'s partial rows, each column summed in a
    fixed order (fp32, ROWS_PER_STEP rows a step), rounded once to its parameter's dtype:
    dw, db, dA_log = -exp(A_log) * sum, ddt_bias."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    WIDTH: tl.constexpr = _partial_columns(C, K, HV, HAS_BIAS)
    col_mask = cols < WIDTH
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    r = tl.arange(0, ROWS_PER_STEP)
    for r0 in tl.range(0, rows, ROWS_PER_STEP):
        rr = (r0 + r).to(tl.int64)
        m = (rr < rows)[:, None] & col_mask[None, :]
        total += tl.sum(tl.load(partial + rr[:, None] * WIDTH + cols[None, :], mask=m,
                                other=0.0), 0)
    CK: tl.constexpr = C * K
    W_DTYPE: tl.constexpr = dw.dtype.element_ty
    tl.store(dw + cols, _round_to(total, W_DTYPE).to(W_DTYPE), mask=cols < CK)
    DECAY0: tl.constexpr = _decay_column(C, K, HAS_BIAS)
    if HAS_BIAS:
        B_DTYPE: tl.constexpr = db.dtype.element_ty
        tl.store(db + cols - CK, _round_to(total, B_DTYPE).to(B_DTYPE),
                 mask=(cols >= CK) & (cols < DECAY0))
    h = cols - DECAY0
    is_a = (h >= 0) & (h < HV)
    A_DTYPE: tl.constexpr = da_log.dtype.element_ty
    a = _exact_exp(tl.load(a_log + h, mask=is_a, other=0.0).to(tl.float32))
    tl.store(da_log + h, _round_to(-total * a, A_DTYPE).to(A_DTYPE), mask=is_a)
    T_DTYPE: tl.constexpr = ddt_bias.dtype.element_ty
    tl.store(ddt_bias + h - HV, _round_to(total, T_DTYPE).to(T_DTYPE),
             mask=(h >= HV) & (h < 2 * HV))
