"""Launch heuristics (core/fusions/gated_norm_launch.py) for a GPU, on any machine: the SM count
is the H200's, so the parameters checked are the ones the GPU runs get."""

from __future__ import annotations

import importlib

import pytest
import torch
import triton

launch = importlib.import_module("core.fusions.gated_norm_launch")

GPU = torch.device("cuda", 0)
H200_SMS = 132


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(launch, "sm_count", lambda device: H200_SMS)
    launch._forward.cache_clear()
    launch.backward_launch.cache_clear()
    yield
    launch._forward.cache_clear()  # forget the stand-in SM count
    launch.backward_launch.cache_clear()


def test_forward_small_grid_regime(h200):
    """Measured on the H200: 32k rows of D=128 take the small block, 131k the regular one."""
    small, regular = launch.forward_launch(32768, 128, GPU), launch.forward_launch(131072, 128, GPU)
    assert (small.bt, small.warps) == (8, 2)
    assert (regular.bt, regular.warps) == (16, 8)
    threshold = launch.SMALL_GRID_PROGRAMS_PER_SM * H200_SMS * regular.bt
    assert launch.forward_launch(threshold - 1, 128, GPU) == small
    assert launch.forward_launch(threshold, 128, GPU) == regular


@pytest.mark.parametrize("dim", [1, 8, 64, 100, 128, 256, 1000, 4096, 8192])
def test_token_counts_give_at_most_two_forward_variants(h200, dim):
    """Packed sequences of varying total length: every token count maps to one of two launch
    configurations, so at most two compiled forward kernels per head dim and dtype."""
    configs = {launch.forward_launch(tokens * heads, dim, GPU)
               for heads in (4, 8, 16, 32) for tokens in range(1, 200_000, 997)}
    assert 1 <= len(configs) <= 2
    for cfg in configs:
        assert cfg.block_d == triton.next_power_of_2(dim) >= dim
        assert 1 <= cfg.warps <= 8 and cfg.bt >= 1
        # a thread holds at most 16 elements of each operand unless the row is wider than
        # 8 warps * 16 elements (then the row itself is the block)
        assert cfg.bt * cfg.block_d <= 16 * 32 * cfg.warps or cfg.bt == 1


def test_backward_does_not_depend_on_rows(h200):
    cfg = launch.backward_launch(128, GPU)
    assert cfg.max_programs == 8 * H200_SMS
    assert cfg.bt * cfg.block_d == launch.BACKWARD_ELEMENTS_PER_BLOCK


def test_interpreter_parameters():
    cpu = torch.device("cpu")
    assert launch.forward_launch(1, 64, cpu) == launch.forward_launch(10**9, 64, cpu)
    assert launch.backward_launch(64, cpu).max_programs == launch.INTERPRETER_PROGRAMS


def test_host_integer_helpers_match_triton():
    for n in range(1, 5000):
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n)
        assert launch.cdiv(n, 16) == triton.cdiv(n, 16)
