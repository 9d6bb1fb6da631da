"""The fused pre-recurrence region under torch.compile (fullgraph): the custom ops of
core.fusions.pre_gated_delta_rule_compile give the eager Function's outputs and gradients, bit
for bit, packed sequences included."""

import pytest
import torch

from core.fusions.fused_pre_gated_delta_rule import fused_pre_gated_delta_rule

HK, HV, DK, DV, WIDTH = 2, 4, 16, 8, 4
WIDTH_FEATURES = 2 * HK * DK + 2 * HV * DV + 2 * HV
CHANNELS = 2 * HK * DK + HV * DV


def _region(qkvzba, weight, bias, a_log, dt_bias, cu_seqlens=None):
    return fused_pre_gated_delta_rule(qkvzba, weight, bias, a_log, dt_bias, num_key_heads=HK,
                                      key_head_dim=DK, num_value_heads=HV, value_head_dim=DV,
                                      cu_seqlens=cu_seqlens)


def _run(fn, tensors, grads, cu_seqlens):
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    qkvzba = leaves[0].transpose(0, 1)  # the bshd view of an sbhd in_proj output
    outs = fn(qkvzba, *leaves[1:], cu_seqlens)
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("packed", [False, True])
def test_compiled_region_equals_eager(packed):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    batch, seq = (1, 14) if packed else (2, 9)
    cu_seqlens = torch.tensor([0, 3, 4, 14], dtype=torch.int32) if packed else None
    tensors = [torch.randn(seq, batch, WIDTH_FEATURES, generator=gen),
               torch.randn(CHANNELS, 1, WIDTH, generator=gen) * 0.5,
               torch.randn(CHANNELS, generator=gen) * 0.1,
               torch.rand(HV, generator=gen) * 2, torch.randn(HV, generator=gen)]
    shapes = [(batch, seq, HV, DK), (batch, seq, HV, DK), (batch, seq, HV, DV),
              (batch, seq, HV, DV), (batch, seq, HV), (batch, seq, HV)]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    out_e, grad_e = _run(_region, tensors, grads, cu_seqlens)
    out_c, grad_c = _run(torch.compile(_region, fullgraph=True), tensors, grads, cu_seqlens)
    for eager, compiled in zip(out_e + grad_e, out_c + grad_c, strict=True):
        assert torch.equal(eager, compiled)
