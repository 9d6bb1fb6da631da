"""Launch heuristics of the fused gated norm, kept apart from the kernel bodies.

Parameters are a pure function of (rows, head dim, SM count): no first-call autotuning, so
training steps are reproducible and have no warm-up stalls. The numbers come from the sweeps
recorded in docs/benchmarks.md (H200, bf16).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

# Largest head dim the single-pass kernels take: a row lives in registers.
MAX_HEAD_DIM = 8192


class ForwardLaunch(NamedTuple):
    bt: int  # rows per block (one loop iteration of a program)
    warps: int
    block_d: int
    max_programs: int  # grid size cap: fewer programs than blocks makes the kernel persistent


class BackwardLaunch(NamedTuple):
    bt: int  # rows per loop iteration of a program
    warps: int
    block_d: int
    max_programs: int  # persistent grid size cap (also the number of fp32 dW partials)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # CPU interpreter: programs run one after another; a few keep dW partials small


@functools.lru_cache(maxsize=1024)
def _forward(rows_bucket: int, dim: int, sms: int) -> ForwardLaunch:
    block_d = triton.next_power_of_2(dim)
    # ~2k elements per program: enough bytes in flight per SM, few enough registers.
    bt = max(1, min(16, 2048 // block_d))
    warps = 4 if bt * block_d >= 2048 else 2
    if block_d >= 2048:
        warps = 8
    return ForwardLaunch(bt, warps, block_d, 1 << 30)


@functools.lru_cache(maxsize=1024)
def _backward(rows_bucket: int, dim: int, sms: int) -> BackwardLaunch:
    block_d = triton.next_power_of_2(dim)
    bt = max(1, min(16, 2048 // block_d))
    warps = 4 if bt * block_d >= 2048 else 2
    if block_d >= 2048:
        warps = 8
    return BackwardLaunch(bt, warps, block_d, sms * 8)


def _bucket(rows: int) -> int:
    # Heuristics may depend on the order of magnitude of rows only: cache hits stay cheap.
    return rows.bit_length()


def forward_launch(rows: int, dim: int, device: torch.device) -> ForwardLaunch:
    return _forward(_bucket(rows), dim, sm_count(device))


def backward_launch(rows: int, dim: int, device: torch.device) -> BackwardLaunch:
    return _backward(_bucket(rows), dim, sm_count(device))
