"""The fused GDN pre-recurrence region: everything between in_proj and the gated delta rule.

megatron-core's GatedDeltaNet.forward takes the in_proj output ``qkvzba`` (bshd, [B, S, W]) to
the recurrence's inputs with a transpose, splits, FLA's ``causal_conv1d`` + SiLU (torch's
``conv1d`` then the activation in ``deterministic_mode``), reshapes, FLA's q/k ``l2norm``, a head
``repeat_interleave`` and ``_compute_g_and_beta``: about ten kernels each way, and a gradient
assembled from pieces. Here: one forward kernel, and a backward kernel with one more that sums
its per-chunk partials into the parameters' gradients (``pre_gated_delta_rule_kernels``,
formulas there), the gradient of the whole in_proj output written into one buffer, every
reduction in a fixed order (deterministic).

    q, k, v, gate, g, beta = fused_pre_gated_delta_rule(
        qkvzba, conv_weight, conv_bias, A_log, dt_bias,
        num_key_heads=..., key_head_dim=..., num_value_heads=..., value_head_dim=...)

``gate`` is the in_proj output's gate slice as a [B, S, Hv, Dv] view (no copy); its gradient
lands in the same buffer as the rest. The rounding points are the unfused path's
(``conv_rounding``; docs/numerics.md). Inputs are checked on every call, host metadata only.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton

from core.fusions.gated_norm_validation import (DEVICE_RULE, check_bool, check_option,
                                                 check_positive_number, check_tensors)
from core.fusions.gated_norm_kernels import INTERPRETED
from core.fusions.pre_gated_delta_rule_kernels import (pre_gdr_bwd, pre_gdr_bwd_sums,
                                                        pre_gdr_fwd)

ENTRY = "fused_pre_gated_delta_rule"
# "once": FLA's causal_conv1d (conv + SiLU, one rounding); "twice": torch's conv1d, then the
# activation (megatron's deterministic_mode path), a rounding after each.
CONV_ROUNDINGS = ("once", "twice")
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 1024  # a head's tile lives in registers
MAX_CONV_WIDTH = 16
DECAY_TOKENS = 4  # tokens per step of the backward's g / beta program (few registers)


class RegionShape(NamedTuple):
    """Local sizes of the region: key / value heads and head dims, the conv width."""
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def features(self) -> int:  # q, k, v, gate, beta, alpha
        return self.conv_channels + self.value_heads * self.value_dim + 2 * self.value_heads

    @property
    def gate_slice(self) -> slice:
        start = self.conv_channels
        return slice(start, start + self.value_heads * self.value_dim)

    def gate_view(self, qkvzba: torch.Tensor) -> torch.Tensor:
        """The gate's slice of a [B, S, W] in_proj output (or its gradient) as [B, S, Hv, Dv]."""
        batch, seq, _ = qkvzba.shape
        return qkvzba[..., self.gate_slice].view(batch, seq, self.value_heads, self.value_dim)


# ----------------------------------------------------------------------------------------------
# Input rules (host metadata only: nothing is read from the device)
# ----------------------------------------------------------------------------------------------


def _check_count(name: str, value) -> int:
    if type(value) is not int:
        raise TypeError(f"{ENTRY}: {name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{ENTRY}: {name} must be >= 1, got {value}")
    return value


def check_pre_gated_delta_rule(qkvzba, conv_weight, conv_bias, A_log, dt_bias, *,
                               num_key_heads, key_head_dim, num_value_heads, value_head_dim,
                               cu_seqlens=None, use_qk_l2norm=True, conv_rounding="once",
                               eps=1e-6) -> RegionShape:
    """The rules of :func:`fused_pre_gated_delta_rule`'s arguments (TypeError for a type,
    ValueError for a value), before any launch. Returns the region's sizes."""
    hk, dk = _check_count("num_key_heads", num_key_heads), _check_count("key_head_dim",
                                                                         key_head_dim)
    hv, dv = _check_count("num_value_heads", num_value_heads), _check_count("value_head_dim",
                                                                             value_head_dim)
    check_bool(ENTRY, "use_qk_l2norm", use_qk_l2norm)
    check_option(ENTRY, "conv_rounding", conv_rounding, CONV_ROUNDINGS)
    check_positive_number(ENTRY, "eps", eps)
    if hv % hk:
        raise ValueError(f"{ENTRY}: num_value_heads ({hv}) must be a multiple of num_key_heads "
                         f"({hk}): value head j reads key head j // (num_value_heads // "
                         "num_key_heads)")
    for name, dim in (("key_head_dim", dk), ("value_head_dim", dv)):
        if dim > MAX_HEAD_DIM:
            raise ValueError(f"{ENTRY}: {name} must be <= {MAX_HEAD_DIM}, got {dim}")
    named = [("qkvzba", qkvzba), ("conv_weight", conv_weight), ("A_log", A_log),
             ("dt_bias", dt_bias)]
    if conv_bias is not None:
        named.append(("conv_bias", conv_bias))
    check_tensors(ENTRY, named)
    if qkvzba.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"{ENTRY}: qkvzba dtype must be bf16, fp16 or fp32, got {qkvzba.dtype}")
    for name, t in named[1:]:
        if t.dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"{ENTRY}: {name} dtype must be bf16, fp16 or fp32, got {t.dtype}")
    for name, t in named:
        if not torch.compiler.is_compiling() and t.is_neg():
            raise ValueError(f"{ENTRY}: {name} is a negative view; pass {name}.resolve_neg()")
    device = qkvzba.device
    kernel_device = "cpu" if INTERPRETED else "cuda"
    if device.type != kernel_device:
        raise ValueError(f"{ENTRY}: qkvzba must be a {kernel_device.upper()} tensor "
                         f"{DEVICE_RULE}, got device {device}")
    for name, t in named[1:]:
        if t.device != device:
            raise ValueError(f"{ENTRY}: {name} must be on qkvzba's device {device}, got "
                             f"{t.device}")
    if qkvzba.dim() != 3:
        raise ValueError(f"{ENTRY}: qkvzba must have rank 3 [batch, sequence, features], got "
                         f"shape {tuple(qkvzba.shape)}")
    if qkvzba.shape[2] > 1 and qkvzba.stride(2) != 1:
        raise ValueError(f"{ENTRY}: qkvzba's last dim must have stride 1 (in_proj's output and "
                         f"its bshd transpose have it), got strides {qkvzba.stride()}")
    width = conv_weight.shape[-1] if conv_weight.dim() in (2, 3) else 0
    shape = RegionShape(hk, hv, dk, dv, width)
    channels = shape.conv_channels
    if qkvzba.shape[2] != shape.features:
        raise ValueError(
            f"{ENTRY}: qkvzba's last dim must be 2 * num_key_heads * key_head_dim + 2 * "
            f"num_value_heads * value_head_dim + 2 * num_value_heads = {shape.features} (q, k, "
            f"v, gate, beta, alpha), got {qkvzba.shape[2]}")
    if conv_weight.shape not in ((channels, width), (channels, 1, width)) or width < 1:
        raise ValueError(f"{ENTRY}: conv_weight must have shape [{channels}, width] or "
                         f"[{channels}, 1, width] (one filter per q/k/v channel), got "
                         f"{tuple(conv_weight.shape)}")
    if width > MAX_CONV_WIDTH:
        raise ValueError(f"{ENTRY}: the conv width must be <= {MAX_CONV_WIDTH}, got {width}")
    if conv_bias is not None and conv_bias.shape != (channels,):
        raise ValueError(f"{ENTRY}: conv_bias must have shape [{channels}], got "
                         f"{tuple(conv_bias.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (hv,):
            raise ValueError(f"{ENTRY}: {name} must have shape [{hv}] (one per value head), "
                             f"got {tuple(t.shape)}")
    for name, t in named[2:]:
        if t.numel() > 1 and t.stride(-1) != 1:
            raise ValueError(f"{ENTRY}: {name} must be contiguous, got strides {t.stride()}")
    if cu_seqlens is not None:
        check_tensors(ENTRY, (("cu_seqlens", cu_seqlens),))
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise ValueError(f"{ENTRY}: cu_seqlens must be a 1-D int32 or int64 tensor, got "
                             f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device != device or cu_seqlens.numel() < 2:
            raise ValueError(f"{ENTRY}: cu_seqlens must be on qkvzba's device with at least 2 "
                             f"entries, got {cu_seqlens.numel()} on {cu_seqlens.device}")
        if qkvzba.shape[0] != 1:
            raise ValueError(f"{ENTRY}: packed sequences (cu_seqlens) require batch 1, got "
                             f"{qkvzba.shape[0]}")
    return shape


# ----------------------------------------------------------------------------------------------
# Launch choices
# ----------------------------------------------------------------------------------------------


class Launch(NamedTuple):
    forward_tokens: int  # tokens per program of the forward
    forward_warps: int
    backward_chunk: int  # tokens per program of the backward, streamed
    backward_rows: int  # tokens per step of its loop (their loads issued together)
    backward_warps: int
    backward_stages: int = 1  # > 1: the loads of the next stages - 1 loop steps in flight
    sum_columns: int = 256  # pre_gdr_bwd_sums: partial-row columns per program
    sum_rows: int = 8  # and rows added per step


# The backward's chunk of 16 ... 256 tokens: the longest whose one-warp programs fill one wave
# (at least 90 % of what the GPU holds at once, RESIDENT_PER_SM per SM at the kernel's 128
# registers: tools/kernel_ir.py, tested) without spilling into a second, or make two waves or
# more. Longer chunks compute fewer of the K - 1 tokens past their end twice and write fewer
# partial rows; a wave that spills a few programs into the next leaves the GPU mostly idle for
# a whole program's time.
# The fastest of 16 ... 256 at 32, 8 and 4 value heads (S = 4096, B = 1) on an H100
# (tools/pre_gdr_benchmark.py --sweep; docs/design.md).
MIN_CHUNK, MAX_CHUNK, RESIDENT_PER_SM = 16, 256, 16
H100_MULTIPROCESSORS = 132  # without a GPU (the interpreter): as on an H100
# pre_gdr_bwd_sums: programs of 32 ... 256 partial-row columns, the widest that makes two
# programs per SM (few columns at 4 or 8 value heads: 4104 at 4, one program per SM at 32
# wide), each adding SUM_TILE elements a step (16 a thread at 4 warps).
MIN_SUM_COLUMNS, MAX_SUM_COLUMNS, SUM_TILE = 32, 256, 2048


def launch_for(shape: RegionShape, seq: int, batch: int = 1,
               multiprocessors: int = H100_MULTIPROCESSORS) -> Launch:
    """Launch sizes for ``batch`` sequences of ``seq`` tokens of this shape."""
    programs_per_chunk = (2 * shape.key_heads + shape.value_heads + 1) * batch
    slots = multiprocessors * RESIDENT_PER_SM
    chunk = MAX_CHUNK
    while chunk > MIN_CHUNK:
        programs = programs_per_chunk * triton.cdiv(seq, chunk)
        if 0.9 * slots <= programs <= slots or programs >= 2 * slots:
            break
        chunk //= 2
    columns = _partial_columns(shape, has_bias=False)
    sum_columns = MAX_SUM_COLUMNS
    while sum_columns > MIN_SUM_COLUMNS and triton.cdiv(columns, sum_columns) < 2 * multiprocessors:
        sum_columns //= 2
    return Launch(forward_tokens=16, forward_warps=4, backward_chunk=chunk, backward_rows=4,
                  backward_warps=1, sum_columns=sum_columns, sum_rows=SUM_TILE // sum_columns)


def _partial_columns(shape: RegionShape, has_bias: bool) -> int:
    """Columns of the backward's partial rows (the kernels' _partial_columns): dw [C, K], db
    [C] with a bias, dA and ddt_bias [Hv] each."""
    channels = shape.conv_channels
    return channels * shape.conv_width + (channels if has_bias else 0) + 2 * shape.value_heads


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The SM count of ``device`` (queried once per device; no synchronisation)."""
    if device.type != "cuda":
        return H100_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def sequence_starts(cu_seqlens: Optional[torch.Tensor], tokens: int,
                    device) -> Optional[torch.Tensor]:
    """For each packed token, the index of its sequence's first token (int32; no host sync)."""
    if cu_seqlens is None:
        return None
    positions = torch.arange(tokens, device=device, dtype=cu_seqlens.dtype)
    index = torch.searchsorted(cu_seqlens, positions, right=True) - 1
    return cu_seqlens[index.clamp_(min=0)].to(torch.int32)


def _flags(conv_bias, seq_start, use_qk_l2norm, conv_rounding, eps):
    return dict(EPS=eps, USE_QK_L2NORM=use_qk_l2norm, CONV_ROUNDING=conv_rounding,
                HAS_BIAS=conv_bias is not None, VARLEN=seq_start is not None)


def _dims(shape: RegionShape) -> dict:
    return dict(HK=shape.key_heads, HV=shape.value_heads, DK=shape.key_dim,
                DV=shape.value_dim, K=shape.conv_width)


# ----------------------------------------------------------------------------------------------
# Forward and backward
# ----------------------------------------------------------------------------------------------


def forward_impl(qkvzba, conv_weight, conv_bias, A_log, dt_bias, shape: RegionShape,
                 seq_start=None, use_qk_l2norm=True, conv_rounding="once", eps=1e-6):
    """q, k ([B, S, Hv, Dk]), v ([B, S, Hv, Dv]), g (fp32) and beta ([B, S, Hv]); no checks."""
    batch, seq, _ = qkvzba.shape
    hv, dk, dv = shape.value_heads, shape.key_dim, shape.value_dim
    dtype, device = qkvzba.dtype, qkvzba.device
    q = torch.empty(batch, seq, hv, dk, dtype=dtype, device=device)
    k = torch.empty_like(q)
    v = torch.empty(batch, seq, hv, dv, dtype=dtype, device=device)
    g = torch.empty(batch, seq, hv, dtype=torch.float32, device=device)
    beta = torch.empty(batch, seq, hv, dtype=dtype, device=device)
    if q.numel() == 0 and v.numel() == 0:
        return q, k, v, g, beta
    launch = launch_for(shape, seq, batch, multiprocessors(device))
    weight = conv_weight.view(conv_weight.shape[0], -1)
    grid = (2 * shape.key_heads + hv + 1, triton.cdiv(seq, launch.forward_tokens), batch)
    pre_gdr_fwd[grid](
        x=qkvzba, w=weight, bias=conv_bias, a_log=A_log, dt_bias=dt_bias, seq_start=seq_start,
        q=q, k=k, v=v, g=g, beta=beta,
        S=seq, sb=qkvzba.stride(0), ss=qkvzba.stride(1),
        w_stride_c=weight.stride(0), w_stride_k=weight.stride(1), **_dims(shape),
        BT=launch.forward_tokens, BDK=_block(dk), BDV=_block(dv), BH=_block(hv),
        **_flags(conv_bias, seq_start, use_qk_l2norm, conv_rounding, eps),
        num_warps=launch.forward_warps,
    )
    return q, k, v, g, beta


def backward_impl(qkvzba, conv_weight, conv_bias, A_log, dt_bias, shape: RegionShape,
                  dq, dk, dv, dg, dbeta, seq_start=None, use_qk_l2norm=True,
                  conv_rounding="once", eps=1e-6, dqkvzba=None, dgate=None):
    """The gradients of qkvzba, the conv weight (in its shape), the conv bias (None without
    one), A_log and dt_bias. ``dqkvzba``: the buffer to write (qkvzba's shape), e.g. one whose
    gate slice already holds the gate's gradient; ``dgate``: the gate's gradient to copy into
    it (any [B, S, Hv, Dv]-sized tensor), None to leave the gate slice unwritten."""
    batch, seq, _ = qkvzba.shape
    hk, hv, width = shape.key_heads, shape.value_heads, shape.conv_width
    channels = shape.conv_channels
    device = qkvzba.device
    if dqkvzba is None:
        dqkvzba = gradient_buffer(qkvzba)
    launch = launch_for(shape, seq, batch, multiprocessors(device))
    chunks = triton.cdiv(seq, launch.backward_chunk)
    columns = _partial_columns(shape, conv_bias is not None)
    # one row per (batch, chunk), every column written by the kernel
    partial = torch.empty(batch * chunks, columns, dtype=torch.float32, device=device)
    if dgate is not None:
        dgate = dgate.reshape(batch, seq, hv * shape.value_dim)
        if dgate.shape[2] > 1 and dgate.stride(2) != 1:
            dgate = dgate.contiguous()
    if seq and batch:
        weight = conv_weight.view(channels, -1)
        pre_gdr_bwd[(2 * hk + hv + 1, chunks, batch)](
            x=qkvzba, w=weight, bias=conv_bias, a_log=A_log, dt_bias=dt_bias,
            seq_start=seq_start, dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta,
            dgate=dqkvzba if dgate is None else dgate, dx=dqkvzba, partial=partial,
            S=seq, sb=qkvzba.stride(0), ss=qkvzba.stride(1), w_stride_c=weight.stride(0),
            w_stride_k=weight.stride(1), dx_sb=dqkvzba.stride(0), dx_ss=dqkvzba.stride(1),
            dgate_sb=0 if dgate is None else dgate.stride(0),
            dgate_ss=0 if dgate is None else dgate.stride(1),
            chunk=launch.backward_chunk, **_dims(shape), ROWS=launch.backward_rows,
            BT=DECAY_TOKENS, BDK=_block(shape.key_dim), BDV=_block(shape.value_dim),
            BH=_block(hv), **_flags(conv_bias, seq_start, use_qk_l2norm, conv_rounding, eps),
            COPY_GATE=dgate is not None, STAGES=launch.backward_stages,
            num_warps=launch.backward_warps,
        )
    dweight = torch.empty(channels, width, dtype=conv_weight.dtype, device=device)
    dbias = None if conv_bias is None else torch.empty_like(conv_bias)
    da_log, ddt_bias = torch.empty_like(A_log), torch.empty_like(dt_bias)
    pre_gdr_bwd_sums[(triton.cdiv(columns, launch.sum_columns),)](
        partial=partial, a_log=A_log, dw=dweight, db=dbias, da_log=da_log, ddt_bias=ddt_bias,
        rows=partial.shape[0], C=channels, K=width, HV=hv, HAS_BIAS=conv_bias is not None,
        ROWS_PER_STEP=launch.sum_rows, BLOCK=launch.sum_columns, num_warps=4)
    return dqkvzba, dweight.view(conv_weight.shape), dbias, da_log, ddt_bias


def gradient_buffer(qkvzba: torch.Tensor) -> torch.Tensor:
    """A new tensor for qkvzba's gradient: laid out as in_proj's [S, B, W] output when qkvzba is
    its bshd transpose (in_proj's backward then reads it contiguous), else contiguous."""
    return _new_buffer(*_buffer_layout(qkvzba))


def _buffer_layout(qkvzba: torch.Tensor) -> tuple:
    """What ``_new_buffer`` needs of qkvzba: size, dtype, device, whether it is sbhd."""
    return qkvzba.shape, qkvzba.dtype, qkvzba.device, qkvzba.transpose(0, 1).is_contiguous()


def _new_buffer(size, dtype, device, sbhd: bool) -> torch.Tensor:
    if sbhd:
        batch, seq, width = size
        return torch.empty(seq, batch, width, dtype=dtype, device=device).transpose(0, 1)
    return torch.empty(size, dtype=dtype, device=device)


class GateGradientSink:
    """The in_proj output's gradient buffer, shared by two backwards: with the fused output norm
    on, its backward (which runs first) writes dgate into the gate's slice
    (``gate_gradient()``), and the region's backward writes the rest into the same buffer
    (``take()``) instead of copying dgate in. Pass a new one to each
    ``fused_pre_gated_delta_rule`` call and to the output norm of the same forward."""

    __slots__ = ("_layout", "_shape", "buffer")

    def __init__(self):
        self._layout = self._shape = self.buffer = None

    def bind(self, qkvzba: torch.Tensor, shape: RegionShape) -> None:
        """Keep qkvzba's layout (not its memory) and the region's sizes."""
        self._layout = _buffer_layout(qkvzba)
        self._shape = shape

    def gate_gradient(self) -> torch.Tensor:
        """The [B, S, Hv, Dv] view of the buffer's gate slice (the buffer made on first use)."""
        if self.buffer is None:
            self.buffer = _new_buffer(*self._layout)
        return self._shape.gate_view(self.buffer)

    def take(self) -> Optional[torch.Tensor]:
        buffer, self.buffer = self.buffer, None
        return buffer


def output_gradients(qkvzba: torch.Tensor, shape: RegionShape, dq, dk, dv, dg, dbeta) -> list:
    """The gradients of q, k, v, g and beta as the kernels read them (contiguous), zeros for an
    output autograd hands None (unused)."""
    batch, seq, _ = qkvzba.shape
    hv = shape.value_heads
    shapes = ((batch, seq, hv, shape.key_dim), (batch, seq, hv, shape.key_dim),
              (batch, seq, hv, shape.value_dim), (batch, seq, hv), (batch, seq, hv))
    dtypes = (qkvzba.dtype,) * 3 + (torch.float32, qkvzba.dtype)
    return [torch.zeros(size, dtype=dtype, device=qkvzba.device) if grad is None
            else grad.contiguous()
            for grad, size, dtype in zip((dq, dk, dv, dg, dbeta), shapes, dtypes)]


class _FusedPreGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkvzba, conv_weight, conv_bias, A_log, dt_bias, shape, seq_start,
                use_qk_l2norm, conv_rounding, eps, dgate_sink):
        q, k, v, g, beta = forward_impl(qkvzba, conv_weight, conv_bias, A_log, dt_bias, shape,
                                        seq_start, use_qk_l2norm, conv_rounding, eps)
        gate = shape.gate_view(qkvzba)
        ctx.save_for_backward(qkvzba, conv_weight, conv_bias, A_log, dt_bias, seq_start)
        ctx.options = (shape, use_qk_l2norm, conv_rounding, eps)
        ctx.dgate_sink = dgate_sink
        if dgate_sink is not None:
            dgate_sink.bind(qkvzba, shape)
        return q, k, v, gate, g, beta

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq, dk, dv, dgate, dg, dbeta):
        qkvzba, conv_weight, conv_bias, A_log, dt_bias, seq_start = ctx.saved_tensors
        shape, use_qk_l2norm, conv_rounding, eps = ctx.options
        sink = ctx.dgate_sink
        dqkvzba = None if sink is None else sink.take()
        if dqkvzba is None:
            dqkvzba = gradient_buffer(qkvzba)
        gate_grad = dqkvzba[..., shape.gate_slice]
        if dgate is None:
            gate_grad.zero_()
        elif _is_view_of(dgate, gate_grad):  # the output norm wrote it there: no copy
            dgate = None
        dqkvzba, dweight, dbias, da_log, ddt_bias = backward_impl(
            qkvzba, conv_weight, conv_bias, A_log, dt_bias, shape,
            *output_gradients(qkvzba, shape, dq, dk, dv, dg, dbeta), seq_start, use_qk_l2norm,
            conv_rounding, eps, dqkvzba=dqkvzba, dgate=dgate)
        return dqkvzba, dweight, dbias, da_log, ddt_bias, None, None, None, None, None, None


def _is_view_of(grad: torch.Tensor, slot: torch.Tensor) -> bool:
    """Whether ``grad`` ([B, S, H, D]) is the memory of ``slot`` ([B, S, H * D]) already (the
    stride of a size-1 dimension, e.g. B = 1, does not matter)."""
    view = slot.view(grad.shape)
    return grad.data_ptr() == view.data_ptr() and all(
        size == 1 or a == b for size, a, b in zip(grad.shape, grad.stride(), view.stride()))


def fused_pre_gated_delta_rule(qkvzba, conv_weight, conv_bias, A_log, dt_bias, *,
                               num_key_heads: int, key_head_dim: int, num_value_heads: int,
                               value_head_dim: int, cu_seqlens=None, use_qk_l2norm: bool = True,
                               conv_rounding: str = "once", eps: float = 1e-6,
                               dgate_sink: Optional[GateGradientSink] = None):
    """The region from the in_proj output to the recurrence's inputs, forward and backward.

    ``qkvzba``: [B, S, W] (bshd; any batch / sequence strides, unit last stride), W = q, k
    (num_key_heads x key_head_dim each), v, gate (num_value_heads x value_head_dim each), beta,
    alpha (num_value_heads each). ``conv_weight``: [C, K] or [C, 1, K] (C = the q, k, v
    channels), ``conv_bias``: [C] or None; ``A_log``, ``dt_bias``: [num_value_heads].
    ``cu_seqlens``: packed sequences (B = 1): the convolution never reads across a boundary.
    ``conv_rounding``: "once" (FLA's causal_conv1d) or "twice" (torch's conv1d then SiLU).

    ``dgate_sink``: a new :class:`GateGradientSink`, also given to the output norm that takes
    ``gate`` (``fused_gated_norm``'s eager path), so that its backward writes the gate's gradient
    into this region's gradient buffer; None: the gate's gradient is copied in.

    Returns q, k ([B, S, num_value_heads, key_head_dim], contiguous; value head j reads key
    head j // (num_value_heads // num_key_heads)), v ([B, S, Hv, Dv], contiguous), gate (a
    [B, S, Hv, Dv] view of qkvzba), g (fp32) and beta ([B, S, Hv])."""
    if dgate_sink is not None and not isinstance(dgate_sink, GateGradientSink):
        raise TypeError(f"{ENTRY}: dgate_sink must be None or a GateGradientSink, got "
                        f"{type(dgate_sink).__name__}")
    shape = check_pre_gated_delta_rule(
        qkvzba, conv_weight, conv_bias, A_log, dt_bias, num_key_heads=num_key_heads,
        key_head_dim=key_head_dim, num_value_heads=num_value_heads,
        value_head_dim=value_head_dim, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
        conv_rounding=conv_rounding, eps=eps)
    seq_start = sequence_starts(cu_seqlens, qkvzba.shape[1], qkvzba.device)
    if torch.compiler.is_compiling():  # custom ops, opaque to the compiler; no sink there
        from core.fusions.pre_gated_delta_rule_compile import pre_gdr_fwd_op

        q, k, v, g, beta = pre_gdr_fwd_op(qkvzba, conv_weight, conv_bias, A_log, dt_bias,
                                          seq_start, list(shape[:4]), use_qk_l2norm,
                                          conv_rounding, float(eps))
        return q, k, v, shape.gate_view(qkvzba), g, beta
    return _FusedPreGatedDeltaRule.apply(qkvzba, conv_weight, conv_bias, A_log, dt_bias, shape,
                                         seq_start, use_qk_l2norm, conv_rounding, float(eps),
                                         dgate_sink)
