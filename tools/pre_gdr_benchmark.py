"""Benchmark and GPU parity of the fused pre-recurrence region, on one GPU, in one process.

    python tools/pre_gdr_benchmark.py [--out DIR] [--quick]   # GPU: pre_gdr_benchmark.json
    python tools/pre_gdr_benchmark.py --sweep [--sweep-kernel backward] [--out DIR]
                                                              # GPU: pre_gdr_launch_sweep.json
    python tools/pre_gdr_benchmark.py --backward-parts        # GPU: pre_gdr_backward_parts.json

The region: the bshd in_proj output to q, k, v, g, beta (Qwen3-Next per-rank sizes: key and
value head dims 128, conv width 4, 2 value heads per key head). Per shape, GPU time (CUDA graph
replay) of the forward and of forward + backward of:
  ours      ``fused_pre_gated_delta_rule``
  megatron  megatron-core's own steps: FLA's ``causal_conv1d`` (SiLU inside), its
            ``_prepare_input_for_gated_delta_rule`` and ``_compute_g_and_beta`` (``jit_fuser``
            on, as megatron trains), FLA's ``l2norm`` inside it
next to the byte floor (bytes read and written once, at the copy ceiling measured in the same
run). Parity (--parity): the share of bitwise-equal elements of ours against megatron's eager
steps (FLA's kernels, the methods unwrapped), worst ulp distance, and the gradients' error
against a float64 reference beside the unfused path's. Sweep (--sweep): each kernel's GPU time
over its launch choices (``launch_for``'s fields), the other kernels at their defaults.
Backward parts (--backward-parts): the backward's GPU time at 32 value heads with steps of its
kernel left out (BACKWARD_STEPS, in a copy of the kernels' module) or the L2 norm off: what
each step costs.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import tempfile
import traceback
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import core.fusions.fused_pre_gated_delta_rule as region  # noqa: E402
import core.fusions.pre_gated_delta_rule_kernels as kernels  # noqa: E402
from core.fusions.fused_pre_gated_delta_rule import fused_pre_gated_delta_rule  # noqa: E402
from core.fusions.gated_norm_reference import (bitwise_share, relative_error,  # noqa: E402
                                               ulp_distance)
from core.fusions.pre_gated_delta_rule_reference import (  # noqa: E402
    unfused_pre_gated_delta_rule)
from tools.bench_common import (bench_graph, copy_ceiling, environment,  # noqa: E402
                                log, require_cuda, write_json)

DK = DV = 128
WIDTH = 4
SHAPES = [(batch, seq, heads) for heads in (32, 8, 4) for seq in (4096, 8192)
          for batch in (1, 2)]
QUICK_SHAPES = [(1, 4096, 32), (1, 4096, 8), (1, 4096, 4)]


def region_inputs(batch, seq, hv, dtype=torch.bfloat16, device="cuda", seed=0):
    """(qkvzba as the bshd view of an sbhd in_proj output, conv weight, A_log, dt_bias)."""
    hk = hv // 2
    gen = torch.Generator(device="cpu").manual_seed(seed)
    width = 2 * hk * DK + 2 * hv * DV + 2 * hv
    sbhd = torch.randn(seq, batch, width, generator=gen).to(device, dtype)
    weight = (torch.randn(2 * hk * DK + hv * DV, 1, WIDTH, generator=gen) * 0.5).to(device, dtype)
    a_log = torch.log(torch.rand(hv, generator=gen) * 15 + 1).to(device, dtype)
    dt_bias = torch.randn(hv, generator=gen).to(device, dtype)
    return sbhd.transpose(0, 1), weight, a_log, dt_bias


def heads(hv):
    return dict(num_key_heads=hv // 2, key_head_dim=DK, num_value_heads=hv, value_head_dim=DV)


def ours(qkvzba, weight, a_log, dt_bias, hv):
    return fused_pre_gated_delta_rule(qkvzba, weight, None, a_log, dt_bias, **heads(hv))


def megatron_steps(eager: bool):
    """megatron-core's region as its forward runs it (``jit_fuser`` on unless ``eager``)."""
    from fla.modules.convolution import causal_conv1d
    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    prepare = _GDNBase._prepare_input_for_gated_delta_rule
    g_and_beta = _GDNBase._compute_g_and_beta
    if eager:
        prepare = getattr(prepare, "__wrapped__", prepare)
        g_and_beta = getattr(g_and_beta, "__wrapped__", g_and_beta)

    def run(qkvzba, weight, a_log, dt_bias, hv):
        hk = hv // 2
        layer = types.SimpleNamespace(qk_dim_local_tp=hk * DK, v_dim_local_tp=hv * DV,
                                      cp_size=1, key_head_dim=DK, value_head_dim=DV,
                                      use_qk_l2norm=True, num_value_heads=hv,
                                      num_key_heads=hk)
        batch, seq, _ = qkvzba.shape
        qkv, gate, beta, alpha = torch.split(
            qkvzba, (2 * hk * DK + hv * DV, hv * DV, hv, hv), dim=-1)
        gate = gate.reshape(batch, seq, -1, DV)
        qkv, _ = causal_conv1d(x=qkv, weight=weight.squeeze(1), bias=None, activation="silu",
                               initial_state=None, output_final_state=False, cu_seqlens=None)
        q, k, v, gate, beta, alpha = prepare(layer, qkv, gate, batch, seq, beta, alpha)
        g, beta = g_and_beta(layer, a_log, dt_bias, alpha, beta)
        return q, k, v, gate, g, beta

    return run


def region_bytes(batch, seq, hv) -> dict:
    """The byte floor: forward reads qkv, beta, alpha and writes q, k (repeated), v, g (fp32),
    beta; backward reads them again with the five output gradients and writes the gradient of
    qkv, beta and alpha (the gate's slice is the output norm's)."""
    tokens, hk = batch * seq, hv // 2
    read = tokens * (2 * hk * DK + hv * DV + 2 * hv) * 2
    outputs = tokens * (2 * hv * DK + hv * DV + hv) * 2 + tokens * hv * 4
    return {"forward": read + outputs, "forward_backward": 3 * read + 2 * outputs}


def timed(fn, inputs, hv, backward: bool) -> float:
    qkvzba, weight, a_log, dt_bias = inputs
    leaves = [t.detach().requires_grad_(backward) for t in (qkvzba, weight, a_log, dt_bias)]
    outs = fn(*leaves, hv)  # outside any capture: compiles and loads the kernels
    grads = [torch.randn_like(o) for o in outs if o.requires_grad] if backward else None
    del outs

    def step():
        outs = fn(*leaves, hv)
        if backward:
            used = [o for o in outs if o.requires_grad]
            return torch.autograd.grad(used, leaves, grads[:len(used)], allow_unused=True)
        return outs

    return bench_graph(step)


def parity(batch, seq, hv) -> dict:
    """Ours against megatron's eager steps, forward bits and gradients against float64."""
    inputs = region_inputs(batch, seq, hv, seed=1)
    eager = megatron_steps(eager=True)
    result = {}
    leaves = {}
    outs = {}
    for name, fn in (("ours", ours), ("megatron", eager)):
        leaves[name] = [t.detach().clone().requires_grad_(True) for t in inputs]
        outs[name] = fn(*leaves[name], hv)
    gen = torch.Generator(device="cpu").manual_seed(2)
    grads = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs["ours"]]
    for name, o_ours, o_ref in zip(("q", "k", "v", "gate", "g", "beta"), outs["ours"],
                                   outs["megatron"]):
        result[name] = {"bitwise": bitwise_share(o_ours, o_ref),
                        "max_ulps": ulp_distance(o_ours, o_ref).max().item()}
    f64 = [t.detach().double().requires_grad_(True) for t in inputs]
    ref64 = unfused_pre_gated_delta_rule(f64[0], f64[1], None, f64[2], f64[3], **heads(hv),
                                         conv_rounding="once")
    for name in ("ours", "megatron"):
        torch.autograd.backward(outs[name], grads)
    torch.autograd.backward(ref64, [g.double() for g in grads])
    for i, name in enumerate(("dqkvzba", "dconv_weight", "dA_log", "ddt_bias")):
        err = {impl: relative_error(leaves[impl][i].grad, f64[i].grad)
               for impl in ("ours", "megatron")}
        result[name] = {"rel_error_ours": err["ours"], "rel_error_megatron": err["megatron"]}
    return result


def run(shapes, out_dir: str, with_parity: bool) -> dict:
    ceiling = copy_ceiling()
    results = {"env": environment(), "copy_ceiling": ceiling, "rows": [], "parity": {}}
    impls = {"ours": ours, "megatron": megatron_steps(eager=False)}
    for batch, seq, hv in shapes:
        inputs = region_inputs(batch, seq, hv)
        floor = {k: v / (ceiling["GBps"] * 1e3) for k, v in region_bytes(batch, seq, hv).items()}
        row = {"batch": batch, "seq": seq, "value_heads": hv, "floor_us": floor}
        for name, fn in impls.items():
            try:
                row[name] = {"forward_us": timed(fn, inputs, hv, False),
                             "forward_backward_us": timed(fn, inputs, hv, True)}
            except Exception as error:  # one failing peer does not end the run
                log(f"{name} failed at {batch}x{seq}x{hv}: {type(error).__name__}: "
                    f"{str(error).splitlines()[0]}\n{traceback.format_exc(limit=-4)}")
                torch.cuda.synchronize()
                row[name] = {"forward_us": float("nan"), "forward_backward_us": float("nan")}
        row["speedup_fwd_bwd"] = (row["megatron"]["forward_backward_us"]
                                  / row["ours"]["forward_backward_us"])
        row["ours_pct_of_floor"] = (100 * floor["forward_backward"]
                                    / row["ours"]["forward_backward_us"])
        results["rows"].append(row)
        log(row)
        del inputs
    if with_parity:
        for hv in (32, 4):
            results["parity"][f"1x4096x{hv}"] = parity(1, 4096, hv)
    write_json(results, out_dir, "pre_gdr_benchmark.json")
    log(f"{'B x S x Hv':>14} {'ours f':>8} {'meg f':>8} {'ours fb':>8} {'meg fb':>8} "
        f"{'floor fb':>8} {'x':>5} {'%floor':>6}")
    for r in results["rows"]:
        log(f"{r['batch']:>3} x{r['seq']:>5} x{r['value_heads']:>3} "
            f"{r['ours']['forward_us']:8.1f} {r['megatron']['forward_us']:8.1f} "
            f"{r['ours']['forward_backward_us']:8.1f} {r['megatron']['forward_backward_us']:8.1f} "
            f"{r['floor_us']['forward_backward']:8.1f} {r['speedup_fwd_bwd']:5.2f} "
            f"{r['ours_pct_of_floor']:6.1f}")
    for key, p in results["parity"].items():
        log(key, {k: v for k, v in p.items()})
    return results


SWEEP_SHAPES = [(1, 4096, 32), (1, 4096, 8), (1, 4096, 4)]
SWEEP = {  # kernel: the Launch fields it reads and their candidates
    "forward": {"forward_tokens": (16, 32, 64), "forward_warps": (2, 4, 8)},
    "backward": {"backward_chunk": (16, 32, 64, 128, 256), "backward_rows": (2, 4, 8),
                 "backward_warps": (1, 2), "backward_stages": (1, 2, 3)},
    "sums": {"sum_columns": (32, 64, 128, 256), "sum_rows": (8, 32, 64)},  # in backward_impl
}


def sweep_candidates(default: region.Launch, swept=tuple(SWEEP)):
    """(kernel, Launch) pairs: one ``swept`` kernel's fields varied, the others at
    ``default``."""
    for kernel in swept:
        fields = SWEEP[kernel]
        for values in itertools.product(*fields.values()):
            yield kernel, default._replace(**dict(zip(fields, values)))


def impl_inputs(batch, seq, hv, device="cuda"):
    """What forward_impl and backward_impl take at this size: (qkvzba, conv weight, A_log,
    dt_bias), the region's shape, and random gradients of the forward's outputs."""
    qkvzba, weight, a_log, dt_bias = region_inputs(batch, seq, hv, device=device)
    shape = region.check_pre_gated_delta_rule(qkvzba, weight, None, a_log, dt_bias, **heads(hv))
    outs = region.forward_impl(qkvzba, weight, None, a_log, dt_bias, shape)
    return (qkvzba, weight, a_log, dt_bias), shape, [torch.randn_like(o) for o in outs]


def sweep(out_dir: str, shapes=SWEEP_SHAPES, swept=tuple(SWEEP)) -> dict:
    """GPU time of forward_impl (kernel "forward") or backward_impl (the others) per launch."""
    results = {"env": environment(), "rows": []}
    default_for = region.launch_for
    try:
        for batch, seq, hv in shapes:
            (qkvzba, weight, a_log, dt_bias), shape, grads = impl_inputs(batch, seq, hv)
            best = {}
            for kernel, launch in sweep_candidates(default_for(shape, seq), swept):
                region.launch_for = lambda *_, launch=launch: launch
                row = {"batch": batch, "seq": seq, "value_heads": hv, "kernel": kernel,
                       "launch": launch._asdict()}
                try:
                    if kernel == "forward":
                        us = bench_graph(lambda: region.forward_impl(qkvzba, weight, None, a_log,
                                                                     dt_bias, shape))
                    else:
                        us = bench_graph(lambda: region.backward_impl(
                            qkvzba, weight, None, a_log, dt_bias, shape, *grads))
                except Exception as e:  # one launch that cannot run costs its row, not the sweep
                    results["rows"].append({**row, "error": f"{type(e).__name__}: {e}"[:500]})
                    log(f"{batch}x{seq}x{hv} {kernel} {row['launch']}: {type(e).__name__}")
                    continue
                row["us"] = us
                results["rows"].append(row)
                if kernel not in best or us < best[kernel]["us"]:
                    best[kernel] = row
            for kernel, row in best.items():
                log(f"{batch}x{seq}x{hv} {kernel:>8} best {row['us']:8.1f} us "
                    f"{ {k: v for k, v in row['launch'].items() if k in SWEEP[kernel]} }")
            write_json(results, out_dir, "pre_gdr_launch_sweep.json")  # after every shape
    finally:
        region.launch_for = default_for
    return results


# Steps of pre_gdr_bwd that --backward-parts leaves out: (the kernel's line, its replacement).
BACKWARD_STEPS = {
    "dx_sum": ("dxs += di * taps[K - 1 - i]", "pass"),
    "dw_partials": ("new_dw = new_dw + (dw[j] + owned * masked[j],)",
                    "new_dw = new_dw + (dw[j],)"),
}
BACKWARD_PARTS = [((), True), (("dx_sum",), True), (("dw_partials",), True),
                  (("dx_sum", "dw_partials"), True), ((), False)]  # (left out, l2norm)


def kernels_without(steps):
    """A copy of the kernels' module with ``steps`` (BACKWARD_STEPS) left out."""
    source = Path(kernels.__file__).read_text()
    for step in steps:
        line, replacement = BACKWARD_STEPS[step]
        if line not in source:
            raise RuntimeError(f"--backward-parts: the kernel has no line {line!r} ({step})")
        source = source.replace(line, replacement)
    name = "pre_gdr_kernels_without_" + "_".join(steps)
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)  # triton.jit reads the source from the file
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def backward_parts(out_dir: str, shapes=SWEEP_SHAPES[:1]) -> dict:
    """GPU time of backward_impl (default launch) per BACKWARD_PARTS case."""
    results = {"env": environment(), "rows": []}
    full = region.pre_gdr_bwd
    try:
        for batch, seq, hv in shapes:
            (qkvzba, weight, a_log, dt_bias), shape, grads = impl_inputs(batch, seq, hv)
            for steps, l2norm in BACKWARD_PARTS:
                region.pre_gdr_bwd = kernels_without(steps).pre_gdr_bwd if steps else full
                us = bench_graph(lambda l2norm=l2norm: region.backward_impl(
                    qkvzba, weight, None, a_log, dt_bias, shape, *grads, use_qk_l2norm=l2norm))
                left_out = list(steps) + ([] if l2norm else ["l2norm_backward"])
                results["rows"].append({"batch": batch, "seq": seq, "value_heads": hv,
                                        "launch": region.launch_for(shape, seq)._asdict(),
                                        "left_out": left_out, "us": us})
                log(f"{batch}x{seq}x{hv} without {left_out or 'nothing'}: {us:8.1f} us")
            write_json(results, out_dir, "pre_gdr_backward_parts.json")
    finally:
        region.pre_gdr_bwd = full
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/benchmark", help="folder for the JSON")
    parser.add_argument("--quick", action="store_true",
                        help="S = 4096, B = 1 only (with --sweep: 32 value heads only)")
    parser.add_argument("--parity", action="store_true", help="also the parity report")
    parser.add_argument("--sweep", action="store_true", help="only the launch sweep")
    parser.add_argument("--sweep-kernel", choices=tuple(SWEEP), action="append",
                        help="with --sweep: this kernel's launches only (repeatable)")
    parser.add_argument("--backward-parts", action="store_true",
                        help="only the backward's time with steps of its kernel left out")
    args = parser.parse_args(argv)
    require_cuda("pre_gdr_benchmark.py")
    if args.backward_parts:
        backward_parts(args.out)
        return
    if args.sweep:
        sweep(args.out, SWEEP_SHAPES[:1] if args.quick else SWEEP_SHAPES,
              tuple(args.sweep_kernel or SWEEP))
        return
    run(QUICK_SHAPES if args.quick else SHAPES, args.out, args.parity)


if __name__ == "__main__":
    main()
