"""Helpers of core.testing.gdn: the capturable stand-in of the gated delta rule and the
fused-norm call counter the harnesses and the example rely on."""

import pytest
import torch

import core.ssm.gated_delta_net as gdn_mod
from core.testing.gdn import (build_gdn_module, counting_fused_norm_calls, gdn_config,
                              layer_inputs)

pytestmark = [pytest.mark.cpu_shims, pytest.mark.usefixtures("model_parallel_tp1")]


def test_capturable_rule_equals_megatrons_chunk_rule():
    """The stand-in the CUDA-graph case runs (megatron's deterministic_mode rule copies from the
    host and cannot be captured) computes megatron's rule: fp32 agreement on a small input."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    from core.testing.gdn import recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    b, t, h, dk, dv = 2, 70, 3, 16, 8  # t > megatron's chunk of 64
    q, v = torch.randn(b, t, h, dk, generator=gen), torch.randn(b, t, h, dv, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    g, beta = -torch.rand(b, t, h, generator=gen), torch.rand(b, t, h, generator=gen)
    expected = torch_chunk_gated_delta_rule(q, k, v, g, beta)[0]
    got = recurrent_gated_delta_rule(q, k, v, g, beta)[0]
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_counting_fused_norm_calls_counts_the_fused_path_only_and_restores_it(fused):
    original = gdn_mod.apply_validated_gated_norm
    module = build_gdn_module(gdn_config(fused_gated_norm=fused))
    x, _ = layer_inputs(24, 2, 64, seed=3)
    with counting_fused_norm_calls() as calls, torch.no_grad():
        module(x, attention_mask=None)
        module(x, attention_mask=None)
    assert len(calls) == (2 if fused else 0)
    assert gdn_mod.apply_validated_gated_norm is original
