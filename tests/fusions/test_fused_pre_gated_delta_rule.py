"""The fused pre-recurrence region (core/fusions/fused_pre_gated_delta_rule.py) at small sizes
(the Triton interpreter without a GPU): outputs and gradients against the unfused reference
(core/fusions/pre_gated_delta_rule_reference.py) in fp32, bf16 and fp16 over its options, sizes
and layouts; repeatable bits; packed sequences against each sequence run alone; empty inputs;
every bad argument refused, by name and rule, before any launch; the gate a view of the input.
The same at model sizes on a GPU: test_fused_pre_gated_delta_rule_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch

import core.fusions.fused_pre_gated_delta_rule as fpg
from core.fusions.fused_pre_gated_delta_rule import (RegionShape, check_pre_gated_delta_rule,
                                                     fused_pre_gated_delta_rule, launch_for,
                                                     sequence_starts)
from core.fusions.gated_norm_reference import ulp_distance
from core.fusions.pre_gated_delta_rule_reference import unfused_pre_gated_delta_rule
from tests.gated_norm_checks import assert_bitwise_or_within_ulps, assert_no_less_accurate
from tests.gated_norm_inputs import DEVICE
from tests.pre_gated_delta_rule_inputs import (GRAD_NAMES, OUTPUT_NAMES, Region,
                                               assert_each_sequence_equals_it_alone,
                                               float64_region_grads, make_cotangents,
                                               make_region, region_grads)

# g is fp32 from exp and log1p: the interpreter's (NumPy's exp and log) against torch's expf
# and log1pf differ by a few fp32 ulps (measured: up to 4); compiled, libdevice's are torch's.
G_ULPS = 8
# In bf16 / fp16 the conv's fp32 sum (taps in order, then the bias) may round one element of
# the activation one ulp away from torch's conv1d; q and k carry it through the L2 norm's own
# rounding (2 ulps seen in fp16).
QK_ULPS, V_ULPS = 2, 1
MIN_BITWISE = 0.99


def assert_outputs_match(fused, reference):
    """(q, k, v, gate, g, beta) of the fused function against the reference's: fp32 within
    1e-5; bf16 / fp16 at least MIN_BITWISE bitwise equal and within a couple of ulps; g within
    G_ULPS fp32 ulps; the gate the same bits."""
    for name, out, ref in zip(OUTPUT_NAMES, fused, reference, strict=True):
        assert out.dtype == ref.dtype and out.shape == ref.shape, (name, out.dtype, out.shape)
        if name == "gate":
            assert torch.equal(out, ref)
        elif name == "g":
            assert out.dtype == torch.float32
            if out.numel():
                assert ulp_distance(out, ref).max().item() <= G_ULPS
        elif out.dtype == torch.float32:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=name)
        else:
            assert_bitwise_or_within_ulps(out, ref, QK_ULPS if name in ("q", "k") else V_ULPS,
                                          MIN_BITWISE)


def assert_grads_match(fused, reference, exact):
    """The five gradients: fp32 ones within 1e-5 of the reference's autograd (relative to the
    largest element: the sums run in another order); low-precision ones no less accurate
    against float64 (``exact``) than the reference's."""
    low = []
    for name, got, want, wide in zip(GRAD_NAMES, fused, reference, exact, strict=True):
        assert (got is None) == (want is None), name
        if got is None:
            continue
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
        if got.dtype == torch.float32 and fused[0].dtype == torch.float32:
            scale = want.abs().max().item() if want.numel() else 0.0
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=name)
        else:
            low.append((name, got, want, wide))
    if low:
        names, got, want, wide = zip(*low)
        assert_no_less_accurate(got, want, wide, names=names)


def compare_with_reference(inputs, region, **options):
    """Fused and reference forward and backward on ``inputs`` with the same cotangents, checked
    by assert_outputs_match and assert_grads_match. Returns the fused outputs and gradients."""
    outputs, grads = region_grads(fused_pre_gated_delta_rule, inputs, region, **options)
    cotangents = make_cotangents(outputs)
    ref_outputs, ref_grads = region_grads(unfused_pre_gated_delta_rule, inputs, region,
                                          cotangents, **options)
    _, exact_grads = float64_region_grads(inputs, region, cotangents, **options)
    assert_outputs_match(outputs, ref_outputs)
    assert_grads_match(grads, ref_grads, exact_grads)
    return outputs, grads


# ----------------------------------------------------------------------- against the reference

# (id, region, batch, seq, make_region keywords, options). Each option value runs in one case
# at least (a few per case keep the interpreter's time down); every case in fp32 and bf16, the
# first two also in fp16. S = 37: three forward blocks and three backward chunks of 16 tokens;
# B = 2 in the bshd view of an sbhd buffer (megatron's layout) and as a contiguous bshd tensor.
CASES = [
    ("base", Region(), 2, 37, {}, {}),
    ("twice", Region(), 1, 37, {}, dict(conv_rounding="twice")),
    ("no_bias-repeat1-width3", Region(key_heads=2, value_heads=2, width=3), 1, 37,
     dict(bias=False), {}),
    ("repeat4-width2-no_l2norm", Region(key_heads=1, value_heads=4, width=2), 1, 37, {},
     dict(use_qk_l2norm=False)),
    ("head_dims_12_24-bshd_contiguous", Region(key_dim=12, value_dim=24), 2, 20,
     dict(layout="bshd"), {}),
]
DTYPE_CASES = ([(case, torch.float32) for case in CASES]
               + [(case, torch.bfloat16) for case in CASES]
               + [(CASES[0], torch.float16), (CASES[1], torch.float16)])


@pytest.mark.parametrize("case, dtype", DTYPE_CASES,
                         ids=[f"{case[0]}-{str(dtype)[6:]}" for case, dtype in DTYPE_CASES])
def test_matches_the_reference(case, dtype):
    """The outputs and the gradients of qkvzba, the conv weight and bias, A_log and dt_bias
    against the unfused reference."""
    _, region, batch, seq, make_kwargs, options = case
    inputs = make_region(region, batch, seq, dtype, **make_kwargs)
    sbhd_view = make_kwargs.get("layout", "sbhd") == "sbhd"
    assert inputs.qkvzba.is_contiguous() == (batch == 1 or not sbhd_view)
    _, grads = compare_with_reference(inputs, region, **options)
    # d(qkvzba) laid out as qkvzba's buffer: in_proj's backward reads it contiguous
    assert (grads[0].transpose(0, 1) if sbhd_view else grads[0]).is_contiguous()


# Backward chunks over S = 37: of 5 tokens (8 chunks, shorter than the conv's window K - 1 = 3
# plus one), of 16 (3, the last short), and one chunk; loop steps of 1 to 3 tokens; 2 warps and
# loads 2 or 3 steps ahead (compiled: the interpreter runs them as the default); the partial
# rows summed 2 to 64 at a time over 32 to 256 columns a program.
@pytest.mark.parametrize("chunk, rows, warps, stages, sums", [
    (5, 1, 1, 1, (32, 2)), (16, 3, 2, 3, (256, 8)), (64, 2, 1, 2, (64, 64))])
@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "packed"])
def test_backward_chunks(chunk, rows, warps, stages, sums, packed, monkeypatch):
    """Other backward launches against the reference, and d(qkvzba) the same bits as the
    default launch's (only dw's partials follow the chunks)."""
    region = Region()
    if packed:
        region, inputs, cu_seqlens = _packed_inputs(UNEQUAL, torch.bfloat16)
        options = dict(cu_seqlens=cu_seqlens)
    else:
        inputs, options = make_region(region, 2, 37, torch.bfloat16), {}
    _, default_grads = region_grads(fused_pre_gated_delta_rule, inputs, region, **options)
    default = fpg.launch_for
    monkeypatch.setattr(fpg, "launch_for", lambda *args: default(*args)._replace(
        backward_chunk=chunk, backward_rows=rows, backward_warps=warps, backward_stages=stages,
        sum_columns=sums[0], sum_rows=sums[1]))
    _, grads = compare_with_reference(inputs, region, **options)
    assert torch.equal(grads[0], default_grads[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_parameters_with_low_precision_activations(dtype):
    """fp32 conv weight and bias, A_log and dt_bias beside bf16 / fp16 activations: g takes
    exp(A_log) in fp32, the parameter gradients are fp32."""
    region = Region()
    inputs = make_region(region, 1, 37, dtype, param_dtype=torch.float32)
    _, grads = compare_with_reference(inputs, region)
    assert grads[0].dtype == dtype
    assert all(g.dtype == torch.float32 for g in grads[1:])


def test_conv_weight_layouts_give_the_same_bits():
    """The conv weight as [C, K], as [C, 1, K] and as a strided [C, 1, K] view (of a [K, C]
    buffer): the same outputs and gradients, each gradient in its weight's shape."""
    region = Region()
    inputs = make_region(region, 1, 20, torch.bfloat16)
    channels = region.conv_channels
    weight = inputs.conv_weight
    flat = weight.view(channels, region.width)
    strided = flat.t().contiguous().t().unsqueeze(1)
    assert not strided.is_contiguous()
    outputs, grads = region_grads(fused_pre_gated_delta_rule, inputs, region)
    cotangents = make_cotangents(outputs)
    for other in (flat, strided):
        other_outputs, other_grads = region_grads(
            fused_pre_gated_delta_rule, inputs._replace(conv_weight=other), region, cotangents)
        assert all(torch.equal(a, b) for a, b in zip(outputs, other_outputs))
        assert other_grads[1].shape == other.shape
        assert torch.equal(other_grads[1].reshape(weight.shape), grads[1])
        for a, b in zip(grads[:1] + grads[2:], other_grads[:1] + other_grads[2:]):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ autograd


def _slices(region: Region) -> dict:
    """Each output's span of qkvzba's features (q, k, v: their conv channels)."""
    qk, vd, hv = region.key_heads * region.key_dim, region.value_heads * region.value_dim, \
        region.value_heads
    bounds = [0, qk, 2 * qk, 2 * qk + vd, 2 * qk + 2 * vd, 2 * qk + 2 * vd + hv,
              2 * qk + 2 * vd + 2 * hv]
    spans = dict(zip(("q", "k", "v", "gate", "beta", "g"), zip(bounds[:-1], bounds[1:])))
    return {name: slice(*span) for name, span in spans.items()}


@pytest.mark.parametrize("used", ["q", "k", "v", "gate", "g", "beta"])
def test_only_one_output_used(used):
    """Only one output enters the loss: the gradient of qkvzba is zero outside that output's
    features (the gate's slice is the gate's gradient itself), the conv weight and bias get
    gradient only in that output's channels, A_log and dt_bias only through g; the rest equals
    the reference's."""
    region = Region()
    inputs = make_region(region, 1, 20, torch.float32)
    outputs = unfused_pre_gated_delta_rule(*inputs, **region.heads())  # for the shapes
    cotangents = [c if name == used else None
                  for name, c in zip(OUTPUT_NAMES, make_cotangents(outputs))]
    _, grads = region_grads(fused_pre_gated_delta_rule, inputs, region, cotangents)
    _, ref_grads = region_grads(unfused_pre_gated_delta_rule, inputs, region, cotangents)
    dqkvzba, dweight, dbias, da_log, ddt_bias = grads
    span = _slices(region)[used]
    outside = torch.ones(region.features, dtype=torch.bool)
    outside[span] = False
    assert torch.count_nonzero(dqkvzba[..., outside]) == 0
    assert torch.count_nonzero(dqkvzba[..., span]) > 0
    if used == "gate":
        assert torch.equal(dqkvzba[..., span], cotangents[3].reshape(1, 20, -1))
    conv_used = used in ("q", "k", "v")
    channels = torch.zeros(region.conv_channels, dtype=torch.bool)
    if conv_used:
        channels[span] = True
    assert torch.count_nonzero(dweight[~channels]) == 0
    assert torch.count_nonzero(dbias[~channels]) == 0
    assert bool((dweight[channels] != 0).any()) == conv_used
    assert torch.count_nonzero(da_log) == torch.count_nonzero(ddt_bias) == (
        region.value_heads if used == "g" else 0)
    assert_grads_match(grads, ref_grads, (None,) * 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_gradient_is_the_incoming_gradient(dtype):
    """The gate slice of d(qkvzba) holds the gate's gradient bit for bit, the other outputs
    used too."""
    region = Region()
    inputs = make_region(region, 2, 5, dtype)
    outputs = fused_pre_gated_delta_rule(*inputs, **region.heads())
    cotangents = make_cotangents(outputs, seed=4)
    dqkvzba = region_grads(fused_pre_gated_delta_rule, inputs, region, cotangents)[1][0]
    assert torch.equal(dqkvzba[..., _slices(region)["gate"]], cotangents[3].reshape(2, 5, -1))


def test_expanded_output_gradients(monkeypatch):
    """A loss that sums the outputs hands the backward expanded (zero-stride) gradients: the
    same bits as the materialized ones."""
    region = Region()
    inputs = make_region(region, 1, 9, torch.bfloat16)
    leaves = inputs.map(lambda t: t.detach().clone().requires_grad_())
    outputs = fused_pre_gated_delta_rule(*leaves, **region.heads())
    strides = []
    real = fpg.output_gradients

    def spy(qkvzba, shape, *grads):
        strides.extend(grad.stride() for grad in grads)
        return real(qkvzba, shape, *grads)

    monkeypatch.setattr(fpg, "output_gradients", spy)
    sum(o.sum() for o in outputs).backward()
    monkeypatch.undo()
    assert len(strides) == 5 and all(set(s) == {0} for s in strides)
    ones = [torch.ones_like(o) for o in outputs]
    _, grads = region_grads(fused_pre_gated_delta_rule, inputs, region, ones)
    for name, leaf, want in zip(GRAD_NAMES, leaves, grads):
        assert torch.equal(leaf.grad, want), name


def test_repeat_runs_give_the_same_bits():
    """Two forward and backward runs on the same inputs: every output and gradient bitwise
    equal (every sum in a fixed order)."""
    region = Region()
    inputs = make_region(region, 2, 20, torch.bfloat16)
    first, first_grads = region_grads(fused_pre_gated_delta_rule, inputs, region)
    second, second_grads = region_grads(fused_pre_gated_delta_rule, inputs, region,
                                        make_cotangents(first))
    for a, b in zip(first + first_grads, second + second_grads):
        assert torch.equal(a, b)


def test_every_buffer_element_is_written():
    """The outputs, the gradient buffer and the fp32 partials start uninitialised: with torch
    filling new memory with NaN (deterministic algorithms), the results are unchanged."""
    region = Region()
    inputs = make_region(region, 2, 20, torch.float32)
    plain, plain_grads = region_grads(fused_pre_gated_delta_rule, inputs, region)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        filled, filled_grads = region_grads(fused_pre_gated_delta_rule, inputs, region,
                                            make_cotangents(plain))
    finally:
        torch.use_deterministic_algorithms(saved)
    for a, b in zip(plain + plain_grads, filled + filled_grads):
        assert torch.equal(a, b)


def test_double_backward_raises():
    """The backward is not differentiable (Triton kernels): a second derivative raises instead
    of holding only the part that flows through the gate's gradient."""
    region = Region()
    inputs = make_region(region, 1, 3, torch.float32)
    qkvzba = inputs.qkvzba.detach().requires_grad_()
    outputs = fused_pre_gated_delta_rule(qkvzba, *inputs[1:], **region.heads())
    cotangents = [c.requires_grad_() for c in make_cotangents(outputs)]
    (dqkvzba,) = torch.autograd.grad(outputs, qkvzba, cotangents, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dqkvzba.sum().backward()


def test_gate_is_a_view_of_qkvzba():
    """The gate output shares qkvzba's storage at the gate slice (no copy), with or without
    autograd."""
    region = Region()
    inputs = make_region(region, 2, 5, torch.bfloat16)
    gate_start = _slices(region)["gate"].start
    for qkvzba in (inputs.qkvzba, inputs.qkvzba.detach().requires_grad_()):
        gate = fused_pre_gated_delta_rule(qkvzba, *inputs[1:], **region.heads())[3]
        assert gate.untyped_storage().data_ptr() == qkvzba.untyped_storage().data_ptr()
        assert gate.data_ptr() == qkvzba[..., gate_start].data_ptr()
        assert gate.shape == (2, 5, region.value_heads, region.value_dim)
        assert torch.equal(gate.reshape(2, 5, -1), qkvzba[..., _slices(region)["gate"]])


# ----------------------------------------------------------------------------- packed sequences

UNEQUAL = [0, 1, 3, 16, 17, 40]  # lengths 1, 2, 13, 1, 23: two shorter than the conv width
PADDED = [0, 8, 16, 32, 40]  # lengths 5, 8, 11, 2 padded with zeros to multiples of 8
PADDED_LENGTHS = [5, 8, 11, 2]


def _packed_inputs(bounds, dtype):
    region = Region()
    inputs = make_region(region, 1, bounds[-1], dtype)
    if bounds is PADDED:
        qkvzba = inputs.qkvzba.clone()
        for start, end, length in zip(bounds[:-1], bounds[1:], PADDED_LENGTHS):
            qkvzba[:, start + length:end] = 0
        inputs = inputs._replace(qkvzba=qkvzba)
    # megatron's cu_seqlens are int32; int64 is accepted too
    index_dtype = torch.int32 if bounds is PADDED else torch.int64
    return region, inputs, torch.tensor(bounds, dtype=index_dtype, device=DEVICE)


@pytest.mark.parametrize("bounds, dtype", [(UNEQUAL, torch.float32), (UNEQUAL, torch.bfloat16),
                                           (PADDED, torch.bfloat16)],
                         ids=["unequal-float32", "unequal-bfloat16", "padded-bfloat16"])
def test_packed_sequences_match_the_reference(bounds, dtype):
    """B = 1 with cu_seqlens: outputs and gradients against the reference, which runs each
    sequence on its own."""
    region, inputs, cu_seqlens = _packed_inputs(bounds, dtype)
    compare_with_reference(inputs, region, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("bounds", [UNEQUAL, PADDED], ids=["unequal", "padded"])
def test_packed_sequence_equals_it_alone(bounds):
    """Each packed sequence's outputs and d(qkvzba) bitwise those of the fused function on that
    sequence alone (B = 1, no cu_seqlens)."""
    region, inputs, cu_seqlens = _packed_inputs(bounds, torch.bfloat16)
    outputs, grads = region_grads(fused_pre_gated_delta_rule, inputs, region,
                                  cu_seqlens=cu_seqlens)
    assert_each_sequence_equals_it_alone(outputs, grads, inputs, region, bounds,
                                         make_cotangents(outputs))


@pytest.mark.parametrize("parity", [0, 1])
def test_packed_sequences_stay_apart(parity):
    """Changing the last token of every other sequence (forward) and the outputs' gradient at
    their first token (backward) changes those sequences only: the outputs and d(qkvzba) of
    the sequences between them keep their bits (the conv reads no token across a boundary,
    either way)."""
    region, inputs, cu_seqlens = _packed_inputs(UNEQUAL, torch.bfloat16)
    outputs, grads = region_grads(fused_pre_gated_delta_rule, inputs, region,
                                  cu_seqlens=cu_seqlens)
    cotangents = make_cotangents(outputs)
    qkvzba = inputs.qkvzba.clone()
    changed_cotangents = [c.clone() for c in cotangents]
    changed = torch.zeros(UNEQUAL[-1], dtype=torch.bool)
    for i in range(parity, len(UNEQUAL) - 1, 2):
        start, end = UNEQUAL[i], UNEQUAL[i + 1]
        qkvzba[:, end - 1] += 1
        for c in changed_cotangents:
            c[:, start] += 1
        changed[start:end] = True
    new_outputs, new_grads = region_grads(fused_pre_gated_delta_rule,
                                          inputs._replace(qkvzba=qkvzba), region,
                                          changed_cotangents, cu_seqlens=cu_seqlens)
    for name, a, b in zip(OUTPUT_NAMES, outputs, new_outputs):
        assert torch.equal(a[:, ~changed], b[:, ~changed]), name
        assert not torch.equal(a[:, changed], b[:, changed]), name
    assert torch.equal(grads[0][:, ~changed], new_grads[0][:, ~changed])
    assert not torch.equal(grads[0][:, changed], new_grads[0][:, changed])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_g_and_beta_at_extreme_inputs(dtype):
    """alpha + dt_bias on both sides of softplus's threshold (20) and far below it, beta_in
    where the sigmoid saturates: g, beta and their gradients against the reference."""
    region = Region(key_heads=1, value_heads=2, key_dim=4, value_dim=4, width=2)
    inputs = make_region(region, 1, 8, dtype)
    z = torch.tensor([-30.0, -16.0, -1e-3, 0.0, 19.75, 20.0, 20.25, 60.0])
    beta_in = torch.tensor([-60.0, -20.0, -8.0, 0.0, 1e-3, 8.0, 20.0, 60.0])
    qkvzba = inputs.qkvzba.clone()
    hv = region.value_heads
    alpha = z[:, None] - inputs.dt_bias.float().cpu()[None, :]
    qkvzba[0, :, -2 * hv:-hv] = beta_in[:, None].to(qkvzba)
    qkvzba[0, :, -hv:] = alpha.to(qkvzba)
    compare_with_reference(inputs._replace(qkvzba=qkvzba), region)


def test_sequence_starts():
    cu_seqlens = torch.tensor([0, 1, 3, 3, 7])
    assert sequence_starts(cu_seqlens, 7, "cpu").tolist() == [0, 1, 1, 3, 3, 3, 3]
    assert sequence_starts(cu_seqlens, 7, "cpu").dtype == torch.int32
    assert sequence_starts(None, 7, "cpu") is None


def test_region_shape_and_launch():
    shape = RegionShape(key_heads=2, value_heads=4, key_dim=12, value_dim=24, conv_width=4)
    assert shape.conv_channels == 2 * 2 * 12 + 4 * 24
    assert shape.features == shape.conv_channels + 4 * 24 + 2 * 4
    assert shape.gate_slice == slice(144, 240)
    # the backward's chunk: the longest of 16 ... 256 tokens whose programs fill 90-100 % of
    # one wave (132 SMs x 16 one-warp programs = 2112 on an H100) or make two waves or more
    assert [launch_for(shape, seq).backward_chunk for seq in (0, 1, 4096, 10**6)] == [
        16, 16, 16, 256]
    qwen = RegionShape(key_heads=16, value_heads=32, key_dim=128, value_dim=128, conv_width=4)
    chunk = {heads: launch_for(qwen._replace(key_heads=heads // 2, value_heads=heads),
                               4096).backward_chunk for heads in (32, 8, 4)}
    assert chunk == {32: 128, 8: 16, 4: 16}  # 2080 programs: one wave; 2176 would spill
    assert launch_for(qwen, 8192, batch=2).backward_chunk == 128  # 4160 programs at 256
    assert launch_for(qwen, 4096, multiprocessors=66).backward_chunk == 256  # 1040 of 1056
    # the parameter gradients' sums: the widest of 32 ... 256 columns a program that makes 264
    # programs (two per SM) of the 32832 / 8208 / 4104 partial-row columns, 2048 elements a step
    sums = {heads: launch_for(qwen._replace(key_heads=heads // 2, value_heads=heads), 4096)
            for heads in (32, 8, 4)}
    assert {h: (s.sum_columns, s.sum_rows) for h, s in sums.items()} == {
        32: (64, 32), 8: (32, 64), 4: (32, 64)}
    assert launch_for(qwen, 4096, multiprocessors=16).sum_columns == 256  # 129 programs


# -------------------------------------------------------------------------------- empty inputs


@pytest.mark.parametrize("batch, seq, bounds", [(2, 0, None), (0, 5, None), (1, 0, [0, 0])],
                         ids=["no_tokens", "no_batch", "packed_no_tokens"])
def test_empty_input(batch, seq, bounds):
    """No tokens: outputs of the right shapes, d(qkvzba) empty, the parameters' gradients
    zero."""
    region = Region()
    inputs = make_region(region, batch, seq, torch.bfloat16)
    cu_seqlens = None if bounds is None else torch.tensor(bounds, device=DEVICE)
    outputs, grads = region_grads(fused_pre_gated_delta_rule, inputs, region,
                                  cu_seqlens=cu_seqlens)
    hv = region.value_heads
    shapes = [(batch, seq, hv, region.key_dim)] * 2 + [(batch, seq, hv, region.value_dim)] * 2 \
        + [(batch, seq, hv)] * 2
    assert [tuple(o.shape) for o in outputs] == shapes
    assert grads[0].shape == inputs.qkvzba.shape
    for grad, param in zip(grads[1:], inputs[1:]):
        assert grad.shape == param.shape and torch.count_nonzero(grad) == 0


# ------------------------------------------------------------------------------------ bad input

_SMALL = Region(key_heads=1, value_heads=2, key_dim=4, value_dim=4, width=2)
_FEATURES = _SMALL.features
_CHANNELS = _SMALL.conv_channels


class _NoLaunch:
    """Stands in for a kernel: any launch fails the test."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        raise AssertionError(f"{self.name} launched")


@pytest.fixture
def no_launch(monkeypatch):
    for name in ("pre_gdr_fwd", "pre_gdr_bwd"):
        monkeypatch.setattr(fpg, name, _NoLaunch(name))


def _call(**changes):
    """fused_pre_gated_delta_rule on valid small inputs with ``changes`` applied (a callable
    change gets the valid value)."""
    inputs = make_region(_SMALL, 1, 3, torch.float32)
    args = dict(inputs._asdict(), **_SMALL.heads())
    for name, value in changes.items():
        args[name] = value(args[name]) if callable(value) else value
    tensors = [args.pop(name) for name in inputs._fields]
    return fused_pre_gated_delta_rule(*tensors, **args)


def test_valid_call_launches_under_the_stand_ins(no_launch):
    """The stand-ins catch a launch: the refusals below are made before any."""
    with pytest.raises(AssertionError, match="pre_gdr_fwd launched"):
        _call()


def _meta(t):
    return t.to("meta")


_KERNEL_DEVICE = "CUDA" if DEVICE == "cuda" else "CPU"


def _cu(values):
    return torch.tensor(values, device=DEVICE)


BAD_INPUTS = [
    ("key_heads_bool", dict(num_key_heads=True), TypeError,
     "num_key_heads must be an int, got bool"),
    ("value_heads_float", dict(num_value_heads=2.0), TypeError,
     "num_value_heads must be an int, got float"),
    ("key_dim_float", dict(key_head_dim=4.0), TypeError, "key_head_dim must be an int, got float"),
    ("value_dim_zero", dict(value_head_dim=0), ValueError, "value_head_dim must be >= 1, got 0"),
    ("key_dim_too_large", dict(key_head_dim=1025), ValueError,
     "key_head_dim must be <= 1024, got 1025"),
    ("value_heads_not_a_multiple", dict(num_key_heads=2, num_value_heads=3), ValueError,
     "num_value_heads (3) must be a multiple of num_key_heads (2)"),
    ("wrong_features", dict(qkvzba=lambda x: torch.cat([x, x[..., :1]], -1)), ValueError,
     f"qkvzba's last dim must be 2 * num_key_heads * key_head_dim + 2 * num_value_heads * "
     f"value_head_dim + 2 * num_value_heads = {_FEATURES} (q, k, v, gate, beta, alpha), got "
     f"{_FEATURES + 1}"),
    ("rank_2", dict(qkvzba=lambda x: x[0]), ValueError, "qkvzba must have rank 3"),
    ("rank_4", dict(qkvzba=lambda x: x[None]), ValueError, "qkvzba must have rank 3"),
    ("strided_features", dict(qkvzba=lambda x: x.repeat_interleave(2, -1)[..., ::2]), ValueError,
     "qkvzba's last dim must have stride 1"),
    ("int_qkvzba", dict(qkvzba=lambda x: x.to(torch.int32)), TypeError,
     "qkvzba dtype must be bf16, fp16 or fp32, got torch.int32"),
    ("float64_qkvzba", dict(qkvzba=lambda x: x.double()), TypeError,
     "qkvzba dtype must be bf16, fp16 or fp32, got torch.float64"),
    ("int_dt_bias", dict(dt_bias=lambda t: t.to(torch.int64)), TypeError,
     "dt_bias dtype must be bf16, fp16 or fp32, got torch.int64"),
    ("conv_weight_channels", dict(conv_weight=lambda w: torch.cat([w, w[:1]])), ValueError,
     f"conv_weight must have shape [{_CHANNELS}, width] or [{_CHANNELS}, 1, width]"),
    ("conv_weight_two_groups", dict(conv_weight=lambda w: w.expand(-1, 2, -1).contiguous()),
     ValueError, f"conv_weight must have shape [{_CHANNELS}, width]"),
    ("conv_weight_1d", dict(conv_weight=lambda w: w.flatten()), ValueError,
     f"conv_weight must have shape [{_CHANNELS}, width]"),
    ("conv_too_wide", dict(conv_weight=lambda w: w.new_zeros(_CHANNELS, 1, 17)), ValueError,
     "the conv width must be <= 16, got 17"),
    ("conv_bias_shape", dict(conv_bias=lambda b: b[:-1]), ValueError,
     f"conv_bias must have shape [{_CHANNELS}], got ({_CHANNELS - 1},)"),
    ("A_log_shape", dict(A_log=lambda a: torch.cat([a, a])), ValueError,
     "A_log must have shape [2] (one per value head), got (4,)"),
    ("dt_bias_shape", dict(dt_bias=lambda d: d[None]), ValueError,
     "dt_bias must have shape [2] (one per value head), got (1, 2)"),
    ("A_log_strided", dict(A_log=lambda a: a.repeat_interleave(2)[::2]), ValueError,
     "A_log must be contiguous"),
    ("conv_bias_strided", dict(conv_bias=lambda b: b.repeat_interleave(2)[::2]), ValueError,
     "conv_bias must be contiguous"),
    ("conv_rounding_not_str", dict(conv_rounding=1), TypeError,
     "conv_rounding must be a str, got int"),
    ("conv_rounding_unknown", dict(conv_rounding="thrice"), ValueError,
     "conv_rounding must be one of ('once', 'twice'), got 'thrice'"),
    ("use_qk_l2norm_str", dict(use_qk_l2norm="True"), TypeError,
     "use_qk_l2norm must be a bool (True or False), got 'True'"),
    ("use_qk_l2norm_int", dict(use_qk_l2norm=1), TypeError, "use_qk_l2norm must be a bool"),
    ("eps_zero", dict(eps=0.0), ValueError, "eps must be finite and > 0"),
    ("eps_negative", dict(eps=-1e-6), ValueError, "eps must be finite and > 0"),
    ("eps_nan", dict(eps=float("nan")), ValueError, "eps must be finite and > 0"),
    ("eps_tensor", dict(eps=torch.tensor(1e-6)), TypeError,
     "eps must be a Python float or int, got Tensor"),
    ("eps_bool", dict(eps=True), TypeError, "eps must be a Python float or int, got bool"),
    ("cu_seqlens_float", dict(cu_seqlens=_cu([0.0, 3.0])), ValueError,
     "cu_seqlens must be a 1-D int32 or int64 tensor, got torch.float32"),
    ("cu_seqlens_2d", dict(cu_seqlens=_cu([[0, 3]])), ValueError,
     "cu_seqlens must be a 1-D int32 or int64 tensor, got torch.int64 of shape (1, 2)"),
    ("cu_seqlens_one_entry", dict(cu_seqlens=_cu([0])), ValueError,
     "cu_seqlens must be on qkvzba's device with at least 2 entries, got 1"),
    ("cu_seqlens_batch_2", dict(cu_seqlens=_cu([0, 3]),
                                qkvzba=lambda x: x.expand(2, -1, -1)), ValueError,
     "packed sequences (cu_seqlens) require batch 1, got 2"),
    ("cu_seqlens_list", dict(cu_seqlens=[0, 3]), TypeError,
     "cu_seqlens must be a torch.Tensor, got list"),
    ("cu_seqlens_meta", dict(cu_seqlens=torch.tensor([0, 3], device="meta")), ValueError,
     "cu_seqlens must be on qkvzba's device"),
    ("A_log_meta", dict(A_log=_meta), ValueError, "A_log must be on qkvzba's device"),
    ("conv_weight_meta", dict(conv_weight=_meta), ValueError,
     "conv_weight must be on qkvzba's device"),
    ("qkvzba_meta", dict(qkvzba=_meta), ValueError,
     f"qkvzba must be a {_KERNEL_DEVICE} tensor"),
    ("qkvzba_list", dict(qkvzba=lambda x: x.tolist()), TypeError,
     "qkvzba must be a torch.Tensor, got list"),
    ("conv_bias_float", dict(conv_bias=0.0), TypeError,
     "conv_bias must be a torch.Tensor, got float"),
    ("dt_bias_sparse", dict(dt_bias=lambda d: d.to_sparse()), TypeError,
     "dt_bias must be a dense (strided) tensor"),
    ("A_log_negative_view", dict(A_log=lambda a: torch._neg_view(a)), ValueError,
     "A_log is a negative view"),
    ("dgate_sink_not_a_sink", dict(dgate_sink=object()), TypeError,
     "dgate_sink must be None or a GateGradientSink, got object"),
]


@pytest.mark.parametrize("changes, error, message", [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_refused_before_any_launch(changes, error, message, no_launch):
    with pytest.raises(error, match=re.escape(f"fused_pre_gated_delta_rule: {message}")):
        _call(**changes)


def test_check_returns_the_region_shape():
    inputs = make_region(_SMALL, 1, 3, torch.float32)
    shape = check_pre_gated_delta_rule(*inputs, **_SMALL.heads())
    assert shape == RegionShape(1, 2, 4, 4, 2)
