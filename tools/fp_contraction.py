"""The training kernels compiled with FP contraction (a * b + c as one FMA) on, as shipped, and
off, as TRITON_DEFAULT_FP_FUSION=0 or Triton 3.10's default would compile them: the forward's
share of elements bitwise equal to the unfused path, the gradients' errors against float64 (and
the unfused path's), and GPU time in CUDA graphs.

    python tools/fp_contraction.py [--shapes 1x4096x32x128,1x4096x8x128] [--out DIR]
                                   # -> DIR/fp_contraction.json

docs/design.md (Launch choices) says why every launch asks for contraction.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tools.bench_common import (EPS, bench_graph, environment, log, make_inputs,  # noqa: E402
                                parse_shape, require_cuda, write_json)

import core.fusions.fused_gated_norm as fgn  # noqa: E402
import core.fusions.gated_norm_plans as plans  # noqa: E402
from core.fusions.gated_norm_reference import (bitwise_share, relative_error,  # noqa: E402
                                               ulp_distance, unfused_gated_norm)

DEFAULT_SHAPES = "1x4096x32x128,1x4096x8x128,1x4096x8x256"
LAUNCHERS = (plans.launch_forward, plans.launch_backward, plans.launch_dw_sum)
GRADIENTS = ("dx", "dgate", "dweight")


@contextlib.contextmanager
def fp_contraction(enabled: bool):
    """While open, the three kernels compile and launch with ``enable_fp_fusion=enabled``."""
    saved = [launcher.compile_options for launcher in LAUNCHERS]
    try:
        for launcher in LAUNCHERS:
            launcher.compile_options = {**launcher.compile_options, "enable_fp_fusion": enabled}
            launcher.compiled.clear()  # kernels kept under the other setting
        yield
    finally:
        for launcher, options in zip(LAUNCHERS, saved):
            launcher.compile_options = options
            launcher.compiled.clear()


def _gradients(fn, x, gate, weight, dy):
    leaves = [t.detach().requires_grad_() for t in (x, gate, weight)]
    return torch.autograd.grad(fn(*leaves, EPS), leaves, dy)


def accuracy(x, gate, weight, dy) -> dict:
    """Under the current setting: the forward against the unfused path (share of bitwise equal
    elements, most ulps apart) and each gradient's relative error against float64, with the
    unfused path's."""
    out = fgn.fused_gated_norm(x, gate, weight, EPS)
    ref = unfused_gated_norm(x, gate, weight, EPS)
    exact = _gradients(unfused_gated_norm, *(t.double() for t in (x, gate, weight, dy)))
    fused = _gradients(fgn.fused_gated_norm, x, gate, weight, dy)
    unfused = _gradients(unfused_gated_norm, x, gate, weight, dy)
    return {"bitwise_share": bitwise_share(out, ref),
            "max_ulps": ulp_distance(out, ref).max().item(),
            "grad_rel_err": {n: relative_error(f, e) for n, f, e in zip(GRADIENTS, fused, exact)},
            "unfused_grad_rel_err": {n: relative_error(u, e)
                                     for n, u, e in zip(GRADIENTS, unfused, exact)}}


def gpu_time(x, gate, weight, dy) -> dict:
    _, rstd = fgn.forward_impl(x, gate, weight, EPS)
    return {"fwd_us": bench_graph(lambda: fgn.forward_impl(x, gate, weight, EPS)),
            "bwd_us": bench_graph(lambda: fgn.backward_impl(x, gate, weight, rstd, dy))}


def measure_shape(shape, timed: bool = True, device=None) -> list[dict]:
    """Both settings at ``shape``; ``timed``: with GPU time and the compiled kernels' option."""
    x, gate, weight, dy, _ = make_inputs(shape, device=device)
    x, gate, weight = x.detach(), gate.detach(), weight.detach()
    rows = []
    for enabled in (True, False):
        with fp_contraction(enabled):
            row = {"shape": list(shape), "fp_contraction": enabled,
                   **accuracy(x, gate, weight, dy)}
            if timed:
                row.update(gpu_time(x, gate, weight, dy))
                compiled = [k for launcher in LAUNCHERS for k in launcher.compiled.values()]
                row["compiled_with"] = sorted({bool(k.metadata.enable_fp_fusion) for k in compiled})
        rows.append(row)
    return rows


def describe(row: dict) -> str:
    errors = " ".join(f"{row['grad_rel_err'][n]:.3e}" for n in GRADIENTS)
    unfused = " ".join(f"{row['unfused_grad_rel_err'][n]:.3e}" for n in GRADIENTS)
    timing = (f"  fwd {row['fwd_us']:6.2f} us  bwd {row['bwd_us']:6.2f} us" if "fwd_us" in row
              else "")
    return (f"{'x'.join(map(str, row['shape'])):16s} {'on ' if row['fp_contraction'] else 'off'}"
            f"  bitwise {row['bitwise_share']:.7f}  max {row['max_ulps']:.0f} ulp"
            f"  dx/dgate/dW err {errors} (unfused {unfused}){timing}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated BxSxHxD shapes")
    parser.add_argument("--out", default="out/benchmark", help="folder for fp_contraction.json")
    args = parser.parse_args(argv)
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    require_cuda("tools/fp_contraction.py")
    rows = []
    for shape in shapes:
        log(f"fp contraction {shape}")
        rows += measure_shape(shape)
    path = write_json({"env": environment(), "rows": rows}, args.out, "fp_contraction.json")
    print("\n".join(describe(r) for r in rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
