"""torch.compile support (core/fusions/gated_norm_compile.py) and compile-cache stability of the
fused gated norm (CPU interpreter or GPU).

- torch.compile(fullgraph=True) of a function calling fused_gated_norm traces through the custom
  ops (no graph break) and gives the eager path's output and gradients bit for bit.
- The Triton specialisation key of both kernels, for the sm_90 target, does not change when only
  the token count changes: packed sequences of varying length never compile a new kernel.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path

import pytest
import torch

import core.fusions.gated_norm_checks as checks
import core.fusions.gated_norm_kernels as kernels
import core.fusions.gated_norm_plans as plans
from core.fusions.fused_gated_norm import backward_impl, forward_impl, fused_gated_norm
from core.fusions.gated_norm_compile import gated_norm_fwd_op
from tests.gated_norm_inputs import EPS, make_inputs, packed_projection_gate

ROOT = Path(__file__).resolve().parents[2]


def strided_gate_inputs(batch, seq, heads=3, dim=64):
    """bf16 inputs whose gate is a slice of a packed projection (token-strided)."""
    x, _, weight = make_inputs((batch, seq, heads, dim))
    return x, packed_projection_gate(x.shape, x.dtype), weight


def _grads(fn, x, gate, weight, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, gate, weight)]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dy))


# inductor: the backend a model compiles with; on the CPU it builds C++ for the ops around the
# custom op (a C++ compiler, as torch.compile needs on any CPU; ~8 s with a cold cache).
@pytest.mark.parametrize("out_layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(backend, out_layout):
    torch._dynamo.reset()
    x, gate, weight = strided_gate_inputs(2, 5)

    def layer(x, gate, weight):
        out = fused_gated_norm(x, gate, weight, EPS, True, out_layout=out_layout,
                               weight_grad_scale=2.0)
        return out * 2.0  # something around the op, so the graph is not just the op

    compiled = torch.compile(layer, fullgraph=True, backend=backend)  # raises on a graph break
    dy = make_inputs(x.shape, x.dtype, seed=1)[0]
    eager = _grads(layer, x, gate, weight, dy)
    traced = _grads(compiled, x, gate, weight, dy)
    for name, a, b in zip(("out", "dx", "dgate", "dweight"), eager, traced):
        assert torch.equal(a, b), f"{name} differs between eager and torch.compile({backend})"
    if out_layout == "sbhd":
        assert traced[0].transpose(0, 1).is_contiguous()


def test_compile_takes_any_view_and_an_fp32_gate():
    """Under torch.compile the custom ops take the views the eager path takes (x every second
    element of a wider buffer, an fp32 gate of one head expanded over the heads, the expanded
    gradient of ``sum()``), with the eager path's output and gradients, bit for bit."""
    torch._dynamo.reset()
    x_source = make_inputs((2, 5, 3, 128))[0]
    gate_source = make_inputs((2, 5, 1, 64), torch.float32, seed=1)[0]
    weight = make_inputs((1, 64))[2]

    def layer(x_source, gate_source, weight):
        x, gate = x_source[..., ::2], gate_source.expand(2, 5, 3, 64)
        return fused_gated_norm(x, gate, weight, EPS)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (layer, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (x_source, gate_source, weight)]
        out = fn(*leaves)
        out.sum().backward()
        results.append((out, *(t.grad for t in leaves)))
    assert results[0][2].dtype == torch.float32  # the gate's gradient, in the gate's dtype
    for name, a, b in zip(("out", "dx", "dgate", "dweight"), *results):
        assert torch.equal(a, b), name


def test_compile_traces_the_input_rules(monkeypatch):
    """Under torch.compile the input rules are traced as they are: the memo of checked
    signatures, whose keys would hold traced sizes, is neither read nor filled (the custom op
    checks the real tensors at its own station when it runs)."""
    monkeypatch.setattr(checks, "_checked_signatures", {})
    torch._dynamo.reset()
    x, gate, weight = strided_gate_inputs(2, 5)
    compiled = torch.compile(lambda x, g, w: fused_gated_norm(x, g, w, EPS), fullgraph=True,
                             backend="aot_eager")
    compiled(x, gate, weight)
    (signature,) = checks._checked_signatures  # kept by the custom op's station, at run time
    assert checks.check_gated_norm_inputs(x, gate, weight, EPS) == (
        checks._checked_signatures[signature])  # the real tensors' signature, nothing traced


def test_compiled_output_takes_in_place_ops():
    """Under torch.compile too, the sbhd output (through ``.transpose(0, 1).contiguous()``, the
    buffer itself) takes in-place ops: the same output and gradients as the eager out-of-place
    ops."""
    torch._dynamo.reset()
    x, gate, weight = strided_gate_inputs(2, 3)
    residual, _, _ = make_inputs((3, 2, 3, 64), seed=1)
    dy, _, _ = make_inputs((3, 2, 3, 64), seed=2)

    def in_place(x, gate, weight):
        out = fused_gated_norm(x, gate, weight, EPS, out_layout="sbhd").transpose(0, 1).contiguous()
        return out.add_(residual).mul_(0.5)

    def out_of_place(x, gate, weight):
        out = fused_gated_norm(x, gate, weight, EPS, out_layout="sbhd").transpose(0, 1).contiguous()
        return (out + residual) * 0.5

    compiled = torch.compile(in_place, fullgraph=True, backend="aot_eager")
    for name, a, b in zip(("out", "dx", "dgate", "dweight"), _grads(compiled, x, gate, weight, dy),
                          _grads(out_of_place, x, gate, weight, dy)):
        assert torch.equal(a, b), name


def test_custom_op_passes_opcheck():
    x, gate, weight = make_inputs((1, 4, 3, 64))
    x.requires_grad_()
    torch.library.opcheck(
        gated_norm_fwd_op, (x, gate, weight, EPS, False, "sbhd", "silu", 2.0),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


# ------------------------------------------------------------------------------------------------
# Specialisation key vs token count
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _kernel_ir():
    """tools/kernel_ir.py: Triton's own binder for an sm_90 target and a launch recorder."""
    spec = importlib.util.spec_from_file_location("kernel_ir", ROOT / "tools" / "kernel_ir.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _keys(kernel_name, run):
    """The compile-cache key (specialisation, options) of every launch of ``kernel_name`` that
    ``run()`` makes, for an sm_90 target; nothing runs."""
    kernel_ir = _kernel_ir()
    binder = kernel_ir.sm90_binder(getattr(kernels, kernel_name))[0]
    launchers = {"gated_norm_fwd": plans.launch_forward, "gated_norm_bwd": plans.launch_backward,
                 "gated_norm_dw_sum": plans.launch_dw_sum}
    with contextlib.ExitStack() as stack:  # every launcher records: no kernel runs
        launches = {name: stack.enter_context(kernel_ir.recording(launcher))
                    for name, launcher in launchers.items()}
        run()
    keys = []
    for args, kwargs in launches[kernel_name]:
        _, specialization, options = binder(*args, **kwargs)
        keys.append(repr((specialization, options)))
    return keys


@pytest.fixture
def launch_rules(request):
    """``"h200"``: the launch parameters an H200 gets (132 SMs, sm_90; tools/kernel_ir.py's
    h200_launch_rules), whatever device runs the test; ``"this_device"``: its own."""
    rules = (_kernel_ir().h200_launch_rules() if request.param == "h200"
             else contextlib.nullcontext())
    with rules:
        yield request.param


@pytest.mark.parametrize("launch_rules", ["h200", "this_device"], indirect=True)
@pytest.mark.parametrize("batch", [1, 2])
def test_token_count_does_not_change_the_compile_key(launch_rules, batch):
    # (seq == 1 is left out: there the sbhd and bshd layouts coincide and take the flat path.)
    seqs = (2, 7, 16, 100, 257, 4096, 4099)
    inputs = [strided_gate_inputs(batch, seq, heads=4, dim=128) for seq in seqs]

    def forwards():
        for x, gate, weight in inputs:
            forward_impl(x, gate, weight, EPS)
            seq, heads, dim = x.shape[1:]
            sbhd = torch.empty((seq, batch, heads, dim), dtype=x.dtype, device=x.device)
            forward_impl(x, gate, weight, EPS, out=sbhd.transpose(0, 1))

    def backwards():  # a new weight_grad_scale (a runtime float) with every token count too
        for scale, (x, gate, weight) in enumerate(inputs, start=1):
            rstd = torch.ones(x.shape[:3], device=x.device)
            backward_impl(x, gate, weight, rstd, torch.ones_like(x), weight_grad_scale=scale / 4)
            seq, heads, dim = x.shape[1:]
            dy_sbhd = torch.ones((seq, batch, heads, dim), dtype=x.dtype, device=x.device)
            backward_impl(x, gate, weight, rstd, dy_sbhd.transpose(0, 1),
                              weight_grad_scale=float(scale))

    for kernel_name, run in (("gated_norm_fwd", forwards), ("gated_norm_bwd", backwards),
                             ("gated_norm_dw_sum", backwards)):
        keys = _keys(kernel_name, run)
        assert len(keys) == 2 * len(seqs)
        bshd, sbhd = set(keys[0::2]), set(keys[1::2])
        assert len(bshd) == 1, (f"{kernel_name}: {len(bshd)} compiled variants for {len(seqs)} "
                                "token counts")
        assert len(sbhd) == 1, (f"{kernel_name} (sbhd): {len(sbhd)} variants for {len(seqs)} "
                                "token counts")


def _specialisations(kernel_name, run) -> list[dict]:
    """Triton's specialisation of each parameter (name -> (type, attribute)) of every launch of
    ``kernel_name`` that ``run()`` makes, for an sm_90 target; nothing runs."""
    kernel_ir = _kernel_ir()
    binder, jit, _ = kernel_ir.sm90_binder(getattr(kernels, kernel_name))
    launcher = {"gated_norm_fwd": plans.launch_forward,
                "gated_norm_bwd": plans.launch_backward}[kernel_name]
    with kernel_ir.recording(launcher) as launches, kernel_ir.recording(plans.launch_dw_sum):
        run()
    return [dict(zip([p.name for p in jit.params], binder(*args, **kwargs)[1]))
            for args, kwargs in launches]


@pytest.mark.parametrize("launch_rules", ["h200"], indirect=True)
def test_only_a_unit_last_dim_stride_compiles_as_the_constant_1(launch_rules):
    """The last-dim stride is a kernel argument that Triton specialises when it is 1: the
    unit-stride launch compiles with the constant 1 there (so ``cols * 1`` is ``cols``: the code
    of a kernel without the argument), whatever the token count; any other stride is a runtime
    value, one compiled variant for the strides of one integer class (2 and 6 alike)."""
    x, gate, weight = make_inputs((2, 5, 4, 128))
    wide = make_inputs((2, 5, 4, 6 * 128), seed=1)[0]
    views = {"unit": x, "unit_other_tokens": make_inputs((2, 9, 4, 128))[0],
             "stride_2": wide[..., :256:2], "stride_6": wide[..., ::6]}
    contiguous = {name: make_inputs(t.shape)[1] for name, t in views.items()}

    def forwards():  # each view as x
        for name, t in views.items():
            forward_impl(t, contiguous[name], weight, EPS)

    def backwards():  # each view as dy
        for name, t in views.items():
            c = contiguous[name]
            backward_impl(c, c, weight, torch.ones(t.shape[:3]), t)

    for kernel_name, run, strides in (("gated_norm_fwd", forwards, "X_STRIDES"),
                                      ("gated_norm_bwd", backwards, "DY_STRIDES")):
        specs = dict(zip(views, _specialisations(kernel_name, run)))
        assert {name: spec[strides][0][3] for name, spec in specs.items()} == {
            "unit": "constexpr", "unit_other_tokens": "constexpr", "stride_2": "i32",
            "stride_6": "i32"}, kernel_name
        assert specs["unit"][strides][1][3] == 1
        keys = {name: repr(sorted(spec.items())) for name, spec in specs.items()}
        assert keys["unit"] == keys["unit_other_tokens"], kernel_name
        assert keys["stride_2"] == keys["stride_6"] != keys["unit"], kernel_name
