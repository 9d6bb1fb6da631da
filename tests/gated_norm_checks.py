"""The accuracy rules the gated norm's tests hold the fused paths to (docs/numerics.md), shared
by the CPU tests and the GPU checks of the kernels, the inference entry and the GDN layer:

- ``assert_bitwise_or_within_ulps``: a low-precision output against its reference, most
  elements bitwise equal and every element within a few ulps (the fp32 sum order, or the GPU's
  fast exp, may flip a rounding); fp32 outputs within 2e-6.
- ``assert_no_less_accurate``: gradients against float64 (``float64_grads``), the fused error
  at most the unfused one's plus 1 % (dW is summed in another, fixed order).
- ``fp32_loss_tolerance``: how far the fp32 losses of a model run flag on and flag off may
  be apart after a few steps.
- ``assert_language_model_matches_unfused``: a language model (GPTModel, HybridModel) with the
  flag on against the same weights with it off, one forward and backward: loss and every
  gradient within fp32 rounding.
- ``RecordOps``: the torch ops a block runs (a host path that should run none, or no copy).
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from core.fusions.gated_norm_reference import (bitwise_share, relative_error, ulp_distance,
                                               unfused_gated_norm)
from tests.gated_norm_inputs import EPS

# An fp32 gradient (dW of an fp32 weight) carries no rounding to a low precision, only that of
# its fp32 sum, whose order differs from autograd's: that alone puts it a couple of fp32 unit
# roundings (u = 2**-24) off float64 either way (fused 1.3-3.4 u, unfused 1.1-2.3 u on the
# fp32-weight cases of tests/fusions/test_fused_gated_norm.py). Rounding its terms to bf16 /
# fp16 instead would cost ~1e3-1e4 u.
FP32_SUM_SLACK = 4 * 2.0**-24

# fp32 models: the fused norm differs from megatron's unfused one only in the order of the fp32
# sum of squares, so over a few steps the losses agree to a few fp32 ulps (measured: 0 or 1).
LOSS_ULPS_FP32 = 8


def fp32_loss_tolerance(loss: float) -> float:
    """LOSS_ULPS_FP32 fp32 ulps at |loss| (a normal fp32 value)."""
    return LOSS_ULPS_FP32 * 2.0 ** (math.frexp(abs(loss))[1] - 24)


def assert_bitwise_or_within_ulps(out, ref, max_ulps: int | None = 1, min_bitwise: float = 0.999):
    """``out`` has ``ref``'s dtype and shape; in bf16 / fp16 at least ``min_bitwise`` of its
    elements are bitwise equal to ``ref``'s and every finite one is within ``max_ulps`` (None:
    no ulp bound, for dx, which cancels near zero); in fp32 it is within 2e-6 (rtol and atol)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape,
                                                               ref.shape)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
        return
    share = bitwise_share(out, ref)
    assert share >= min_bitwise, f"only {share:.6%} bitwise equal"
    finite = out.isfinite() & ref.isfinite()
    if max_ulps is not None and finite.any():
        worst = ulp_distance(out[finite], ref[finite]).max().item()
        assert worst <= max_ulps, f"{worst} ulps apart"


def gradients(fn, x, gate, weight, dy, zero_centered=False, activation="silu") -> tuple:
    """(dx, dgate, dweight) of ``fn`` (fused_gated_norm or unfused_gated_norm) at these inputs."""
    leaves = [t.detach().requires_grad_() for t in (x, gate, weight)]
    out = fn(*leaves, EPS, zero_centered, activation)  # the sixth parameter of both
    return torch.autograd.grad(out, leaves, dy)


def float64_grads(x, gate, weight, dy, zero_centered=False, activation="silu") -> tuple:
    """(dx, dgate, dweight) of the unfused gated norm evaluated in float64."""
    return gradients(unfused_gated_norm, x.double(), gate.double(), weight.double(), dy.double(),
                     zero_centered, activation)


def assert_no_less_accurate(fused, unfused, exact, names=("dx", "dgate", "dweight")):
    """For each gradient: its error against float64 (``exact``) at most the unfused one's, plus
    1 %; the absolute term covers an exact unfused result, or the sum order of an fp32 dW."""
    for name, f, u, e in zip(names, fused, unfused, exact, strict=True):
        err_fused, err_unfused = relative_error(f, e), relative_error(u, e)
        slack = FP32_SUM_SLACK if f.dtype == torch.float32 else 1e-10
        assert err_fused <= 1.01 * err_unfused + slack, (name, err_fused, err_unfused)


class RecordOps(TorchDispatchMode):
    """``with RecordOps() as rec:`` records in ``rec.ops`` the name of every torch op dispatched
    inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def assert_language_model_matches_unfused(model, unfused, vocab: int, seq: int,
                                          seed: int) -> int:
    """``model`` (flag on) and ``unfused`` (flag off, given ``model``'s weights here) on the same
    causal batch of two sequences of ``seq`` tokens, the labels the inputs: the per-token losses
    (multi-token prediction losses enter the backward inside the model) and every parameter's
    gradient agree within fp32 rounding. Returns how many fused norms the forward ran."""
    from core.testing.gdn import counting_fused_norm_calls

    unfused.load_state_dict(model.state_dict())
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(seq).expand(2, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    with counting_fused_norm_calls() as calls:
        loss = model(ids, positions, attention_mask=mask, labels=ids)
    expected = unfused(ids, positions, attention_mask=mask, labels=ids)
    torch.testing.assert_close(loss, expected)
    loss.sum().backward()
    expected.sum().backward()
    grads = dict(unfused.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, msg=name)
    return len(calls)
