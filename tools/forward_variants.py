"""Forward experiment: the training forward (``forward_impl``) next to a contiguous-only copy
of its arithmetic with one addressing or cache choice switched at a time: a grid-stride loop or
one block per program, 64-bit offsets per element or one 64-bit base per block with 32-bit
offsets inside, ``evict_first`` loads, ``.cs`` (streaming) stores. Every variant is checked bit
for bit against ours and timed (do_bench median) with the % of the copy ceiling measured in the
same run. docs/design.md (Launch choices) says what the shipped kernel took from it.

    python tools/forward_variants.py [--out DIR]      # -> DIR/forward_variants.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tools.bench_common import (bench, bytes_moved, copy_ceiling, environment,  # noqa: E402
                                pct_of_ceiling, require_cuda)

import core.fusions.fused_gated_norm as _fgn  # noqa: E402
import core.fusions.gated_norm_kernels as _kernels  # noqa: E402
from core.fusions.gated_norm_plans import COMPILE_OPTIONS  # noqa: E402


@triton.jit
def _block(x, gate, w, out, rstd, block, ROWS, D: tl.constexpr, EPS, BT: tl.constexpr,
           cols, col_mask, OFFSET32: tl.constexpr, EVICT_FIRST: tl.constexpr,
           STREAM_STORE: tl.constexpr):
    if OFFSET32:  # one 64-bit base per block, 32-bit offsets inside it
        base = tl.cast(block, tl.int64) * BT * D
        local = tl.arange(0, BT)
        rows = block * BT + local
        offs = (local * D)[:, None] + cols[None, :]
        x, gate, out = x + base, gate + base, out + base
    else:
        rows = tl.cast(block, tl.int64) * BT + tl.arange(0, BT).to(tl.int64)
        offs = (rows * D)[:, None] + cols[None, :]
    row_mask = rows < ROWS
    mask = row_mask[:, None] & col_mask[None, :]
    if EVICT_FIRST:
        xv = tl.load(x + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        gv = tl.load(gate + offs, mask=mask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
    else:
        xv = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
        gv = tl.load(gate + offs, mask=mask, other=0.0).to(tl.float32)
    # the shipped kernel's arithmetic (its activation and roundings)
    act = _kernels._activation(gv, "silu")
    r = tl.math.rsqrt(tl.sum(xv * xv, axis=1) / D + EPS)
    y = _kernels._round_to(xv * r[:, None] * w[None, :], tl.bfloat16) * act
    y = _kernels._round_to(y, tl.bfloat16).to(tl.bfloat16)
    if STREAM_STORE:
        tl.store(out + offs, y, mask=mask, cache_modifier=".cs")
    else:
        tl.store(out + offs, y, mask=mask)
    tl.store(rstd + rows, r, mask=row_mask)


@triton.jit
def contiguous_fwd(x, gate, weight, out, rstd, ROWS, D: tl.constexpr, EPS,
                   BT: tl.constexpr, BLOCK_D: tl.constexpr, LOOP: tl.constexpr,
                   OFFSET32: tl.constexpr, EVICT_FIRST: tl.constexpr, STREAM_STORE: tl.constexpr):
    """The training forward (silu, bf16 norm rounding) on contiguous [ROWS, D] tensors.
    LOOP: a grid-stride loop over blocks instead of exactly one block per program."""
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    w = tl.load(weight + cols, mask=col_mask, other=0.0).to(tl.float32)
    if LOOP:
        for block in tl.range(tl.program_id(0), tl.cdiv(ROWS, BT), tl.num_programs(0)):
            _block(x, gate, w, out, rstd, block, ROWS, D, EPS, BT, cols, col_mask, OFFSET32,
                   EVICT_FIRST, STREAM_STORE)
    else:
        _block(x, gate, w, out, rstd, tl.program_id(0), ROWS, D, EPS, BT, cols, col_mask,
               OFFSET32, EVICT_FIRST, STREAM_STORE)


def variant_launches(x, gate, weight, out, rstd, eps, programs_cap=132 * 16):
    """(name, launch) of every variant for contiguous [rows, D] views of ``x``, ``gate`` and
    ``out`` (bf16): three blocks, each one block per program or a grid-stride loop over at most
    ``programs_cap`` programs, and with one block per program each addressing and cache choice."""
    dim = x.shape[-1]
    rows = x.numel() // dim
    block_d = triton.next_power_of_2(dim)
    configs = [(max(1, 1024 // block_d), 2), (max(1, 2048 // block_d), 4),
               (max(1, 4096 // block_d), 4)]
    launches = []
    for (bt, warps), loop, off32, evict, cs in itertools.product(
            configs, (False, True), (False, True), (False, True), (False, True)):
        if loop and (off32 or evict or cs):
            continue  # the loop is timed once per config, against the plain one-block kernel
        grid = triton.cdiv(rows, bt) if not loop else min(triton.cdiv(rows, bt), programs_cap)
        name = (f"bt={bt} w={warps}" + (" loop" if loop else "") + (" off32" if off32 else "")
                + (" evict_first" if evict else "") + (" .cs store" if cs else ""))

        def launch(grid=grid, bt=bt, warps=warps, flags=(loop, off32, evict, cs)):
            contiguous_fwd[(grid,)](x, gate, weight, out, rstd, rows, dim, eps, bt, block_d,
                                    *flags, num_warps=warps, **COMPILE_OPTIONS)
        launches.append((name, launch))
    return launches


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/forward_variants")
    args = parser.parse_args()
    require_cuda("forward_variants.py")
    os.makedirs(args.out, exist_ok=True)
    ceiling = copy_ceiling()["GBps"]
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}: "
          f"copy ceiling {ceiling:.0f} GB/s")
    results = []
    eps = 1e-6
    for rows, dim in ((524288, 128), (1048576, 128), (262144, 256)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(1, rows // 32, 32, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        g = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = (1 + 0.1 * torch.randn(dim, device="cuda", generator=gen)).to(torch.bfloat16)
        nbytes = bytes_moved(x.shape)["fwd"]
        ref, _ = _fgn.forward_impl(x, g, w, eps)
        us = bench(lambda: _fgn.forward_impl(x, g, w, eps), rep=200)
        row = {"rows": rows, "D": dim, "variant": "ours (forward_impl)", "us": us,
               "pct": pct_of_ceiling(nbytes, us, ceiling), "bitwise": 1.0}
        results.append(row)
        print(f"{rows:>8} x {dim}: {row['variant']:44s} {us:8.1f} us {row['pct']:5.1f} %")
        out = torch.empty_like(x)
        rstd = torch.empty(rows, device="cuda", dtype=torch.float32)
        for name, launch in variant_launches(x, g, w, out, rstd, eps):
            launch()
            torch.cuda.synchronize()
            bitwise = (out == ref).float().mean().item()
            us = bench(launch, rep=200)
            row = {"rows": rows, "D": dim, "variant": name, "us": us,
                   "pct": pct_of_ceiling(nbytes, us, ceiling), "bitwise": bitwise}
            results.append(row)
            print(f"{rows:>8} x {dim}: {name:44s} {us:8.1f} us {row['pct']:5.1f} % "
                  f"bitwise {bitwise:.6f}", flush=True)
    with open(os.path.join(args.out, "forward_variants.json"), "w") as f:
        json.dump({"env": environment(), "device": torch.cuda.get_device_name(),
                   "triton": triton.__version__, "ceiling_GBps": ceiling, "results": results},
                  f, indent=1)


if __name__ == "__main__":
    main()
