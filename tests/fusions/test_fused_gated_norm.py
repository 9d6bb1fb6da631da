"""The training entry points (core/fusions/fused_gated_norm.py): fused_gated_norm's autograd
(gradients of any input, in-place ops on the output, first order only, empty input), its
signature, and every bad argument of fused_gated_norm, forward_impl and backward_impl refused
before any launch. The kernels' numerics: test_gated_norm_kernels.py; validate_gated_norm:
test_validate_gated_norm.py."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import core.fusions.fused_gated_norm as fgn
import core.fusions.gated_norm_launch as launch_rules
import core.fusions.gated_norm_plans as plans
import core.fusions.gated_norm_validation as validation
from core.fusions.fused_gated_norm import backward_impl, forward_impl, fused_gated_norm
from core.fusions.gated_norm_reference import unfused_gated_norm
from tests.gated_norm_checks import assert_bitwise_or_within_ulps
from tests.gated_norm_inputs import DEVICE, EPS, make_inputs


# ---------------------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("mode", ["no_grad", "inputs_without_grad"])
def test_forward_without_autograd_stores_no_rstd(mode, monkeypatch):
    """Nothing to differentiate (inference, the no-grad first forward of a recompute): the
    forward stores no rstd and the output keeps its bits."""
    x, gate, weight = make_inputs((2, 5, 3, 64), torch.bfloat16)
    with_rstd = fused_gated_norm(*(t.detach().requires_grad_() for t in (x, gate, weight)), EPS)
    calls = []
    real = fgn.forward_buffer  # what the entry calls

    def spy(*args, store_rstd=True):
        calls.append(store_rstd)
        return real(*args, store_rstd=store_rstd)

    monkeypatch.setattr(fgn, "forward_buffer", spy)
    if mode == "no_grad":
        with torch.no_grad():
            out = fused_gated_norm(*(t.detach().requires_grad_() for t in (x, gate, weight)), EPS)
    else:
        out = fused_gated_norm(x, gate, weight, EPS)
    assert calls == [False] and not out.requires_grad
    assert torch.equal(out, with_rstd.detach())
    assert forward_impl(x, gate, weight, EPS, store_rstd=False)[1] is None


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_takes_a_gradient_whose_last_dim_is_strided(dtype):
    """Autograd may hand the backward a gradient with a non-unit last stride (here every second
    element of a wider tensor): the kernel reads it through that stride, not as if it were
    dense."""
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


def test_double_backward_raises():
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    x.requires_grad_()
    out = fused_gated_norm(x, gate, weight, EPS)
    dy = make_inputs(out.shape, out.dtype, seed=1)[0].requires_grad_()
    (dx,) = torch.autograd.grad(out, x, dy, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dx.sum().backward()


@pytest.mark.parametrize("shape", [(0, 4, 2, 64), (2, 0, 2, 64), (1, 3, 0, 64), (2, 3, 2, 0)])
def test_empty_input(shape):
    x, gate, weight = make_inputs(shape, torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (x, gate, weight)]
    out = fused_gated_norm(*leaves, EPS)
    assert out.shape == shape
    dx, dgate, dweight = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert dx.shape == shape and dgate.shape == shape
    assert torch.equal(dweight, torch.zeros_like(weight))


def test_gate_activation_is_the_sixth_parameter():
    """megatron main's signature: ``fused_gated_norm(x, gate, weight, eps, zero_centered=False,
    gate_activation="silu")``, the sixth parameter positional or keyword, the options after it
    keyword-only."""
    x, gate, weight = make_inputs((1, 3, 2, 64), torch.bfloat16)
    sigmoid = unfused_gated_norm(x, gate, weight, EPS, True, "sigmoid")
    assert not torch.equal(sigmoid, unfused_gated_norm(x, gate, weight, EPS, True, "silu"))
    for out in (fused_gated_norm(x, gate, weight, EPS, True, "sigmoid"),
                fused_gated_norm(x, gate, weight, EPS, True, gate_activation="sigmoid")):
        assert_bitwise_or_within_ulps(out, sigmoid)
    params = list(inspect.signature(fused_gated_norm).parameters.values())
    assert [p.name for p in params[:6]] == ["x", "gate", "weight", "eps", "zero_centered",
                                            "gate_activation"]
    assert params[5].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and params[5].default == "silu"
    assert {p.name for p in params[6:]} == {"out_layout", "weight_grad_scale"}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[6:])


# --------------------------------------------------------------------------------------- the impls


def test_integer_eps_and_scale_reach_the_impls_kernels_as_floats():
    """forward_impl and backward_impl take an int eps / weight_grad_scale as the float it
    equals, also one past Triton's 64-bit integer binding, with no error after a launch."""
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    big = 2**64
    out, rstd = forward_impl(x, gate, weight, big)
    want_out, want_rstd = forward_impl(x, gate, weight, float(big))
    assert torch.equal(out, want_out) and torch.equal(rstd, want_rstd)
    got = backward_impl(x, gate, weight, rstd, x, weight_grad_scale=big)
    want = backward_impl(x, gate, weight, rstd, x, weight_grad_scale=float(big))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_forward_impl_computes_in_place():
    """out may be x or gate itself: each program reads its rows before it writes them."""
    x, gate, weight = make_inputs((2, 3, 4, 64), torch.bfloat16)
    want, _ = forward_impl(x, gate, weight, EPS)
    for name, t in (("x", x.clone()), ("gate", gate.clone())):
        args = {"x": x, "gate": gate} | {name: t}
        out, _ = forward_impl(args["x"], args["gate"], weight, EPS, out=t)
        assert out is t and torch.equal(t, want), name


def test_forward_impl_writes_into_a_view_with_any_last_dim_stride():
    """out may be every second element of a wider buffer (the others keep their values), also
    computed in place when x is that very view."""
    x, gate, weight = make_inputs((2, 3, 4, 64), torch.bfloat16)
    want, _ = forward_impl(x, gate, weight, EPS)
    buffer = torch.zeros(2, 3, 4, 128, dtype=x.dtype, device=x.device)
    out, _ = forward_impl(x, gate, weight, EPS, out=buffer[..., 1::2])
    assert torch.equal(out, want) and torch.equal(buffer[..., ::2], torch.zeros_like(x))
    buffer[..., ::2] = x
    strided_x = buffer[..., ::2]
    out, _ = forward_impl(strided_x, gate, weight, EPS, out=strided_x)
    assert out is strided_x and torch.equal(buffer[..., ::2], want)


def test_forward_impl_writing_into_out_counts_as_in_place():
    """A kernel's write is invisible to autograd: forward_impl bumps out's version, so a graph
    that saved the tensor refuses to backward instead of using the overwritten values, as after
    any in-place op; and it refuses an out that requires grad while grad mode is on."""
    a = torch.randn(1, 2, 2, 64, device=DEVICE, requires_grad=True)
    x = a.exp()  # exp saves its output for the backward
    gate, weight = torch.randn_like(x), torch.ones(64, device=DEVICE)
    version = x._version
    with torch.no_grad():
        forward_impl(x, gate, weight, EPS, out=x)
    assert x._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        x.sum().backward()
    leaf = torch.zeros_like(x, requires_grad=True)
    with pytest.raises(ValueError, match="forward_impl: out requires grad with grad mode enabled"):
        forward_impl(x.detach(), gate, weight, EPS, out=leaf)
    with torch.no_grad():
        forward_impl(x.detach(), gate, weight, EPS, out=leaf)


@pytest.mark.interpreter  # compiled, a tile of 2**20 elements is far past the registers
@pytest.mark.interpreter_backward
def test_impls_take_row_blocks_up_to_tritons_largest_tile():
    """16384 rows of 64 are one tile of 2**20 elements, Triton's largest."""
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    want = forward_impl(x, gate, weight, EPS)
    got = forward_impl(x, gate, weight, EPS, bt=2**14, pdl=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    dy = torch.randn_like(x)
    want = backward_impl(x, gate, weight, got[1], dy)
    got = backward_impl(x, gate, weight, got[1], dy, bt=2**14, programs=2**14,
                                      dw_sum_pdl=False)
    assert all(torch.equal(a, b) for a, b in zip(got[:2], want[:2]))
    torch.testing.assert_close(got[2], want[2])  # one partial instead of two: another sum order


# --------------------------------------------------------------------------------------- bad input


def _bad_inputs():
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.bfloat16)
    meta = torch.empty(1, 2, 2, 64, dtype=torch.bfloat16, device="meta")
    return {
        "rank": ((x[0], gate[0], weight, EPS), ValueError, "x must have rank 4"),
        "gate_shape": ((x, gate[:, :1], weight, EPS), ValueError, "gate must have x's shape"),
        # megatron main's rule: the gate in x's dtype or fp32 (test_gated_norm_kernels.py)
        "gate_dtype": ((x, gate.half(), weight, EPS), TypeError,
                       "gate dtype must be fp32 or x's dtype torch.bfloat16, got torch.float16"),
        "gate_dtype_fp64": ((x, gate.double(), weight, EPS), TypeError,
                            "gate dtype must be fp32 or x's dtype"),
        "gate_dtype_below_fp32_x": ((x.float(), gate, weight.float(), EPS), TypeError,
                                    "gate dtype must be fp32 or x's dtype torch.float32, got "
                                    "torch.bfloat16"),
        "x_dtype": ((x.double(), gate.double(), weight.double(), EPS), TypeError,
                    "x dtype must be"),
        "int_dtype": ((x.int(), gate.int(), weight, EPS), TypeError, "x dtype must be"),
        "weight_dtype": ((x, gate, weight.half(), EPS), TypeError,
                         "weight dtype must be fp32 or x's dtype"),
        "weight_shape": ((x, gate, weight[:32], EPS), ValueError,
                         r"weight must have shape \(64,\)"),
        "weight_2d": ((x, gate, weight.view(1, 64), EPS), ValueError, "weight must have shape"),
        "device": ((x, gate, weight.to("meta"), EPS), ValueError,
                   "x, gate and weight must be on one device"),
        "device_x": ((meta, gate, weight, EPS), ValueError, "must be on one device"),
        # The interpreter takes CPU tensors, a GPU build CUDA tensors: meta is neither.
        "device_all_meta": ((meta, meta, weight.to("meta"), EPS), ValueError,
                            "x must be a (CPU|CUDA) tensor .*TRITON_INTERPRET=1.*got device meta"),
        "head_dim": ((*make_inputs((1, 1, 1, 8200), torch.bfloat16), EPS), ValueError,
                     "head dim .* must be <= 8192"),
        # Expanded (memoryless) views with 2**31 rows: row indices are 32-bit in the kernels.
        "rows": ((*(x[:1, :1, :1, :1].expand(2**16, 2**11, 16, 1) for _ in range(2)), weight[:1],
                  EPS),
                 ValueError, r"batch \* sequence \* heads must be <= 2147418112"),
        "eps_zero": ((x, gate, weight, 0.0), ValueError, "eps must be finite and > 0"),
        "eps_negative": ((x, gate, weight, -1e-6), ValueError, "eps must be finite and > 0"),
        "eps_nan": ((x, gate, weight, math.nan), ValueError, "eps must be finite and > 0"),
        "eps_inf": ((x, gate, weight, math.inf), ValueError, "eps must be finite and > 0"),
        # The kernels take eps as fp32: beyond its range it would be inf, or 0 / flushed to 0.
        "eps_fp32_overflow": ((x, gate, weight, 1e39), ValueError, "eps must be finite and > 0"),
        "eps_huge_int": ((x, gate, weight, 10**400), ValueError, "eps must be finite and > 0"),
        "eps_fp32_subnormal": ((x, gate, weight, 1e-40), ValueError, "eps must be finite and > 0"),
        "eps_tensor": ((x, gate, weight, torch.tensor(1e-6)), TypeError,
                       "eps must be a Python float or int"),
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
                          "weight must be a dense \\(strided\\) tensor, got layout "
                          "torch.sparse_coo"),
        # zero_centered selects a compiled variant: only a bool, never a truth value.
        **{f"zero_centered_{name}": ((x, gate, weight, EPS, value), TypeError,
                                     "zero_centered must be a bool")
           for name, value in (("str", "False"), ("none", None), ("half", 0.5), ("int", 1))},
        **{f"weight_grad_scale_{name}": (
            (x, gate, weight, EPS, False, {"weight_grad_scale": value}), error,
            "weight_grad_scale must be")
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

    for launcher in (plans.launch_forward, plans.launch_backward):
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
        forward_impl(x, gate, weight, EPS, value)
    with pytest.raises(TypeError, match="backward_impl: zero_centered must be a bool"):
        backward_impl(x, gate, weight, rstd, x, value)


def test_cpu_tensors_need_the_interpreter(monkeypatch, no_launches):
    """Compiled Triton kernels read device memory: CPU tensors are refused before any launch
    (Triton itself would fail inside its launcher, or read host addresses on a cached launch)."""
    monkeypatch.setattr(validation, "INTERPRETED", False)
    x, gate, weight = (t.cpu() for t in make_inputs((1, 2, 2, 64), torch.bfloat16))
    with pytest.raises(ValueError,
                       match="x must be a CUDA tensor .*TRITON_INTERPRET=1.*got device cpu"):
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
    monkeypatch.setattr(plans, "_launch_plans", {})
    x, gate, weight = (t.cpu() for t in make_inputs((1, 2, 2, 64), torch.bfloat16))
    rstd = torch.ones(x.shape[:3])
    rule = "x must be a CUDA tensor .*TRITON_INTERPRET=1.*got device cpu"
    with pytest.raises(ValueError, match="forward_impl: " + rule):
        forward_impl(x, gate, weight, EPS)
    with pytest.raises(ValueError, match="backward_impl: " + rule):
        backward_impl(x, gate, weight, rstd, x)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"out_layout": "hbsd"}, ValueError, "out_layout must be one of"),
    ({"out_layout": None}, TypeError, "out_layout must be a str, got NoneType"),
    ({"out_layout": 1}, TypeError, "out_layout must be a str, got int"),
    ({"gate_activation": "gelu"}, ValueError, "gate_activation must be one of"),
    ({"gate_activation": ["silu"]}, TypeError, "gate_activation must be a str, got list"),
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
    with pytest.raises(error, match="forward_impl: gate_activation must be"):
        forward_impl(x, gate, weight, EPS, gate_activation=activation)
    with pytest.raises(error, match="backward_impl: gate_activation must be"):
        backward_impl(x, gate, weight, rstd, x, gate_activation=activation)


def test_impls_check_eps_and_the_weight_grad_scale():
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    rstd = torch.ones(x.shape[:3], device=x.device)
    with pytest.raises(ValueError, match="forward_impl: eps must be finite and > 0"):
        forward_impl(x, gate, weight, 1e39)
    with pytest.raises(ValueError, match="backward_impl: weight_grad_scale must be finite"):
        backward_impl(x, gate, weight, rstd, x, weight_grad_scale=1e39)


def _impl_calls():
    """(call, exception, message) of forward_impl / backward_impl with one bad argument each;
    every call follows good ones with the same launch options, and with values a dict key
    cannot tell from the bad ones (1 == True), so the checks cannot hide behind a kept launch
    plan."""
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    rstd = forward_impl(x, gate, weight, EPS)[1]
    fwd, bwd = forward_impl, backward_impl
    fwd(x, gate, weight, 1)
    fwd(x, gate, weight, EPS, bt=1)
    bwd(x, gate, weight, rstd, x)
    bwd(x, gate, weight, rstd, x, weight_grad_scale=1)
    bwd(x, gate, weight, rstd, x, programs=1)
    # x and an out that shares half of its bytes, after a good out of the same signature
    storage = torch.cat([x.flatten(), x.flatten()])
    x_in = storage[:x.numel()].view(x.shape)
    shifted_out = storage[128:128 + x.numel()].view(x.shape)
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
                            "forward_impl: out must either be gate itself .* partially "
                            "overlaps gate"),
        "out_rows_overlap": (lambda: fwd(x, gate, weight, EPS, out=torch.empty_like(x)[:, :, :1]
                                         .expand(x.shape)), ValueError,
                             "forward_impl: out rows must not overlap each other"),
        # a zero last stride: the elements of a row are one (x and gate may be, out may not)
        "out_elements_overlap": (lambda: fwd(x, gate, weight, EPS,
                                             out=torch.empty_like(x)[..., :1].expand(x.shape)),
                                 ValueError, "forward_impl: out rows must not overlap each other "
                                             "or themselves"),
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
                        "forward_impl: x, gate and weight must be on one device"),
        "out_device": (lambda: fwd(x, gate, weight, EPS, out=meta["x"]), ValueError,
                       "forward_impl: x, gate, out and weight must be on one device"),
        "weight_device": (lambda: fwd(x, gate, meta["weight"], EPS), ValueError,
                          "forward_impl: x, gate and weight must be on one device"),
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
        "empty_rstd_dtype": (lambda: bwd(x[:, :0], gate[:, :0], weight, rstd[:, :0].double(),
                                         x[:, :0]),
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
        "rstd_strided": (lambda: bwd(x, gate, weight,
                                     rstd.transpose(1, 2).contiguous().transpose(1, 2), x),
                         ValueError, "backward_impl: rstd must be a contiguous"),
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


def test_only_the_gate_may_be_fp32():
    """An fp32 gate goes with a bf16 x (megatron main's rule); out and dy stay in x's dtype, so an
    fp32 gate is no out for a bf16 x (TypeError before any launch)."""
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.bfloat16)
    gate = gate.float()
    out, rstd = forward_impl(x, gate, weight, EPS)
    assert out.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="forward_impl: out dtype must equal x's dtype"):
        forward_impl(x, gate, weight, EPS, out=gate)
    with pytest.raises(TypeError, match="backward_impl: dy dtype must equal x's dtype"):
        backward_impl(x, gate, weight, rstd, out.float())


@pytest.mark.parametrize("case", list(_impl_calls()))
def test_impls_check_their_tensors_and_launch_overrides(case):
    call, exception, message = _impl_calls()[case]
    with pytest.raises(exception, match=message):
        call()
