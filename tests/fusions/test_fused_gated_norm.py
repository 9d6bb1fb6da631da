"""The training kernels against the unfused Megatron path (CPU interpreter or GPU)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import core.fusions.fused_gated_norm as kernel_module
import core.fusions.gated_norm_validation as validation
from core.fusions import fused_gdn_gated_rms_norm
from core.fusions.fused_gated_norm import _row_offset, fused_gated_norm
import core.fusions.gated_norm_launch as launch_rules
from core.fusions.gated_norm_launch import forward_launch
from core.fusions.gated_norm_reference import relative_error, ulp_distance, unfused_gated_norm
from core.testing.h200 import h200_device_rules
from tests.gated_norm_checks import (
    RecordOps,
    assert_bitwise_or_within_ulps,
    assert_no_less_accurate,
    float64_grads,
    gradients,
)
from tests.gated_norm_inputs import (DEVICE, EPS, make_inputs, packed_projection_gate, sbhd_view,
                                     sequence_slice)

LOW_PRECISION = (torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------ forward


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


@pytest.mark.parametrize("mode", ["no_grad", "inputs_without_grad"])
def test_forward_without_autograd_stores_no_rstd(mode, monkeypatch):
    """Nothing to differentiate (inference, the no-grad first forward of a recompute): the
    forward stores no rstd and the output keeps its bits."""
    x, gate, weight = make_inputs((2, 5, 3, 64), torch.bfloat16)
    with_rstd = fused_gated_norm(*(t.detach().requires_grad_() for t in (x, gate, weight)), EPS)
    calls = []
    real = kernel_module._forward_into  # what the entry calls

    def spy(x, gate, weight, eps, zero_centered, out, activation, store_rstd, *rest):
        calls.append(store_rstd)
        return real(x, gate, weight, eps, zero_centered, out, activation, store_rstd, *rest)

    monkeypatch.setattr(kernel_module, "_forward_into", spy)
    if mode == "no_grad":
        with torch.no_grad():
            out = fused_gated_norm(*(t.detach().requires_grad_() for t in (x, gate, weight)), EPS)
    else:
        out = fused_gated_norm(x, gate, weight, EPS)
    assert calls == [False] and not out.requires_grad
    assert torch.equal(out, with_rstd.detach())
    assert kernel_module.forward_impl(x, gate, weight, EPS, store_rstd=False)[1] is None


@pytest.mark.parametrize("needs_grad", ["x", "gate", "weight"])
def test_one_input_requiring_grad_gets_its_gradient(needs_grad):
    """Any one of the three inputs requiring grad makes the call differentiable: the output
    requires grad and that input's gradient is the unfused path's (the others get none)."""
    inputs = dict(zip(("x", "gate", "weight"), make_inputs((2, 5, 3, 64), torch.bfloat16)))
    inputs[needs_grad].requires_grad_()
    out = fused_gated_norm(*inputs.values(), EPS)
    assert out.requires_grad
    dy = make_inputs(out.shape, torch.bfloat16, seed=3)[0]
    (got,) = torch.autograd.grad(out, inputs[needs_grad], dy)
    (want,) = torch.autograd.grad(unfused_gated_norm(*inputs.values(), EPS), inputs[needs_grad], dy)
    if needs_grad == "weight":
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    else:
        assert_bitwise_or_within_ulps(got, want)


# ------------------------------------------------------------------------------------ layouts


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


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_backward_takes_a_gradient_whose_last_dim_is_strided(dtype):
    """Autograd may hand the backward a gradient with a non-unit last stride (here every second
    element of a wider tensor); the kernel reads unit-stride rows, so backward_impl must copy it
    first, not read it as if it were dense."""
    x, gate, weight = make_inputs((2, 4, 3, 64), dtype)
    wide = make_inputs((2, 4, 3, 128), dtype, seed=7)[0]
    dy = wide[..., ::2]
    assert dy.stride(-1) == 2
    leaves = [t.detach().requires_grad_() for t in (x, gate, weight)]
    grads = torch.autograd.grad(fused_gated_norm(*leaves, EPS), leaves, dy)
    ref_leaves = [t.detach().requires_grad_() for t in (x, gate, weight)]
    ref_grads = torch.autograd.grad(unfused_gated_norm(*ref_leaves, EPS), ref_leaves,
                                    dy.contiguous())
    for got, want in zip(grads[:2], ref_grads[:2]):
        assert_bitwise_or_within_ulps(got, want)
    torch.testing.assert_close(grads[2].float(), ref_grads[2].float(), rtol=1e-2, atol=1e-2)


class _LaunchSpy:
    """Stands in for a Triton kernel: records the tensors a launch receives and runs the real
    kernel outside the op recorder (the interpreter copies to and from its own buffers)."""

    def __init__(self, kernel):
        self.kernel, self.tensor_args = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.tensor_args.append([a for a in args if isinstance(a, torch.Tensor)])
            with torch.utils._python_dispatch._disable_current_modes():
                return self.kernel[grid](*args, **kwargs)
        return launch


def test_no_input_is_copied(monkeypatch):
    module = kernel_module
    fwd_spy, bwd_spy = _LaunchSpy(module.gated_norm_fwd), _LaunchSpy(module.gated_norm_bwd)
    sum_spy = _LaunchSpy(module.gated_norm_dw_sum)
    for launcher, spy in ((module.launch_forward, fwd_spy), (module.launch_backward, bwd_spy),
                          (module.launch_dw_sum, sum_spy)):
        monkeypatch.setattr(launcher, "kernel", spy)
        monkeypatch.setattr(launcher, "compiled", {})  # no kernel kept from earlier tests
    x, gate, weight = make_inputs((2, 4, 3, 64), torch.bfloat16)
    x, gate = sbhd_view(x), packed_projection_gate(x.shape, x.dtype)
    leaves = [t.detach().requires_grad_() for t in (x, gate, weight)]
    dy = sbhd_view(make_inputs(x.shape, torch.bfloat16, seed=4)[0])
    with RecordOps() as rec:
        out = fused_gated_norm(*leaves, EPS, out_layout="sbhd")
        torch.autograd.grad(out, leaves, dy)

    # The kernels read the caller's tensors themselves, including the strided incoming grad.
    (fwd_args,), (bwd_args,) = fwd_spy.tensor_args, bwd_spy.tensor_args
    assert all(a is b for a, b in zip(fwd_args[:3], leaves))
    assert [a.data_ptr() for a in bwd_args[:3]] == [t.data_ptr() for t in leaves]
    assert bwd_args[4].data_ptr() == dy.data_ptr() and bwd_args[4].stride() == dy.stride()
    # No copy on the host side (the dW partial sum rounds to the weight dtype in its kernel).
    copies = [op for op in rec.ops if op.split(".")[-1] in ("copy_", "clone", "contiguous", "_to_copy")]
    assert copies == [], rec.ops


@pytest.mark.parametrize("out_layout", ["bshd", "sbhd"])
def test_output_takes_in_place_ops(out_layout):
    """The output may be modified in place before the backward, as megatron's residual add and
    in-place dropout do: for "sbhd" also through ``.transpose(0, 1).contiguous()``, which returns
    a view of the very buffer the kernel wrote. Output and gradients equal those of the same ops
    on a copy (the dropout is in place on both sides: on CUDA the out-of-place dropout draws
    its mask another way)."""
    x, gate, weight = make_inputs((2, 3, 2, 64), torch.bfloat16)
    residual = make_inputs((3, 2, 2, 64), torch.bfloat16, seed=1)[0]
    dy = make_inputs((3, 2, 2, 64), torch.bfloat16, seed=2)[0]

    def run(in_place):
        leaves = [t.detach().requires_grad_() for t in (x, gate, weight)]
        sbhd = fused_gated_norm(*leaves, EPS, out_layout=out_layout).transpose(0, 1).contiguous()
        torch.manual_seed(0)
        if in_place:
            out = F.dropout(sbhd.add_(residual), 0.5, training=True, inplace=True)
        else:
            out = F.dropout(sbhd + residual, 0.5, training=True, inplace=True)
        return (out, *torch.autograd.grad(out, leaves, dy))

    for name, a, b in zip(("out", "dx", "dgate", "dweight"), run(True), run(False)):
        assert torch.equal(a, b), name


class _KernelRecorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the arguments
    by kernel parameter and runs nothing."""

    def __init__(self, kernel):
        self.names, self.launches = kernel.arg_names, []

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            assert len(args) == len(self.names), "every kernel parameter is passed, defaults included"
            self.launches.append(dict(zip(self.names, args)))
        return record


def _record_forward_launches(monkeypatch) -> list:
    """The forward's launcher records each launch instead of launching (prepared or not, every
    launch reaches the kernel: no compiled kernel is kept)."""
    recorder = _KernelRecorder(kernel_module.gated_norm_fwd)
    monkeypatch.setattr(kernel_module.launch_forward, "kernel", recorder)
    monkeypatch.setattr(kernel_module.launch_forward, "compiled", {})
    return recorder.launches


def test_forward_launch_arguments_follow_the_kernel_signature(monkeypatch):
    """Both entries build gated_norm_fwd's arguments in one place (launch_gated_norm_fwd); each
    value must land on the kernel parameter of its name. Fails if the kernel's signature or the
    builder's order drifts."""
    launches = _record_forward_launches(monkeypatch)
    x, gate, weight = make_inputs((2, 5, 3, 64), torch.bfloat16)
    gate = packed_projection_gate(x.shape, x.dtype)  # token stride 3 * 3 * 64
    out = torch.empty(5, 2, 3, 64, dtype=x.dtype, device=x.device).transpose(0, 1)  # sbhd
    _, rstd = kernel_module.forward_impl(x, gate, weight, 0.25, True, bt=2, out=out,
                                         activation="sigmoid")
    # inference: [tokens, H * D] rows, z the middle third of a packed [7, 3 * 128] projection
    x2 = make_inputs((7, 128), x.dtype)[0]
    z2 = packed_projection_gate((1, 7, 2, 64), x.dtype)[0].flatten(-2)
    out2 = torch.empty_like(x2)
    with torch.no_grad():
        fused_gdn_gated_rms_norm(x2, z2, weight, out2, 0.5, 2, 64, False, "sigmoid")
    train, infer = launches
    tensors = ("x", "gate", "weight", "out", "rstd")
    for got, want in ((train, (x, gate, weight, out, rstd)), (infer, (x2, z2, weight, out2, None))):
        assert all(got.pop(name) is t for name, t in zip(tensors, want))
    # (batch, sequence, head) strides; flat tokens (batch stride = S x token stride, never read
    # by the kernel) pass 0 for the batch: x and the packed gate are flat, the sbhd out is not.
    assert x.stride(0) == 5 * x.stride(1) and gate.stride(0) == 5 * gate.stride(1)
    assert out.stride(0) != 5 * out.stride(1)
    assert train == dict(
        ROWS=30, HEADS=3, D=64, SEQUENCE=5,
        X_STRIDES=(0, *x.stride()[1:3]), GATE_STRIDES=(0, *gate.stride()[1:3]),
        OUT_STRIDES=out.stride()[:3],
        X_FLAT_TOKENS=True, GATE_FLAT_TOKENS=True, OUT_FLAT_TOKENS=False,
        X_DENSE=True, GATE_DENSE=False, OUT_DENSE=False,
        EPS=0.25, ZERO_CENTERED=True, BT=2, BLOCK_D=64, NORM_DTYPE=tl.bfloat16,
        ACTIVATION="sigmoid", NORM_BEFORE_GATE=True, STORE_RSTD=True,
        PDL=forward_launch(64, x.device).pdl,  # on an sm_90+ GPU; never under the interpreter
    )
    assert z2.stride(0) != 128  # the packed projection's token stride
    assert infer == dict(  # one sequence of 7 tokens, heads D = 64 apart within a row
        ROWS=14, HEADS=2, D=64, SEQUENCE=7,
        X_STRIDES=(0, x2.stride(0), 64), GATE_STRIDES=(0, z2.stride(0), 64),
        OUT_STRIDES=(0, out2.stride(0), 64),
        X_FLAT_TOKENS=True, GATE_FLAT_TOKENS=True, OUT_FLAT_TOKENS=True,
        X_DENSE=True, GATE_DENSE=False, OUT_DENSE=True,
        EPS=0.5, ZERO_CENTERED=False, BT=forward_launch(64, x.device).bt, BLOCK_D=64,
        NORM_DTYPE=tl.float32, ACTIVATION="sigmoid", NORM_BEFORE_GATE=False, STORE_RSTD=False,
        PDL=forward_launch(64, x.device).pdl,
    )


def test_every_kernel_launch_asks_for_fp_contraction(monkeypatch):
    """The kernels' bits are validated with FP contraction (FMA) on: each launch of the three
    kernels, from training and from the inference entry, asks for it, so neither
    TRITON_DEFAULT_FP_FUSION=0 nor a Triton whose default is off compiles them another way."""
    options = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: options.append(kwargs)

    launchers = (kernel_module.launch_forward, kernel_module.launch_backward,
                 kernel_module.launch_dw_sum)
    for launcher in launchers:
        monkeypatch.setattr(launcher, "kernel", Recorder())
        monkeypatch.setattr(launcher, "compiled", {})  # every launch reaches the recorder
    x, gate, weight = make_inputs((2, 5, 3, 64), torch.bfloat16)
    _, rstd = kernel_module.forward_impl(x, gate, weight, EPS)
    kernel_module.backward_impl(x, gate, weight, rstd, torch.ones_like(x))
    with torch.no_grad():
        x2 = x.flatten(0, 1).flatten(-2)
        fused_gdn_gated_rms_norm(x2, x2, weight, torch.empty_like(x2), EPS, 3, 64)
    assert len(options) == 4
    assert all(kwargs["enable_fp_fusion"] is True for kwargs in options), options


# ------------------------------------------------------------------------------------ backward


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
    for name, f, e in zip(("dx", "dgate", "dweight"), fused, float64_grads(x, gate, weight, dy, zero_centered)):
        assert relative_error(f, e) < 5e-6, name


def test_sigmoid_activation_forward_and_backward():
    x, gate, weight = make_inputs((2, 6, 2, 64), torch.bfloat16)
    dy = make_inputs(x.shape, torch.bfloat16, seed=3)[0]
    out = fused_gated_norm(x, gate, weight, EPS, activation="sigmoid")
    assert_bitwise_or_within_ulps(out, unfused_gated_norm(x, gate, weight, EPS, activation="sigmoid"))
    # The backward's contract, as for silu: no less accurate than the unfused path (on the GPU
    # torch's sigmoid backward multiplies in another order, so bits may differ).
    assert_no_less_accurate(gradients(fused_gated_norm, x, gate, weight, dy, activation="sigmoid"),
                            gradients(unfused_gated_norm, x, gate, weight, dy, activation="sigmoid"),
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


def test_integer_eps_reaches_the_kernel_as_a_float(monkeypatch):
    # An int would be another kernel argument type (and 1 a specialised value): one more compile.
    seen, forward_into = [], kernel_module._forward_into  # what the entry calls
    monkeypatch.setattr(kernel_module, "_forward_into",
                        lambda x, gate, weight, eps, *args:
                        seen.append(eps) or forward_into(x, gate, weight, eps, *args))
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    assert torch.equal(fused_gated_norm(x, gate, weight, 1), fused_gated_norm(x, gate, weight, 1.0))
    assert [type(eps) for eps in seen] == [float, float]


def test_integer_eps_and_scale_reach_the_impls_kernels_as_floats():
    """forward_impl and backward_impl take an int eps / weight_grad_scale as the float it
    equals, also one past Triton's 64-bit integer binding, with no error after a launch."""
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    big = 2**64
    out, rstd = kernel_module.forward_impl(x, gate, weight, big)
    want_out, want_rstd = kernel_module.forward_impl(x, gate, weight, float(big))
    assert torch.equal(out, want_out) and torch.equal(rstd, want_rstd)
    got = kernel_module.backward_impl(x, gate, weight, rstd, x, weight_grad_scale=big)
    want = kernel_module.backward_impl(x, gate, weight, rstd, x, weight_grad_scale=float(big))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_double_backward_raises():
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    x.requires_grad_()
    out = fused_gated_norm(x, gate, weight, EPS)
    dy = make_inputs(out.shape, out.dtype, seed=1)[0].requires_grad_()
    (dx,) = torch.autograd.grad(out, x, dy, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dx.sum().backward()


# ------------------------------------------------------------------------------------ empty input


@pytest.mark.parametrize("shape", [(0, 4, 2, 64), (2, 0, 2, 64), (1, 3, 0, 64), (2, 3, 2, 0)])
def test_empty_input(shape):
    x, gate, weight = make_inputs(shape, torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (x, gate, weight)]
    out = fused_gated_norm(*leaves, EPS)
    assert out.shape == shape
    dx, dgate, dweight = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert dx.shape == shape and dgate.shape == shape
    assert torch.equal(dweight, torch.zeros_like(weight))


def test_rows_get_the_same_bits_in_any_batch():
    """Batch invariance: a token's output, rstd, dx and dgate are the same bits alone as inside
    a batch many times larger (on the GPU: 8 tokens against 4096 tokens of 32 heads, 131k rows).
    The interpreter's bits do not depend on the block size, so on the CPU this checks the
    addressing of a token slice; that the launch parameters never depend on the row count is
    tests/fusions/test_fused_gated_norm_compile.py::test_token_count_does_not_change_the_compile_key."""
    seq, heads = (4096, 32) if DEVICE == "cuda" else (64, 4)
    x, gate, weight = make_inputs((1, seq, heads, 128), torch.bfloat16)
    dy = make_inputs((1, seq, heads, 128), torch.bfloat16, seed=1)[0]
    big = kernel_module.forward_impl(x, gate, weight, EPS)
    small = kernel_module.forward_impl(x[:, :8], gate[:, :8], weight, EPS)
    for a, b in zip(small, big):
        assert torch.equal(a, b[:, :8])
    dx, dgate, _ = kernel_module.backward_impl(x, gate, weight, big[1], dy)
    dx8, dgate8, _ = kernel_module.backward_impl(x[:, :8], gate[:, :8], weight, small[1], dy[:, :8])
    assert torch.equal(dx8, dx[:, :8]) and torch.equal(dgate8, dgate[:, :8])


# ------------------------------------------------------------------------------------ bad input


def _bad_inputs():
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.bfloat16)
    strided = make_inputs((1, 2, 2, 128), torch.bfloat16, seed=1)[0][..., ::2]
    meta = torch.empty(1, 2, 2, 64, dtype=torch.bfloat16, device="meta")
    return {
        "rank": ((x[0], gate[0], weight, EPS), ValueError, "x must have rank 4"),
        "gate_shape": ((x, gate[:, :1], weight, EPS), ValueError, "gate must have x's shape"),
        "gate_dtype": ((x, gate.half(), weight, EPS), TypeError, "gate dtype must equal x's dtype"),
        "x_dtype": ((x.double(), gate.double(), weight.double(), EPS), TypeError, "x dtype must be"),
        "int_dtype": ((x.int(), gate.int(), weight, EPS), TypeError, "x dtype must be"),
        "weight_dtype": ((x, gate, weight.half(), EPS), TypeError, "weight dtype must be fp32 or x's dtype"),
        "weight_shape": ((x, gate, weight[:32], EPS), ValueError, r"weight must have shape \(64,\)"),
        "weight_2d": ((x, gate, weight.view(1, 64), EPS), ValueError, "weight must have shape"),
        "x_last_stride": ((strided, gate, weight, EPS), ValueError, "x must have last-dim stride 1"),
        "gate_last_stride": ((x, strided, weight, EPS), ValueError, "gate must have last-dim stride 1"),
        "device": ((x, gate, weight.to("meta"), EPS), ValueError, "x, gate and weight must be on one device"),
        "device_x": ((meta, gate, weight, EPS), ValueError, "must be on one device"),
        # The interpreter takes CPU tensors, a GPU build CUDA tensors: meta is neither.
        "device_all_meta": ((meta, meta, weight.to("meta"), EPS), ValueError,
                            "x must be a (CPU|CUDA) tensor .*TRITON_INTERPRET=1.*got device meta"),
        "head_dim": ((*make_inputs((1, 1, 1, 8200), torch.bfloat16), EPS), ValueError,
                     "head dim .* must be <= 8192"),
        # Expanded (memoryless) views with 2**31 rows: row indices are 32-bit in the kernels.
        "rows": ((*(x[:1, :1, :1, :1].expand(2**16, 2**11, 16, 1) for _ in range(2)), weight[:1], EPS),
                 ValueError, r"batch \* sequence \* heads must be <= 2147418112"),
        "eps_zero": ((x, gate, weight, 0.0), ValueError, "eps must be finite and > 0"),
        "eps_negative": ((x, gate, weight, -1e-6), ValueError, "eps must be finite and > 0"),
        "eps_nan": ((x, gate, weight, math.nan), ValueError, "eps must be finite and > 0"),
        "eps_inf": ((x, gate, weight, math.inf), ValueError, "eps must be finite and > 0"),
        # The kernels take eps as fp32: beyond its range it would be inf, or 0 / flushed to 0.
        "eps_fp32_overflow": ((x, gate, weight, 1e39), ValueError, "eps must be finite and > 0"),
        "eps_huge_int": ((x, gate, weight, 10**400), ValueError, "eps must be finite and > 0"),
        "eps_fp32_subnormal": ((x, gate, weight, 1e-40), ValueError, "eps must be finite and > 0"),
        "eps_tensor": ((x, gate, weight, torch.tensor(1e-6)), TypeError, "eps must be a Python float or int"),
        "eps_str": ((x, gate, weight, "1e-6"), TypeError, "eps must be a Python float or int"),
        "not_tensor": ((x.tolist(), gate, weight, EPS), TypeError, "x must be a torch.Tensor"),
        # A real view of a complex conjugate (z.conj().imag) holds its values negated in memory.
        "gate_negative_view": ((x, torch._neg_view(gate), weight, EPS), ValueError,
                               r"gate is a negative view .*gate.resolve_neg\(\)"),
        "weight_negative_view": ((x, gate, torch._neg_view(weight), EPS), ValueError,
                                 "weight is a negative view"),
        "sparse_gate": ((x, gate.to_sparse(), weight, EPS), TypeError,
                        "gate must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"),
        "sparse_weight": ((x, gate, weight.to_sparse(), EPS), TypeError,
                          "weight must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"),
        # zero_centered selects a compiled variant: only a bool, never a truth value.
        **{f"zero_centered_{name}": ((x, gate, weight, EPS, value), TypeError,
                                     "zero_centered must be a bool")
           for name, value in (("str", "False"), ("none", None), ("half", 0.5), ("int", 1))},
        **{f"weight_grad_scale_{name}": ((x, gate, weight, EPS, False, {"weight_grad_scale": value}),
                                         error, "weight_grad_scale must be")
           for name, value, error in (("zero", 0.0, ValueError), ("negative", -2.0, ValueError),
                                      ("nan", math.nan, ValueError), ("inf", math.inf, ValueError),
                                      ("fp32_overflow", 1e39, ValueError),
                                      ("str", "2", TypeError), ("bool", True, TypeError),
                                      ("tensor", torch.tensor(2.0), TypeError))},
    }


class KernelLaunched(AssertionError):
    pass


@pytest.fixture
def no_launches(monkeypatch):
    """Every kernel launch of the module raises KernelLaunched: what the entry launches
    through (the launchers' ``launch``), whichever path leads there."""
    def no_launch(*args, **kwargs):
        raise KernelLaunched("a kernel was launched")

    for launcher in (kernel_module.launch_forward, kernel_module.launch_backward):
        monkeypatch.setattr(launcher, "launch", no_launch)


def test_no_launches_stops_a_good_call(no_launches):
    """The spy below is on the path fused_gated_norm takes: good inputs reach it."""
    with pytest.raises(KernelLaunched):
        fused_gated_norm(*make_inputs((1, 2, 2, 64), torch.bfloat16), EPS)


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_input_raises_before_launch(case, no_launches):
    args, error, message = _bad_inputs()[case]
    kwargs = args[-1] if isinstance(args[-1], dict) else {}
    with pytest.raises(error, match=message):
        fused_gated_norm(*args[:len(args) - bool(kwargs)], **kwargs)


@pytest.mark.parametrize("value", ["False", None, 0.5, 0])
def test_impls_take_only_a_bool_zero_centered(value):
    """zero_centered is a constexpr of both kernels: forward_impl and backward_impl refuse
    anything but a bool too (a truth value would pick a kernel silently)."""
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    rstd = torch.ones(x.shape[:3], device=x.device)
    with pytest.raises(TypeError, match="forward_impl: zero_centered must be a bool"):
        kernel_module.forward_impl(x, gate, weight, EPS, value)
    with pytest.raises(TypeError, match="backward_impl: zero_centered must be a bool"):
        kernel_module.backward_impl(x, gate, weight, rstd, x, value)


def test_cpu_tensors_need_the_interpreter(monkeypatch, no_launches):
    """Compiled Triton kernels read device memory: CPU tensors are refused before any launch
    (Triton itself would fail inside its launcher, or read host addresses on a cached launch)."""
    monkeypatch.setattr(validation, "INTERPRETED", False)
    x, gate, weight = (t.cpu() for t in make_inputs((1, 2, 2, 64), torch.bfloat16))
    with pytest.raises(ValueError, match="x must be a CUDA tensor .*TRITON_INTERPRET=1.*got device cpu"):
        fused_gated_norm(x, gate, weight, EPS)


@pytest.mark.parametrize("no_device", [RuntimeError("no driver"),
                                       AssertionError("Torch not compiled with CUDA enabled")],
                         ids=["no_driver", "torch_without_cuda"])
def test_impls_take_cpu_tensors_only_under_the_interpreter(no_device, monkeypatch):
    """forward_impl and backward_impl name the device rule too, also where no CUDA device can
    be asked which one is current (no driver, a torch built without CUDA)."""

    def current_device():
        raise no_device

    monkeypatch.setattr(validation, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    monkeypatch.setattr(kernel_module, "_launch_plans", {})
    x, gate, weight = (t.cpu() for t in make_inputs((1, 2, 2, 64), torch.bfloat16))
    rstd = torch.ones(x.shape[:3])
    rule = "x must be a CUDA tensor .*TRITON_INTERPRET=1.*got device cpu"
    with pytest.raises(ValueError, match="forward_impl: " + rule):
        kernel_module.forward_impl(x, gate, weight, EPS)
    with pytest.raises(ValueError, match="backward_impl: " + rule):
        kernel_module.backward_impl(x, gate, weight, rstd, x)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"out_layout": "hbsd"}, ValueError, "out_layout must be one of"),
    ({"out_layout": None}, TypeError, "out_layout must be a str, got NoneType"),
    ({"out_layout": 1}, TypeError, "out_layout must be a str, got int"),
    ({"activation": "gelu"}, ValueError, "activation must be one of"),
    ({"activation": ["silu"]}, TypeError, "activation must be a str, got list"),
])
def test_bad_options_raise(kwargs, error, message):
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.bfloat16)
    with pytest.raises(error, match=message):
        fused_gated_norm(x, gate, weight, EPS, **kwargs)


@pytest.mark.parametrize("activation, error", [("gelu", ValueError), (["silu"], TypeError)])
def test_impls_take_only_a_kernel_activation(activation, error):
    """The kernels select the activation by name and have no other: forward_impl and
    backward_impl refuse another name before any launch (it would run as silu)."""
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    rstd = torch.ones(x.shape[:3], device=x.device)
    with pytest.raises(error, match="forward_impl: activation must be"):
        kernel_module.forward_impl(x, gate, weight, EPS, activation=activation)
    with pytest.raises(error, match="backward_impl: activation must be"):
        kernel_module.backward_impl(x, gate, weight, rstd, x, activation=activation)


def test_impls_check_eps_and_the_weight_grad_scale():
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    rstd = torch.ones(x.shape[:3], device=x.device)
    with pytest.raises(ValueError, match="forward_impl: eps must be finite and > 0"):
        kernel_module.forward_impl(x, gate, weight, 1e39)
    with pytest.raises(ValueError, match="backward_impl: weight_grad_scale must be finite"):
        kernel_module.backward_impl(x, gate, weight, rstd, x, weight_grad_scale=1e39)


def _impl_calls():
    """(call, exception, message) of forward_impl / backward_impl with one bad argument each;
    every call follows good ones with the same launch options, and with values a dict key
    cannot tell from the bad ones (1 == True), so the checks cannot hide behind a kept launch
    plan."""
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    rstd = kernel_module.forward_impl(x, gate, weight, EPS)[1]
    fwd, bwd = kernel_module.forward_impl, kernel_module.backward_impl
    fwd(x, gate, weight, 1)
    fwd(x, gate, weight, EPS, bt=1)
    bwd(x, gate, weight, rstd, x)
    bwd(x, gate, weight, rstd, x, weight_grad_scale=1)
    bwd(x, gate, weight, rstd, x, programs=1)
    # x and an out that shares half of its bytes, after a good out of the same signature
    storage = torch.cat([x.flatten(), x.flatten()])
    x_in, shifted_out = storage[:x.numel()].view(x.shape), storage[128:128 + x.numel()].view(x.shape)
    fwd(x_in, gate, weight, EPS, out=torch.empty_like(x))
    weight_in_out = torch.empty_like(x)
    meta = {name: t.to("meta") for name, t in (("x", x), ("weight", weight), ("rstd", rstd))}
    # The dW sum loads all partials of its columns as one tile: where it takes many columns per
    # program (the interpreter: all 64), that bounds the programs below MAX_PROGRAMS.
    most_programs = validation.MAX_TILE_ELEMENTS // launch_rules.backward_launch(
        64, x.device).dw_sum_columns
    device_dependent = {}
    if most_programs < validation.MAX_PROGRAMS:
        device_dependent["programs_tile"] = (
            lambda: bwd(x, gate, weight, rstd, x, programs=most_programs + 1), ValueError,
            rf"backward_impl: programs must be <= {most_programs} here: programs x "
            r"\d+ \(the dW sum's columns per program\)")
    # griddepcontrol is sm_90+ PTX: neither the interpreter nor an older GPU takes it
    if not launch_rules.supports_programmatic_dependent_launch(x.device):
        device_dependent["pdl_true"] = (
            lambda: fwd(x, gate, weight, EPS, pdl=True), ValueError,
            "forward_impl: pdl=True needs programmatic dependent launch")
        device_dependent["dw_sum_pdl_true"] = (
            lambda: bwd(x, gate, weight, rstd, x, dw_sum_pdl=True), ValueError,
            "backward_impl: dw_sum_pdl=True needs programmatic dependent launch")
    return device_dependent | {
        "out_partly_x": (lambda: fwd(x_in, gate, weight, EPS, out=shifted_out), ValueError,
                         "forward_impl: out must either be x itself .* partially overlaps x"),
        "out_partly_gate": (lambda: fwd(x, x_in, weight, EPS, out=shifted_out), ValueError,
                            "forward_impl: out must either be gate itself .* partially overlaps gate"),
        "out_rows_overlap": (lambda: fwd(x, gate, weight, EPS, out=torch.empty_like(x)[:, :, :1]
                                         .expand(x.shape)), ValueError,
                             "forward_impl: out rows must not overlap each other"),
        "out_over_weight": (lambda: fwd(x, gate, weight_in_out[0, 0, 0], EPS, out=weight_in_out),
                            ValueError, "forward_impl: out must not overlap weight"),
        "eps_bool": (lambda: fwd(x, gate, weight, True), TypeError,
                     "forward_impl: eps must be a Python float or int, got bool"),
        "bt_bool": (lambda: fwd(x, gate, weight, EPS, bt=True), TypeError,
                    "forward_impl: bt must be None or an int, got bool"),
        "gate_none": (lambda: fwd(x, None, weight, EPS), TypeError,
                      "forward_impl: gate must be a torch.Tensor, got NoneType"),
        "x_list": (lambda: fwd(x.tolist(), gate, weight, EPS), TypeError,
                   "forward_impl: x must be a torch.Tensor, got list"),
        "gate_device": (lambda: fwd(x, meta["x"], weight, EPS), ValueError,
                        "forward_impl: x, gate, out and weight must be on one device"),
        "out_device": (lambda: fwd(x, gate, weight, EPS, out=meta["x"]), ValueError,
                       "forward_impl: x, gate, out and weight must be on one device"),
        "weight_device": (lambda: fwd(x, gate, meta["weight"], EPS), ValueError,
                          "forward_impl: x, gate, out and weight must be on one device"),
        "empty_gate_none": (lambda: fwd(x[:, :0], None, weight, EPS), TypeError,
                            "forward_impl: gate must be a torch.Tensor"),
        "weight_grad_scale_bool": (lambda: bwd(x, gate, weight, rstd, x, weight_grad_scale=True),
                                   TypeError, "backward_impl: weight_grad_scale must be a Python "
                                              "float or int, got bool"),
        "programs_bool": (lambda: bwd(x, gate, weight, rstd, x, programs=True), TypeError,
                          "backward_impl: programs must be None or an int, got bool"),
        "dy_none": (lambda: bwd(x, gate, weight, rstd, None), TypeError,
                    "backward_impl: dy must be a torch.Tensor, got NoneType"),
        "rstd_none": (lambda: bwd(x, gate, weight, None, x), TypeError,
                      "backward_impl: rstd must be a torch.Tensor, got NoneType"),
        "dy_device": (lambda: bwd(x, gate, weight, rstd, meta["x"]), ValueError,
                      "backward_impl: x, gate, dy and weight must be on one device"),
        "rstd_device": (lambda: bwd(x, gate, weight, meta["rstd"], x), ValueError,
                        r"backward_impl: rstd must be a contiguous tensor of shape \(1, 2, 2\) on"),
        "empty_dy_none": (lambda: bwd(x[:, :0], gate[:, :0], weight, rstd[:, :0], None),
                          TypeError, "backward_impl: dy must be a torch.Tensor"),
        "gate_negative_view": (lambda: fwd(x, torch._neg_view(gate), weight, EPS), ValueError,
                               "forward_impl: gate is a negative view"),
        "rstd_negative_view": (lambda: bwd(x, gate, weight, torch._neg_view(rstd), x), ValueError,
                               "backward_impl: rstd is a negative view"),
        "dy_negative_view": (lambda: bwd(x, gate, weight, rstd, torch._neg_view(x)), ValueError,
                             "backward_impl: dy is a negative view"),
        "dy_0dim": (lambda: bwd(x, gate, weight, rstd, x.new_ones(())), ValueError,
                    "backward_impl: dy must have x's shape"),
        "empty_rstd_dtype": (lambda: bwd(x[:, :0], gate[:, :0], weight, rstd[:, :0].double(), x[:, :0]),
                             TypeError, "backward_impl: rstd dtype must be fp32"),
        "empty_eps": (lambda: fwd(x[:, :0], gate[:, :0], weight, 0.0), ValueError,
                      "forward_impl: eps must be finite and > 0"),
        "gate_shape": (lambda: fwd(x, gate[:, :1], weight, EPS), ValueError,
                       "forward_impl: gate must have x's shape"),
        "out_shape": (lambda: fwd(x, gate, weight, EPS, out=x[:, :1].clone()), ValueError,
                      "forward_impl: out must have x's shape"),
        "out_dtype": (lambda: fwd(x, gate, weight, EPS, out=x.half()), TypeError,
                      "forward_impl: out dtype must equal x's dtype"),
        "weight_shape": (lambda: fwd(x, gate, weight[:32], EPS), ValueError,
                         r"forward_impl: weight must have shape \(64,\)"),
        "bt": (lambda: fwd(x, gate, weight, EPS, bt=3), ValueError,
               "forward_impl: bt must be a power of two <= 65536, got 3"),
        "warps_64": (lambda: fwd(x, gate, weight, EPS, warps=64), ValueError,
                     "forward_impl: warps must be a power of two <= 32, got 64"),
        # The backward's int32 loop bound, cdiv(rows, bt), holds for blocks of up to 2**16 rows.
        "bt_2_17": (lambda: bwd(x, gate, weight, rstd, x, bt=2**17), ValueError,
                    "backward_impl: bt must be a power of two <= 65536, got 131072"),
        "warps": (lambda: fwd(x, gate, weight, EPS, warps="4"), TypeError,
                  "forward_impl: warps must be None or an int"),
        "pdl": (lambda: fwd(x, gate, weight, EPS, pdl="yes"), TypeError,
                "forward_impl: pdl must be a bool"),
        "dy_shape": (lambda: bwd(x, gate, weight, rstd, x[:, :1]), ValueError,
                     "backward_impl: dy must have x's shape"),
        "rstd_dtype": (lambda: bwd(x, gate, weight, rstd.double(), x), TypeError,
                       "backward_impl: rstd dtype must be fp32"),
        "rstd_shape": (lambda: bwd(x, gate, weight, rstd[:, :1], x), ValueError,
                       r"backward_impl: rstd must be a contiguous tensor of shape \(1, 2, 2\)"),
        "rstd_strided": (lambda: bwd(x, gate, weight, rstd.transpose(1, 2).contiguous().transpose(1, 2),
                                     x), ValueError, "backward_impl: rstd must be a contiguous"),
        "programs": (lambda: bwd(x, gate, weight, rstd, x, programs=0), ValueError,
                     "backward_impl: programs must be between 1 and 65536, got 0"),
        # past 2**16 programs the backward's int32 block index could pass 2**31
        "programs_2_16_plus_1": (lambda: bwd(x, gate, weight, rstd, x, programs=2**16 + 1),
                                 ValueError, "backward_impl: programs must be between 1 and 65536"),
        # Triton's largest tile (2**20 elements) holds 16384 rows of 64
        "bt_tile": (lambda: fwd(x, gate, weight, EPS, bt=2**15), ValueError,
                    r"forward_impl: bt must be <= 16384 here: bt x 64 \(a row padded"),
        "bwd_bt_tile": (lambda: bwd(x, gate, weight, rstd, x, bt=2**15), ValueError,
                        r"backward_impl: bt must be <= 16384 here"),
        "dw_sum_pdl": (lambda: bwd(x, gate, weight, rstd, x, dw_sum_pdl=1), TypeError,
                       "backward_impl: dw_sum_pdl must be a bool"),
    }


@pytest.mark.interpreter  # compiled, a tile of 2**20 elements is far past the registers
@pytest.mark.interpreter_backward
def test_impls_take_row_blocks_up_to_tritons_largest_tile():
    """16384 rows of 64 are one tile of 2**20 elements, Triton's largest."""
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    want = kernel_module.forward_impl(x, gate, weight, EPS)
    got = kernel_module.forward_impl(x, gate, weight, EPS, bt=2**14, pdl=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    dy = torch.randn_like(x)
    want = kernel_module.backward_impl(x, gate, weight, got[1], dy)
    got = kernel_module.backward_impl(x, gate, weight, got[1], dy, bt=2**14, programs=2**14,
                                      dw_sum_pdl=False)
    assert all(torch.equal(a, b) for a, b in zip(got[:2], want[:2]))
    torch.testing.assert_close(got[2], want[2])  # one partial instead of two: another sum order


@pytest.mark.parametrize("case", list(_impl_calls()))
def test_impls_check_their_tensors_and_launch_overrides(case):
    call, exception, message = _impl_calls()[case]
    with pytest.raises(exception, match=message):
        call()


def test_forward_impl_computes_in_place():
    """out may be x or gate itself: each program reads its rows before it writes them."""
    x, gate, weight = make_inputs((2, 3, 4, 64), torch.bfloat16)
    want, _ = kernel_module.forward_impl(x, gate, weight, EPS)
    for name, t in (("x", x.clone()), ("gate", gate.clone())):
        args = {"x": x, "gate": gate} | {name: t}
        out, _ = kernel_module.forward_impl(args["x"], args["gate"], weight, EPS, out=t)
        assert out is t and torch.equal(t, want), name


def test_forward_impl_writing_into_out_counts_as_in_place():
    """A kernel's write is invisible to autograd: forward_impl bumps out's version, so a graph
    that saved the tensor refuses to backward instead of using the overwritten values, as after
    any in-place op; and it refuses an out that requires grad while grad mode is on."""
    a = torch.randn(1, 2, 2, 64, device=DEVICE, requires_grad=True)
    x = a.exp()  # exp saves its output for the backward
    gate, weight = torch.randn_like(x), torch.ones(64, device=DEVICE)
    version = x._version
    with torch.no_grad():
        kernel_module.forward_impl(x, gate, weight, EPS, out=x)
    assert x._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        x.sum().backward()
    leaf = torch.zeros_like(x, requires_grad=True)
    with pytest.raises(ValueError, match="forward_impl: out requires grad with grad mode enabled"):
        kernel_module.forward_impl(x.detach(), gate, weight, EPS, out=leaf)
    with torch.no_grad():
        kernel_module.forward_impl(x.detach(), gate, weight, EPS, out=leaf)


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


# ------------------------------------------------------------------------------------ 64-bit rows


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
    rows = torch.tensor([0, 1, heads, seq * heads - 1, seq * heads, batch * seq * heads - 1], dtype=torch.int32)
    out = torch.empty(rows.shape, dtype=torch.int64)
    _row_offsets_kernel[(1,)](rows.to(DEVICE), out := out.to(DEVICE), rows.numel(), seq, heads,
                              stride_b, stride_s, stride_h, flat_tokens, 8)
    rows = rows.long()
    token, head = rows // heads, rows % heads
    expected = (token // seq) * stride_b + (token % seq) * stride_s + head * stride_h
    assert expected.max() > 2**33
    assert torch.equal(out.cpu(), expected)


# ------------------------------------------------------------------------------------ dense blocks


def _dense(t, bt):
    return kernel_module._layout(t, bt)[2]


def test_megatron_tensors_are_addressed_as_dense_blocks():
    """FLA's contiguous output, the gate slice of the packed projection and the sbhd output
    buffer take the dense path (32-bit offsets from one block start) at the forward's and the
    backward's blocks of D = 128 on a GPU, and the answer does not depend on the token count
    (no recompile)."""
    gpu = torch.device("cuda", 0)
    with h200_device_rules():
        blocks = {launch_rules.forward_launch(128, gpu).bt,
                  launch_rules.backward_launch(128, gpu).bt}
    assert len(blocks) == 2
    for seq in (1, 7, 4096, 4099):
        for batch in (1, 2):
            x = torch.empty(batch, seq, 32, 128, device="meta")
            gate = torch.empty(seq, batch, 3 * 32 * 128, device="meta").transpose(0, 1)[
                ..., 4096:8192].unflatten(-1, (32, 128))
            out = torch.empty(seq, batch, 32, 128, device="meta").transpose(0, 1)
            for t in (x, gate, out):
                for bt in blocks:
                    assert _dense(t, bt), (seq, batch, t.stride(), bt)


def test_dense_blocks_rules():
    x = torch.empty(2, 5, 4, 64, device="meta")
    assert _dense(x, 4) and _dense(x, 2)  # bt divides the heads
    assert _dense(x, 8)  # crosses tokens, but tokens are dense too
    packed = torch.empty(2, 5, 3 * 4 * 64, device="meta")[..., 256:512].unflatten(-1, (4, 64))
    assert _dense(packed, 4) and not _dense(packed, 8)  # tokens are 768 apart, not 256
    sbhd = torch.empty(5, 2, 4, 64, device="meta").transpose(0, 1)
    assert _dense(sbhd, 4) and not _dense(sbhd, 8)  # not flat: only within a token
    heads_apart = torch.empty(2, 5, 64, 8, device="meta").transpose(2, 3)[:, :, :4]  # head stride 1
    assert heads_apart.shape == (2, 5, 4, 64) and not _dense(heads_apart, 4)


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
    dense_operands = [name for name, t in operands.items() if _dense(t, bt)]
    assert dense_operands, "no operand takes the dense path: the case compares a path with itself"
    results = []
    for dense in (True, False):
        if not dense:
            monkeypatch.setattr(kernel_module, "dense_blocks", lambda *args: False)
            monkeypatch.setattr(kernel_module, "_launch_plans", {})  # plans made with dense blocks
            assert not any(_dense(t, bt) for t in operands.values())
        out, rstd = kernel_module.forward_impl(x, gate, weight, EPS, bt=bt, out=out_buffer)
        grads = kernel_module.backward_impl(x, gate, weight, rstd, dy, bt=bt, programs=3)
        results.append((out.clone(), rstd, *grads))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ launch shapes


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
    ref_out, ref_rstd = kernel_module.forward_impl(x, gate, weight, EPS)
    out, rstd = kernel_module.forward_impl(x, gate, weight, EPS, bt=bt)
    ref_grads = kernel_module.backward_impl(x, gate, weight, ref_rstd, dy)
    grads = kernel_module.backward_impl(x, gate, weight, ref_rstd, dy, bt=bt, programs=programs)
    if DEVICE == "cpu":
        assert torch.equal(out, ref_out) and torch.equal(rstd, ref_rstd)
        assert torch.equal(grads[0], ref_grads[0]) and torch.equal(grads[1], ref_grads[1])
    else:
        torch.testing.assert_close(rstd, ref_rstd, rtol=2.5e-7, atol=0)
        for got, want in ((out, ref_out), (grads[0], ref_grads[0]), (grads[1], ref_grads[1])):
            assert ulp_distance(got, want).max().item() <= 1
    torch.testing.assert_close(grads[2].float(), ref_grads[2].float(), rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("shape, programs, grid", [
    ((1, 2, 1, 64), None, 2),  # fewer blocks than the cap: one program each
    ((1, 47, 1, 64), None, 4),  # the cap, each walking fewer than LONG_WALK_BLOCKS blocks
    ((1, 12, 4, 64), None, 3),  # 48 blocks: each of 4 would walk 12, so the long-walk grid
    ((1, 47, 1, 64), 5, 5),  # an override takes its count
    ((1, 2, 1, 64), 100, 2),  # at most one program per block
])
def test_the_backward_grid_follows_the_launch_rule(monkeypatch, shape, programs, grid):
    """backward_impl launches ``backward_programs(rule, blocks)`` programs, or the override, at
    most one per row block; the grid moves no dx or dgate bit, only dW's grouping (a rule of
    4 programs, 3 for long walks, and one row per block)."""
    x, gate, weight = make_inputs(shape, torch.bfloat16)
    dy = make_inputs(shape, torch.bfloat16, seed=4)[0]
    _, rstd = kernel_module.forward_impl(x, gate, weight, EPS)
    want = kernel_module.backward_impl(x, gate, weight, rstd, dy, bt=1, programs=1)
    rule = launch_rules.backward_launch(64, x.device)._replace(
        bt=1, max_programs=4, long_walk_programs=3)
    monkeypatch.setattr(kernel_module, "backward_launch", lambda dim, device: rule)
    monkeypatch.setattr(kernel_module, "_launch_plans", {})
    grids, launch = [], kernel_module.launch_backward.launch
    monkeypatch.setattr(kernel_module.launch_backward, "launch",
                        lambda grid, *rest: (grids.append(grid), launch(grid, *rest)))
    got = kernel_module.backward_impl(x, gate, weight, rstd, dy, programs=programs)
    assert launch_rules.LONG_WALK_BLOCKS == 12 and grids == [grid]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=8e-3, atol=1e-3)


# ------------------------------------------------------------------------------ dW partial sum


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
    cfg = kernel_module.backward_launch(12, partials.device)
    grid, prepared = kernel_module._dw_sum_launch(  # backward_impl's second launch
        37, 12, dtype, cfg._replace(max_programs=64, dw_sum_columns=8), scale)
    got = partials.new_empty(12, dtype=dtype)
    kernel_module.launch_dw_sum.launch(grid, (partials, got), prepared)
    want = (partials.double().sum(0) * scale).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    if scale != 1.0 and dtype != torch.float32:  # the case tells the two orders apart
        assert not torch.equal(want, (partials.double().sum(0).to(dtype).double() * scale).to(dtype))


# ------------------------------------------------------------------------------------ launch plans


def test_a_launch_plan_is_never_reused_for_other_strides(monkeypatch):
    """Plans are keyed by the exact metadata: the same shape with other strides (x contiguous,
    then an sbhd view; the gate contiguous, then a packed projection's slice; dy contiguous, then
    sbhd) gets its own plan and the result of a fresh computation on contiguous copies."""
    monkeypatch.setattr(kernel_module, "_launch_plans", {})
    shape = (2, 5, 4, 64)
    x, gate, weight = make_inputs(shape, torch.bfloat16)
    dy = make_inputs(shape, torch.bfloat16, seed=4)[0]
    strided = (sbhd_view(x), packed_projection_gate(shape, x.dtype), sbhd_view(dy))
    results = []
    for xs, gs, dys in ((x, gate, dy), strided, (x, gate, dy)):
        out, rstd = kernel_module.forward_impl(xs, gs, weight, EPS)
        results.append((xs, gs, dys, out, rstd, *kernel_module.backward_impl(xs, gs, weight, rstd, dys)))
    assert len(kernel_module._launch_plans) == 4  # forward and backward of two layouts
    for xs, gs, dys, *got in results:
        plain = [t.contiguous() for t in (xs, gs, dys)]
        monkeypatch.setattr(kernel_module, "_launch_plans", {})
        out, rstd = kernel_module.forward_impl(plain[0], plain[1], weight, EPS)
        want = (out, rstd, *kernel_module.backward_impl(plain[0], plain[1], weight, rstd, plain[2]))
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_a_kept_plan_holds_no_buffer_and_every_call_gets_its_own(monkeypatch):
    """A plan keeps the shape of each buffer it allocates (rstd, the dW partials) as a
    one-element template; every call gets new contiguous fp32 buffers, never the template's
    memory."""
    monkeypatch.setattr(kernel_module, "_launch_plans", {})
    shape = (2, 5, 4, 64)
    x, gate, weight = make_inputs(shape, torch.bfloat16)
    dy = make_inputs(shape, torch.bfloat16, seed=4)[0]
    partials, launch = [], kernel_module.launch_backward.launch
    monkeypatch.setattr(kernel_module.launch_backward, "launch",
                        lambda grid, tensors, *rest: (partials.append(tensors[-1]),
                                                      launch(grid, tensors, *rest)))
    rstds = [kernel_module.forward_impl(x, gate, weight, EPS)[1] for _ in range(2)]
    for rstd in rstds:
        kernel_module.backward_impl(x, gate, weight, rstd, dy)
    forward_plan, backward_plan = kernel_module._launch_plans.values()
    assert forward_plan.rstd.shape == shape[:3]
    assert backward_plan.dw_partials.shape == (backward_plan.grid, shape[3])
    for buffers, template in ((rstds, forward_plan.rstd), (partials, backward_plan.dw_partials)):
        assert template.untyped_storage().nbytes() == 4
        storages = {template.untyped_storage().data_ptr()}
        for buffer in buffers:
            assert buffer.shape == template.shape and buffer.dtype == torch.float32
            assert buffer.is_contiguous() and buffer.device == x.device
            storages.add(buffer.untyped_storage().data_ptr())
        assert len(storages) == 3


def test_a_launch_plan_is_kept_per_current_device(monkeypatch):
    """The same tensors with another current device (torch.cuda.set_device on a GPU) go through
    the rules again: the kernels launch on the current device."""
    monkeypatch.setattr(kernel_module, "_launch_plans", {})
    checked = []
    rules = kernel_module._check_forward
    monkeypatch.setattr(kernel_module, "_check_forward",
                        lambda *args: (checked.append(1), rules(*args)))
    current = [None]
    monkeypatch.setattr(kernel_module, "current_device", lambda: current[0])
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    for device in (None, None, 1, 1, None):
        current[0] = device
        kernel_module.forward_impl(x, gate, weight, EPS)
    assert len(checked) == 2


def test_launch_plan_table_is_bounded(monkeypatch):
    monkeypatch.setattr(kernel_module, "_launch_plans", {})
    monkeypatch.setattr(kernel_module, "MAX_PLANS", 3)
    x, gate, weight = make_inputs((1, 6, 2, 32), torch.float32)
    for tokens in range(1, 7):  # a new token count per step: a new signature each
        kernel_module.forward_impl(x[:, :tokens], gate[:, :tokens], weight, EPS)
        assert len(kernel_module._launch_plans) <= 3


def test_an_interpreter_that_cannot_run_the_backward_loop_is_named(monkeypatch):
    """Triton 3.6's interpreter converts loop bounds with int() of a one-element array, which
    newer NumPy refuses: the backward says so before its launch instead of failing inside it."""
    import numpy

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    try:
        int(numpy.zeros(1, dtype=numpy.int32))
        refused = False
    except TypeError:
        refused = True
    assert (kernel_module.interpreter_loop_problem() is not None) == refused
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    assert kernel_module.interpreter_loop_problem() is None
    monkeypatch.setattr(kernel_module, "INTERPRETER_LOOP_PROBLEM", "the reason")
    monkeypatch.setattr(kernel_module, "_launch_plans", {})
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    rstd = torch.ones(x.shape[:3], device=x.device)
    with pytest.raises(RuntimeError, match="backward_impl: the reason"):
        kernel_module.backward_impl(x, gate, weight, rstd, x)
