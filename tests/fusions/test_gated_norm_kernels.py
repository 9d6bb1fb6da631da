"""The training kernels' numerics against the unfused Megatron path (CPU interpreter or GPU):
forward and gradients per dtype, head dim, activation and layout, the roundings, 64-bit row
offsets, the dW partial sum, and bits that depend on neither the block, the grid nor the batch.
Launch arguments and plans: test_gated_norm_plans.py; the entry points: test_fused_gated_norm.py.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import core.fusions.gated_norm_kernels as kernels
import core.fusions.gated_norm_plans as plans
from core.fusions.fused_gated_norm import backward_impl, forward_impl, fused_gated_norm
from core.fusions.gated_norm_kernels import _column_offsets, _row_offset
from core.fusions.gated_norm_reference import relative_error, ulp_distance, unfused_gated_norm
from tests.gated_norm_checks import (
    assert_bitwise_or_within_ulps,
    assert_no_less_accurate,
    float64_grads,
    gradients,
)
from tests.gated_norm_inputs import (DEVICE, EPS, make_inputs, packed_projection_gate, sbhd_view,
                                     sequence_slice)


LOW_PRECISION = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------- forward


# (x dtype, weight fp32): an fp32 x has an fp32 weight already, so w_fp32 is not a case of its own.
DTYPE_WEIGHT_CASES = [pytest.param(dtype, weight_fp32, id=f"{str(dtype)[6:]}-{weight}")
                      for dtype in (torch.bfloat16, torch.float16, torch.float32)
                      for weight_fp32, weight in ((False, "w_same"), (True, "w_fp32"))
                      if not (weight_fp32 and dtype == torch.float32)]


@pytest.mark.parametrize("dtype, weight_fp32", DTYPE_WEIGHT_CASES)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero_centered"])
@pytest.mark.parametrize("dim", [64, 96, 192])
def test_forward_matches_unfused(dtype, weight_fp32, zero_centered, dim):
    x, gate, weight = make_inputs((2, 5, 3, dim), dtype, torch.float32 if weight_fp32 else None)
    if zero_centered:
        weight = weight - 1
    out = fused_gated_norm(x, gate, weight, EPS, zero_centered)
    assert_bitwise_or_within_ulps(out, unfused_gated_norm(x, gate, weight, EPS, zero_centered))


@pytest.mark.parametrize("dim", [128, 256, 1000, 1024, 3000, 8192])  # up to MAX_HEAD_DIM
def test_head_dims_forward_and_backward(dim):
    x, gate, weight = make_inputs((1, 3, 2, dim), torch.bfloat16)
    dy = make_inputs(x.shape, torch.bfloat16, seed=4)[0]
    out = fused_gated_norm(x, gate, weight, EPS)
    assert_bitwise_or_within_ulps(out, unfused_gated_norm(x, gate, weight, EPS))
    assert_no_less_accurate(gradients(fused_gated_norm, x, gate, weight, dy),
                            gradients(unfused_gated_norm, x, gate, weight, dy),
                            float64_grads(x, gate, weight, dy, False))


def test_bf16_rounding_is_to_nearest_even_not_truncation():
    # Truncation (the Triton interpreter's own cast) and round-to-nearest-even give other bf16
    # values for many of these fp32 products (asserted below); the kernel must give RNE's.
    x, gate, weight = make_inputs((1, 64, 4, 64), torch.bfloat16, seed=3)
    out = fused_gated_norm(x, gate, weight, EPS)
    ref = unfused_gated_norm(x, gate, weight, EPS)
    truncated = (unfused_gated_norm(x.float(), gate.float(), weight.float(), EPS)
                 .view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert not torch.equal(ref, truncated)  # the check below can tell the two apart
    assert_bitwise_or_within_ulps(out, ref)


def test_nan_and_inf_propagate_like_the_reference():
    x, gate, weight = make_inputs((1, 4, 2, 64), torch.bfloat16)
    x[0, 0, 0, 3] = float("nan")
    x[0, 1, 1, 5] = float("inf")
    gate[0, 2, 0, 7] = float("-inf")
    gate[0, 3, 1, 9] = float("inf")
    out = fused_gated_norm(x, gate, weight, EPS)
    ref = unfused_gated_norm(x, gate, weight, EPS)
    assert torch.equal(out.isnan(), ref.isnan())
    assert_bitwise_or_within_ulps(out, ref)


def test_rows_get_the_same_bits_in_any_batch():
    """Batch invariance: a token's output, rstd, dx and dgate are the same bits alone as inside
    a batch many times larger (on the GPU: 8 tokens against 4096 tokens of 32 heads, 131k rows).
    The interpreter's bits do not depend on the block size, so on the CPU this checks the
    addressing of a token slice; that the launch parameters never depend on the row count is
    tests/fusions/test_gated_norm_compile.py::test_token_count_does_not_change_the_compile_key."""
    seq, heads = (4096, 32) if DEVICE == "cuda" else (64, 4)
    x, gate, weight = make_inputs((1, seq, heads, 128), torch.bfloat16)
    dy = make_inputs((1, seq, heads, 128), torch.bfloat16, seed=1)[0]
    big = forward_impl(x, gate, weight, EPS)
    small = forward_impl(x[:, :8], gate[:, :8], weight, EPS)
    for a, b in zip(small, big):
        assert torch.equal(a, b[:, :8])
    dx, dgate, _ = backward_impl(x, gate, weight, big[1], dy)
    dx8, dgate8, _ = backward_impl(x[:, :8], gate[:, :8], weight, small[1], dy[:, :8])
    assert torch.equal(dx8, dx[:, :8]) and torch.equal(dgate8, dgate[:, :8])


@pytest.mark.parametrize("shape", [(2, 3, 4, 1), (1, 1, 1, 1)])
def test_head_dim_one_with_any_last_dim_stride(shape):
    """A last dim of one element is read at offset 0 whatever its stride: the strides torch
    gives such tensors (a permuted view, the expanded gradient of ``sum()``, a stride-0 weight)
    are taken, forward and backward, as the unfused path takes them."""
    base = torch.randn(shape[-1], *shape[:-1], device=DEVICE, dtype=torch.bfloat16)
    x = base.permute(1, 2, 3, 0).requires_grad_()  # last-dim stride != 1, yet contiguous
    gate = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(1, device=DEVICE, dtype=torch.bfloat16).expand(1).requires_grad_()
    out = fused_gated_norm(x, gate, weight, EPS)
    ref = unfused_gated_norm(x, gate, weight, EPS)
    assert_bitwise_or_within_ulps(out, ref)
    out.float().sum().backward()  # dy: an expanded scalar, strides 0
    fused = (x.grad, gate.grad, weight.grad)
    for t in (x, gate, weight):
        t.grad = None
    unfused_gated_norm(x, gate, weight, EPS).float().sum().backward()
    for got, want in zip(fused, (x.grad, gate.grad, weight.grad)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------- backward


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("weight_fp32", [False, True], ids=["w_same", "w_fp32"])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero_centered"])
@pytest.mark.parametrize("dim", [64, 96])
def test_gradients_no_less_accurate_than_unfused(dtype, weight_fp32, zero_centered, dim):
    """With an fp32 weight the unfused norm output is fp32 (promote_types): its gradient and
    the y in dgate are not rounded to x's dtype, and the fused backward must not round them
    either (docs/numerics.md, Backward)."""
    x, gate, weight = make_inputs((2, 8, 4, dim), dtype, torch.float32 if weight_fp32 else None)
    dy = make_inputs(x.shape, dtype, seed=11)[0]
    assert_no_less_accurate(gradients(fused_gated_norm, x, gate, weight, dy, zero_centered),
                            gradients(unfused_gated_norm, x, gate, weight, dy, zero_centered),
                            float64_grads(x, gate, weight, dy, zero_centered))


@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero_centered"])
def test_fp32_gradients_close_to_float64(zero_centered):
    x, gate, weight = make_inputs((2, 6, 3, 96), torch.float32)
    dy = make_inputs(x.shape, torch.float32, seed=5)[0]
    fused = gradients(fused_gated_norm, x, gate, weight, dy, zero_centered)
    exact = float64_grads(x, gate, weight, dy, zero_centered)
    for name, f, e in zip(("dx", "dgate", "dweight"), fused, exact):
        assert relative_error(f, e) < 5e-6, name


def test_sigmoid_activation_forward_and_backward():
    x, gate, weight = make_inputs((2, 6, 2, 64), torch.bfloat16)
    dy = make_inputs(x.shape, torch.bfloat16, seed=3)[0]
    out = fused_gated_norm(x, gate, weight, EPS, gate_activation="sigmoid")
    assert_bitwise_or_within_ulps(out, unfused_gated_norm(x, gate, weight, EPS,
                                                          gate_activation="sigmoid"))
    # The backward's contract, as for silu: no less accurate than the unfused path (on the GPU
    # torch's sigmoid backward multiplies in another order, so bits may differ).
    assert_no_less_accurate(gradients(fused_gated_norm, x, gate, weight, dy, False, "sigmoid"),
                            gradients(unfused_gated_norm, x, gate, weight, dy, False, "sigmoid"),
                            float64_grads(x, gate, weight, dy, False, "sigmoid"))


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [2.0, 8])
def test_weight_grad_scale_multiplies_dw_exactly(weight_dtype, scale):
    """A power-of-two scale is applied before dW's one rounding: exactly ``scale`` times the
    unscaled dW, bit for bit; dx and dgate do not change."""
    x, gate, weight = make_inputs((2, 6, 3, 64), torch.bfloat16, weight_dtype)
    dy = make_inputs(x.shape, torch.bfloat16, seed=2)[0]

    def run(**kwargs):
        leaves = [t.detach().requires_grad_() for t in (x, gate, weight)]
        return torch.autograd.grad(fused_gated_norm(*leaves, EPS, **kwargs), leaves, dy)

    dx, dgate, dweight = run()
    dx_s, dgate_s, dweight_s = run(weight_grad_scale=scale)
    assert torch.equal(dx_s, dx) and torch.equal(dgate_s, dgate)
    assert dweight_s.dtype == weight_dtype
    assert torch.equal(dweight_s, dweight * scale)
    assert not torch.equal(dweight_s, dweight)


# ----------------------------------------------------------------------------------------- layouts


LAYOUTS = {
    "contiguous": lambda x, g: (x, g),
    "packed_gate": lambda x, g: (x, packed_projection_gate(x.shape, x.dtype)),
    "sbhd_x_and_gate": lambda x, g: (sbhd_view(x), sbhd_view(g)),
    "sbhd_x_packed_gate": lambda x, g: (sbhd_view(x), packed_projection_gate(x.shape, x.dtype)),
    "sequence_slices": lambda x, g: (sequence_slice(x), sequence_slice(g)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("out_layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_strided_layouts_forward_and_backward(layout, out_layout, dtype):
    x, gate, weight = make_inputs((2, 4, 3, 96), dtype)
    x, gate = LAYOUTS[layout](x, gate)
    dy = make_inputs(x.shape, dtype, seed=7)[0]
    # the grad of a transpose-contiguous, or (sequence slices) of a slice of a longer sequence
    dy = sequence_slice(dy) if layout == "sequence_slices" else sbhd_view(dy)
    leaves = [t.detach().requires_grad_() for t in (x, gate, weight)]
    out = fused_gated_norm(*leaves, EPS, out_layout=out_layout)
    grads = torch.autograd.grad(out, leaves, dy)

    ref_leaves = [t.detach().contiguous().requires_grad_() for t in (x, gate, weight)]
    ref = unfused_gated_norm(*ref_leaves, EPS)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.contiguous())
    assert_bitwise_or_within_ulps(out, ref)
    if out_layout == "sbhd":
        assert out.transpose(0, 1).is_contiguous()
    for got, want in zip(grads[:2], ref_grads[:2]):
        assert_bitwise_or_within_ulps(got, want)
    torch.testing.assert_close(grads[2].float(), ref_grads[2].float(), rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------------- views


# Every view of x, gate and dy the contract allows, each made from a source buffer of its own
# (B, S, H, D = 2, 4, 3, 96; D not a power of two: masked columns): name -> {tensor: (source
# shape, the [B, S, H, D] view of the source)}; a tensor not named is contiguous.
B, S, H, D = 2, 4, 3, 96
VIEWS = {
    "x_every_second_element": {"x": ((B, S, H, 2 * D), lambda t: t[..., ::2])},
    # permuted out of an sbhd buffer, then every second element
    "x_sbhd_every_second_element": {"x": ((S, B, H, 2 * D),
                                          lambda t: t.transpose(0, 1)[..., 1::2])},
    # the head dim outermost: a last-dim stride of B * S * H, heads adjacent
    "x_dim_outermost": {"x": ((D, B, S, H), lambda t: t.permute(1, 2, 3, 0))},
    "gate_every_second_element": {"gate": ((B, S, H, 2 * D), lambda t: t[..., 1::2])},
    "gate_heads_and_dim_swapped": {"gate": ((B, S, D, H), lambda t: t.transpose(2, 3))},
    "gate_of_one_head_over_heads": {"gate": ((B, S, 1, D), lambda t: t.expand(B, S, H, D))},
    "gate_broadcast": {"gate": ((D,), lambda t: t.expand(B, S, H, D))},
    "gate_one_value_per_row": {"gate": ((B, S, H, 1), lambda t: t.expand(B, S, H, D))},
    # the gradient of ``sum()``: one value, all strides 0
    "dy_expanded": {"dy": ((), lambda t: t.expand(B, S, H, D))},
    "dy_every_second_element": {"dy": ((B, S, H, 2 * D), lambda t: t[..., ::2])},
    "all_strided": {"x": ((S, B, H, 2 * D), lambda t: t.transpose(0, 1)[..., ::2]),
                    "gate": ((B, S, 1, D), lambda t: t.expand(B, S, H, D)),
                    "dy": ((B, S, H, 2 * D), lambda t: t[..., 1::2])},
}
CONTIGUOUS = ((B, S, H, D), lambda t: t)


def _view_sources(views: dict, dtype, gate_dtype=None) -> dict:
    """Random source buffers of the views (x ~ N(0, 1), gate ~ N(0, 4) as make_inputs)."""
    gen = torch.Generator().manual_seed(0)
    scales = {"x": 1.0, "gate": 2.0, "dy": 1.0}
    return {name: (scales[name] * torch.randn(views[name][0], generator=gen)).to(
        DEVICE, gate_dtype if name == "gate" and gate_dtype else dtype) for name in scales}


def _through_views(fn, views: dict, sources: dict, weight, cast=lambda t: t):
    """``fn`` (fused or unfused) on the views of (``cast`` of) the sources: its output and the
    gradients of the x source, the gate source and the weight for the view of dy."""
    leaves = [cast(sources[name]).detach().requires_grad_() for name in ("x", "gate")]
    leaves.append(cast(weight).detach().requires_grad_())
    x, gate = (views[name][1](t) for name, t in zip(("x", "gate"), leaves))
    dy = views["dy"][1](cast(sources["dy"]))
    out = fn(x, gate, leaves[2], EPS)
    return out, torch.autograd.grad(out, leaves, dy)


def _assert_views_match_unfused(views: dict, sources: dict, weight) -> tuple:
    """The output bitwise or within an ulp of the unfused one, the source gradients in its
    dtypes and no less accurate against float64; bf16 source gradients also bitwise or within an
    ulp (fp16 ones flip a rounding more often, and a sum over an expanded gate's copies may
    cancel: there the norm-wise accuracy rule is the contract). Returns the fused gradients."""
    fused_out, fused = _through_views(fused_gated_norm, views, sources, weight)
    unfused_out, unfused = _through_views(unfused_gated_norm, views, sources, weight)
    _, exact = _through_views(unfused_gated_norm, views, sources, weight, torch.Tensor.double)
    assert_bitwise_or_within_ulps(fused_out, unfused_out)
    names = ("x source", "gate source", "weight")
    assert [g.dtype for g in fused] == [g.dtype for g in unfused]
    assert_no_less_accurate(fused, unfused, exact, names)
    for got, want in zip(fused[:2], unfused[:2]):
        if got.dtype == torch.bfloat16:
            assert_bitwise_or_within_ulps(got, want)
    return fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", VIEWS)
def test_views_forward_and_gradients_to_the_source_buffers(case, dtype):
    """x, gate and dy with any four strides (a last-dim stride other than 1, zero strides, heads
    adjacent) are read in place: the output and the gradients that reach each source buffer
    (summed over an expanded gate's copies by autograd) are the unfused path's."""
    views = {"x": CONTIGUOUS, "gate": CONTIGUOUS, "dy": CONTIGUOUS} | VIEWS[case]
    sources = _view_sources(views, dtype)
    x, gate, dy = (views[name][1](sources[name]) for name in ("x", "gate", "dy"))
    assert not (x.is_contiguous() and gate.is_contiguous() and dy.is_contiguous())
    weight = make_inputs((1, D), dtype)[2]
    _assert_views_match_unfused(views, sources, weight)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("case", ["contiguous", "gate_every_second_element",
                                  "gate_of_one_head_over_heads", "all_strided"])
def test_fp32_gate_with_low_precision_x(case, dtype):
    """A gate in fp32 with a bf16 or fp16 x (megatron main's rule): the kernel reads it as it is
    (the result is not that of the gate rounded to x's dtype), and its gradient is fp32, as
    autograd's of the unfused ``y * act(gate.float())``."""
    views = {"x": CONTIGUOUS, "gate": CONTIGUOUS, "dy": CONTIGUOUS} | VIEWS.get(case, {})
    sources = _view_sources(views, dtype, gate_dtype=torch.float32)
    weight = make_inputs((1, D), dtype)[2]
    x, gate = (views[name][1](sources[name]) for name in ("x", "gate"))
    out = fused_gated_norm(x, gate, weight, EPS)
    assert out.dtype == dtype
    assert not torch.equal(out, unfused_gated_norm(x, gate.to(dtype), weight, EPS))
    dx_source, dgate_source, _ = _assert_views_match_unfused(views, sources, weight)
    assert dx_source.dtype == dtype and dgate_source.dtype == torch.float32


@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32], ids=["gate_bf16",
                                                                             "gate_fp32"])
def test_views_without_rows(gate_dtype):
    """Views with no rows (no tokens) launch nothing: an empty output, empty gradients of the
    sources in their own dtypes, a zero dW."""
    x_source = torch.randn(0, B, H, 2 * D, device=DEVICE, dtype=torch.bfloat16).requires_grad_()
    gate_source = torch.randn(B, 0, 1, D, device=DEVICE, dtype=gate_dtype).requires_grad_()
    weight = make_inputs((1, D), torch.bfloat16)[2].requires_grad_()
    x = x_source.transpose(0, 1)[..., ::2]
    out = fused_gated_norm(x, gate_source.expand(B, 0, H, D), weight, EPS)
    assert out.shape == (B, 0, H, D) and out.dtype == torch.bfloat16
    dy = torch.ones((), device=DEVICE, dtype=torch.bfloat16).expand(out.shape)
    dx, dgate, dweight = torch.autograd.grad(out, (x_source, gate_source, weight), dy)
    assert dx.shape == x_source.shape and dgate.shape == gate_source.shape
    assert dgate.dtype == gate_dtype
    assert torch.equal(dweight, torch.zeros_like(weight))


def test_the_gradient_of_sum_is_read_with_its_zero_strides(monkeypatch):
    """``out.sum().backward()`` hands the backward one value expanded over the output (all
    strides 0): the kernel reads it as it is, and the sources get the unfused path's
    gradients."""
    strides, launch = [], plans.launch_backward.launch
    monkeypatch.setattr(plans.launch_backward, "launch",
                        lambda grid, tensors, *rest: (strides.append(tensors[4].stride()),
                                                      launch(grid, tensors, *rest)))
    views = {"x": CONTIGUOUS, "dy": CONTIGUOUS} | VIEWS["all_strided"]
    sources = _view_sources(views, torch.bfloat16)
    weight = make_inputs((1, D), torch.bfloat16)[2]
    grads = []
    for fn in (fused_gated_norm, unfused_gated_norm):
        leaves = [sources[name].detach().requires_grad_() for name in ("x", "gate")]
        x, gate = (views[name][1](t) for name, t in zip(("x", "gate"), leaves))
        fn(x, gate, weight, EPS).sum().backward()
        grads.append([t.grad for t in leaves])
    assert strides == [(0, 0, 0, 0)]
    for got, want in zip(*grads):
        assert_bitwise_or_within_ulps(got, want)


# ------------------------------------------------------------------------------------- 64-bit rows


@triton.jit
def _row_offsets_kernel(rows_ptr, out_ptr, N, SEQUENCE, HEADS: tl.constexpr, STRIDE_B, STRIDE_S,
                        STRIDE_H, FLAT_TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    rows = tl.load(rows_ptr + i, mask=i < N, other=0)
    offsets = _row_offset(rows, SEQUENCE, HEADS, STRIDE_B, STRIDE_S, STRIDE_H, FLAT_TOKENS)
    tl.store(out_ptr + i, offsets, mask=i < N)


@pytest.mark.parametrize("flat_tokens", [True, False])
def test_row_offset_is_64_bit(flat_tokens):
    # A [B=3, S=2**20, H=32, D=128] tensor with sbhd strides: offsets reach ~1.3e10 > 2**33.
    batch, seq, heads, dim = 3, 2**20, 32, 128
    if flat_tokens:
        stride_s, stride_h = heads * dim, dim
        stride_b = seq * stride_s
    else:
        stride_b, stride_s, stride_h = heads * dim, batch * heads * dim, dim
    # Row indices are int32, as in the kernels (rows <= MAX_ROWS): the 64-bit products must
    # come from _row_offset itself.
    rows = torch.tensor([0, 1, heads, seq * heads - 1, seq * heads, batch * seq * heads - 1],
                        dtype=torch.int32)
    out = torch.empty(rows.shape, dtype=torch.int64)
    _row_offsets_kernel[(1,)](rows.to(DEVICE), out := out.to(DEVICE), rows.numel(), seq, heads,
                              stride_b, stride_s, stride_h, flat_tokens, 8)
    rows = rows.long()
    token, head = rows // heads, rows % heads
    expected = (token // seq) * stride_b + (token % seq) * stride_s + head * stride_h
    assert expected.max() > 2**33
    assert torch.equal(out.cpu(), expected)


@triton.jit
def _column_offsets_kernel(out_ptr, STRIDE_D, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    tl.store(out_ptr + cols, _column_offsets(cols, STRIDE_D).to(tl.int64))


@pytest.mark.parametrize("stride", [1, 0, 2, 2**20])
def test_column_offsets_are_64_bit_past_a_unit_stride(stride):
    """A row of 8192 elements (MAX_HEAD_DIM) 2**20 apart spans ~8.6e9 elements, past 2**31: a
    stride other than 1 gives 64-bit column offsets (1 gives the columns themselves)."""
    out = torch.empty(8192, dtype=torch.int64, device=DEVICE)
    _column_offsets_kernel[(1,)](out, stride, 8192)
    expected = torch.arange(8192, dtype=torch.int64) * stride
    assert stride != 2**20 or expected.max() > 2**32
    assert torch.equal(out.cpu(), expected)


# ------------------------------------------------------------------------------------ dense blocks


# (x / gate layout, out and dy layout, bt): blocks inside a token (bt divides the 4 heads) and
# across tokens (bt = 8). An sbhd view has no flat tokens, so at bt = 8 it is never dense: there
# the sbhd x and gate go with a bshd out and dy, which are.
DENSE_CASES = [(layout, "sbhd", bt) for layout in ("contiguous", "packed_gate", "sbhd_x_and_gate")
               for bt in (1, 2, 4)] + [("contiguous", "sbhd", 8), ("packed_gate", "sbhd", 8),
                                       ("sbhd_x_and_gate", "bshd", 8)]


@pytest.mark.parametrize("layout, out_layout, bt", DENSE_CASES,
                         ids=[f"{layout}-{out}-{bt}" for layout, out, bt in DENSE_CASES])
def test_dense_and_per_row_addressing_agree(layout, out_layout, bt, monkeypatch):
    """The dense path and the per-row 64-bit path compute the same bits (forward and backward).
    Each case has at least one operand the dense path addresses, so the two runs differ."""
    x, gate, weight = make_inputs((2, 5, 4, 64), torch.bfloat16)
    x, gate = LAYOUTS[layout](x, gate)
    dy = make_inputs(x.shape, torch.bfloat16, seed=4)[0]
    out_buffer = torch.empty(2, 5, 4, 64, dtype=x.dtype, device=x.device)
    if out_layout == "sbhd":
        dy, out_buffer = sbhd_view(dy), out_buffer.transpose(0, 1).contiguous().transpose(0, 1)
    operands = {"x": x, "gate": gate, "out": out_buffer, "dy": dy}
    dense_operands = [name for name, t in operands.items() if plans.layout(t, bt)[2]]
    assert dense_operands, "no operand takes the dense path: the case compares a path with itself"
    results = []
    for dense in (True, False):
        if not dense:
            monkeypatch.setattr(plans, "dense_blocks", lambda *args: False)
            monkeypatch.setattr(plans, "_launch_plans", {})  # plans made with dense blocks
            assert not any(plans.layout(t, bt)[2] for t in operands.values())
        out, rstd = forward_impl(x, gate, weight, EPS, bt=bt, out=out_buffer)
        grads = backward_impl(x, gate, weight, rstd, dy, bt=bt, programs=3)
        results.append((out.clone(), rstd, *grads))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------- launch shapes


@pytest.mark.parametrize("bt, programs", [(1, 1), (2, 3), (4, 5), (8, 64)])
def test_any_block_and_grid_size_gives_the_same_result(bt, programs):
    """Partial blocks, loop tails, idle programs and many dW partials give the same rows.

    Under the interpreter every launch sums a row in the same order, so out, rstd, dx and dgate
    are bit-identical and dW differs only by the order of its partial sums. On a GPU the order
    within a row follows the block's layout (BT, warps): rstd may then move by an fp32 ulp and
    an element by one output ulp, which is why the launch heuristics are fixed per head dim."""
    x, gate, weight = make_inputs((2, 7, 3, 96), torch.bfloat16)  # 42 rows: a tail for every bt
    x, gate = sbhd_view(x), packed_projection_gate(x.shape, x.dtype)
    dy = sbhd_view(make_inputs(x.shape, torch.bfloat16, seed=4)[0])
    ref_out, ref_rstd = forward_impl(x, gate, weight, EPS)
    out, rstd = forward_impl(x, gate, weight, EPS, bt=bt)
    ref_grads = backward_impl(x, gate, weight, ref_rstd, dy)
    grads = backward_impl(x, gate, weight, ref_rstd, dy, bt=bt, programs=programs)
    if DEVICE == "cpu":
        assert torch.equal(out, ref_out) and torch.equal(rstd, ref_rstd)
        assert torch.equal(grads[0], ref_grads[0]) and torch.equal(grads[1], ref_grads[1])
    else:
        torch.testing.assert_close(rstd, ref_rstd, rtol=2.5e-7, atol=0)
        for got, want in ((out, ref_out), (grads[0], ref_grads[0]), (grads[1], ref_grads[1])):
            assert ulp_distance(got, want).max().item() <= 1
    torch.testing.assert_close(grads[2].float(), ref_grads[2].float(), rtol=8e-3, atol=1e-3)


# ---------------------------------------------------------------------------------- dW partial sum


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_dw_partial_sum_is_exact_and_rounds_to_nearest_even(dtype, scale):
    """Integer-valued partials add exactly in fp32 in any order, and times 3 stay exact, so the
    result must equal the float64 sum times ``weight_grad_scale`` rounded once (RTNE) to the
    weight's dtype: 259 is a bf16 tie (258 | 260) that truncation would get wrong. With scale 3
    the scale must come before the one rounding: 259 -> 260 -> 780 is not round(777) = 776 in
    bf16, nor 2109 -> 2108 -> 6324 round(6327) = 6328 in fp16. 37 partials of a 12-wide row in
    8-column programs: neither fills a block."""
    gen = torch.Generator().manual_seed(0)
    partials = torch.randint(-40, 41, (37, 12), generator=gen).float()
    partials[:, 0] = 0.0
    partials[:7, 0] = 37.0  # 259
    partials[:, 1] = 57.0  # 2109: odd above 2048, between two fp16 values
    partials = partials.to(DEVICE)
    cfg = plans.backward_launch(12, partials.device)
    grid, prepared = plans.dw_sum_launch(  # backward_impl's second launch
        37, 12, dtype, cfg._replace(max_programs=64, dw_sum_columns=8), scale)
    got = partials.new_empty(12, dtype=dtype)
    plans.launch_dw_sum.launch(grid, (partials, got), prepared)
    want = (partials.double().sum(0) * scale).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    if scale != 1.0 and dtype != torch.float32:  # the case tells the two orders apart
        rounded_first = (partials.double().sum(0).to(dtype).double() * scale).to(dtype)
        assert not torch.equal(want, rounded_first)


# ------------------------------------------------------------------------------ launch arguments


def test_launch_arguments_follow_a_kernel_that_starts_with_its_pointers():
    """Each kernel's argument structure is its parameters after its pointers, named and ordered
    by the kernel's own signature; a kernel whose first parameters are not those pointers is
    refused (the direct launcher passes the tensors first, by position)."""
    fwd = kernels.gated_norm_fwd
    args = kernels.scalar_arguments("Args", fwd, ("x", "gate", "weight", "out", "rstd"))
    assert args._fields[0] == "ROWS" and len(args._fields) == len(fwd.arg_names) - 5
    with pytest.raises(TypeError, match=r"Args: the kernel's first parameters are \('x', 'gate', "
                                        r"'weight'\), not the pointers \('x', 'weight', 'gate'\)"):
        kernels.scalar_arguments("Args", fwd, ("x", "weight", "gate"))
