"""Sweep of the launch parameters of both training kernels (rows per block, warps, backward
programs per SM), GPU time in CUDA graphs, and the backward's dW partial sum against torch's.

    python tools/launch_sweep.py [--shapes 1x4096x8x128,4x4096x16x256] [--out DIR]   # -> DIR/launch_sweep.json

The shipped heuristics (core/fusions/gated_norm_launch.py) are a function of the head dim and
the SM count only; docs/design.md says why.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from tools.bench_common import (DTYPE, EPS, bench_graph, bytes_moved, copy_ceiling,  # noqa: E402
                                environment, log, make_inputs, parse_shape, pct_of_ceiling,
                                require_cuda, write_json)

import core.fusions.fused_gated_norm as fgn  # noqa: E402

DEFAULT_SHAPES = "1x4096x8x128,1x4096x32x128,1x32768x32x128,4x4096x16x256"
WARPS = (2, 4, 8)
PROGRAMS_PER_SM = (1, 2, 4, 8, 16)
MIN_ELEMENTS_PER_THREAD = 4


def candidate_blocks(dim: int) -> list[tuple[int, int]]:
    """(rows per block, warps) pairs around the 2048-element block, at least
    MIN_ELEMENTS_PER_THREAD elements per thread."""
    block_d = triton.next_power_of_2(dim)
    base = max(1, 2048 // block_d)
    return [(bt, warps) for bt in (max(1, base // 2), base, base * 2) for warps in WARPS
            if bt * block_d // (32 * warps) >= MIN_ELEMENTS_PER_THREAD]


def sweep_shape(shape, ceiling: float, sms: int) -> list[dict]:
    x, g, w, dy, _ = make_inputs(shape)
    x, g, w = x.detach(), g.detach(), w.detach()
    nbytes = bytes_moved(shape)
    _, rstd = fgn.forward_impl(x, g, w, EPS)
    results = []

    def timed(kernel, fn, **params):
        try:
            us = bench_graph(fn)
        except Exception as e:  # noqa: BLE001 - a configuration out of resources is skipped
            log(f"  {kernel} {shape} {params}: {type(e).__name__}")
            return
        results.append({"kernel": kernel, "shape": shape, **params, "us": us,
                        "pct": pct_of_ceiling(nbytes[kernel], us, ceiling)})

    for bt, warps in candidate_blocks(shape[3]):
        timed("fwd", lambda: fgn.forward_impl(x, g, w, EPS, bt=bt, warps=warps), bt=bt, warps=warps)
        for per_sm in PROGRAMS_PER_SM:
            timed("bwd", lambda: fgn.backward_impl(x, g, w, rstd, dy, bt=bt, warps=warps,
                                                    programs=sms * per_sm),
                  bt=bt, warps=warps, per_sm=per_sm)
    # The backward's tail: the fixed-order sum of the per-program dW partials, rounded to the
    # weight's dtype, by the project's kernel and by torch (sum + cast).
    cfg = fgn.backward_launch(shape[3], x.device)
    partial = torch.zeros(cfg.max_programs, shape[3], device=x.device)
    results.append({"kernel": "dw_sum", "shape": shape, "programs": cfg.max_programs,
                    "us": bench_graph(lambda: fgn.sum_dw_partials(partial, DTYPE, cfg)),
                    "torch_us": bench_graph(lambda: partial.sum(0).to(DTYPE))})
    return results


def best_lines(results: list[dict], top: int = 5) -> list[str]:
    lines = []
    for shape in dict.fromkeys(tuple(r["shape"]) for r in results):
        for kernel in ("fwd", "bwd"):
            ranked = sorted((r for r in results if tuple(r["shape"]) == shape and r["kernel"] == kernel),
                            key=lambda r: r["us"])
            lines.append(f"{kernel} {shape}: " + "; ".join(
                f"bt{r['bt']} w{r['warps']}" + (f" p{r['per_sm']}" if "per_sm" in r else "")
                + f" {r['us']:.1f} us {r['pct']:.0f} %" for r in ranked[:top]))
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated BxSxHxD shapes")
    parser.add_argument("--out", default="out/benchmark", help="folder for launch_sweep.json")
    args = parser.parse_args(argv)
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    require_cuda("launch_sweep.py")
    ceiling = copy_ceiling()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"env": environment(), "ceiling": ceiling, "sweep": []}
    for shape in shapes:
        results["sweep"] += sweep_shape(shape, ceiling["GBps"], sms)
        write_json(results, args.out, "launch_sweep.json")
    for line in best_lines(results["sweep"]):
        log(line)


if __name__ == "__main__":
    main()
