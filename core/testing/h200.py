"""An H200 as the launch rules (core.fusions.gated_norm_launch) see it, on any machine: its SM
count, its DRAM bandwidth per SM and programmatic dependent launch (sm_90). The kernel-IR tool
and the CPU tests of the launch rules and of the kernels' addressing pick an H200's launch
parameters with it."""

from __future__ import annotations

import contextlib

import core.fusions.gated_norm_launch as launch_rules

H200_SMS = 132
# Peak DRAM bandwidth per SM, bytes/s: two transfers per memory clock over the bus, over the
# SMs, from what torch reports for an H200 (3201 MHz, 6016 bits).
H200_DRAM_BANDWIDTH_PER_SM = 2 * 3_201_000e3 * 6016 / 8 / H200_SMS


@contextlib.contextmanager
def h200_device_rules():
    """While open, the launch rules' device queries answer as an H200 for any device, and
    ``forward_launch`` / ``backward_launch`` forget what they cached before and after."""
    saved = (launch_rules.sm_count, launch_rules.dram_bandwidth_per_sm,
             launch_rules.programmatic_dependent_launch)
    launch_rules.sm_count = lambda device: H200_SMS
    launch_rules.dram_bandwidth_per_sm = lambda device: H200_DRAM_BANDWIDTH_PER_SM
    launch_rules.programmatic_dependent_launch = lambda device: True
    launch_rules.forward_launch.cache_clear()
    launch_rules.backward_launch.cache_clear()
    try:
        yield
    finally:
        (launch_rules.sm_count, launch_rules.dram_bandwidth_per_sm,
         launch_rules.programmatic_dependent_launch) = saved
        launch_rules.forward_launch.cache_clear()
        launch_rules.backward_launch.cache_clear()
