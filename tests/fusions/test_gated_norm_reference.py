"""The plain-torch references every other test measures against
(core/fusions/gated_norm_reference.py):
``ulp_distance`` on pairs whose distance is known from the format itself, and
``unfused_gated_norm`` against megatron's own ``_GDNBase._apply_gated_norm``, run as written."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from core.fusions.gated_norm_reference import relative_error, ulp_distance, unfused_gated_norm
from core.testing.gdn import eager_megatron_gdn
from core.transformer import RMSNorm
from tests.gated_norm_inputs import EPS, make_inputs

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _step(t: torch.Tensor, n: int, toward: float) -> torch.Tensor:
    """``t`` moved ``n`` representable values toward ``toward`` (torch.nextafter, n times)."""
    target = torch.full_like(t, toward)
    for _ in range(n):
        t = torch.nextafter(t, target)
    return t


def _smallest_subnormal(dtype) -> float:
    finfo = torch.finfo(dtype)
    return finfo.tiny * finfo.eps  # 2**(min_exp - 1 - mantissa bits)


# ------------------------------------------------------------------------------------ ulp_distance


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2])
def test_neighbours_built_by_nextafter_are_n_ulps_apart(dtype, n):
    gen = torch.Generator().manual_seed(0)
    scales = 10.0 ** torch.randint(-3, 4, (2000,), generator=gen)
    a = (torch.randn(2000, generator=gen) * scales).to(dtype)
    a = torch.cat([a, torch.tensor([1.0, -1.0, torch.finfo(dtype).tiny, torch.finfo(dtype).max / 2],
                                   dtype=dtype)])
    for toward in (float("inf"), float("-inf")):
        b = _step(a, n, toward)
        want = torch.full(a.shape, n, dtype=ulp_distance(a, a).dtype)
        assert torch.equal(ulp_distance(a, b), want)
        assert torch.equal(ulp_distance(b, a), ulp_distance(a, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_distance_over_a_binade_counts_its_mantissa_values(dtype):
    """1 and 2 are 1 / eps values apart (one binade: 2**mantissa bits); 1 and 4 twice that; a
    distance that a cap at any small number would hide."""
    one = torch.tensor([1.0, -1.0], dtype=dtype)
    per_binade = round(1 / torch.finfo(dtype).eps)
    assert ulp_distance(one, 2 * one).tolist() == [per_binade, per_binade]
    assert ulp_distance(one, 4 * one).tolist() == [2 * per_binade, 2 * per_binade]
    assert ulp_distance(one[:1], one[1:]).item() > 2 * per_binade  # across zero: far apart


@pytest.mark.parametrize("dtype", DTYPES)
def test_distance_across_zero_counts_the_values_in_between(dtype):
    """k and -j smallest subnormals are k + j values apart (+0 and -0 are one point), whatever
    the direction."""
    tiny = _smallest_subnormal(dtype)
    k = torch.tensor([1.0, 1.0, 2.0, 5.0, 3.0], dtype=torch.float64)
    j = torch.tensor([1.0, 2.0, 2.0, 0.0, 7.0], dtype=torch.float64)
    pos, neg = (k * tiny).to(dtype), (-j * tiny).to(dtype)
    assert torch.equal(pos.double() / tiny, k) and torch.equal(-neg.double() / tiny, j)  # exact
    want = (k + j).to(ulp_distance(pos, neg).dtype)
    assert torch.equal(ulp_distance(pos, neg), want)
    assert torch.equal(ulp_distance(neg, pos), want)
    # the same with nextafter from zero: one step up and one step down are 2 apart
    zero = torch.zeros(1, dtype=dtype)
    assert ulp_distance(_step(zero, 1, 1.0), _step(zero, 1, -1.0)).item() == 2
    assert ulp_distance(_step(zero, 3, 1.0), _step(-zero, 2, -1.0)).item() == 5


@pytest.mark.parametrize("dtype", DTYPES)
def test_signed_zeros_and_equal_values_are_zero_apart(dtype):
    zeros = torch.tensor([0.0, -0.0, 0.0, -0.0], dtype=dtype)
    other = torch.tensor([-0.0, 0.0, 0.0, -0.0], dtype=dtype)
    assert torch.signbit(zeros).tolist() == [False, True, False, True]  # really both zeros
    assert ulp_distance(zeros, other).tolist() == [0, 0, 0, 0]
    a = make_inputs((3, 64), dtype)[0]
    special = torch.tensor([float("inf"), float("-inf"), torch.finfo(dtype).max], dtype=dtype)
    for t in (a, special):
        assert ulp_distance(t, t.clone()).max().item() == 0
    # zero's neighbours: the smallest subnormals, 1 ulp from either zero
    up = _step(torch.zeros(2, dtype=dtype), 1, 1.0)
    assert ulp_distance(up, zeros[:2]).tolist() == [1, 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_is_ordered_by_its_bits_beyond_infinity(dtype):
    """ulp_distance reads bit patterns: a NaN is 0 from the same NaN and beyond +-inf from every
    number, never within 1 ulp of a finite value (callers that compare NaN positions mask them
    first). max -> inf is 1 ulp, as the format's order has it."""
    finfo = torch.finfo(dtype)
    nan = torch.tensor([float("nan")], dtype=dtype)
    assert ulp_distance(nan, nan.clone()).item() == 0
    neg_nan = torch.copysign(nan, torch.tensor(-1.0, dtype=dtype))  # torch's -nan keeps the sign
    assert torch.signbit(neg_nan).item() and ulp_distance(neg_nan, neg_nan.clone()).item() == 0
    big, inf = torch.tensor([finfo.max], dtype=dtype), torch.tensor([float("inf")], dtype=dtype)
    assert ulp_distance(big, inf).item() == 1
    for sign, n in ((1, nan), (-1, neg_nan)):
        d_inf = ulp_distance(n, sign * inf).item()
        assert d_inf >= 1
        for value in (0.0, 1.0, finfo.max, -1.0, -finfo.max):
            finite = torch.tensor([sign * abs(value)], dtype=dtype)
            assert ulp_distance(n, finite).item() == ulp_distance(finite, sign * inf).item() + d_inf


@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float64),
                                    (torch.bfloat16, torch.float32)], ids=["float64", "mixed"])
def test_other_dtypes_are_refused(dtypes):
    with pytest.raises(TypeError,
                       match="ulp_distance: a and b must have one dtype, bf16, fp16 or fp32"):
        ulp_distance(torch.zeros(2, dtype=dtypes[0]), torch.zeros(2, dtype=dtypes[1]))


# ------------------------------------------------------------------------------ unfused reference


@pytest.mark.parametrize("dtype, weight_fp32", [  # an fp32 x has an fp32 weight already
    pytest.param(torch.bfloat16, False, id="bfloat16-w_same"),
    pytest.param(torch.bfloat16, True, id="bfloat16-w_fp32"),
    pytest.param(torch.float16, False, id="float16-w_same"),
    pytest.param(torch.float16, True, id="float16-w_fp32"),
    pytest.param(torch.float32, False, id="float32"),
])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero_centered"])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_unfused_gated_norm_is_megatrons_apply_gated_norm_run_eagerly(dtype, weight_fp32,
                                                                     zero_centered, activation):
    """``unfused_gated_norm`` is what megatron-core's ``_GDNBase._apply_gated_norm`` computes,
    as written (no torch.compile): its ``out_norm`` (the repository's TE-style RMSNorm) and
    ``act_fn``, on the [B, S, H, D] inputs megatron hands it. Bit for bit."""
    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    x, gate, weight = make_inputs((2, 5, 3, 64), dtype, torch.float32 if weight_fp32 else None)
    config = types.SimpleNamespace(params_dtype=weight.dtype, use_cpu_initialization=True,
                                   layernorm_zero_centered_gamma=zero_centered,
                                   sequence_parallel=False)
    norm = RMSNorm(config, hidden_size=64, eps=EPS).to(x.device)
    with torch.no_grad():
        norm.weight.copy_(weight - 1 if zero_centered else weight)
    act_fn = {"silu": F.silu, "sigmoid": torch.sigmoid}[activation]

    def te_style_norm(rows):  # written out here too, so that rms_norm is not its own reference
        xf, w = rows.float(), weight.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w
        return y.to(torch.promote_types(rows.dtype, weight.dtype))

    with torch.no_grad(), eager_megatron_gdn():
        apply_gated_norm = _GDNBase._apply_gated_norm
        assert getattr(apply_gated_norm, "_torchdynamo_orig_callable", None) is None  # as written
        outputs = [apply_gated_norm(types.SimpleNamespace(out_norm=out_norm, act_fn=act_fn), x,
                                    gate) for out_norm in (norm, te_style_norm)]
        ours = unfused_gated_norm(x, gate, norm.weight, EPS, zero_centered, activation)
    assert ours.dtype == dtype and ours.shape == x.shape
    for megatron in outputs:
        assert megatron.dtype == dtype and megatron.shape == (2 * 5 * 3, 64)
        assert torch.equal(ours.reshape(-1, 64), megatron)


def test_relative_error_is_measured_against_the_exact_value():
    exact = torch.tensor([3.0, 4.0])
    assert relative_error(2 * exact, exact) == pytest.approx(1.0)  # ||x|| / ||x||
    assert relative_error(exact / 2, exact) == pytest.approx(0.5)  # not / ||approx||
    assert relative_error(exact, exact) == 0.0
