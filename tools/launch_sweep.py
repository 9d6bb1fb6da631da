"""Sweep of the launch parameters of both training kernels (rows per block, warps; forward:
programmatic dependent launch on or off; backward: programs per SM and pipeline stages, and the
shipped launch with its dW sum launched early or as usual), GPU time in CUDA graphs, with the
shipped launch of each kernel timed in the same run. Per shape it also times the shipped forward
against the same launch into one output allocated once (``forward_parts``), and splits the
shipped backward: its row kernel alone, followed by an empty kernel and by its dW sum, its dW sum
alone (and torch's sum of the same partials) (``backward_parts``); both next to the kernel that
moves the same bytes, into buffers allocated once and into new ones per call (docs/design.md,
Small row counts).

    python tools/launch_sweep.py [--shapes 1x4096x8x128,4x4096x16x256] [--programs-per-sm 4,8,16]
                                 [--stages 1,3] [--blocks 8x1,16x2] [--out DIR]
                                 # -> DIR/launch_sweep.json

``--blocks`` (rows x warps) replaces the swept blocks, 512-2048 elements with 4-16 per thread
(``candidate_blocks``), for every shape.

The shipped heuristics (core/fusions/gated_norm_launch.py) are a function of the head dim and
the SM count only; docs/design.md says why.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from tools.bench_common import (EPS, bench_graph, bytes_moved, copy_ceiling,  # noqa: E402
                                environment, log, make_inputs, parse_blocks,
                                parse_positive_ints, parse_shape, pct_of_ceiling, require_cuda,
                                same_bytes_copy, same_bytes_tensors, shape_label, write_json)

import core.fusions.fused_gated_norm as fgn  # noqa: E402
import core.fusions.gated_norm_plans as plans  # noqa: E402
from core.fusions.gated_norm_launch import (backward_launch, backward_programs, cdiv,  # noqa: E402
                                            forward_launch)

DEFAULT_SHAPES = "1x4096x4x128,1x4096x8x128,1x4096x16x128,1x4096x32x128,1x4096x8x256"
WARPS = (1, 2, 4, 8)
BLOCK_ELEMENTS = (512, 1024, 2048)
PROGRAMS_PER_SM = (4, 8, 16)
STAGES = (1, 3)
ALTERNATIONS = 5
ELEMENTS_PER_THREAD = (4, 16)  # the range swept (fewer leave lanes idle, more spill)


def candidate_blocks(dim: int) -> list[tuple[int, int]]:
    """(rows per block, warps) pairs of 512-2048 elements per block with 4-16 elements per
    thread."""
    block_d = triton.next_power_of_2(dim)
    low, high = ELEMENTS_PER_THREAD
    blocks = dict.fromkeys((max(1, n // block_d), warps) for n in BLOCK_ELEMENTS for warps in WARPS)
    return [(bt, warps) for bt, warps in blocks
            if low <= bt * block_d // (32 * warps) <= high]


def sweep_shape(shape, ceiling: float, sms: int, programs_per_sm=PROGRAMS_PER_SM,
                stages_swept=STAGES, blocks=None) -> list[dict]:
    """Every launch of the sweep at ``shape`` (``blocks``: the (rows, warps) pairs to sweep,
    ``candidate_blocks`` when None), then the parts of the shipped kernels."""
    x, g, w, dy, _ = make_inputs(shape)
    x, g, w = x.detach(), g.detach(), w.detach()
    nbytes = bytes_moved(shape)
    _, rstd = fgn.forward_impl(x, g, w, EPS)
    results = []

    def record(kernel, us, **params):
        results.append({"kernel": kernel, "shape": shape, **params, "us": us,
                        "pct": pct_of_ceiling(nbytes[kernel], us, ceiling)})

    def timed(kernel, fn, **params):
        try:
            us = bench_graph(fn)
        except Exception as e:  # noqa: BLE001 - a configuration out of resources is skipped
            log(f"  {kernel} {shape} {params}: {type(e).__name__}")
            return
        record(kernel, us, **params)

    fwd_cfg, bwd_cfg = forward_launch(shape[3], x.device), backward_launch(shape[3], x.device)
    timed("fwd", lambda: fgn.forward_impl(x, g, w, EPS), shipped=True, bt=fwd_cfg.bt,
          warps=fwd_cfg.warps, pdl=fwd_cfg.pdl)
    # The shipped backward with its dW sum launched early and as usual: a difference of a few
    # tenths of a us, so the two are timed in turn, ALTERNATIONS times each (median).
    shipped_programs = backward_programs(bwd_cfg, cdiv(x.shape[:3].numel(), bwd_cfg.bt))
    shipped_bwd = dict(bt=bwd_cfg.bt, warps=bwd_cfg.warps, per_sm=shipped_programs / sms,
                       stages=bwd_cfg.stages)
    pairs = times_in_turn({flag: lambda flag=flag: fgn.backward_impl(x, g, w, rstd, dy,
                                                                     dw_sum_pdl=flag)
                           for flag in (True, False)})
    for flag, times in pairs.items():
        record("bwd", statistics.median(times), **shipped_bwd, dw_sum_pdl=flag, runs_us=times,
               shipped=flag == bwd_cfg.dw_sum_pdl)
    for bt, warps in blocks or candidate_blocks(shape[3]):
        for pdl in dict.fromkeys((False, fwd_cfg.pdl)):
            timed("fwd", lambda: fgn.forward_impl(x, g, w, EPS, bt=bt, warps=warps, pdl=pdl),
                  bt=bt, warps=warps, pdl=pdl)
        for per_sm in programs_per_sm:
            for stages in stages_swept:
                timed("bwd", lambda: fgn.backward_impl(x, g, w, rstd, dy, bt=bt, warps=warps,
                                                        programs=sms * per_sm, stages=stages),
                      bt=bt, warps=warps, per_sm=per_sm, stages=stages,
                      dw_sum_pdl=bwd_cfg.dw_sum_pdl)
    results.append({"kernel": "forward_parts", "shape": shape, **forward_parts(x, g, w)})
    results.append({"kernel": "backward_parts", "shape": shape, "programs": shipped_programs,
                    **backward_parts(x, g, w, rstd, dy)})
    return results


def times_in_turn(parts: dict) -> dict:
    """``name -> [us, ...]``: ``bench_graph`` of each part in ALTERNATIONS rounds, each round
    timing every part in turn (a drift of the GPU's clocks falls on all of them alike)."""
    times = {name: [] for name in parts}
    for _ in range(ALTERNATIONS):
        for name, fn in parts.items():
            times[name].append(bench_graph(fn))
    return times


def medians_in_turn(parts: dict) -> dict:
    """``name -> median us`` of ``times_in_turn``."""
    return {name: statistics.median(t) for name, t in times_in_turn(parts).items()}


def forward_parts(x, g, w) -> dict:
    """The shipped forward, which allocates its output per call (a graph of captured calls keeps
    one call's output while the next runs, so it cycles through two), against the same launch
    into one output allocated once, and the kernel that moves the forward's bytes
    (``same_bytes_copy``) into a buffer allocated once and into one allocated per call; medians
    of the four timed in turn."""
    out = torch.empty_like(x)
    return medians_in_turn({
        "forward_us": lambda: fgn.forward_impl(x, g, w, EPS),
        "forward_one_output_us": lambda: fgn.forward_impl(x, g, w, EPS, out=out),
        **same_bytes_copy_parts(x, backward=False),
    })


def same_bytes_copy_parts(x, backward: bool) -> dict:
    """The kernel that moves the bytes of a phase at ``x``'s size (``same_bytes_copy``), into
    buffers allocated once and into outputs allocated per call, as parts to time."""
    copy = same_bytes_tensors(x.shape, x.device)
    return {
        "same_bytes_copy_us": lambda: same_bytes_copy(copy, backward),
        "same_bytes_copy_new_outputs_us": lambda: same_bytes_copy(copy, backward,
                                                                  new_outputs=True),
    }


@triton.jit
def _empty_kernel(unused):
    pass


def backward_parts(x, g, w, rstd, dy) -> dict:
    """Where the shipped backward's time goes (the whole of it: the pairs of ``sweep_shape``),
    medians over ALTERNATIONS of the parts timed in turn: its row kernel alone (the same launch
    without the dW sum after it); the row kernel followed by a one-program kernel that does
    nothing (what a second launch costs) and by its dW sum, both on buffers allocated once (the
    shipped backward allocates dx and dgate per call, so a graph of its calls cycles through
    more memory); its dW sum alone (the fixed-order sum of the row kernel's per-program fp32
    partials, rounded to the weight's dtype); torch's ``sum(0).to(dtype)`` of the same partials;
    and the kernel that moves the backward's bytes (``same_bytes_copy``) into buffers allocated
    once and into two allocated per call, as the shipped backward's dx and dgate are."""
    plan = plans.backward_plan(x, g, w, rstd, dy, zero_centered=False, gate_activation="silu",
                               weight_grad_scale=1.0)
    dx, dgate = torch.empty_like(x), torch.empty_like(g)
    partial = x.new_empty((plan.grid, x.shape[3]), dtype=torch.float32)
    dweight = torch.empty_like(w)
    row_kernel = (x, g, w, rstd, dy, dx, dgate, partial)

    def row():
        plans.launch_backward.launch(plan.grid, row_kernel, plan.launch)

    def dw_sum():
        plans.launch_dw_sum.launch(plan.dw_sum_grid, (partial, dweight), plan.dw_sum)

    row()  # partials for the dW sum timed alone

    return medians_in_turn({
        "row_kernel_us": row,
        "row_kernel_then_empty_us": lambda: (row(), _empty_kernel[(1,)](partial)),
        "row_kernel_then_dw_sum_us": lambda: (row(), dw_sum()),
        "dw_sum_us": dw_sum,
        "torch_dw_sum_us": lambda: partial.sum(0).to(w.dtype),
        **same_bytes_copy_parts(x, backward=True),
    })


def describe(r: dict) -> str:
    extra = (f" {r['per_sm']:g}/SM" if "per_sm" in r else "") + \
        (f" {r['stages']} stages" if "stages" in r else "") + (" pdl" if r.get("pdl") else "") + \
        (" dw-sum-pdl" if r.get("dw_sum_pdl") else "")
    return f"bt{r['bt']} w{r['warps']}{extra} {r['us']:.1f} us {r['pct']:.0f} %"


def best_lines(results: list[dict], top: int = 5) -> list[str]:
    """Per shape and kernel: the shipped launch, then the ``top`` fastest of the sweep."""
    lines = []
    for shape in dict.fromkeys(tuple(r["shape"]) for r in results):
        for kernel in ("fwd", "bwd"):
            rows = [r for r in results if tuple(r["shape"]) == shape and r["kernel"] == kernel]
            shipped = [describe(r) for r in rows if r.get("shipped")]
            ranked = sorted((r for r in rows if not r.get("shipped")), key=lambda r: r["us"])
            lines.append(f"{kernel} {shape}: shipped {'; '.join(shipped)} | best "
                         + "; ".join(describe(r) for r in ranked[:top]))
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated BxSxHxD shapes")
    parser.add_argument("--programs-per-sm", default=",".join(map(str, PROGRAMS_PER_SM)),
                        help="backward: comma-separated persistent programs per SM to sweep")
    parser.add_argument("--stages", default=",".join(map(str, STAGES)),
                        help="backward: comma-separated pipeline stage counts to sweep")
    parser.add_argument("--blocks", default=None,
                        help="comma-separated ROWSxWARPS blocks to sweep instead of the candidates")
    parser.add_argument("--out", default="out/benchmark", help="folder for launch_sweep.json")
    args = parser.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",")]
        programs_per_sm = parse_positive_ints("--programs-per-sm", args.programs_per_sm)
        stages = parse_positive_ints("--stages", args.stages)
        blocks = parse_blocks(args.blocks) if args.blocks is not None else None
    except ValueError as exc:
        parser.error(str(exc))
    require_cuda("launch_sweep.py")
    ceiling = copy_ceiling()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"env": environment(), "ceiling": ceiling, "sweep": []}
    for shape in shapes:
        results["sweep"] += sweep_shape(shape, ceiling["GBps"], sms, programs_per_sm, stages,
                                        blocks)
        write_json(results, args.out, "launch_sweep.json")
    for line in best_lines(results["sweep"]):
        log(line)
    log("shape | forward | forward into one output | same-bytes copy: into one output, into new "
        "ones (us)")
    for r in results["sweep"]:
        if r["kernel"] == "forward_parts":
            log(f"{shape_label(r['shape'])} | {r['forward_us']:.2f} | "
                f"{r['forward_one_output_us']:.2f} | {r['same_bytes_copy_us']:.2f}, "
                f"{r['same_bytes_copy_new_outputs_us']:.2f}")
    log("shape | backward | row kernel | + empty kernel | + dW sum | dW sum | same-bytes copy: "
        "into buffers allocated once, into new ones (us)")
    shipped = {tuple(r["shape"]): r["us"] for r in results["sweep"]
               if r["kernel"] == "bwd" and r.get("shipped")}
    for r in results["sweep"]:
        if r["kernel"] == "backward_parts":
            log(f"{shape_label(r['shape'])} | {shipped[tuple(r['shape'])]:.2f} | "
                f"{r['row_kernel_us']:.2f} | {r['row_kernel_then_empty_us']:.2f} | "
                f"{r['row_kernel_then_dw_sum_us']:.2f} | {r['dw_sum_us']:.2f} | "
                f"{r['same_bytes_copy_us']:.2f}, {r['same_bytes_copy_new_outputs_us']:.2f}")


if __name__ == "__main__":
    main()
