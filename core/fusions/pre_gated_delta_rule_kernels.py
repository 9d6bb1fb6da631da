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
  dw_partial[p, c, j] = sum over the block's tokens s of dpre[s] x[s - K + 1 + j]
  dalpha = round(dg (-A) sigmoid(alpha + dt_bias)),  dbeta_in = round(dbeta beta (1 - beta))
  dA_partial[p, h] = sum dg (-A) softplus(..),  ddt_partial[p, h] = sum dg (-A) sigmoid(..)
The partials are summed in a fixed order on the host side (deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from core.fusions.gated_norm_kernels import (INTERPRETED, _activation, _activation_grad,
                                             _round_to, _sigmoid)

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
def _l2_rstd(y, EPS: tl.constexpr):
    """FLA's l2norm: 1 / sqrt(sum over the head of y^2 + eps), per row."""
    return 1 / tl.sqrt(tl.sum(y * y, 1) + EPS)


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
        y = _round_to(y * _l2_rstd(y, EPS)[:, None], DTYPE)
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
def _conv_channels_backward(x_b, w, dx_rows, dw_partial, db_partial, part_row, pre, dact, r,
                            r_mask, own, start, chans, chan_mask, seq_start, S, ss, w_stride_c,
                            w_stride_k, C: tl.constexpr, K: tl.constexpr,
                            CONV_ROUNDING: tl.constexpr, HAS_BIAS: tl.constexpr,
                            VARLEN: tl.constexpr):
    """From the gradient at the activation's output (``dact``, rows ``r``), the block's dw / db
    partials over its own rows and dx of those rows. dx[t] needs dpre at t .. t + K - 1: the
    block's rows past its own (the halo) are computed here, and reached by gathering the tile
    shifted by i rows (no recomputation per shift)."""
    DTYPE: tl.constexpr = dx_rows.dtype.element_ty
    BT: tl.constexpr = pre.shape[0]
    m = r_mask[:, None] & chan_mask[None, :]
    p = _round_to(pre, DTYPE) if CONV_ROUNDING == "twice" else pre
    dpre = tl.where(m, dact * _activation_grad(p, "silu"), 0.0)
    owned = tl.where(own[:, None], dpre, 0.0)
    part = part_row * C + chans
    for j in tl.static_range(K):
        src = r - (K - 1) + j
        xm = ((src >= start) & r_mask)[:, None] & chan_mask[None, :]
        xv = tl.load(x_b + src.to(tl.int64)[:, None] * ss + chans[None, :], mask=xm, other=0.0)
        tl.store(dw_partial + part * K + j, tl.sum(owned * xv.to(tl.float32), 0), mask=chan_mask)
    if HAS_BIAS:
        tl.store(db_partial + part, tl.sum(owned, 0), mask=chan_mask)
    local = tl.arange(0, BT)
    dxs = tl.zeros_like(dpre)
    for i in tl.static_range(K):
        if i == 0:
            shifted = dpre
        else:  # row t of ``shifted``: dpre at t + i (the clamped rows are past the own rows)
            index = tl.broadcast_to(tl.minimum(local + i, BT - 1)[:, None], dpre.shape)
            shifted = tl.gather(dpre, index, 0)
        if VARLEN:  # dpre[t + i] reaches dx[t] only within t's sequence
            s = r + i
            same = tl.load(seq_start + s, mask=s < S, other=S) <= r
            shifted = tl.where(same[:, None], shifted, 0.0)
        wi = tl.load(w + chans * w_stride_c + (K - 1 - i) * w_stride_k, mask=chan_mask, other=0.0)
        dxs += shifted * wi.to(tl.float32)[None, :]
    tl.store(dx_rows + chans[None, :], _round_to(dxs, DTYPE).to(DTYPE),
             mask=own[:, None] & chan_mask[None, :])


@triton.jit
def _bwd_key_head(x_b, w, bias, grad, dx_rows, dw_partial, db_partial, part_row, r, r_mask,
                  own, tok, start, seq_start, head, kh, S, ss, w_stride_c, w_stride_k,
                  HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  K: tl.constexpr, R: tl.constexpr, BDK: tl.constexpr, EPS: tl.constexpr,
                  USE_QK_L2NORM: tl.constexpr, CONV_ROUNDING: tl.constexpr,
                  HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr):
    """q/k head ``head``: the head repeat's gradient summed, the l2norm backward (dact), then
    the conv's backward of its channels."""
    DTYPE: tl.constexpr = dx_rows.dtype.element_ty
    d = tl.arange(0, BDK)
    d_mask = d < DK
    chans = head * DK + d
    m = r_mask[:, None] & d_mask[None, :]
    dy = tl.zeros((r.shape[0], BDK), dtype=tl.float32)
    for i in tl.static_range(R):
        dy += tl.load(grad + (tok * HV + kh * R + i) * DK + d[None, :], mask=m,
                      other=0.0).to(tl.float32)
    if R > 1:
        dy = _round_to(dy, DTYPE)
    pre = _conv_pre(x_b, r, r_mask, start, chans, d_mask, w, w_stride_c, w_stride_k, bias, ss,
                    K, HAS_BIAS)
    if USE_QK_L2NORM:
        y = _conv_act(pre, DTYPE, CONV_ROUNDING)
        rstd = _l2_rstd(y, EPS)
        y = y * rstd[:, None]
        dy = _round_to(dy * rstd[:, None] - tl.sum(dy * y, 1)[:, None] * y * rstd[:, None],
                       DTYPE)
    _conv_channels_backward(x_b, w, dx_rows, dw_partial, db_partial, part_row, pre, dy, r,
                            r_mask, own, start, chans, d_mask, seq_start, S, ss, w_stride_c,
                            w_stride_k, 2 * HK * DK + HV * DV, K, CONV_ROUNDING, HAS_BIAS, VARLEN)


@triton.jit
def _bwd_value_head(x_b, w, bias, dv, dx_rows, dw_partial, db_partial, part_row, r, r_mask,
                    own, tok, start, seq_start, vh, S, ss, w_stride_c, w_stride_k,
                    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    K: tl.constexpr, BDV: tl.constexpr, CONV_ROUNDING: tl.constexpr,
                    HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr):
    d = tl.arange(0, BDV)
    d_mask = d < DV
    chans = 2 * HK * DK + vh * DV + d
    m = r_mask[:, None] & d_mask[None, :]
    dact = tl.load(dv + (tok * HV + vh) * DV + d[None, :], mask=m, other=0.0).to(tl.float32)
    pre = _conv_pre(x_b, r, r_mask, start, chans, d_mask, w, w_stride_c, w_stride_k, bias, ss,
                    K, HAS_BIAS)
    _conv_channels_backward(x_b, w, dx_rows, dw_partial, db_partial, part_row, pre, dact, r,
                            r_mask, own, start, chans, d_mask, seq_start, S, ss, w_stride_c,
                            w_stride_k, 2 * HK * DK + HV * DV, K, CONV_ROUNDING, HAS_BIAS, VARLEN)


@triton.jit
def _bwd_decay(x_b, a_log, dt_bias, dg, dbeta, dx_rows, da_partial, ddt_partial, part_row, t,
               t_mask, tok, ss, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
               DV: tl.constexpr, BH: tl.constexpr):
    DTYPE: tl.constexpr = dx_rows.dtype.element_ty
    beta_in, z, a, h, h_mask, m = _decay_inputs(x_b, a_log, dt_bias, t, t_mask, ss, HK, HV, DK,
                                                DV, BH)
    grad_off = tok * HV + h[None, :]
    dg_v = tl.load(dg + grad_off, mask=m, other=0.0).to(tl.float32)
    dz = dg_v * -a[None, :] * _exact_sigmoid(z)  # d g / d (alpha + dt_bias)
    sb_ = _exact_sigmoid(beta_in)
    dbeta_v = tl.load(dbeta + grad_off, mask=m, other=0.0).to(tl.float32)
    dx_decay = dx_rows + (2 * HK * DK + 2 * HV * DV)
    tl.store(dx_decay + h[None, :], _round_to(dbeta_v * sb_ * (1.0 - sb_), DTYPE).to(DTYPE),
             mask=m)
    tl.store(dx_decay + HV + h[None, :], _round_to(dz, DTYPE).to(DTYPE), mask=m)
    part = part_row * HV + h
    # dA_log = exp(A_log) * sum(dg * -softplus): the host multiplies by -exp(A_log)
    tl.store(da_partial + part, tl.sum(tl.where(m, dg_v * _softplus(z), 0.0), 0), mask=h_mask)
    tl.store(ddt_partial + part, tl.sum(tl.where(m, dz, 0.0), 0), mask=h_mask)


@triton.jit
def pre_gdr_bwd(
    x, w, bias, a_log, dt_bias, seq_start, dq, dk, dv, dg, dbeta, dx,
    dw_partial, db_partial, da_partial, ddt_partial,
    S, sb, ss, w_stride_c, w_stride_k, dx_sb, dx_ss, blocks,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BH: tl.constexpr,
    EPS: tl.constexpr, USE_QK_L2NORM: tl.constexpr, CONV_ROUNDING: tl.constexpr,
    HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr,
):
    """Program (head, token block, batch), heads as in ``pre_gdr_fwd``. A block owns
    OWN = BT - K + 1 tokens from ``block * OWN`` and computes dpre on all BT (its K - 1 last rows
    are the next block's first). q/k and v heads: dx of their channels and the block's dw / db
    partials; the last: dbeta_in, dalpha and the block's dA / ddt_bias partials. Partials: row
    ``batch * blocks + block``."""
    head = tl.program_id(0)
    block = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    OWN: tl.constexpr = BT - K + 1
    local = tl.arange(0, BT)
    r = block * OWN + local
    r_mask = r < S
    own = r_mask & (local < OWN)
    x_b = x + b * sb
    dx_rows = dx + b * dx_sb + r.to(tl.int64)[:, None] * dx_ss
    part_row = b * blocks + block
    R: tl.constexpr = HV // HK
    tok = (b * S + r.to(tl.int64))[:, None]
    start = _sequence_start(seq_start, r, r_mask, VARLEN)
    if head < HK:
        _bwd_key_head(x_b, w, bias, dq, dx_rows, dw_partial, db_partial, part_row, r, r_mask,
                      own, tok, start, seq_start, head, head, S, ss, w_stride_c, w_stride_k, HK,
                      HV, DK, DV, K, R, BDK, EPS, USE_QK_L2NORM, CONV_ROUNDING, HAS_BIAS, VARLEN)
    elif head < 2 * HK:
        _bwd_key_head(x_b, w, bias, dk, dx_rows, dw_partial, db_partial, part_row, r, r_mask,
                      own, tok, start, seq_start, head, head - HK, S, ss, w_stride_c, w_stride_k,
                      HK, HV, DK, DV, K, R, BDK, EPS, USE_QK_L2NORM, CONV_ROUNDING, HAS_BIAS,
                      VARLEN)
    elif head < 2 * HK + HV:
        _bwd_value_head(x_b, w, bias, dv, dx_rows, dw_partial, db_partial, part_row, r, r_mask,
                        own, tok, start, seq_start, head - 2 * HK, S, ss, w_stride_c, w_stride_k,
                        HK, HV, DK, DV, K, BDV, CONV_ROUNDING, HAS_BIAS, VARLEN)
    else:
        _bwd_decay(x_b, a_log, dt_bias, dg, dbeta, dx_rows, da_partial, ddt_partial, part_row, r,
                   own, tok, ss, HK, HV, DK, DV, BH)
