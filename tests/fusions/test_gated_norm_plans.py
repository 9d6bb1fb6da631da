"""Launch plans (core/fusions/gated_norm_plans.py): every launch's arguments land on the kernel
parameter of their name, ask for FP contraction and read the caller's tensors in place; dense
blocks; the backward grid; the table of plans (kept per checked signature and options, never
reused for other strides, holding no buffer, bounded)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import core.fusions.gated_norm_kernels as kernels
import core.fusions.gated_norm_launch as launch_rules
import core.fusions.gated_norm_plans as plans
from core.fusions import fused_gdn_gated_rms_norm
from core.fusions.fused_gated_norm import backward_impl, forward_impl, fused_gated_norm
from core.fusions.gated_norm_launch import forward_launch
from core.testing.h200 import h200_device_rules
from tests.gated_norm_checks import RecordOps
from tests.gated_norm_inputs import EPS, make_inputs, packed_projection_gate, sbhd_view


# -------------------------------------------------------------------------------- launch arguments


class _KernelRecorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the arguments
    by kernel parameter and runs nothing."""

    def __init__(self, kernel):
        self.names, self.launches = kernel.arg_names, []

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            assert len(args) == len(self.names), "every parameter is passed, defaults included"
            self.launches.append(dict(zip(self.names, args)))
        return record


def _record_forward_launches(monkeypatch) -> list:
    """The forward's launcher records each launch instead of launching (prepared or not, every
    launch reaches the kernel: no compiled kernel is kept)."""
    recorder = _KernelRecorder(kernels.gated_norm_fwd)
    monkeypatch.setattr(plans.launch_forward, "kernel", recorder)
    monkeypatch.setattr(plans.launch_forward, "compiled", {})
    return recorder.launches


def test_forward_launch_arguments_follow_the_kernel_signature(monkeypatch):
    """Both entries fill gated_norm_fwd's arguments by keyword (``ForwardArgs``, ordered by the
    kernel's own signature); each value must land on the kernel parameter of its name."""
    launches = _record_forward_launches(monkeypatch)
    x, gate, weight = make_inputs((2, 5, 3, 64), torch.bfloat16)
    gate = packed_projection_gate(x.shape, x.dtype)  # token stride 3 * 3 * 64
    out = torch.empty(5, 2, 3, 64, dtype=x.dtype, device=x.device).transpose(0, 1)  # sbhd
    _, rstd = forward_impl(x, gate, weight, 0.25, True, bt=2, out=out, gate_activation="sigmoid")
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
    # (batch, sequence, head, element) strides; flat tokens (batch stride = S x token stride,
    # never read by the kernel) pass 0 for the batch: x and the packed gate are flat, the sbhd
    # out is not.
    assert x.stride(0) == 5 * x.stride(1) and gate.stride(0) == 5 * gate.stride(1)
    assert out.stride(0) != 5 * out.stride(1)
    assert train == dict(
        ROWS=30, HEADS=3, D=64, SEQUENCE=5,
        X_STRIDES=(0, *x.stride()[1:]), GATE_STRIDES=(0, *gate.stride()[1:]),
        OUT_STRIDES=out.stride(),
        X_FLAT_TOKENS=True, GATE_FLAT_TOKENS=True, OUT_FLAT_TOKENS=False,
        X_DENSE=True, GATE_DENSE=False, OUT_DENSE=False,
        EPS=0.25, ZERO_CENTERED=True, BT=2, BLOCK_D=64, NORM_DTYPE=tl.bfloat16,
        ACTIVATION="sigmoid", NORM_BEFORE_GATE=True, STORE_RSTD=True,
        PDL=forward_launch(64, x.device).pdl,  # on an sm_90+ GPU; never under the interpreter
    )
    assert z2.stride(0) != 128  # the packed projection's token stride
    assert infer == dict(  # one sequence of 7 tokens, heads D = 64 apart within a row
        ROWS=14, HEADS=2, D=64, SEQUENCE=7,
        X_STRIDES=(0, x2.stride(0), 64, 1), GATE_STRIDES=(0, z2.stride(0), 64, 1),
        OUT_STRIDES=(0, out2.stride(0), 64, 1),
        X_FLAT_TOKENS=True, GATE_FLAT_TOKENS=True, OUT_FLAT_TOKENS=True,
        X_DENSE=True, GATE_DENSE=False, OUT_DENSE=True,
        EPS=0.5, ZERO_CENTERED=False, BT=forward_launch(64, x.device).bt, BLOCK_D=64,
        NORM_DTYPE=tl.float32, ACTIVATION="sigmoid", NORM_BEFORE_GATE=False, STORE_RSTD=False,
        PDL=forward_launch(64, x.device).pdl,
    )


def test_integer_eps_reaches_the_kernel_as_a_float(monkeypatch):
    """An int eps would be another kernel argument type (and 1 a specialised value): one more
    compile. Both fused_gated_norm and forward_impl hand the kernel a float."""
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    assert torch.equal(fused_gated_norm(x, gate, weight, 1), fused_gated_norm(x, gate, weight, 1.0))
    launches = _record_forward_launches(monkeypatch)
    monkeypatch.setattr(plans, "_launch_plans", {})  # plans made for the int eps below
    fused_gated_norm(x, gate, weight, 1)
    forward_impl(x, gate, weight, 1)
    assert [(type(launch["EPS"]), launch["EPS"]) for launch in launches] == [(float, 1.0)] * 2


def test_every_kernel_launch_asks_for_fp_contraction(monkeypatch):
    """The kernels' bits are validated with FP contraction (FMA) on: each launch of the three
    kernels, from training and from the inference entry, asks for it, so neither
    TRITON_DEFAULT_FP_FUSION=0 nor a Triton whose default is off compiles them another way."""
    options = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: options.append(kwargs)

    launchers = (plans.launch_forward, plans.launch_backward, plans.launch_dw_sum)
    for launcher in launchers:
        monkeypatch.setattr(launcher, "kernel", Recorder())
        monkeypatch.setattr(launcher, "compiled", {})  # every launch reaches the recorder
    x, gate, weight = make_inputs((2, 5, 3, 64), torch.bfloat16)
    _, rstd = forward_impl(x, gate, weight, EPS)
    backward_impl(x, gate, weight, rstd, torch.ones_like(x))
    with torch.no_grad():
        x2 = x.flatten(0, 1).flatten(-2)
        fused_gdn_gated_rms_norm(x2, x2, weight, torch.empty_like(x2), EPS, 3, 64)
    assert len(options) == 4
    assert all(kwargs["enable_fp_fusion"] is True for kwargs in options), options


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


def _every_second_element(t):
    """The values of ``t`` as every second element of a buffer twice as wide (last stride 2)."""
    buffer = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    buffer[..., ::2].copy_(t)
    return buffer[..., ::2]


# (x, gate, dy) as Megatron hands them, and the views of any other caller: a last-dim stride of
# 2, a gate of one head expanded over the heads (in fp32), the expanded gradient of ``sum()``.
NO_COPY_VIEWS = {
    "megatron": lambda x, gate, dy: (sbhd_view(x), packed_projection_gate(x.shape, x.dtype),
                                     sbhd_view(dy)),
    "strided_last_dim": lambda x, gate, dy: (_every_second_element(x),
                                             _every_second_element(gate),
                                             _every_second_element(dy)),
    "expanded": lambda x, gate, dy: (x, gate[:, :, :1].float().expand(gate.shape),
                                     dy[:1, :1, :1, :1].expand(dy.shape)),
}


@pytest.mark.parametrize("views", NO_COPY_VIEWS)
def test_no_input_is_copied(monkeypatch, views):
    fwd_spy, bwd_spy = _LaunchSpy(kernels.gated_norm_fwd), _LaunchSpy(kernels.gated_norm_bwd)
    sum_spy = _LaunchSpy(kernels.gated_norm_dw_sum)
    for launcher, spy in ((plans.launch_forward, fwd_spy), (plans.launch_backward, bwd_spy),
                          (plans.launch_dw_sum, sum_spy)):
        monkeypatch.setattr(launcher, "kernel", spy)
        monkeypatch.setattr(launcher, "compiled", {})  # no kernel kept from earlier tests
    x, gate, weight = make_inputs((2, 4, 3, 64), torch.bfloat16)
    dy = make_inputs(x.shape, torch.bfloat16, seed=4)[0]
    x, gate, dy = NO_COPY_VIEWS[views](x, gate, dy)
    leaves = [t.detach().requires_grad_() for t in (x, gate, weight)]
    with RecordOps() as rec:
        out = fused_gated_norm(*leaves, EPS, out_layout="sbhd")
        torch.autograd.grad(out, leaves, dy)

    # The kernels read the caller's tensors themselves, including the strided incoming grad.
    (fwd_args,), (bwd_args,) = fwd_spy.tensor_args, bwd_spy.tensor_args
    assert all(a is b for a, b in zip(fwd_args[:3], leaves))
    assert [a.data_ptr() for a in bwd_args[:3]] == [t.data_ptr() for t in leaves]
    assert bwd_args[4].data_ptr() == dy.data_ptr() and bwd_args[4].stride() == dy.stride()
    # No copy on the host side (the dW partial sum rounds to the weight dtype in its kernel).
    copies = [op for op in rec.ops
              if op.split(".")[-1] in ("copy_", "clone", "contiguous", "_to_copy")]
    assert copies == [], rec.ops


# ------------------------------------------------------------------------------------ dense blocks


def _dense(t, bt):
    return plans.layout(t, bt)[2]


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
    # Rows D apart, but elements 2 apart: the dense tile would read the wrong elements.
    every_second = torch.empty(5120, device="meta").as_strided((2, 5, 4, 64), (1280, 256, 64, 2))
    assert not _dense(every_second, 4) and plans.layout(every_second, 4)[0][3] == 2
    expanded = torch.empty(64, device="meta").expand(2, 5, 4, 64)
    assert not _dense(expanded, 4) and plans.layout(expanded, 4)[0] == (0, 0, 0, 1)
    # A last dim of one element is at offset 0 whatever its stride: the unit-stride kernel's.
    one_element = torch.empty(1, 2, 5, 4, device="meta").permute(1, 2, 3, 0)
    assert one_element.stride(-1) != 1 and plans.layout(one_element, 4)[0][3] == 1


# ----------------------------------------------------------------------------------- backward grid


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
    _, rstd = forward_impl(x, gate, weight, EPS)
    want = backward_impl(x, gate, weight, rstd, dy, bt=1, programs=1)
    rule = launch_rules.backward_launch(64, x.device)._replace(
        bt=1, max_programs=4, long_walk_programs=3)
    monkeypatch.setattr(plans, "backward_launch", lambda dim, device: rule)
    monkeypatch.setattr(plans, "_launch_plans", {})
    grids, launch = [], plans.launch_backward.launch
    monkeypatch.setattr(plans.launch_backward, "launch",
                        lambda grid, *rest: (grids.append(grid), launch(grid, *rest)))
    got = backward_impl(x, gate, weight, rstd, dy, programs=programs)
    assert launch_rules.LONG_WALK_BLOCKS == 12 and grids == [grid]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=8e-3, atol=1e-3)


# ------------------------------------------------------------------------------------ launch plans


def test_a_launch_plan_is_never_reused_for_other_strides(monkeypatch):
    """Plans are kept per checked signature, the exact metadata: the same shape with other
    strides (x contiguous,
    then an sbhd view; the gate contiguous, then a packed projection's slice; dy contiguous, then
    sbhd) gets its own plan and the result of a fresh computation on contiguous copies."""
    monkeypatch.setattr(plans, "_launch_plans", {})
    shape = (2, 5, 4, 64)
    x, gate, weight = make_inputs(shape, torch.bfloat16)
    dy = make_inputs(shape, torch.bfloat16, seed=4)[0]
    strided = (sbhd_view(x), packed_projection_gate(shape, x.dtype), sbhd_view(dy))
    results = []
    for xs, gs, dys in ((x, gate, dy), strided, (x, gate, dy)):
        out, rstd = forward_impl(xs, gs, weight, EPS)
        results.append((xs, gs, dys, out, rstd, *backward_impl(xs, gs, weight, rstd, dys)))
    assert len(plans._launch_plans) == 4  # forward and backward of two layouts
    for xs, gs, dys, *got in results:
        plain = [t.contiguous() for t in (xs, gs, dys)]
        monkeypatch.setattr(plans, "_launch_plans", {})
        out, rstd = forward_impl(plain[0], plain[1], weight, EPS)
        want = (out, rstd, *backward_impl(plain[0], plain[1], weight, rstd, plain[2]))
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_a_kept_plan_holds_no_buffer_and_every_call_gets_its_own(monkeypatch):
    """A plan keeps the shape of each buffer it allocates (rstd, the dW partials) as a
    one-element template; every call gets new contiguous fp32 buffers, never the template's
    memory."""
    monkeypatch.setattr(plans, "_launch_plans", {})
    shape = (2, 5, 4, 64)
    x, gate, weight = make_inputs(shape, torch.bfloat16)
    dy = make_inputs(shape, torch.bfloat16, seed=4)[0]
    partials, launch = [], plans.launch_backward.launch
    monkeypatch.setattr(plans.launch_backward, "launch",
                        lambda grid, tensors, *rest: (partials.append(tensors[-1]),
                                                      launch(grid, tensors, *rest)))
    rstds = [forward_impl(x, gate, weight, EPS)[1] for _ in range(2)]
    for rstd in rstds:
        backward_impl(x, gate, weight, rstd, dy)
    forward_plan, backward_plan = plans._launch_plans.values()
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


def test_launch_plan_table_is_bounded(monkeypatch):
    monkeypatch.setattr(plans, "_launch_plans", {})
    monkeypatch.setattr(plans, "MAX_PLANS", 3)
    x, gate, weight = make_inputs((1, 6, 2, 32), torch.float32)
    for tokens in range(1, 7):  # a new token count per step: a new signature each
        forward_impl(x[:, :tokens], gate[:, :tokens], weight, EPS)
        assert len(plans._launch_plans) <= 3


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
    assert (kernels.interpreter_loop_problem() is not None) == refused
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    assert kernels.interpreter_loop_problem() is None
    monkeypatch.setattr(plans, "INTERPRETER_LOOP_PROBLEM", "the reason")
    monkeypatch.setattr(plans, "_launch_plans", {})
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    rstd = torch.ones(x.shape[:3], device=x.device)
    with pytest.raises(RuntimeError, match="backward_impl: the reason"):
        backward_impl(x, gate, weight, rstd, x)


def test_a_signature_without_a_number_gets_a_plan_for_its_call_alone(monkeypatch):
    """Inputs whose signature no memo keeps (checked None: symbolic sizes, no CUDA device to
    ask) launch with a plan built for the call, which is not kept."""
    x, gate, weight = make_inputs((2, 3, 2, 64), torch.bfloat16)
    sbhd = torch.empty(3, 2, 2, 64, dtype=x.dtype, device=x.device)
    want = forward_impl(x, gate, weight, EPS, out=sbhd.transpose(0, 1))
    monkeypatch.setattr(plans, "_launch_plans", {})
    buffer, rstd = plans.forward_buffer(x, gate, weight, EPS, False, "sbhd", "silu", None)
    assert plans._launch_plans == {}
    assert torch.equal(buffer.transpose(0, 1), want[0]) and torch.equal(rstd, want[1])
