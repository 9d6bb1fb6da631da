"""Benchmark of the fused gated norm against its peers, on one GPU, in one process.

    python tools/benchmark.py [--out DIR] [--quick]       # GPU: benchmark.json, .csv, .png
    python tools/benchmark.py --megatron-fused-gated-norm FILE.py   # megatron main's kernel too
    python tools/benchmark.py --report FILE.json [--out DIR]   # no GPU: comparison, CSV, plot

Per shape, forward and backward separately, of: ours, the unfused Megatron path (eager), its
torch.compile (default, and with emulate_precision_casts=True, which keeps the intermediate bf16
rounding), FLA's rms_norm_gated (when fla-core is importable) and Megatron-LM main's
fused_gated_norm (``megatron_main``: the installed megatron.core.fusions.fused_gated_norm, or the
.py file given by --megatron-fused-gated-norm; its limits: power-of-two head dims, output
contiguous in bshd, so the sbhd case pays the transpose copy). Each is timed as GPU time (the
call captured in a CUDA graph and replayed) and eagerly (do_bench after its L2 flush, which hides
the host's launch work behind the flush: GPU-dominated, not a host cost), and reported
as us, GB/s and % of the copy ceiling measured at the start of the same run, next to a plain
kernel moving the same bytes in the same harness into outputs it allocates per call, as every
implementation does (``same_bytes_copy``). Also: the inference entry against FLA's forward, and
the host cost of one call (tools/host_cost.py).
Correctness (parity, CUDA graphs, torch.compile, compile count) is tested by
``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from core.fusions import fused_gdn_gated_rms_norm  # noqa: E402
from core.fusions.fused_gated_norm import fused_gated_norm  # noqa: E402
from core.fusions.gated_norm_reference import unfused_gated_norm  # noqa: E402
from tools import bench_report, host_cost  # noqa: E402
from tools.bench_common import (DEVICE, DTYPE, EPS, MEGATRON_MAIN_FLAG,  # noqa: E402
                                bench, bench_graph, bytes_moved, capture, copy_ceiling,
                                environment, gbps, load_fla_rms_norm_gated,
                                load_megatron_main_fused_gated_norm, log, make_inputs,
                                pct_of_ceiling, require_cuda, same_bytes_copy_us, shape_label,
                                write_json)

# Model shapes [B, S, H, D] (Qwen3-Next's GDN: 32 value heads of 128 at TP 1), then what one
# tensor-parallel rank holds: 4-32 heads of 128 at S = 4096 and 8192, and 8 or 16 heads of 256.
MODEL_SHAPES = [(1, 4096, 32, 128), (2, 8192, 32, 128), (1, 32768, 32, 128), (4, 4096, 16, 256)]
TP_RANK_SHAPES = ([(1, s, h, 128) for s in (4096, 8192) for h in (4, 8, 16, 32)]
                  + [(1, s, h, 256) for s in (4096, 8192) for h in (8, 16)])
SHAPES = list(dict.fromkeys(TP_RANK_SHAPES + MODEL_SHAPES))  # in order, no repeats
QUICK_SHAPES = [(1, 4096, 32, 128), (2, 8192, 32, 128)]
# The strided gate (a slice of the packed projection) and the sbhd output, next to the plain
# layout of the same shape.
VARIANTS = [((1, 4096, 32, 128), "strided_gate"), ((1, 4096, 32, 128), "sbhd"),
            ((2, 8192, 32, 128), "strided_gate")]
IMPLS = ("ours", "eager", "compile", "compile_casts", "fla", "megatron_main")
SERVING_TOKENS = (1, 64, 1024, 8192, 65536)
SERVING_HEADS, SERVING_DIM = 32, 128


class PeerRefused(Exception):
    """A peer does not take a case's inputs (its documented limits): the case records it as not
    timed, with the reason, and the run goes on."""


def implementations(fla_fn, megatron_main_fn=None) -> dict:
    """name -> fn(x, gate, weight, sbhd) returning a [B, S, H, D] (bshd) or [S, B, H, D] (sbhd)
    output, the way a user of that peer would produce the layer's output. A peer may raise
    PeerRefused for inputs outside its contract."""

    def ours(x, g, w, sbhd):
        out = fused_gated_norm(x, g, w, EPS, out_layout="sbhd" if sbhd else "bshd")
        return out.transpose(0, 1) if sbhd else out  # the free contiguous [S, B, H, D] view

    def unfused(x, g, w, sbhd):
        out = unfused_gated_norm(x, g, w, EPS)
        return out.transpose(0, 1).contiguous() if sbhd else out  # Megatron's transpose copy

    # One static-shape graph per case: lift dynamo's default recompile limit of 8.
    torch._dynamo.config.recompile_limit = 64
    impls = {"ours": ours, "eager": unfused, "compile": torch.compile(unfused, dynamic=False),
             "compile_casts": torch.compile(unfused, dynamic=False,
                                            options={"emulate_precision_casts": True})}
    if fla_fn is not None:
        def fla(x, g, w, sbhd):
            out = fla_fn(x, g, w, None, activation="swish", eps=EPS)
            return out.transpose(0, 1).contiguous() if sbhd else out
        impls["fla"] = fla
    if megatron_main_fn is not None:
        def megatron_main(x, g, w, sbhd):
            dim = x.shape[-1]
            if dim & (dim - 1):
                raise PeerRefused(f"head dim {dim}: megatron main's kernels take power-of-two "
                                  "head dims only")
            try:
                out = megatron_main_fn(x, g, w, EPS)
            except (ValueError, NotImplementedError) as e:  # its way of refusing an input
                raise PeerRefused(f"refused: {type(e).__name__}: {e}") from e
            return out.transpose(0, 1).contiguous() if sbhd else out  # its output is bshd
        impls["megatron_main"] = megatron_main
    return impls


def eager_times(fn, x, g, w, dy, sbhd) -> dict:
    """Eager (do_bench) times in us of forward and backward. The timed forward's output and
    autograd graph are freed on return."""
    out = fn(x, g, w, sbhd)  # compile / warm up
    # Gradients w.r.t. (x, gate, weight): for the strided gate this is the gradient of the view,
    # so autograd's SliceBackward into the packed buffer (paid alike by every implementation) is
    # not timed.
    inputs = (x, g, w)
    torch.autograd.grad(out, inputs, dy, retain_graph=True)
    return {"fwd_us": bench(lambda: fn(x, g, w, sbhd)),
            "bwd_us": bench(lambda: torch.autograd.grad(out, inputs, dy, retain_graph=True))}


def time_impl(fn, shape, variant) -> dict:
    """Eager (do_bench) and GPU (CUDA graph) times in us of forward and backward."""
    x, g, w, dy, _ = make_inputs(shape, variant)
    sbhd = variant == "sbhd"
    if sbhd:
        dy = dy.transpose(0, 1).contiguous()
    times = eager_times(fn, x, g, w, dy, sbhd)
    # In a graph the backward is captured with its forward: autograd runs each backward op on
    # the stream of its forward op. Fresh leaves, and the strided gate's slice taken inside the
    # captured step (as a model does): leaves or views whose autograd graph was built on the
    # default stream make the capture fail.
    x, g, w, _, _ = make_inputs(shape, variant, seed=1)

    def gate():
        return g if g._base is None else g._base.as_strided(g.shape, g.stride(), g.storage_offset())

    def fwd_bwd():
        gv = gate()
        return torch.autograd.grad(fn(x, gv, w, sbhd), (x, gv, w), dy)

    times["fwd_graph_us"] = bench_graph(lambda: fn(x, gate(), w, sbhd))
    times["bwd_graph_us"] = bench_graph(fwd_bwd) - times["fwd_graph_us"]
    return times


def with_rates(times: dict, nbytes: dict, ceiling: float) -> dict:
    """Times plus GB/s and % of the copy ceiling for each phase and timing."""
    result = dict(times)
    for phase in ("fwd", "bwd"):
        result[f"{phase}_GBps"] = gbps(nbytes[phase], times[f"{phase}_us"])
        result[f"{phase}_pct"] = pct_of_ceiling(nbytes[phase], times[f"{phase}_us"], ceiling)
        result[f"{phase}_graph_pct"] = pct_of_ceiling(nbytes[phase], times[f"{phase}_graph_us"],
                                                      ceiling)
    return result


def inference_at_shape(shape, fla_fn) -> dict:
    """The inference entry (in place into a preallocated out, z a slice of the packed
    projection) against FLA's forward, eager us."""
    b, s, h, d = shape
    tokens = b * s
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    x = torch.randn((tokens, h * d), device=DEVICE, dtype=DTYPE, generator=gen)
    z = (2 * torch.randn((tokens, 2 * h * d), device=DEVICE, dtype=DTYPE, generator=gen))[:, h * d:]
    w = 1 + 0.2 * torch.randn(d, device=DEVICE, dtype=DTYPE, generator=gen)
    out = torch.empty_like(x)
    result = {}
    with torch.no_grad():
        result["ours_us"] = bench(lambda: fused_gdn_gated_rms_norm(x, z, w, out, EPS, h, d))
        if fla_fn is not None:
            xv, zv = x.view(tokens, h, d), z.unflatten(-1, (h, d))
            result["fla_us"] = bench(lambda: fla_fn(xv, zv, w, None, activation="swish", eps=EPS))
    return result


def serving_sizes() -> list[dict]:
    """The inference entry against the training forward (no grad) at serving token counts."""
    heads, dim = SERVING_HEADS, SERVING_DIM
    rows = []
    for tokens in SERVING_TOKENS:
        inference = inference_at_shape((1, tokens, heads, dim), None)["ours_us"]
        x, g, w, _, _ = make_inputs((1, tokens, heads, dim))
        with torch.no_grad():
            training = bench(lambda: fused_gated_norm(x, g, w, EPS))
        nbytes = bytes_moved((1, tokens, heads, dim))["infer"]
        rows.append({"tokens": tokens, "inference_us": inference,
                     "inference_GBps": gbps(nbytes, inference), "training_fwd_us": training})
    return rows


def warm_up_capture() -> None:
    """One untimed capture of a forward and of a forward + backward: the first captures of a
    process have failed on the H200 (capture invalidated) while every later one worked."""
    x, g, w, dy, leaves = make_inputs((1, 16, 8, 128))
    for fn in (lambda: fused_gated_norm(x, g, w, EPS),
               lambda: torch.autograd.grad(fused_gated_norm(x, g, w, EPS), leaves, dy)):
        try:
            capture(fn)
        except RuntimeError as e:
            log(f"warm-up capture failed ({e}); later captures are expected to work")


def run(shapes, variants, impl_names, out_dir: str, megatron_main=None) -> dict:
    """Times ``impl_names`` at ``shapes`` (plain layout) and ``variants``, writing benchmark.json
    into ``out_dir`` after each case. ``megatron_main``: what
    bench_common.load_megatron_main_fused_gated_norm returned, (fn, source) or (None, why);
    default: that function's auto-detection, when megatron_main is among ``impl_names``. A
    requested peer that is not available is left out, and ``absent_peers`` says why."""
    fla_fn, fla_version = load_fla_rms_norm_gated()
    megatron_main_fn, megatron_main_source = None, None
    if "megatron_main" in impl_names:
        megatron_main_fn, megatron_main_source = (megatron_main
                                                  or load_megatron_main_fused_gated_norm())
    results = {"env": environment(fla=fla_version, megatron_main=megatron_main_source
                                  if megatron_main_fn is not None else None)}
    log(json.dumps(results["env"]))
    absent = {}
    if "fla" in impl_names and fla_fn is None:
        absent["fla"] = "fla-core not importable"
    if "megatron_main" in impl_names and megatron_main_fn is None:
        absent["megatron_main"] = megatron_main_source
    results["absent_peers"] = absent
    for name, why in absent.items():
        log(f"{name} absent: {why}")
    results["ceiling"] = copy_ceiling()
    ceiling = results["ceiling"]["GBps"]
    log(f"copy ceiling: {ceiling:.0f} GB/s")
    impls = {k: v for k, v in implementations(fla_fn, megatron_main_fn).items()
             if k in impl_names}
    warm_up_capture()
    results["timings"] = []
    for shape, variant in [(s, "plain") for s in shapes] + variants:
        label, nbytes = shape_label(shape, variant), bytes_moved(shape)
        entry = {"label": label, "shape": shape, "variant": variant,
                 "rows": shape[0] * shape[1] * shape[2], "bytes": nbytes,
                 "floor_us": {k: nbytes[k] / ceiling / 1e3 for k in ("fwd", "bwd")}, "impls": {}}
        copy_us = same_bytes_copy_us(shape)
        entry[bench_report.SAME_BYTES_COPY] = {**{f"{k}_graph_us": v for k, v in copy_us.items()},
                                    **{f"{k}_graph_pct": pct_of_ceiling(nbytes[k], v, ceiling)
                                       for k, v in copy_us.items()}}
        for name, fn in impls.items():
            if variant != "plain" and name.startswith("compile"):
                # each torch.compile case costs ~10 s of compilation; the report says so
                entry.setdefault("not_timed", {})[name] = "torch.compile: plain layout only"
                continue
            try:
                times = time_impl(fn, shape, variant)
            except PeerRefused as e:
                entry.setdefault("not_timed", {})[name] = str(e)
                log(f"{label} {name}: not timed, {e}")
                continue
            except Exception as e:  # noqa: BLE001 - a peer that fails at one shape is reported
                entry.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
                log(f"{label} {name}: {entry['errors'][name]}")
                continue
            entry["impls"][name] = with_rates(times, nbytes, ceiling)
            log(f"{label:28s} {name:14s} graph fwd {times['fwd_graph_us']:8.1f} us  bwd "
                f"{times['bwd_graph_us']:8.1f} us | eager fwd {times['fwd_us']:8.1f}  bwd "
                f"{times['bwd_us']:8.1f}")
        if variant == "plain":
            entry["inference"] = inference_at_shape(shape, fla_fn)
        results["timings"].append(entry)
        torch.cuda.empty_cache()
        write_json(results, out_dir, "benchmark.json")  # what is measured survives a later failure
    results["inference_serving"] = serving_sizes()
    results["host_cost"] = host_cost.host_cost()
    results["vs_peers"] = bench_report.peer_comparison(results)
    write_json(results, out_dir, "benchmark.json")
    return results


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out/benchmark",
                        help="folder for benchmark.json, benchmark.csv and benchmark.png")
    parser.add_argument("--quick", action="store_true",
                        help=f"only {', '.join(shape_label(s) for s in QUICK_SHAPES)}, "
                             "no layout variants")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help="comma-separated implementations to time, of " + ", ".join(IMPLS))
    parser.add_argument("--report", metavar="JSON",
                        help="time nothing: print the comparison of a recorded benchmark.json and "
                             "write its CSV and plot into --out (no GPU needed)")
    parser.add_argument(MEGATRON_MAIN_FLAG, metavar="FILE.py",
                        help="time the fused_gated_norm of this file (Megatron-LM main's "
                             "megatron/core/fusions/fused_gated_norm.py) as megatron_main; "
                             "default: the installed megatron's, when it has that module")
    args = parser.parse_args(argv)
    unknown = set(args.impls.split(",")) - set(IMPLS)
    if unknown:
        parser.error(f"--impls: unknown {sorted(unknown)}; choose from {', '.join(IMPLS)}")
    if args.megatron_fused_gated_norm and "megatron_main" not in args.impls.split(","):
        parser.error(f"{MEGATRON_MAIN_FLAG} names the megatron_main peer, which --impls "
                     "leaves out")
    if args.megatron_fused_gated_norm and args.report:
        parser.error(f"{MEGATRON_MAIN_FLAG} names a peer to time; --report times nothing")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            results = json.load(f)
        if not isinstance(results, dict) or "timings" not in results:
            keys = sorted(results) if isinstance(results, dict) else type(results).__name__
            raise SystemExit(f"--report {args.report}: not a benchmark.py result (one has "
                             f"'timings'; this one: {keys})")
        bench_report.write_report(results, args.out)
        return
    impl_names = args.impls.split(",")
    megatron_main = None
    if args.megatron_fused_gated_norm:  # a bad path fails here, before the GPU is needed
        megatron_main = load_megatron_main_fused_gated_norm(args.megatron_fused_gated_norm)
    require_cuda("benchmark.py")
    shapes, variants = (QUICK_SHAPES, []) if args.quick else (SHAPES, VARIANTS)
    results = run(shapes, variants, impl_names, args.out, megatron_main)
    for line in bench_report.summary_lines(results):
        log(line)
    bench_report.write_report(results, args.out)
    log(f"wrote {os.path.join(args.out, 'benchmark.json')}, benchmark.csv, benchmark.png")


if __name__ == "__main__":
    main()
