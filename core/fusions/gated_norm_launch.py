"""Launch heuristics of the fused gated norm, kept apart from the kernel bodies.

Parameters are a pure function of (head dim, SM count): no first-call autotuning, so training
steps are reproducible and have no warm-up stalls, and never of the row count, so a row's bits do
not depend on the size of its batch. The numbers come from H200 sweeps (bf16; docs/design.md,
launch choices; ``python tools/launch_sweep.py`` reruns them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

# Largest head dim the single-pass kernels take: a row lives in registers.
MAX_HEAD_DIM = 8192
# Row indices are int32 in the kernels (element offsets are int64); the margin keeps the indices
# of a last, partial block of up to 2**16 rows below 2**31.
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
    max_programs: int  # persistent grid size cap (also the number of fp32 dW partials)
    stages: int  # software pipelining of the row-block loop (loads of later blocks in flight)
    dw_sum_columns: int  # gated_norm_dw_sum: columns per program (all partials in one load)
    dw_sum_warps: int
    # The dW sum launched with programmatic dependent launch, the backward kernel letting it
    # launch once its row loops are done (DW_SUM_PDL below).
    dw_sum_pdl: bool = False


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # CPU interpreter: programs run one after another; a few keep dW partials small


# Programmatic dependent launch (Hopper and later) of the forward: it may start while the kernel
# before it in the stream drains, waits for that kernel's writes (griddepcontrol.wait) before its
# first load, and lets the kernel after it start once all of its own programs run. It hides part
# of the time between two kernels, a large share of a call at the row counts of TP 4-8 ranks
# (H200, GPU time in CUDA graphs, tools/launch_sweep.py: 4.33 -> 3.74 us at 16k rows of D=128,
# 6.83 -> 6.27 at 32k, 26.18 -> 25.36 at 128k, 14.46 -> 13.94 at 32k rows of D=256). Bits do not
# change. The backward kernel launches as usual (launched early, with the dW sum, it was 30-70 %
# slower in CUDA graphs); its dW sum is launched early (DW_SUM_PDL below).
PROGRAMMATIC_DEPENDENT_LAUNCH = True


@functools.lru_cache(maxsize=None)
def programmatic_dependent_launch(device: torch.device) -> bool:
    """Whether the kernels that take it (the forward, the backward's dW sum) are launched on
    ``device`` with programmatic dependent launch: NVIDIA sm_90+ (griddepcontrol is PTX: not for the interpreter, nor for ROCm, whose devices also
    report a capability)."""
    return (PROGRAMMATIC_DEPENDENT_LAUNCH and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


# H200 sweeps (bf16, 524k and 1M rows of D=128, 262k rows of D=256):
# - forward (tools/forward_variants.py, without the grid-stride loop and with 32-bit column
#   offsets): 2048 elements per program with 4 warps (bt=16 at D=128, bt=8 at D=256) was best
#   or within 0.5 % of it at every size (99 % / 95 % / 95 % of the copy ceiling); 1024 with 2
#   warps was within 1 %, 4096 with 4 warps 9 % slower.
# - backward (tools/launch_sweep.py, GPU time in CUDA graphs, dW sum included, 16k-128k rows of
#   D=128 and 32k of D=256): 512 elements per loop iteration with 2 warps (4 rows at D=128, 2 at
#   D=256), 3 pipeline stages and 8 programs per SM was the fastest at 32k and 128k rows and
#   within 3 % of it at 16k; against the former 1024 elements, 4 warps, no pipelining: 9.9 vs
#   12.5 us at 16k rows, 15.3 vs 17.9 at 32k, 46.5 vs 49.4 at 128k, 27.8 vs 34.0 at 32k rows of
#   D=256 (where 1 warp, 16 elements per thread, was 5 % faster still: one shape, not taken).
#   Every block of 8 elements per thread lays a row out the same way (tools/kernel_ir.py), so
#   dx keeps its bits across these choices.
# - forward (`tools/launch_sweep.py`, GPU time in CUDA graphs, the real kernel):
#   at D=128, 8 warps (8 elements per thread) beat 4: 26.3 vs 27.6 us at 131k rows, 187.5 vs
#   188.3 at 1M, 6.7 vs 7.1 at 32k; at D=256, 4 warps stayed best (bt=8: 95.5 us, 8 warps 100.5).
# - forward, small grids (D=128): 1024 elements with 2 warps beat the regular
#   block at 16k and 32k rows (6.45 vs 6.8 us) and lost from 49k rows on. Not taken: a row's
#   reduction tree follows its layout along the row (elements per thread, lanes, warps; rstd
#   can move by an fp32 ulp), and for rows that are not 16-byte aligned 2 warps lay a row out
#   differently from 8 (compiled for sm_90: tools/kernel_ir.py, docs/design.md), so a rows-dependent
#   choice would make a token's output depend on how many tokens share its batch.
# Neither kernel's parameters depend on the row count (only the grid does): a row gets the same
# bits in any batch (test_rows_get_the_same_bits_in_any_batch), and a new token count never
# compiles a new kernel.
FORWARD_ELEMENTS_PER_BLOCK = 2048
BACKWARD_ELEMENTS_PER_BLOCK = 512
FORWARD_ELEMENTS_PER_THREAD = 16
FORWARD_ELEMENTS_PER_THREAD_NARROW = 8  # rows of <= 128 elements (BLOCK_D <= 128)
# Swept blocks that beat the rule above, by BLOCK_D: (rows per program, warps). 256: 4 rows x
# 4 warps (8 elements per thread) against the rule's 8 x 4, in two sweeps: -7 to -8 % at 32k rows, -1.8 % at 131k, -0.4 to -0.6 % at 262k, +1 to +3 % at 16k.
# A row's layout (8 elements x 32 lanes, or 4 warps along an unaligned row) is the same in
# both, so no bit changes (tools/kernel_ir.py).
FORWARD_SWEPT_BLOCKS = {256: (4, 4)}
BACKWARD_ELEMENTS_PER_THREAD = 8
BACKWARD_PROGRAMS_PER_SM = 8
BACKWARD_STAGES = 3


# The dW partial sum (gated_norm_dw_sum): a few columns per program, all partials in one load
# (<= 2048 x 8 fp32 = 64 per thread with 8 warps), about 64 programs reading the partials at once
# (swept: 2 columns at D=128, 4 at D=256, 0.1-0.4 us faster than 8 at 132-1056 partials).
# The interpreter pays per program: one program takes the whole row.
DW_SUM_PROGRAMS = 64
DW_SUM_MAX_COLUMNS = 8
DW_SUM_WARPS = 8
# The dW sum with programmatic dependent launch: the backward kernel lets it launch once a
# program's row loop is done, and it waits for the backward's completion before reading a
# partial. GPU time of the backward alone in CUDA graphs, same process (H200, bf16): 10.13 ->
# 9.92 us at 16k rows of D=128, 15.65 -> 15.39 at 32k, 26.84 -> 26.56 at 64k, 46.93 -> 46.64 at
# 128k, 27.72 -> 27.48 at 32k rows of D=256; it also lets a kernel launched the same way after
# it (the next forward) start early. With the backward's implicit trigger (at its exit) instead,
# it was 0.15-0.3 us slower than no early launch. Bits do not change.
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


def _interpreter(dim: int) -> BackwardLaunch:
    block_d = next_power_of_2(dim)
    return BackwardLaunch(max(1, INTERPRETER_ELEMENTS_PER_BLOCK // block_d), 1, block_d,
                          INTERPRETER_PROGRAMS, 1, block_d, 1)


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
    per_thread = FORWARD_ELEMENTS_PER_THREAD_NARROW if block_d <= 128 else FORWARD_ELEMENTS_PER_THREAD
    # A row wider than 8 warps * 16 elements keeps 8 warps (more elements per thread).
    return ForwardLaunch(bt, _warps(bt * block_d, per_thread), block_d, pdl)


@functools.lru_cache(maxsize=1024)
def backward_launch(dim: int, device: torch.device) -> BackwardLaunch:
    """Launch parameters of gated_norm_bwd (a persistent grid of at most ``max_programs``) and of
    the dW partial sum, for rows of ``dim`` elements; independent of the row count."""
    if device.type == "cpu":
        return _interpreter(dim)
    block_d = next_power_of_2(dim)
    bt = max(1, BACKWARD_ELEMENTS_PER_BLOCK // block_d)
    dw_sum_columns = max(1, min(DW_SUM_MAX_COLUMNS, block_d // DW_SUM_PROGRAMS))
    return BackwardLaunch(bt, _warps(bt * block_d, BACKWARD_ELEMENTS_PER_THREAD), block_d,
                          sm_count(device) * BACKWARD_PROGRAMS_PER_SM, BACKWARD_STAGES,
                          dw_sum_columns, DW_SUM_WARPS,
                          DW_SUM_PDL and programmatic_dependent_launch(device))
