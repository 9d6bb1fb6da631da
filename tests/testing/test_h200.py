"""core/testing/h200.py: the launch rules answer as an H200 inside the block, as before after
it, and no launch parameters picked inside outlive it."""

from __future__ import annotations

import torch

import core.fusions.gated_norm_launch as launch_rules
from core.testing.h200 import H200_DRAM_BANDWIDTH_PER_SM, H200_SMS, h200_device_rules

GPU = torch.device("cuda", 0)


def test_the_rules_see_an_h200_only_inside_the_block():
    before = (launch_rules.sm_count, launch_rules.dram_bandwidth_per_sm,
              launch_rules.programmatic_dependent_launch)
    with h200_device_rules():
        assert launch_rules.sm_count(GPU) == H200_SMS == 132
        assert launch_rules.dram_bandwidth_per_sm(GPU) == H200_DRAM_BANDWIDTH_PER_SM
        assert 36e9 < H200_DRAM_BANDWIDTH_PER_SM < 37e9  # 4.8 TB/s over 132 SMs
        assert launch_rules.programmatic_dependent_launch(GPU) is True
        assert launch_rules.backward_launch(128, GPU).max_programs == 8 * H200_SMS
        assert launch_rules.forward_launch(128, GPU).pdl is True
    assert (launch_rules.sm_count, launch_rules.dram_bandwidth_per_sm,
            launch_rules.programmatic_dependent_launch) == before
    assert launch_rules.forward_launch.cache_info().currsize == 0
    assert launch_rules.backward_launch.cache_info().currsize == 0
