"""Inputs and runners shared by the tests and GPU checks of the fused pre-recurrence region
(core/fusions/fused_pre_gated_delta_rule.py).

``Region`` names the local sizes; ``make_region`` builds the in_proj output ``qkvzba`` (a bshd
view of an sbhd buffer, as megatron's GatedDeltaNet transposes its in_proj output, or a plain
contiguous bshd tensor), the conv weight and bias, A_log (megatron's init: log of U(1, 16)) and
dt_bias; ``make_cotangents`` the gradients of the six outputs; ``region_grads`` runs the fused
function or the reference forward and backward and returns the outputs and the five gradients;
``assert_each_sequence_equals_it_alone`` checks a packed run against each sequence run alone.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from core.fusions.pre_gated_delta_rule_reference import unfused_pre_gated_delta_rule
from tests.gated_norm_inputs import DEVICE

OUTPUT_NAMES = ("q", "k", "v", "gate", "g", "beta")
GRAD_NAMES = ("dqkvzba", "dconv_weight", "dconv_bias", "dA_log", "ddt_bias")


class Region(NamedTuple):
    """Local sizes: key / value heads, their head dims, the conv width."""
    key_heads: int = 2
    value_heads: int = 4
    key_dim: int = 16
    value_dim: int = 8
    width: int = 4

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def features(self) -> int:
        return self.conv_channels + self.value_heads * self.value_dim + 2 * self.value_heads

    def heads(self) -> dict:
        """The head keywords of both entry points."""
        return dict(num_key_heads=self.key_heads, key_head_dim=self.key_dim,
                    num_value_heads=self.value_heads, value_head_dim=self.value_dim)


class RegionInputs(NamedTuple):
    qkvzba: torch.Tensor
    conv_weight: torch.Tensor
    conv_bias: Optional[torch.Tensor]
    A_log: torch.Tensor
    dt_bias: torch.Tensor

    def map(self, fn) -> "RegionInputs":
        """``fn`` applied to every tensor (None stays None)."""
        return RegionInputs(*(None if t is None else fn(t) for t in self))


def make_region(region: Region, batch: int, seq: int, dtype=torch.bfloat16, *, bias=True,
                layout="sbhd", param_dtype=None, device=DEVICE, seed=0) -> RegionInputs:
    """Random inputs on ``device``, the same values on every device for a seed. ``layout``:
    "sbhd" (qkvzba a [B, S, W] view of a contiguous [S, B, W] buffer) or "bshd" (contiguous).
    ``param_dtype``: the conv weight / bias, A_log and dt_bias dtype (default ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    param_dtype = param_dtype or dtype
    channels = region.conv_channels
    sbhd = torch.randn(seq, batch, region.features, generator=gen)
    if layout == "sbhd":
        qkvzba = sbhd.to(device, dtype).transpose(0, 1)
    elif layout == "bshd":
        qkvzba = sbhd.transpose(0, 1).contiguous().to(device, dtype)
    else:
        raise ValueError(f"layout must be 'sbhd' or 'bshd', got {layout!r}")
    weight = 0.5 * torch.randn(channels, 1, region.width, generator=gen)
    conv_bias = 0.1 * torch.randn(channels, generator=gen) if bias else None
    a_log = torch.log(1 + 15 * torch.rand(region.value_heads, generator=gen))
    dt_bias = torch.randn(region.value_heads, generator=gen)
    params = [None if t is None else t.to(device, param_dtype)
              for t in (weight, conv_bias, a_log, dt_bias)]
    return RegionInputs(qkvzba, *params)


def make_cotangents(outputs, seed=1) -> tuple:
    """Random gradients of (q, k, v, gate, g, beta), each in its output's dtype and shape."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outputs)


def region_grads(fn, inputs: RegionInputs, region: Region, cotangents=None, **options):
    """(outputs, gradients): ``fn`` (fused_pre_gated_delta_rule or the reference) run on leaf
    copies of ``inputs``, and the gradients of (qkvzba, conv weight, conv bias, A_log,
    dt_bias) for ``cotangents`` (default: make_cotangents of the outputs). A None cotangent
    leaves its output out of the backward (an input it leaves unused gets zeros); a conv bias
    of None has gradient None."""
    leaves = inputs.map(lambda t: t.detach().clone().requires_grad_())
    outputs = fn(*leaves, **region.heads(), **options)
    if cotangents is None:
        cotangents = make_cotangents(outputs)
    used = [(o, c) for o, c in zip(outputs, cotangents, strict=True) if c is not None]
    wrt = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad([o for o, _ in used], wrt, [c for _, c in used],
                                     materialize_grads=True))
    grads = tuple(None if t is None else next(grads) for t in leaves)
    return tuple(o.detach() for o in outputs), grads


def float64_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm formula in x's own dtype (the reference's casts to fp32)."""
    return x * (1 / torch.sqrt(x.square().sum(-1, keepdim=True) + eps))


def float64_region_grads(inputs: RegionInputs, region: Region, cotangents, **options):
    """The reference's outputs and gradients with every step in float64: the inputs and
    cotangents converted exactly, torch's conv1d and SiLU in the input dtype (conv_rounding
    "twice", which rounds nothing in float64; "once" would convolve in fp32) and the l2norm
    formula without its fp32 cast. Only the gradient of alpha passes an fp32 cast (the
    reference's ``alpha.float()``), 2**-24 relative, far below bf16's and fp16's rounding."""
    eps = options.get("eps", 1e-6)
    options = dict(options, conv_rounding="twice", l2norm=lambda x: float64_l2norm(x, eps))
    wide = inputs.map(lambda t: t.double())
    return region_grads(unfused_pre_gated_delta_rule, wide, region,
                        [None if c is None else c.double() for c in cotangents], **options)


def assert_each_sequence_equals_it_alone(outputs, grads, inputs: RegionInputs, region: Region,
                                         bounds, cotangents) -> None:
    """Each packed sequence's outputs and d(qkvzba), from a run of the fused function with
    ``cu_seqlens`` = ``bounds`` and ``cotangents``, are bitwise those of the fused function on
    that sequence alone (B = 1, no cu_seqlens)."""
    from core.fusions.fused_pre_gated_delta_rule import fused_pre_gated_delta_rule

    for start, end in zip(bounds[:-1], bounds[1:]):
        alone = inputs._replace(qkvzba=inputs.qkvzba[:, start:end])
        alone_outputs, alone_grads = region_grads(
            fused_pre_gated_delta_rule, alone, region, [c[:, start:end] for c in cotangents])
        for name, a, b in zip(OUTPUT_NAMES, outputs, alone_outputs):
            assert torch.equal(a[:, start:end], b), (name, start, end)
        assert torch.equal(grads[0][:, start:end], alone_grads[0]), (start, end)
