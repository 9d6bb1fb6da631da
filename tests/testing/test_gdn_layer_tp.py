"""Helpers of core.testing.gdn_layer_tp: the norm-call counter that tells a replayed CUDA-graph
step from an eager one."""

import pytest
import torch

import core.ssm.gated_delta_net as gdn_mod
from core.testing.gdn import build_gdn_module, gdn_config, layer_inputs
from core.testing.gdn_layer_tp import counting_norm_calls

pytestmark = [pytest.mark.cpu_shims, pytest.mark.usefixtures("model_parallel_tp1")]


def test_counting_norm_calls_counts_each_run_of_the_norm_code_and_restores_it():
    """The counter the CUDA-graph harnesses use to tell a replayed step (no Python norm call)
    from an eager one."""
    original = gdn_mod.GatedDeltaNet._apply_gated_norm
    module = build_gdn_module(gdn_config(fused_gated_norm=True))
    x, _ = layer_inputs(24, 2, 64, seed=3)
    with counting_norm_calls() as calls, torch.no_grad():
        module(x, attention_mask=None)
        module(x, attention_mask=None)
    assert len(calls) == 2
    assert gdn_mod.GatedDeltaNet._apply_gated_norm is original
