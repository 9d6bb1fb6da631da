"""The fused pre-recurrence region on a CUDA GPU at Qwen3-Next's per-rank sizes (16 key and 32
value heads of dim 128, conv width 4, at TP 1, 4 and 8; S = 4096): parity with megatron's eager
steps (FLA's causal_conv1d and l2norm, or torch's conv1d in deterministic mode), gradients
against float64, repeatable bits, packed sequences against each sequence alone, CUDA-graph
replay and torch.compile. The same properties at small sizes run on the CPU:
test_fused_pre_gated_delta_rule.py."""

from __future__ import annotations

import pytest
import torch

import core.fusions.fused_pre_gated_delta_rule as fpg
from core.fusions.fused_pre_gated_delta_rule import fused_pre_gated_delta_rule
from core.fusions.pre_gated_delta_rule_reference import unfused_pre_gated_delta_rule
from tests.gated_norm_checks import assert_bitwise_or_within_ulps, assert_no_less_accurate
from tests.pre_gated_delta_rule_inputs import (GRAD_NAMES, OUTPUT_NAMES, Region,
                                               assert_each_sequence_equals_it_alone,
                                               float64_region_grads, make_cotangents,
                                               make_region, region_grads)
from tools.bench_common import capture

pytestmark = pytest.mark.gpu

TP1, TP4, TP8 = (Region(16 // tp, 32 // tp, 128, 128, 4) for tp in (1, 4, 8))
SEQ = 4096
# q and k: the conv's fp32 sum in another order than FLA's may move the activation one ulp,
# which the L2 norm's rounding can carry to two
MAX_ULPS = dict(q=2, k=2, v=1, beta=1)


def megatron_kernels(conv: str) -> dict:
    """The reference's keywords for megatron's steps: FLA's l2norm, and FLA's causal_conv1d
    ("fla") or torch's conv1d then SiLU (megatron's deterministic_mode: conv_rounding
    "twice")."""
    from fla.modules.l2norm import l2norm

    if conv == "torch":
        return dict(l2norm=l2norm, conv_rounding="twice")
    from fla.modules.convolution import causal_conv1d

    return dict(l2norm=l2norm, causal_conv1d=causal_conv1d)


def assert_parity(outputs, reference):
    """>= 99.9 % of q, k, v, beta bitwise equal and within MAX_ULPS; gate and g bitwise (g is
    torch's ``-A_log.exp() * F.softplus(alpha.float() + dt_bias)``: libdevice's exp and
    log1p)."""
    for name, out, ref in zip(OUTPUT_NAMES, outputs, reference, strict=True):
        if name in ("gate", "g"):
            assert torch.equal(out, ref), name
        else:
            assert_bitwise_or_within_ulps(out, ref, MAX_ULPS[name], min_bitwise=0.999)


def assert_accuracy(grads, reference_grads, exact_grads):
    """Each gradient no less accurate against float64 than the reference path's."""
    kept = [(n, g, r, e) for n, g, r, e in zip(GRAD_NAMES, grads, reference_grads, exact_grads)
            if g is not None]
    names, grads, reference_grads, exact_grads = zip(*kept)
    assert_no_less_accurate(grads, reference_grads, exact_grads, names=names)


PARITY_CASES = [("tp1", TP1, False, "fla"), ("tp4", TP4, False, "fla"),
                ("tp8", TP8, False, "fla"), ("tp8-conv_bias", TP8, True, "fla"),
                ("tp4-deterministic_conv", TP4, False, "torch")]


@pytest.mark.parametrize("region, bias, conv", [c[1:] for c in PARITY_CASES],
                         ids=[c[0] for c in PARITY_CASES])
def test_parity_with_megatrons_eager_steps(region, bias, conv):
    """bf16, B = 1, S = 4096, qkvzba the bshd view of in_proj's sbhd output: the outputs
    against megatron's steps (assert_parity), every gradient no less accurate against
    float64 than theirs."""
    options = dict(conv_rounding="twice") if conv == "torch" else {}
    inputs = make_region(region, 1, SEQ, torch.bfloat16, bias=bias, seed=1)
    outputs, grads = region_grads(fused_pre_gated_delta_rule, inputs, region, **options)
    cotangents = make_cotangents(outputs)  # the ones region_grads used
    ref_outputs, ref_grads = region_grads(unfused_pre_gated_delta_rule, inputs, region,
                                          cotangents, **megatron_kernels(conv))
    _, exact_grads = float64_region_grads(inputs, region, cotangents)
    assert_parity(outputs, ref_outputs)
    assert_accuracy(grads, ref_grads, exact_grads)


@pytest.mark.parametrize("batch, packed", [(2, False), (1, True)], ids=["bshd", "packed"])
def test_repeat_runs_give_the_same_bits(batch, packed):
    """Two forward and backward runs at TP 1's sizes: every output and gradient bitwise
    equal (every sum in a fixed order, no atomics)."""
    inputs = make_region(TP1, batch, SEQ, torch.bfloat16, seed=3)
    options = dict(cu_seqlens=_cu_seqlens(UNEQUAL)) if packed else {}
    first, first_grads = region_grads(fused_pre_gated_delta_rule, inputs, TP1, **options)
    second, second_grads = region_grads(fused_pre_gated_delta_rule, inputs, TP1,
                                        make_cotangents(first), **options)
    for a, b in zip(first + first_grads, second + second_grads):
        assert torch.equal(a, b)


UNEQUAL = [0, 1, 3, 1000, 1001, 2500, SEQ]  # lengths 1 and 2 shorter than the conv width


def _cu_seqlens(bounds):
    return torch.tensor(bounds, dtype=torch.int32, device="cuda")


def test_packed_sequences():
    """B = 1 with cu_seqlens at TP 4's sizes: parity with megatron's steps on the same packed
    input, gradients no less accurate, and each sequence's outputs and d(qkvzba) bitwise those
    of the fused function on that sequence alone."""
    region = TP4
    cu_seqlens = _cu_seqlens(UNEQUAL)
    inputs = make_region(region, 1, SEQ, torch.bfloat16, seed=4)
    outputs, grads = region_grads(fused_pre_gated_delta_rule, inputs, region,
                                  cu_seqlens=cu_seqlens)
    cotangents = make_cotangents(outputs)
    ref_outputs, ref_grads = region_grads(unfused_pre_gated_delta_rule, inputs, region,
                                          cotangents, cu_seqlens=cu_seqlens,
                                          **megatron_kernels("fla"))
    _, exact_grads = float64_region_grads(inputs, region, cotangents, cu_seqlens=cu_seqlens)
    assert_parity(outputs, ref_outputs)
    assert_accuracy(grads, ref_grads, exact_grads)
    assert_each_sequence_equals_it_alone(outputs, grads, inputs, region, UNEQUAL, cotangents)


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "packed"])
def test_backward_chunks_give_the_same_bits(packed, monkeypatch):
    """d(qkvzba) at TP 8's sizes bitwise equal with chunks of 16, 64 and 256 tokens, 1 to 4
    tokens per loop step and loads up to 2 steps ahead: each chunk computes the K - 1 dpre rows
    after it itself."""
    batch, options = (1, dict(cu_seqlens=_cu_seqlens(UNEQUAL))) if packed else (2, {})
    inputs = make_region(TP8, batch, SEQ, torch.bfloat16, seed=5)
    default = fpg.launch_for
    results = {}
    for chunk, rows, stages in ((16, 1, 1), (64, 4, 3), (256, 2, 2)):
        monkeypatch.setattr(fpg, "launch_for", lambda *args, chunk=chunk, rows=rows, stages=stages:
                            default(*args)._replace(backward_chunk=chunk, backward_rows=rows,
                                                    backward_stages=stages))
        _, grads = region_grads(fused_pre_gated_delta_rule, inputs, TP8, **options)
        results[chunk] = grads[0]
    for chunk, dx in results.items():
        assert torch.equal(dx, results[16]), chunk


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "packed"])
def test_two_warp_backward(packed, monkeypatch):
    """The backward in two-warp programs (2 channels a lane; the L2 norm's sums cross the warps)
    at TP 4's sizes: every gradient no less accurate against float64 than megatron's steps, and
    d(qkvzba)'s v slice bitwise the one-warp default's (per channel, no sum across channels)."""
    region = TP4
    options = dict(cu_seqlens=_cu_seqlens(UNEQUAL)) if packed else {}
    inputs = make_region(region, 1, SEQ, torch.bfloat16, seed=7)
    outputs, default_grads = region_grads(fused_pre_gated_delta_rule, inputs, region, **options)
    cotangents = make_cotangents(outputs)
    default = fpg.launch_for
    monkeypatch.setattr(fpg, "launch_for", lambda *args: default(*args)._replace(
        backward_warps=2, backward_stages=2))
    _, grads = region_grads(fused_pre_gated_delta_rule, inputs, region, cotangents, **options)
    _, ref_grads = region_grads(unfused_pre_gated_delta_rule, inputs, region, cotangents,
                                **options, **megatron_kernels("fla"))
    _, exact_grads = float64_region_grads(inputs, region, cotangents, **options)
    assert_accuracy(grads, ref_grads, exact_grads)
    v = slice(2 * region.key_heads * region.key_dim, region.conv_channels)
    assert torch.equal(grads[0][..., v], default_grads[0][..., v])


def test_cuda_graph_replay_matches_eager():
    """Forward + backward captured in one graph (bshd, B = 2, no cu_seqlens), replayed on new
    values of every input: the same bits as an eager step on them."""
    region = TP4
    inputs = make_region(region, 2, 1024, torch.bfloat16, bias=True, seed=5)
    # cotangents from a forward without autograd: no view of a leaf made before the capture
    cotangents = make_cotangents(fused_pre_gated_delta_rule(*inputs, **region.heads()))
    leaves = inputs.map(lambda t: t.detach().clone().requires_grad_())

    def step():
        outputs = fused_pre_gated_delta_rule(*leaves, **region.heads())
        return (*outputs, *torch.autograd.grad(outputs, list(leaves), cotangents))

    graph, captured = capture(step, warmup=2)
    new = make_region(region, 2, 1024, torch.bfloat16, bias=True, seed=6)
    with torch.no_grad():
        for leaf, value in zip(leaves, new):
            leaf.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))


def test_compile_matches_eager():
    """torch.compile (fullgraph=False, inductor) of a block that calls the region between
    elementwise ops that round alike in both: outputs and gradients bitwise the eager
    block's."""
    torch._dynamo.reset()
    region = TP8
    inputs = make_region(region, 2, 512, torch.bfloat16, seed=7)

    def block(*tensors, **options):
        q, k, v, gate, g, beta = fused_pre_gated_delta_rule(*tensors, **options)
        return q * 2, k + 1, v, gate * 3, g * 0.5, beta

    compiled, compiled_grads = region_grads(torch.compile(block, fullgraph=False), inputs,
                                            region)
    eager, eager_grads = region_grads(block, inputs, region, make_cotangents(compiled))
    for a, b in zip(compiled + compiled_grads, eager + eager_grads):
        if a is not None:
            assert torch.equal(a, b)
