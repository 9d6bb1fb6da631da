"""Launch heuristics (core/fusions/gated_norm_launch.py) for a GPU, on any machine: the SM count
and the DRAM bandwidth are the H200's (or the H100's), so the parameters checked are the ones
the GPU runs get."""

from __future__ import annotations

import functools

import pytest
import torch
import triton

import core.fusions.gated_norm_launch as launch
from core.testing.h200 import H200_DRAM_BANDWIDTH_PER_SM, H200_SMS, h200_device_rules

GPU = torch.device("cuda", 0)
# An H100 SXM's peak DRAM bandwidth per SM, bytes/s, as core.testing.h200 gives an H200's: two
# transfers per memory clock over the bus, over its 132 SMs (torch reports 2619 MHz, 5120 bits).
H100_BANDWIDTH_PER_SM = 2 * 2_619_000e3 * 5120 / 8 / H200_SMS


@pytest.fixture
def h200():
    with h200_device_rules():
        yield


def test_h200_parameters(h200):
    """The swept choices (docs/design.md, Launch choices)."""
    forward = functools.partial(launch.ForwardLaunch, pdl=True)
    assert launch.forward_launch(128, GPU) == forward(bt=16, warps=8, block_d=128)
    assert launch.forward_launch(256, GPU) == forward(bt=4, warps=4, block_d=256)
    assert launch.forward_launch(200, GPU) == forward(bt=4, warps=4, block_d=256)
    assert launch.forward_launch(512, GPU) == forward(bt=4, warps=4, block_d=512)
    assert launch.backward_launch(128, GPU) == launch.BackwardLaunch(
        bt=4, warps=1, block_d=128, max_programs=8 * H200_SMS, long_walk_programs=8 * H200_SMS,
        stages=3, dw_sum_columns=2, dw_sum_warps=8, dw_sum_pdl=True, dw_sum_dependents=True)
    cfg = launch.backward_launch(256, GPU)
    assert (cfg.bt, cfg.warps, cfg.dw_sum_columns) == (2, 1, 4)
    assert launch.backward_launch(200, GPU)[:3] == (2, 1, 256)
    assert launch.backward_launch(512, GPU).dw_sum_columns == 8


@pytest.mark.parametrize("dim", [128, 256])
def test_backward_programs_follow_the_dram_bandwidth_of_an_sm(h200, monkeypatch, dim):
    """8 persistent programs per SM; on an H100 (less DRAM bandwidth per SM) 6 once each of the
    8 would walk LONG_WALK_BLOCKS row blocks or more; fewer blocks than programs take one
    program each. Where torch reports no memory clock, the H200's rule."""
    h200 = launch.backward_launch(dim, GPU)
    long_walk = launch.LONG_WALK_BLOCKS * 8 * H200_SMS
    for blocks in (1, 1000, 8 * H200_SMS, long_walk - 1, long_walk, 10**6):
        assert launch.backward_programs(h200, blocks) == min(blocks, 8 * H200_SMS)
    for bandwidth, per_sm in ((H100_BANDWIDTH_PER_SM, 6), (None, 8)):
        monkeypatch.setattr(launch, "dram_bandwidth_per_sm", lambda device: bandwidth)
        launch.backward_launch.cache_clear()
        cfg = launch.backward_launch(dim, GPU)
        assert cfg == h200._replace(long_walk_programs=per_sm * H200_SMS)
        assert launch.backward_programs(cfg, 100) == 100
        assert launch.backward_programs(cfg, long_walk - 1) == 8 * H200_SMS
        assert launch.backward_programs(cfg, long_walk) == per_sm * H200_SMS
        assert launch.backward_programs(cfg, 10**6) == per_sm * H200_SMS
    launch.backward_launch.cache_clear()


def test_dram_bandwidth_per_sm_from_the_device_properties(monkeypatch):
    """Two transfers per memory clock (kHz) over the bus (bits), over the SMs; None where torch
    reports no memory clock or bus width."""
    class H100Properties:
        memory_clock_rate, memory_bus_width, multi_processor_count = 2_619_000, 5120, 132

    class H200Properties:
        memory_clock_rate, memory_bus_width, multi_processor_count = 3_201_000, 6016, 132

    class Unreported:
        multi_processor_count = 132

    for props, want in ((H100Properties, H100_BANDWIDTH_PER_SM),
                        (H200Properties, H200_DRAM_BANDWIDTH_PER_SM), (Unreported, None)):
        launch.dram_bandwidth_per_sm.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
        assert launch.dram_bandwidth_per_sm(GPU) == want
    assert 25e9 < H100_BANDWIDTH_PER_SM < launch.LOW_BANDWIDTH_PER_SM < H200_DRAM_BANDWIDTH_PER_SM
    launch.dram_bandwidth_per_sm.cache_clear()


def test_no_programmatic_dependent_launch_where_the_gpu_has_none(h200, monkeypatch):
    """Before sm_90 (and on ROCm) griddepcontrol does not exist: no launch takes it, and the
    dW sum neither waits for it nor lets the next kernel launch early."""
    monkeypatch.setattr(launch, "programmatic_dependent_launch", lambda device: False)
    launch.forward_launch.cache_clear()
    launch.backward_launch.cache_clear()
    for dim in (128, 256):
        assert launch.forward_launch(dim, GPU).pdl is False
        cfg = launch.backward_launch(dim, GPU)
        assert cfg.dw_sum_pdl is False and cfg.dw_sum_dependents is False


@pytest.mark.parametrize("dim", [64, 128, 256, 512])
def test_backward_blocks_keep_the_row_layout_of_wider_ones(h200, dim):
    """The backward's block keeps 8 elements per thread, so a row is laid out along the lanes
    exactly as in the wider blocks swept against it (tools/kernel_ir.py checks the compiled
    layout): a launch-rule change moves no dx bit of a row relative to those blocks. The swept
    one-warp blocks at 128 and 256 take 16, which lay a row out alike (at 256 a 2-byte row;
    tests/tools/test_kernel_ir.py)."""
    cfg = launch.backward_launch(dim, GPU)
    assert cfg.bt * cfg.block_d == 512
    per_thread = 16 if dim in (128, 256) else 8
    assert cfg.bt * cfg.block_d // (32 * cfg.warps) == per_thread


def test_programmatic_dependent_launch_needs_hopper(monkeypatch):
    launch.programmatic_dependent_launch.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert not launch.programmatic_dependent_launch(torch.device("cuda", 7))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert launch.programmatic_dependent_launch(torch.device("cuda", 8))
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not launch.programmatic_dependent_launch(torch.device("cuda", 10))
    monkeypatch.setattr(torch.version, "hip", None)
    assert not launch.programmatic_dependent_launch(torch.device("cpu"))
    monkeypatch.setattr(launch, "PROGRAMMATIC_DEPENDENT_LAUNCH", False)
    assert not launch.programmatic_dependent_launch(torch.device("cuda", 9))
    assert launch.supports_programmatic_dependent_launch(torch.device("cuda", 9))
    launch.programmatic_dependent_launch.cache_clear()


@pytest.mark.parametrize("dim", [1, 8, 64, 100, 128, 256, 1000, 4096, 8192])
def test_parameters_are_sane_for_every_head_dim(h200, dim):
    for cfg in (launch.forward_launch(dim, GPU), launch.backward_launch(dim, GPU)):
        assert cfg.block_d == triton.next_power_of_2(dim) >= dim
        assert 1 <= cfg.warps <= 8 and cfg.bt >= 1
        # a thread holds at most 16 elements of each operand unless the row is wider than
        # 8 warps * 16 elements (then the row itself is the block)
        assert cfg.bt * cfg.block_d <= 16 * 32 * cfg.warps or cfg.bt == 1


def test_interpreter_parameters():
    cpu = torch.device("cpu")
    assert launch.forward_launch(64, cpu).bt * 64 == launch.INTERPRETER_ELEMENTS_PER_BLOCK
    assert launch.backward_launch(64, cpu).max_programs == launch.INTERPRETER_PROGRAMS
    assert launch.backward_launch(64, cpu).long_walk_programs == launch.INTERPRETER_PROGRAMS
    # griddepcontrol is PTX: the interpreter launches nothing early
    backward = launch.backward_launch(64, cpu)
    assert not launch.forward_launch(64, cpu).pdl
    assert not backward.dw_sum_pdl and not backward.dw_sum_dependents


def test_host_integer_helpers_match_triton():
    for n in range(1, 5000):
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n)
        assert launch.cdiv(n, 16) == triton.cdiv(n, 16)
