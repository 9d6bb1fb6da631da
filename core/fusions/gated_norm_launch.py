"""Launch heuristics of the fused gated norm, kept apart from the kernel bodies.

Parameters are a pure function of the head dim and the GPU (its SM count and the DRAM bandwidth
of an SM): no first-call autotuning, so training steps are reproducible and have no warm-up
stalls. Blocks never depend on the row count, so a row's bits do not depend on the size of its
batch; the row count sizes the grids, and the backward's number of programs, which only groups
the rows of dW's fp32 partials. The numbers come from H200 and H100 sweeps (bf16;
docs/design.md, Launch choices; ``python tools/launch_sweep.py`` reruns them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

# Largest head dim the single-pass kernels take: a row lives in registers.
MAX_HEAD_DIM = 8192
# Row indices are int32 in the kernels (element offsets are int64); the margin keeps the
# backward's loop bound, cdiv(rows, bt) computed in int32 as (rows + bt - 1) // bt, below 2**31
# for blocks of up to 2**16 rows, and its next block index, block + programs, for up to 2**16
# programs (gated_norm_validation.MAX_OVERRIDE, MAX_PROGRAMS).
MAX_ROWS = 2**31 - 2**16


class ForwardLaunch(NamedTuple):
    bt: int  # rows per program (the grid is cdiv(rows, bt))
    warps: int
    block_d: int
    pdl: bool  # programmatic dependent launch (see below)


class BackwardLaunch(NamedTuple):
    bt: int  # rows per loop iteration of a program
    warps: int
    block_d: int
    max_programs: int  # persistent grid size cap (also the most fp32 dW partials)
    long_walk_programs: int  # the grid once each program walks many row blocks (backward_programs)
    stages: int  # software pipelining of the row-block loop (loads of later blocks in flight)
    dw_sum_columns: int  # gated_norm_dw_sum: columns per program (all partials in one load)
    dw_sum_warps: int
    # The dW sum launched with programmatic dependent launch, the backward kernel letting it
    # launch as its programs start (DW_SUM_PDL below).
    dw_sum_pdl: bool = False
    # The dW sum letting the kernel after it start launching as soon as it starts itself, so
    # that a kernel launched early (the next forward) overlaps its launch with it.
    dw_sum_dependents: bool = False


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """SMs of a CUDA ``device`` (the interpreter's launch is ``_interpreter``'s)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def dram_bandwidth_per_sm(device: torch.device) -> Optional[float]:
    """Peak DRAM bandwidth of a CUDA ``device`` per SM, in bytes/s (two transfers per memory
    clock over the bus: H100 SXM 3.35 TB/s over 132 SMs, 25 GB/s; H200 4.8 TB/s, 36.5 GB/s), or
    None where torch does not report the memory clock or bus width."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / props.multi_processor_count


# Programmatic dependent launch (sm_90+): the forward may start while the kernel before it
# drains and waits for its writes before its first load, which hides part of the time between
# kernels at the row counts of TP 4-8 ranks. Bits do not change. The backward kernel itself
# launches as usual (launched early it was slower in CUDA graphs); its dW sum is launched early
# (DW_SUM_PDL) and lets the next kernel launch early. docs/design.md, Small row counts.
# Like every constant here, read into cached rules and launch plans: a per-call choice is the
# impls' override (forward_impl(pdl=...), backward_impl(dw_sum_pdl=...)).
PROGRAMMATIC_DEPENDENT_LAUNCH = True


def supports_programmatic_dependent_launch(device: torch.device) -> bool:
    """Whether ``device`` can take programmatic dependent launch: NVIDIA sm_90+ (griddepcontrol
    is PTX: not for the interpreter, nor for ROCm, whose devices also report a capability)."""
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


@functools.lru_cache(maxsize=None)
def programmatic_dependent_launch(device: torch.device) -> bool:
    """Whether the launch rules use programmatic dependent launch on ``device`` (the forward
    launched early; the forward and the dW sum letting the next kernel launch early)."""
    return PROGRAMMATIC_DEPENDENT_LAUNCH and supports_programmatic_dependent_launch(device)


# Block shapes from H200 sweeps (bf16; the measurements: docs/design.md, Launch choices).
# Forward: 2048 elements per program, 8 per thread up to 128 elements per row and 16 beyond.
# Backward: 512 elements per loop iteration, 8 per thread (16, one warp, at 128 and 256), 3
# pipeline stages, 8 persistent programs per SM (6 for long walks on an H100: below).
# Neither depends on the row count (only the grid does): a row's fp32 reduction tree follows its
# layout along the row, so a rows-dependent block could give a token other bits in another batch
# (test_rows_get_the_same_bits_in_any_batch), and a new token count never compiles a new kernel.
FORWARD_ELEMENTS_PER_BLOCK = 2048
BACKWARD_ELEMENTS_PER_BLOCK = 512
FORWARD_ELEMENTS_PER_THREAD = 16
FORWARD_ELEMENTS_PER_THREAD_NARROW = 8  # rows of <= 128 elements (BLOCK_D <= 128)
# Swept blocks that beat the rule above, by BLOCK_D: (rows per program, warps). At 256, 4 x 4
# lays a row out as the rule's 8 x 4 does (tools/kernel_ir.py), so no bit changes.
FORWARD_SWEPT_BLOCKS = {256: (4, 4)}
BACKWARD_ELEMENTS_PER_THREAD = 8
# One warp (16 elements per thread) at 128 and 256, faster at the small row counts of TP ranks:
# a row is still laid out as in the rule's 2-warp block (tools/kernel_ir.py), so dx and dgate
# keep their bits (at 256, fp32 rows get another fixed order).
BACKWARD_SWEPT_BLOCKS = {128: (4, 1), 256: (2, 1)}
BACKWARD_PROGRAMS_PER_SM = 8
BACKWARD_STAGES = 3
# Where an SM gets less DRAM bandwidth (the H100's 25 GB/s against the H200's 36.5), 6 programs per
# SM stream faster than 8 once each of the 8 would walk LONG_WALK_BLOCKS row blocks or more
# (H100: 3.5-5 % from 128k rows of 128 elements, 1.5 % at 64k), while below that 8 keep more
# blocks in flight (6 were 10 % slower at 16k rows). On the H200, 6 were 7-11 % slower at every
# row count (docs/design.md, Launch choices). The program count changes no dx or dgate bit, only
# how dW's rows are grouped into partials before the fixed-order sum.
LOW_BANDWIDTH_PER_SM = 30e9  # bytes/s
LOW_BANDWIDTH_PROGRAMS_PER_SM = 6
LONG_WALK_BLOCKS = 12


# The dW partial sum (gated_norm_dw_sum): a few columns per program, all partials in one load,
# about 64 programs reading at once (faster than 16). The interpreter pays per program: one
# program takes the whole row.
DW_SUM_PROGRAMS = 64
DW_SUM_MAX_COLUMNS = 8
DW_SUM_WARPS = 8
# The dW sum with programmatic dependent launch: the backward's programs let it launch as they
# start, so it is resident, waiting for the backward's completion (griddepcontrol.wait), when
# the partials are done, and the time between the two kernels shrinks (launched only once a
# program's row loop is done, it hid less). Bits do not change.
DW_SUM_PDL = True


# CPU (Triton interpreter): every program is emulated in Python with numpy over whole blocks, so
# a few big blocks are fastest (a training step of the CPU example: 0.58 s -> 0.03 s per
# forward). Rows are independent and dW stays a fixed-order sum of per-program partials.
INTERPRETER_ELEMENTS_PER_BLOCK = 32768
INTERPRETER_PROGRAMS = 2


def _warps(elements: int, per_thread: int) -> int:
    return max(1, min(8, elements // (32 * per_thread)))


# Host-side integer helpers for the per-call path: triton.cdiv and triton.next_power_of_2 are
# jit functions that cost ~3 us of host time a call.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def keep_bounded(table: dict, key, value, bound: int):
    """``table[key] = value``, the table emptied first when it holds ``bound`` entries (the
    host-side tables of checked signatures and of launches); returns ``value``."""
    if len(table) >= bound:
        table.clear()
    table[key] = value
    return value


def _interpreter(dim: int) -> BackwardLaunch:
    block_d = next_power_of_2(dim)
    return BackwardLaunch(max(1, INTERPRETER_ELEMENTS_PER_BLOCK // block_d), 1, block_d,
                          INTERPRETER_PROGRAMS, INTERPRETER_PROGRAMS, 1, block_d, 1)


# Both are cached on (dim, device): every forward and backward asks, with the same answer.
@functools.lru_cache(maxsize=1024)
def forward_launch(dim: int, device: torch.device) -> ForwardLaunch:
    """Launch parameters of gated_norm_fwd for rows of ``dim`` elements. The row count only sizes
    the grid (``cdiv(rows, bt)`` at the call site)."""
    if device.type == "cpu":
        cfg = _interpreter(dim)
        return ForwardLaunch(cfg.bt, cfg.warps, cfg.block_d, False)
    block_d = next_power_of_2(dim)
    pdl = programmatic_dependent_launch(device)
    if block_d in FORWARD_SWEPT_BLOCKS:
        return ForwardLaunch(*FORWARD_SWEPT_BLOCKS[block_d], block_d, pdl)
    bt = max(1, FORWARD_ELEMENTS_PER_BLOCK // block_d)
    per_thread = (FORWARD_ELEMENTS_PER_THREAD_NARROW if block_d <= 128
                  else FORWARD_ELEMENTS_PER_THREAD)
    # A row wider than 8 warps * 16 elements keeps 8 warps (more elements per thread).
    return ForwardLaunch(bt, _warps(bt * block_d, per_thread), block_d, pdl)


@functools.lru_cache(maxsize=1024)
def backward_launch(dim: int, device: torch.device) -> BackwardLaunch:
    """Launch parameters of gated_norm_bwd (a persistent grid of at most ``max_programs``; its
    size for a row count: ``backward_programs``) and of the dW partial sum, for rows of ``dim``
    elements."""
    if device.type == "cpu":
        return _interpreter(dim)
    block_d = next_power_of_2(dim)
    if block_d in BACKWARD_SWEPT_BLOCKS:
        bt, warps = BACKWARD_SWEPT_BLOCKS[block_d]
    else:
        bt = max(1, BACKWARD_ELEMENTS_PER_BLOCK // block_d)
        warps = _warps(bt * block_d, BACKWARD_ELEMENTS_PER_THREAD)
    dw_sum_columns = max(1, min(DW_SUM_MAX_COLUMNS, block_d // DW_SUM_PROGRAMS))
    sms, bandwidth = sm_count(device), dram_bandwidth_per_sm(device)
    long_walk_per_sm = (LOW_BANDWIDTH_PROGRAMS_PER_SM
                        if bandwidth is not None and bandwidth < LOW_BANDWIDTH_PER_SM
                        else BACKWARD_PROGRAMS_PER_SM)
    return BackwardLaunch(bt, warps, block_d,
                          sms * BACKWARD_PROGRAMS_PER_SM, sms * long_walk_per_sm, BACKWARD_STAGES,
                          dw_sum_columns, DW_SUM_WARPS,
                          DW_SUM_PDL and programmatic_dependent_launch(device),
                          programmatic_dependent_launch(device))


def backward_programs(cfg: BackwardLaunch, blocks: int) -> int:
    """Persistent programs of a backward over ``blocks`` row blocks: one per block up to
    ``cfg.max_programs``, and ``cfg.long_walk_programs`` once each of ``cfg.max_programs`` would
    walk LONG_WALK_BLOCKS blocks or more."""
    if blocks >= LONG_WALK_BLOCKS * cfg.max_programs:
        return cfg.long_walk_programs
    return min(cfg.max_programs, blocks)
