"""The training kernels on a CUDA GPU, at the sizes a model runs: parity with the unfused path,
the gate's exp against tl.exp on every fp32 value, 64-bit offsets past 2**31 elements,
repeatable bits, launch blocks that lay a row out alike, CUDA-graph capture, torch.compile with
inductor, and no recompilation when only the token count changes. The same properties at small
sizes run on the CPU in tests/fusions (Triton interpreter); what is here needs the GPU's
compiler, memory or CUDA graphs."""

from __future__ import annotations


import pytest
import torch
import triton
import triton.language as tl

from core.fusions.gated_norm_reference import relative_error, ulp_distance, unfused_gated_norm
from tests.gated_norm_checks import (
    assert_bitwise_or_within_ulps,
    assert_no_less_accurate,
    float64_grads,
)
from tests.gated_norm_inputs import EPS, make_grad_inputs, shifted
from tools.bench_common import capture
from tools.parity_sources import parity_sources

pytestmark = pytest.mark.gpu

import core.fusions.fused_gated_norm as fgn  # noqa: E402
import core.fusions.gated_norm_kernels as kernels  # noqa: E402
import core.fusions.gated_norm_launch as gated_norm_launch  # noqa: E402
import core.fusions.gated_norm_plans as plans  # noqa: E402

PARITY_CASES = [((1, 4096, 32, 128), "plain"), ((1, 4096, 32, 128), "strided_gate"),
                ((1, 4096, 32, 128), "sbhd"), ((2, 8192, 32, 128), "plain"),
                ((2, 8192, 32, 128), "strided_gate"), ((1, 32768, 32, 128), "plain"),
                ((4, 4096, 16, 256), "plain")]


@pytest.mark.parametrize("shape, variant", PARITY_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{v}" for s, v in PARITY_CASES])
def test_parity_with_the_unfused_path(shape, variant):
    """Forward >= 99.9 % bitwise equal and within 2 ulp (docs/numerics.md), 100 % once the
    reference uses our rstd; dx and dgate >= 99.9 % bitwise, dgate within 2 ulp; dx and dW no
    less accurate against float64 than the unfused path's."""
    x, g, w, dy, _ = make_grad_inputs(shape, "plain" if variant == "sbhd" else variant, seed=1234)
    out = fgn.fused_gated_norm(x, g, w, EPS, out_layout="sbhd" if variant == "sbhd" else "bshd")
    ref = unfused_gated_norm(x, g, w, EPS)
    assert_bitwise_or_within_ulps(out, ref, max_ulps=2)
    _, rstd = fgn.forward_impl(x.detach(), g.detach(), w.detach(), EPS)
    with_our_rstd = unfused_gated_norm(x.detach(), g.detach(), w.detach(), EPS, rstd=rstd)
    # what is left: the fast exp and division of the activation (docs/numerics.md)
    assert_bitwise_or_within_ulps(out, with_our_rstd, max_ulps=1, min_bitwise=1 - 1e-7)
    ours = torch.autograd.grad(out, (x, g, w), dy)
    theirs = torch.autograd.grad(ref, (x, g, w), dy)
    assert_bitwise_or_within_ulps(ours[0], theirs[0], max_ulps=None)  # dx
    assert_bitwise_or_within_ulps(ours[1], theirs[1], max_ulps=2)  # dgate
    exact_dx, _, exact_dw = float64_grads(x, g, w, dy)
    assert_no_less_accurate((ours[0], ours[2]), (theirs[0], theirs[2]), (exact_dx, exact_dw),
                            names=("dx", "dweight"))


def test_kernels_keep_fp_contraction_where_tritons_default_is_off(monkeypatch):
    """With Triton's default FP contraction off (TRITON_DEFAULT_FP_FUSION=0; Triton 3.10's
    default), the kernels still compile with it on and give the same bits."""
    x, g, w, dy, _ = make_grad_inputs((1, 512, 8, 128), "plain", seed=3)
    x, g, w = x.detach(), g.detach(), w.detach()

    def run():
        for launcher in (plans.launch_forward, plans.launch_backward, plans.launch_dw_sum):
            launcher.compiled.clear()  # each launch asks JITFunction.run for its kernel again
        out, rstd = fgn.forward_impl(x, g, w, EPS)
        return (out, *fgn.backward_impl(x, g, w, rstd, dy))

    default = run()
    monkeypatch.setattr(triton.knobs.language, "default_fp_fusion", False)
    off = run()
    for launcher in (plans.launch_forward, plans.launch_backward, plans.launch_dw_sum):
        assert launcher.compiled, "launched directly from then on"
        assert all(k.metadata.enable_fp_fusion for k in launcher.compiled.values())
    assert all(torch.equal(a, b) for a, b in zip(default, off))


@triton.jit
def _exp_mismatches(counts, BLOCK: tl.constexpr):
    """Per block of fp32 bit patterns g, how many give other bits (NaN equals NaN) in:
    _exp_neg(g) against tl.exp(-g); the same where tl.exp(-g) >= 2**-126; 1 + each of them."""
    bits = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = bits.to(tl.uint32).to(tl.float32, bitcast=True)
    ours = kernels._exp_neg(g)
    plain = tl.exp(-g)
    differ = _differ(ours, plain)
    out = counts + 3 * tl.program_id(0)
    tl.store(out, tl.sum(differ.to(tl.int32), axis=0))
    tl.store(out + 1, tl.sum((differ & (plain >= 1.1754943508222875e-38)).to(tl.int32), axis=0))
    tl.store(out + 2, tl.sum(_differ(1.0 + ours, 1.0 + plain).to(tl.int32), axis=0))


@triton.jit
def _differ(a, b):
    both_nan = (a != a) & (b != b)
    return (a.to(tl.uint32, bitcast=True) != b.to(tl.uint32, bitcast=True)) & ~both_nan


def test_gate_exponential_keeps_the_bits_of_tl_exp_for_every_fp32_gate():
    """_exp_neg (one flush-to-zero ex2) differs from tl.exp(-g) only where exp(-g) < 2**-126;
    the kernels only use it as 1 + exp(-g), which keeps tl.exp's bits for all 2**32 fp32 gates
    (docs/numerics.md, The gate activation's exp)."""
    block = 1 << 14
    counts = torch.empty((1 << 32) // block, 3, dtype=torch.int32, device="cuda")
    _exp_mismatches[(counts.shape[0],)](counts, BLOCK=block)
    differ, differ_above_subnormals, one_plus_differ = counts.sum(0).tolist()
    assert differ > 0  # the flush-to-zero ex2 is in use: the exps do differ, on subnormals
    assert differ_above_subnormals == 0
    assert one_plus_differ == 0


def test_differences_come_from_the_order_of_the_sum_of_squares():
    """At 1M rows: the rows whose output differs have an rstd that differs from torch's, and
    given our rstd the unfused path equals our output but for the activation's last bits
    (at most 1 element in 10^7)."""
    result = parity_sources()
    assert result["of_them_rstd_differs"] == result["rows_with_a_difference"]
    assert result["out_vs_unfused_with_our_rstd"]["differ"] <= 1e-7


def test_more_than_2_31_elements():
    """64-bit offsets: forward and backward at the first and last tokens of a 2.2e9-element
    tensor equal the unfused path (out and dgate within 2 ulp, dx no less accurate against
    float64), and dW matches a chunked float64 reference. (The unfused path's own dW would need
    its autograd graph over all 2.2e9 elements: ~100 GB of fp32 intermediates.)"""
    batch, seq, heads, dim = 1, 540_000, 32, 128
    assert batch * seq * heads * dim > 2**31
    x, gate, weight, dy, leaves = make_grad_inputs((batch, seq, heads, dim))
    out = fgn.fused_gated_norm(x, gate, weight, EPS)
    dx, dgate, dweight = torch.autograd.grad(out, leaves, dy)
    for tokens in (slice(0, 1000), slice(seq - 1000, seq)):
        ref_leaves = [t.detach()[:, tokens].clone().requires_grad_() for t in (x, gate)]
        ref_leaves.append(weight.detach().clone().requires_grad_())
        ref = unfused_gated_norm(*ref_leaves, EPS)
        rdx, rdg, _ = torch.autograd.grad(ref, ref_leaves, dy[:, tokens])
        assert_bitwise_or_within_ulps(out[:, tokens], ref, max_ulps=2)
        assert_bitwise_or_within_ulps(dx[:, tokens], rdx, max_ulps=None)
        assert_bitwise_or_within_ulps(dgate[:, tokens], rdg, max_ulps=2)
        exact_dx, _, _ = float64_grads(x[:, tokens], gate[:, tokens], weight, dy[:, tokens])
        assert_no_less_accurate((dx[:, tokens],), (rdx,), (exact_dx,), names=("dx",))
    exact = torch.zeros(dim, dtype=torch.float64, device="cuda")
    for start in range(0, seq, 20_000):
        tokens = slice(start, min(seq, start + 20_000))
        leaves64 = [x.detach()[:, tokens].double(), gate.detach()[:, tokens].double(),
                    weight.detach().double().requires_grad_()]
        ref = unfused_gated_norm(*leaves64, EPS)
        exact += torch.autograd.grad(ref, leaves64[2], dy[:, tokens].double())[0]
    assert relative_error(dweight, exact) < 1e-2


def test_repeat_runs_give_identical_bits():
    x, gate, weight, dy, _ = make_grad_inputs((2, 8192, 32, 128))

    def run():
        leaves = [t.detach().requires_grad_() for t in (x, gate, weight)]
        out = fgn.fused_gated_norm(*leaves, EPS)
        return (out, *torch.autograd.grad(out, leaves, dy))

    assert all(torch.equal(a, b) for a, b in zip(run(), run()))


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "one_element_off"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_d256_blocks_with_the_same_row_layout_give_the_same_bits(dtype, offset):
    """D = 256's launch block (4 rows x 4 warps) against the rule's (8 x 4): the same layout
    along a row (tests/tools/test_kernel_ir.py, on the CPU), so the same bits."""
    shape = (4, 4096, 16, 256)
    x, gate, weight, _, _ = make_grad_inputs(shape, dtype=dtype)
    x, gate, weight = x.detach(), gate.detach(), weight.detach()
    if offset:
        x = shifted(x, offset)
    assert tuple(gated_norm_launch.forward_launch(256, torch.device("cuda"))[:2]) != (8, 4)
    default = fgn.forward_impl(x, gate, weight, EPS)
    rule = fgn.forward_impl(x, gate, weight, EPS, bt=8, warps=4)
    assert all(torch.equal(a, b) for a, b in zip(default, rule))


def _forget_launch_rules(launch) -> None:
    """Clear gated_norm_launch's caches and the launch plans made from them."""
    for rule in (launch.forward_launch, launch.backward_launch,
                 launch.programmatic_dependent_launch):
        rule.cache_clear()
    plans._launch_plans.clear()


@pytest.fixture
def launch_rules(monkeypatch):
    """gated_norm_launch, its caches and the launch plans cleared before and after the test."""
    import core.fusions.gated_norm_launch as launch

    _forget_launch_rules(launch)
    yield launch
    monkeypatch.undo()
    _forget_launch_rules(launch)


def test_programmatic_dependent_launch_changes_no_bit(launch_rules, monkeypatch):
    """With programmatic dependent launch the forward may start before the kernel before it
    ends, and waits for its writes before loading: x and the gate come from torch kernels launched
    just before it, several steps run back to back, so a forward also starts while the previous
    step's dW sum runs. The dW sum, launched early as its backward's programs start (DW_SUM_PDL),
    waits for their partials; it is also run launched as usual. With and without PDL, every
    output has the same bits."""
    assert launch_rules.programmatic_dependent_launch(torch.device("cuda"))
    x, gate, weight, dy, _ = make_grad_inputs((1, 4096, 8, 128))

    def run():
        leaves = [(x.detach() * 1.5).requires_grad_(), (gate.detach() + 0.25).requires_grad_(),
                  weight.detach().requires_grad_()]
        out = fgn.fused_gated_norm(*leaves, EPS)
        return (out, *torch.autograd.grad(out, leaves, dy * 0.5))

    assert launch_rules.backward_launch(128, torch.device("cuda")).dw_sum_pdl
    with_pdl = [run() for _ in range(3)]
    monkeypatch.setattr(launch_rules, "DW_SUM_PDL", False)
    _forget_launch_rules(launch_rules)
    assert not launch_rules.backward_launch(128, torch.device("cuda")).dw_sum_pdl
    with_pdl += [run() for _ in range(3)]
    monkeypatch.setattr(launch_rules, "PROGRAMMATIC_DEPENDENT_LAUNCH", False)
    _forget_launch_rules(launch_rules)
    assert not launch_rules.programmatic_dependent_launch(torch.device("cuda"))
    without = run()
    for got in with_pdl:
        assert all(torch.equal(a, b) for a, b in zip(got, without))


@pytest.mark.parametrize("shape, block, other", [((1, 8192, 16, 128), (4, 1), (4, 2)),
                                                 ((1, 8192, 16, 128), (4, 1), (8, 4)),
                                                 ((1, 4096, 16, 256), (2, 1), (2, 2))])
def test_backward_blocks_with_the_same_row_layout_give_dx_the_same_bits(shape, block, other):
    """The backward's block against others with the same layout along a bf16 row
    (tests/tools/test_kernel_ir.py): D = 128, the swept 4 rows x 1 warp against the rule's 4 x 2
    and 8 x 4; D = 256, the swept 2 rows x 1 warp against the rule's 2 x 2. dx and
    dgate keep their bits; dW sums other per-program partials, within fp32 rounding."""
    x, gate, weight, dy, _ = make_grad_inputs(shape)
    x, gate, weight = x.detach(), gate.detach(), weight.detach()
    _, rstd = fgn.forward_impl(x, gate, weight, EPS)
    assert gated_norm_launch.backward_launch(shape[3], x.device)[:2] == block
    default = fgn.backward_impl(x, gate, weight, rstd, dy)
    wider = fgn.backward_impl(x, gate, weight, rstd, dy, bt=other[0], warps=other[1])
    assert torch.equal(default[0], wider[0]) and torch.equal(default[1], wider[1])
    assert ulp_distance(default[2], wider[2]).max().item() <= 1


def test_the_long_walk_grid_changes_no_dx_or_dgate_bit():
    """At 262k rows every program of the full grid walks more than LONG_WALK_BLOCKS row blocks,
    so the backward takes the rule's long-walk grid (6 programs per SM on an H100, 8 on an
    H200). Against both grids, dx and dgate have the same bits; dW groups its rows otherwise,
    within an ulp."""
    import core.fusions.gated_norm_launch as launch

    shape = (1, 8192, 32, 128)
    x, gate, weight, dy, _ = make_grad_inputs(shape)
    x, gate, weight = x.detach(), gate.detach(), weight.detach()
    _, rstd = fgn.forward_impl(x, gate, weight, EPS)
    cfg = gated_norm_launch.backward_launch(shape[3], x.device)
    blocks = x.shape[:3].numel() // cfg.bt
    assert blocks >= launch.LONG_WALK_BLOCKS * cfg.max_programs
    default = fgn.backward_impl(x, gate, weight, rstd, dy)
    sms = launch.sm_count(x.device)
    for per_sm in (launch.BACKWARD_PROGRAMS_PER_SM, launch.LOW_BANDWIDTH_PROGRAMS_PER_SM):
        other = fgn.backward_impl(x, gate, weight, rstd, dy, programs=per_sm * sms)
        assert torch.equal(default[0], other[0]) and torch.equal(default[1], other[1])
        assert ulp_distance(default[2], other[2]).max().item() <= 1


def test_cuda_graph_replay_matches_eager():
    """Forward + backward captured in one graph (the gate slice taken inside the captured step,
    as a model does), replayed on new data: the same bits as an eager step."""
    b, s, h, d = 2, 512, 8, 128
    inputs = make_grad_inputs((b, s, h, d), "strided_gate")
    # Keep no gate view made before the capture: it would keep packed's gradient accumulator,
    # made on the default stream, alive, and capture forbids work on the legacy stream.
    x, weight, dy, leaves = inputs[0], inputs[2], inputs[3], inputs[4]
    del inputs
    packed = leaves[1]

    def step():
        out = fgn.fused_gated_norm(x, packed[..., h * d:].unflatten(-1, (h, d)), weight, EPS)
        return (out, *torch.autograd.grad(out, leaves, dy))

    graph, captured = capture(step, warmup=2)
    with torch.no_grad():
        for t in leaves:
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, step()))


def test_compile_fullgraph_with_inductor_matches_eager():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x, g, w, dy, leaves = make_grad_inputs((2, 256, 8, 128), "strided_gate")
    dy_sbhd = dy.transpose(0, 1).contiguous()

    def layer(x, g, w):
        return fgn.fused_gated_norm(x, g, w, EPS, out_layout="sbhd").transpose(0, 1) * 2.0

    out = torch.compile(layer, fullgraph=True)(x, g, w)  # raises on any graph break
    grads = torch.autograd.grad(out, leaves, dy_sbhd)
    ref = layer(x, g, w)
    ref_grads = torch.autograd.grad(ref, leaves, dy_sbhd)
    assert sum(counters["graph_break"].values()) == 0
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def compiled_binaries(kernel) -> int:
    """Number of compiled binaries of a @triton.jit kernel (triton 3.x: device_caches)."""
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_new_token_count_compiles_nothing(batch, layout):
    """Forward + backward at nine token counts (32k to 786k rows) after one call: no new binary
    of either kernel."""
    jitted = (kernels.gated_norm_fwd, kernels.gated_norm_bwd)

    def step(seq):
        x, g, w, dy, leaves = make_grad_inputs((batch, seq, 32, 128), "strided_gate")
        torch.autograd.grad(fgn.fused_gated_norm(x, g, w, EPS, out_layout=layout), leaves, dy)

    step(1000)
    before = [compiled_binaries(k) for k in jitted]
    for seq in (1001, 1234, 2048, 3001, 4096, 4097, 7777, 8192, 12289):
        step(seq)
    assert [compiled_binaries(k) for k in jitted] == before
