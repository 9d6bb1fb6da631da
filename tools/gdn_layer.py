"""Megatron's GatedDeltaNet layer (core.ssm.GatedDeltaNet from core.models.get_gdn_module_spec,
no Transformer Engine needed) with FLA's kernels, bf16, at the GDN shapes of Qwen3-Next (hidden
2048, 16 key heads, 32 value heads, head dims 128), in up to three states of its two fusions:
"off" (both off), "norm" (the fused output norm, ``fused_gated_norm``) and "both" (the output
norm and the fused pre-recurrence region, ``gdn_pre_gated_delta_rule_fusion``):

  * parity: the norm section on the layer's own tensors (bitwise share against megatron's
    unfused _apply_gated_norm, eager and as jit_fuser compiles it; out, dx, dgate, dW errors
    against float64), and the whole layer's errors against an fp32 copy of it ("off" vs "norm");
  * speed and memory (``perf``): forward + backward time (CUDA events, median and fastest step;
    the states' steps alternate, their order rotating every round; each state's speed-up over
    every state before it, step pair by step pair), peak memory and the activation memory the
    forward keeps for backward (bytes per token) of the layer, S=4096 B=1 and S=8192 B=2;
    with ``--value-heads`` at the per-rank head counts of tensor parallelism (TP 1, 4, 8 of
    Qwen3-Next: 32, 8, 4 value heads with 16, 4, 2 key heads, hidden 2048);
  * under megatron's local CUDA graphs (``graphs``, GPU): forward + backward of a GDN
    TransformerLayer (input norm, GDN, MLP) whose forward and backward are captured and replayed,
    at the same head counts and shapes (``--graph-repeats`` layers per state, built and captured
    in rotating order);
  * where the norm's gain comes from (``breakdown``): the output-norm section alone, its GPU time
    per kernel (torch.profiler) split into the norm + gate kernels and the copies the fused path
    removes;
  * where the layer's time goes (``kernels``): per state, the GPU time of each kernel of one
    forward + backward (torch.profiler), the top kernels side by side and the total;
  * where an eager step's host time goes (``host``, at ``--host-value-heads`` and
    ``--host-shape``, by default TP 8's 4 value heads at S=4096 B=1): per state, the self CPU
    time of each torch op, the host time of each part of the layer's forward (its submodules and
    its own steps) and of the backward, next to the step's wall time and GPU time.

    python tools/gdn_layer.py [--out DIR] [--parts parity,perf,graphs,breakdown,kernels,host]
    python tools/gdn_layer.py --parts perf,graphs --value-heads 32 8 4 --shapes 4096x1 8192x1
    python tools/gdn_layer.py --parts perf,kernels --states norm,both [--no-jit]
    torchrun --nproc-per-node 2 tools/gdn_layer.py --tp 2 [--out DIR]   # -> DIR/gdn_layer_tp2.json
    python tools/gdn_layer.py --cpu --out DIR   # tiny shapes on the CPU (a dry run of this script)

Without ``--tp`` the results go to DIR/gdn_layer.json, keyed ``H=<value heads> S=<seq> B=<batch>
<state>`` (perf, graphs) or ``H=.. S=.. B=..`` (kernels, host: the states inside).

With ``--tp N`` (N processes, NCCL) it records, per case of core.testing.gdn_tp (flag on and
off, sequence parallelism, fp32/bf16 params, DDP grad_reduce_in_fp32 and the distributed
optimizer on and off), the out_norm dW after megatron's finalize_model_grads against TP = 1 and
whether every rank holds the same bits.

The pass/fail checks of the same quantities are tests/ssm/test_gated_delta_net_gpu.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

QWEN3_NEXT = dict(hidden_size=2048, num_key_heads=16, num_value_heads=32, key_head_dim=128,
                  value_head_dim=128)
TINY = dict(hidden_size=64, num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16)
GPU_SHAPES = ((4096, 1), (8192, 2))  # (sequence, batch)
CPU_SHAPES = ((64, 2),)
PARTS = ("parity", "perf", "graphs", "breakdown", "kernels", "host")
# The fusions' flags in each measured state; "both" adds the pre-recurrence region to "norm".
STATE_FLAGS = {
    "off": dict(fused_gated_norm=False, gdn_pre_gated_delta_rule_fusion=False),
    "norm": dict(fused_gated_norm=True, gdn_pre_gated_delta_rule_fusion=False),
    "both": dict(fused_gated_norm=True, gdn_pre_gated_delta_rule_fusion=True),
}
STATES = tuple(STATE_FLAGS)
KERNEL_ROWS = 25  # kernels part: kernels listed by name, the rest summed as "other"
KERNEL_NAME_CHARS = 60
HOST_OP_ROWS = 20  # host part: torch ops listed by name
HOST_VALUE_HEADS = 4  # TP 8's per-rank head count of Qwen3-Next, where the host sets the pace
HOST_SHAPE = (4096, 1)
# Layer tensors with at least this many elements estimate their error against the fp32 layer
# well; the few-element parameters (one value per head: A_log, dt_bias; out_norm.weight) do not.
WELL_SAMPLED = {"cuda": 2**16, "cpu": 2**10}


@dataclasses.dataclass
class LayerSetup:
    """Where and at which sizes the layer runs. The CPU needs core.testing.cpu's shims."""

    device: str = "cuda"
    sizes: dict = dataclasses.field(default_factory=lambda: dict(QWEN3_NEXT))
    tp: int = 1

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    def with_value_heads(self, heads: int) -> "LayerSetup":
        """The per-rank GDN of a TP run that leaves ``heads`` value heads on each rank (key heads
        in the same ratio), as one TP = 1 module: what one GPU computes at that TP size."""
        total_v, total_k = self.sizes["num_value_heads"], self.sizes["num_key_heads"]
        if heads < 1 or total_v % heads or (total_k * heads) % total_v:
            raise ValueError(f"--value-heads {heads}: must divide {total_v} value heads with the "
                             f"{total_k} key heads in proportion")
        sizes = dict(self.sizes, num_value_heads=heads, num_key_heads=total_k * heads // total_v)
        return dataclasses.replace(self, sizes=sizes)

    def make_state_module(self, state: str, **extra):
        """The layer in one of STATES (its flags from STATE_FLAGS)."""
        flags = STATE_FLAGS[state]
        return self.make_module(flags["fused_gated_norm"], gdn_pre_gated_delta_rule_fusion=flags[
            "gdn_pre_gated_delta_rule_fusion"], **extra)

    def make_module(self, fused: bool, dtype=torch.bfloat16, deterministic: bool = False, **extra):
        from core.testing.gdn import build_gdn_module, gdn_config, randomize_norm_weights

        config = gdn_config(params_dtype=dtype, fused_gated_norm=fused,
                            deterministic_mode=deterministic or self.cpu,
                            tensor_model_parallel_size=self.tp, **self.sizes, **extra)
        module = build_gdn_module(config, seed=1234)
        randomize_norm_weights(module)
        return module

    def inputs(self, seq: int, batch: int, dtype=torch.bfloat16, seed: int = 0):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        size = (seq, batch, self.sizes["hidden_size"])
        x = torch.randn(size, generator=gen).to(self.device, dtype)
        dy = torch.randn(size, generator=gen).to(self.device, dtype) * 0.1
        return x, dy

    def sync(self) -> None:
        if not self.cpu:
            torch.cuda.synchronize()


def fwd_bwd(module, x, dy):
    """(output, input grad, {param name: grad}) of one forward + backward."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = module(x, attention_mask=None)[0]
    out.backward(dy)
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach(), grads


def max_ulp(a, b) -> int:
    from core.fusions.gated_norm_reference import ulp_distance

    return int(ulp_distance(a, b).max().item()) if a.numel() else 0


def norm_section_inputs(module, x, dy):
    """The (core_attn_out, gate) that the layer hands its output norm and the gradient arriving
    at the norm's output, recorded during one forward/backward of ``module``."""
    seen = {}
    original = module._apply_gated_norm

    def record(xn, gate):
        seen["x"], seen["gate"] = xn.detach().clone(), gate.detach().clone()
        out = original(xn, gate)
        out.register_hook(lambda g: seen.__setitem__("dout", g.detach().clone()))
        return out

    module._apply_gated_norm = record
    try:
        fwd_bwd(module, x, dy)
    finally:
        del module._apply_gated_norm
    return seen["x"], seen["gate"], seen["dout"]


def norm_section_parity(off, on, x_in, dy) -> dict:
    """The fused norm against megatron's unfused ``_apply_gated_norm`` (eager as written, and as
    it runs with jit_fuser) on the layer's real tensors: the forward's bits, and out, dx, dgate,
    dW against a float64 evaluation of the same section."""
    from core.fusions.gated_norm_reference import bitwise_share, relative_error, unfused_gated_norm
    from core.testing.gdn import eager_megatron_gdn

    xn, gate, dout = norm_section_inputs(off, x_in, dy)
    weight = off.out_norm.weight

    def run(module):
        leaves = [t.detach().requires_grad_(True) for t in (xn, gate)]
        module.zero_grad(set_to_none=True)
        out = module._apply_gated_norm(*leaves)
        out.backward(dout.reshape(out.shape))
        # megatron's unfused path returns [B * S * H, D] rows; compare everything as [B, S, H, D]
        return (out.detach().reshape(xn.shape), leaves[0].grad, leaves[1].grad,
                module.out_norm.weight.grad.detach().clone())

    fused = run(on)
    with eager_megatron_gdn():
        eager = run(off)
    jit = run(off)
    # float64: the same function with no rounding anywhere
    leaves64 = [t.detach().double().requires_grad_(True) for t in (xn, gate, weight)]
    out64 = unfused_gated_norm(*leaves64, off.config.layernorm_epsilon, on.out_norm_zero_centered,
                               on.gate_activation)
    out64.backward(dout.double().reshape(out64.shape))
    exact = (out64.detach().reshape(xn.shape), *[t.grad for t in leaves64])
    errors = {name: {"fused": relative_error(fused[i], exact[i]),
                     "unfused_eager": relative_error(eager[i], exact[i]),
                     "unfused_jit": relative_error(jit[i], exact[i])}
              for i, name in ((1, "dx"), (2, "dgate"), (3, "dweight"), (0, "out"))}
    return {"elements": xn.numel(), "eps": off.config.layernorm_epsilon,
            "weight_dtype": str(weight.dtype),
            "out_bitwise_vs_eager": bitwise_share(fused[0], eager[0]),
            "out_max_ulp_vs_eager": max_ulp(fused[0], eager[0]),
            "out_bitwise_vs_jit": bitwise_share(fused[0], jit[0]),
            "eager_bitwise_vs_jit": bitwise_share(eager[0], jit[0]),
            "rel_err_vs_float64": errors,
            "worst_err_ratio_fused_over_eager": max(
                e["fused"] / max(e["unfused_eager"], 1e-300) for e in errors.values())}


def layer_parity(setup: LayerSetup, seq: int, batch: int) -> dict:
    """Flag on vs off (jit and eager) against an fp32 copy of the layer (megatron's torch chunk
    path, deterministic_mode: the same math, no FLA autotuning for fp32), and the norm section."""
    from core.fusions.gated_norm_reference import bitwise_share, relative_error
    from core.testing.gdn import eager_megatron_gdn

    off, on = setup.make_module(False), setup.make_module(True)
    on.load_state_dict(off.state_dict())
    ref32 = setup.make_module(False, dtype=torch.float32, deterministic=True)
    ref32.load_state_dict({
        k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in off.state_dict().items()})
    x, dy = setup.inputs(seq, batch)
    r_on, r_off, r_off2 = fwd_bwd(on, x, dy), fwd_bwd(off, x, dy), fwd_bwd(off, x, dy)
    with eager_megatron_gdn():
        r_eager = fwd_bwd(off, x, dy)
    r_32 = fwd_bwd(ref32, x.float(), dy.float())
    del ref32
    # One differing norm element changes the whole out_proj row of its token, so the layer is
    # compared by its error against the fp32 layer; flag off twice shows the run-to-run noise.
    res = {"shape": f"S={seq} B={batch}",
           "out_bitwise_off_vs_off": bitwise_share(r_off[0], r_off2[0]),
           "out_bitwise_on_vs_off_jit": bitwise_share(r_on[0], r_off[0]),
           "out_bitwise_on_vs_off_eager": bitwise_share(r_on[0], r_eager[0])}
    picks = {"output": lambda r: r[0], "input": lambda r: r[1]}
    picks.update({n: (lambda r, n=n: r[2][n]) for n in sorted(r_on[2])})
    errors = {}
    for name, pick in picks.items():
        e = {"elements": pick(r_on).numel(), "err_on": relative_error(pick(r_on), pick(r_32)),
             "err_off_jit": relative_error(pick(r_off), pick(r_32)),
             "err_off_eager": relative_error(pick(r_eager), pick(r_32))}
        e["ratio_on_over_worse_off"] = e["err_on"] / max(e["err_off_jit"], e["err_off_eager"],
                                                         1e-300)
        errors[name] = e
    res["rel_err_vs_fp32_layer"] = errors
    well_sampled = WELL_SAMPLED[setup.device]
    res["well_sampled_elements"] = well_sampled
    res["worst_layer_err_ratio_well_sampled"] = max(
        e["ratio_on_over_worse_off"] for e in errors.values() if e["elements"] >= well_sampled)
    res["norm_section"] = norm_section_parity(off, on, x, dy)
    return res


def timings_ms(setup: LayerSetup, fn, iters: int, warmup: int = 3) -> list:
    """Wall times of ``iters`` calls of fn() in ms (CUDA events; on the CPU perf_counter)."""
    for _ in range(warmup):
        fn()
    setup.sync()
    return [step_ms(setup, fn) for _ in range(iters)]


def step_ms(setup: LayerSetup, fn) -> float:
    """Wall time of one call of fn() in ms, from an idle device to its end."""
    if setup.cpu:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def rotated_states(states, i: int) -> tuple[str, ...]:
    """The states in the order round ``i`` measures them: the list rotated by ``i``, so that no
    state always runs after the same other one (two states: off, on, then on, off, ...)."""
    shift = i % len(states)
    return tuple(states[shift:]) + tuple(states[:shift])


def layer_step(module, x, dy):
    """One forward + backward of ``module`` on a leaf copy of ``x`` (grads reset first)."""
    xr = x.detach().clone().requires_grad_(True)

    def step():
        module.zero_grad(set_to_none=True)
        xr.grad = None
        module(xr, attention_mask=None)[0].backward(dy)

    return step, xr


def measure_states(setup: LayerSetup, seq: int, batch: int, iters: int, states=STATES,
                   warmup: int = 3) -> dict[str, dict]:
    """Per state (keys: ``states``): forward + backward time of the layer, its peak memory above
    the inputs (GPU) and the activation memory its forward keeps for backward per token; for
    each state, its paired speed-up over every state listed before it (``paired_speedup``).
    The layers' steps alternate, their order rotating every round, so a drift of the host's or
    the GPU's speed during the measurement (the eager layer at TP 4-8 shapes waits on the host)
    falls on all alike."""
    from core.testing.gdn import bytes_kept_for_backward

    x, dy = setup.inputs(seq, batch, seed=2)
    results, steps, layers = {}, {}, {}
    for state in states:
        module = setup.make_state_module(state)
        step, xr = layer_step(module, x, dy)
        probe = x.detach().clone().requires_grad_(True)
        kept, _ = bytes_kept_for_backward(lambda: module(probe, attention_mask=None),
                                          exclude=module.parameters())
        steps[state], layers[state] = step, (module, xr)
        results[state] = {"kept_bytes_per_token": kept / (seq * batch)}
    for step in steps.values():
        for _ in range(warmup):
            step()
    setup.sync()
    times = {state: [] for state in states}
    for i in range(iters):
        for state in rotated_states(states, i):
            times[state].append(step_ms(setup, steps[state]))
    for state, step in steps.items():
        if not setup.cpu:
            module, xr = layers[state]
            module.zero_grad(set_to_none=True)
            xr.grad = None
            torch.cuda.empty_cache()
            setup.sync()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            setup.sync()
            results[state]["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        results[state].update(fwd_bwd_ms_median=statistics.median(times[state]),
                              fwd_bwd_ms_min=min(times[state]), fwd_bwd_ms_steps=times[state])
    for i, state in enumerate(states):
        for base in states[:i]:
            results[state].update(paired_speedup(times[base], times[state], base))
    return results


def paired_speedup(base_ms: list[float], new_ms: list[float], base: str = "off") -> dict:
    """Step i of each layer ran next to the other's step i: the median over pairs of base / new
    (``paired_speedup_vs_<base>``), and the share of pairs where the new step was faster
    (``pairs_faster_than_<base>``). Unlike a ratio of two medians, it compares steps that saw
    the same state of the host."""
    ratios = [b / n for b, n in zip(base_ms, new_ms)]
    return {f"paired_speedup_vs_{base}": statistics.median(ratios),
            f"pairs_faster_than_{base}": sum(r > 1 for r in ratios) / len(ratios)}


def measure_graphed(setup: LayerSetup, seq: int, batch: int, state: str, iters: int,
                    warmup: int = 3) -> dict:
    """Forward + backward of a GDN TransformerLayer (input norm, GatedDeltaNet, MLP) in ``state``
    under megatron's local CUDA graphs (``cuda_graph_impl="local"``), wrapped in megatron's DDP:
    one eager step records the layer, ``create_cudagraphs()`` captures its forward and backward,
    the timed steps replay them. megatron's jit_fuser'd GDN methods and fused bias-dropout-add do
    not survive the capture, in any state, so they run eagerly here (the unfused norm is the
    eager one). GPU only."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.cuda_graphs import create_cudagraphs

    from core.testing.gdn import build_gdn_layer, eager_megatron_gdn, gdn_config
    from core.testing.gdn_layer_tp import counting_norm_calls, reset_cuda_graphs, wrap_ddp

    x, dy = setup.inputs(seq, batch, seed=2)
    with eager_megatron_gdn():
        reset_cuda_graphs()
        model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True, force_reset_rng=True)
        config = gdn_config(params_dtype=torch.bfloat16, deterministic_mode=False,
                            cuda_graph_impl="local", bias_dropout_fusion=False,
                            **STATE_FLAGS[state], **setup.sizes)
        model = wrap_ddp(build_gdn_layer(config, seed=None).to(setup.device))

        def step(model=model):  # bound, not closed over: deleting both frees the layer
            model.zero_grad_buffer()
            model(x.detach().requires_grad_(True), attention_mask=None)[0].backward(dy)

        try:
            step()  # eager, recorded
            create_cudagraphs()
            with counting_norm_calls() as norm_calls:
                times = timings_ms(setup, step, iters, warmup)
            runners = model.module.cudagraph_manager.cudagraph_runners
            captured = all(r.fwd_graph is not None and r.bwd_graph is not None for r in runners)
        finally:
            reset_cuda_graphs()
            del step, model
            model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
            torch.cuda.empty_cache()
    return dict(fwd_bwd_ms_median=statistics.median(times), fwd_bwd_ms_min=min(times),
                graphs_captured=captured and bool(runners),
                python_norm_calls_per_step=len(norm_calls) / (iters + warmup))


GRAPH_REPEATS = 3


def measure_graphed_states(setup: LayerSetup, seq: int, batch: int, iters: int,
                           repeats: int = GRAPH_REPEATS, states=STATES) -> dict[str, dict]:
    """Each state under megatron's CUDA graphs, ``repeats`` times (``measure_graphed``: a layer
    built, captured and replayed ``iters`` steps), the states in rotating order (off, norm, both,
    then norm, both, off, ...): one capture's median moves by a few % from one build to the
    next. Per state the median of the repeats' medians, and per state listed before it the
    speed-up of each repeat (``speedup_vs_<base>_repeats``: its median over this state's)."""
    runs = {state: [] for state in states}
    for i in range(repeats):
        for state in rotated_states(states, i):
            runs[state].append(measure_graphed(setup, seq, batch, state, iters))
    results = {}
    for state, measured in runs.items():
        medians = [r["fwd_bwd_ms_median"] for r in measured]
        results[state] = dict(
            fwd_bwd_ms_median=statistics.median(medians),
            fwd_bwd_ms_min=min(r["fwd_bwd_ms_min"] for r in measured),
            fwd_bwd_ms_repeats=medians,
            graphs_captured=all(r["graphs_captured"] for r in measured),
            python_norm_calls_per_step=max(r["python_norm_calls_per_step"] for r in measured))
    for i, state in enumerate(states):
        for base in states[:i]:
            results[state][f"speedup_vs_{base}_repeats"] = [
                b / n for b, n in zip(results[base]["fwd_bwd_ms_repeats"],
                                      results[state]["fwd_bwd_ms_repeats"])]
    return results


def kernel_group(name: str) -> str:
    """'copies', 'fills' or 'rest' (the norm and gate math) for a profiled kernel name."""
    low = name.lower()
    if low.startswith("triton") or "gated_norm" in low:  # compiled math (inductor names carry
        return "rest"                                    # "_to_copy" for the casts) or ours
    if "copy" in low or "memcpy" in low:
        return "copies"
    if "fill" in low or "zero" in low or "memset" in low:
        return "fills"
    return "rest"


def kernel_times_ms(setup: LayerSetup, step, iters: int) -> tuple[dict, dict]:
    """GPU time of each kernel of one ``step()`` in ms and its launches per step (means over
    ``iters`` steps), from the profiler's device activity; on the CPU, the self CPU time and
    calls of each aten op."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU if setup.cpu else ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        setup.sync()
    times, calls = {}, {}
    for event in prof.key_averages():
        if setup.cpu:
            us = event.self_cpu_time_total if event.key.startswith("aten::") else 0
        elif str(getattr(event, "device_type", "")).split(".")[-1] == "CUDA":
            us = event.self_device_time_total
        else:
            us = 0
        if us:
            times[event.key] = times.get(event.key, 0.0) + us / 1e3 / iters
            calls[event.key] = calls.get(event.key, 0.0) + event.count / iters
    return times, calls


def breakdown(setup: LayerSetup, seq: int, batch: int, iters: int) -> dict:
    """The output-norm section of the layer alone, forward + backward, at the layer's shapes and
    layouts: the gate is a slice of the packed in_proj output ([S, B, W] transposed to
    [B, S, W]), the norm input FLA's contiguous [B, S, H, D] output. Unfused = megatron's code
    as it runs in training: gate.contiguous(), _apply_gated_norm, then reshape + transpose(0, 1)
    .contiguous(). Fused = our module's _apply_gated_norm on the gate view (sbhd output, so the
    same reshape + transpose + .contiguous() is free). Gain from the kernels = rest(unfused) -
    rest(fused); gain from the copies = copies(unfused) - copies(fused), per-kernel GPU time."""
    off, on = setup.make_module(False), setup.make_module(True)
    on.load_state_dict(off.state_dict())
    heads = setup.sizes["num_value_heads"] // setup.tp
    dim = setup.sizes["value_head_dim"]
    width = off.in_proj.weight.shape[0]  # local qkvzba width
    gen = torch.Generator(device="cpu").manual_seed(3)
    packed = torch.randn(seq, batch, width, generator=gen).to(setup.device, torch.bfloat16)
    z0 = 2 * setup.sizes["num_key_heads"] * setup.sizes["key_head_dim"] // setup.tp + heads * dim
    x = torch.randn(batch, seq, heads, dim, generator=gen).to(setup.device, torch.bfloat16)
    dy = torch.randn(seq, batch, heads * dim, generator=gen).to(setup.device, torch.bfloat16)
    packed.requires_grad_(True)
    x.requires_grad_(True)

    def gate_view():
        return packed.transpose(0, 1)[..., z0:z0 + heads * dim].unflatten(-1, (heads, dim))

    def to_sbhd(y):
        return y.reshape(batch, seq, -1).transpose(0, 1).contiguous()

    def run(fn):
        def step():
            x.grad = packed.grad = None
            off.zero_grad(set_to_none=True)
            on.zero_grad(set_to_none=True)
            fn().backward(dy)
        return step

    variants = {"unfused": run(lambda: to_sbhd(off._apply_gated_norm(x, gate_view().contiguous()))),
                "fused": run(lambda: to_sbhd(on._apply_gated_norm(x, gate_view())))}
    res = {"shape": f"S={seq} B={batch}"}
    for name, step in variants.items():
        wall = statistics.median(timings_ms(setup, step, iters))  # warms up (and compiles) too
        kernels, calls = kernel_times_ms(setup, step, iters)
        groups = {"copies": 0.0, "fills": 0.0, "rest": 0.0}
        for kernel, ms in kernels.items():
            groups[kernel_group(kernel)] += ms
        res[name] = {"wall_ms": wall, "kernel_ms": sum(kernels.values()),
                     **{f"{g}_ms": v for g, v in groups.items()},
                     "copy_calls": sum(n for k, n in calls.items() if kernel_group(k) == "copies"),
                     "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}
    u, f = res["unfused"], res["fused"]
    res.update(gain_wall_ms=u["wall_ms"] - f["wall_ms"],
               gain_kernel_ms=u["kernel_ms"] - f["kernel_ms"],
               gain_from_kernels_ms=u["rest_ms"] - f["rest_ms"],
               gain_from_copies_ms=u["copies_ms"] - f["copies_ms"],
               gain_from_fills_ms=u["fills_ms"] - f["fills_ms"])
    return res


def short_name(name: str, chars: int = KERNEL_NAME_CHARS) -> str:
    """``name`` cut to ``chars`` characters (the cut ones end in "...")."""
    return name if len(name) <= chars else name[:chars - 3] + "..."


def top_rows(per_state: dict[str, dict[str, float]],
             rows: int | None = None) -> dict[str, dict[str, float]]:
    """One table of ``per_state`` ({state: {name: value}}): the names by their largest value in
    any state, largest first, each with its value in every state (0.0 where the state has none).
    With ``rows``: the first ``rows`` names, then "other", per state the sum of the names left
    out; every column keeps its state's total."""
    names = {name for values in per_state.values() for name in values}
    ranked = sorted(names, key=lambda n: (-max(v.get(n, 0.0) for v in per_state.values()), n))
    kept = ranked if rows is None else ranked[:rows]
    table = {n: {s: values.get(n, 0.0) for s, values in per_state.items()} for n in kept}
    if rows is not None:
        table["other"] = {s: sum(values.get(n, 0.0) for n in ranked[rows:])
                          for s, values in per_state.items()}
    return table


def warm_up(setup: LayerSetup, step, warmup: int) -> None:
    """``warmup`` calls of step(), then an idle device: autotuning and compilation done."""
    for _ in range(warmup):
        step()
    setup.sync()


def release(setup: LayerSetup) -> None:
    if not setup.cpu:
        torch.cuda.empty_cache()


def layer_kernels(setup: LayerSetup, seq: int, batch: int, iters: int, states=STATES,
                  warmup: int = 3) -> dict:
    """Where one forward + backward of the layer spends its GPU time, per state: each kernel's
    GPU time per step (``kernel_times_ms``: torch.profiler's device activity, the mean over
    ``iters`` steps after ``warmup`` unprofiled ones), by name cut to KERNEL_NAME_CHARS
    (kernels whose cut names agree are summed). ``ms``: the KERNEL_ROWS kernels of most time
    in any state and "other" (``top_rows``); ``total_ms`` per state = its column's sum;
    ``launches_per_step``: kernel launches. On the CPU: the self CPU time of each aten op."""
    x, dy = setup.inputs(seq, batch, seed=2)
    times, launches = {}, {}
    for state in states:
        module = setup.make_state_module(state)
        step, _ = layer_step(module, x, dy)
        warm_up(setup, step, warmup)
        kernels, calls = kernel_times_ms(setup, step, iters)
        times[state] = {}
        for name, ms in kernels.items():
            times[state][short_name(name)] = times[state].get(short_name(name), 0.0) + ms
        launches[state] = sum(calls.values())
        del module, step
        release(setup)
    return {"shape": f"S={seq} B={batch}",
            "measure": ("self CPU ms per step of each aten op (no GPU)" if setup.cpu
                        else "GPU ms per step of each kernel"),
            "total_ms": {state: sum(t.values()) for state, t in times.items()},
            "launches_per_step": launches, "ms": top_rows(times, KERNEL_ROWS)}


class HostTimer:
    """Host time (perf_counter) of named spans: per label the calls, the time inside (total)
    and the time inside less that of the spans opened within (self), so that the self times of
    a step's spans add up to the step. Spans nest per thread. ``clock``: seconds now."""

    def __init__(self, clock=time.perf_counter):
        self.total_s, self.self_s, self.calls = {}, {}, {}
        self.clock = clock
        self._local = threading.local()

    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def enter(self, label: str) -> None:
        self._stack().append([label, self.clock(), 0.0])

    def exit(self, label: str) -> None:
        end = self.clock()
        stack = self._stack()
        if not stack or stack[-1][0] != label:
            raise RuntimeError(f"HostTimer: span {label!r} closed, but the open span is "
                               f"{stack[-1][0] if stack else None!r}")
        _, start, inner = stack.pop()
        total = end - start
        for table, value in ((self.total_s, total), (self.self_s, total - inner),
                             (self.calls, 1)):
            table[label] = table.get(label, 0) + value
        if stack:
            stack[-1][2] += total

    @contextlib.contextmanager
    def span(self, label: str):
        self.enter(label)
        try:
            yield
        finally:
            self.exit(label)

    def wrap(self, label: str, fn):
        """``fn`` with each call timed as a span ``label``."""
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.span(label):
                return fn(*args, **kwargs)
        return timed


# GatedDeltaNet's own steps, looked up on the layer by its forwards (timed as instance attributes
# that wrap them: outside the jit_fuser-compiled methods, which stay as they are).
LAYER_STEPS = ("_prepare_input_for_gated_delta_rule", "_compute_g_and_beta", "gated_delta_rule",
               "_gated_norm_and_a2a", "_apply_gated_norm")
# Submodules that hooks cannot time without changing the layer's path.
UNHOOKED_CHILDREN = {
    "conv1d": "never called: the forwards read its parameters (and a pre-hook on it makes "
              "GatedDeltaNet.forward run it at in_proj's end)",
    "out_norm": "inside _apply_gated_norm: compiled by jit_fuser, where a hook would split the "
                "compiled graph, or not called at all (the fused norm)",
}


def layer_functions():
    """(module, name) of the module-level functions the layer's forwards call: megatron's FLA
    convolution and the fused pre-recurrence region."""
    from core.ssm import pre_gated_delta_rule_forward
    from core.ssm.megatron_gdn_import import import_megatron_gdn

    return ((import_megatron_gdn().gdn, "causal_conv1d"),
            (pre_gated_delta_rule_forward, "fused_pre_gated_delta_rule"))


@contextlib.contextmanager
def timed_layer_parts(module, timer: HostTimer):
    """While the block runs, ``timer`` times each part of ``module``'s forward: its submodules
    (forward pre- and post-hooks; not those of UNHOOKED_CHILDREN), its LAYER_STEPS and
    ``layer_functions()``, each by its name. Everything is restored afterwards."""
    handles, undo = [], []
    try:
        for name, child in module.named_children():
            if name not in UNHOOKED_CHILDREN:
                handles.append(child.register_forward_pre_hook(
                    lambda _m, _args, name=name: timer.enter(name)))
                handles.append(child.register_forward_hook(
                    lambda _m, _args, _out, name=name: timer.exit(name)))
        for name in LAYER_STEPS:
            if name in module.__dict__:  # an instance attribute (megatron's gated_delta_rule)
                undo.append(functools.partial(setattr, module, name, module.__dict__[name]))
            else:
                undo.append(functools.partial(delattr, module, name))
            setattr(module, name, timer.wrap(name, getattr(module, name)))
        for owner, name in layer_functions():
            undo.append(functools.partial(setattr, owner, name, getattr(owner, name)))
            setattr(owner, name, timer.wrap(name, getattr(owner, name)))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for restore in reversed(undo):
            restore()


def op_times_ms(setup: LayerSetup, step, iters: int) -> tuple[dict, object, float]:
    """Over ``iters`` calls of step() under torch.profiler: the self CPU time of each torch op
    per step in ms, the GPU time of the kernels per step (None on the CPU), and the host time
    per step (perf_counter, the profiler's own cost included)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([] if setup.cpu else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(iters):
            step()
        host_s = time.perf_counter() - start
        setup.sync()
    ops, gpu_us = {}, 0.0
    for event in prof.key_averages():
        if str(getattr(event, "device_type", "")).split(".")[-1] == "CUDA":
            gpu_us += event.self_device_time_total
        elif event.self_cpu_time_total:
            ops[event.key] = ops.get(event.key, 0.0) + event.self_cpu_time_total / 1e3 / iters
    return ops, None if setup.cpu else gpu_us / 1e3 / iters, host_s * 1e3 / iters


def host_time(setup: LayerSetup, seq: int, batch: int, iters: int, states=STATES,
              warmup: int = 3) -> dict:
    """Where an eager forward + backward of the layer spends host time, per state.

    Timed steps (the states' steps alternating in rotating order, ``iters`` each): the step's
    wall time (``step_ms``), the host time of the forward and of the backward call (a backward
    returns once its kernels are queued), and ``parts_ms``: the host self time per step of each
    part of the forward (``timed_layer_parts``; "forward, elsewhere" is the forward's time outside
    them, "backward" the whole backward call), which add up to forward + backward.
    Profiled steps (``op_times_ms``, ``iters`` per state, no part timed): ``ops_ms``, the self CPU
    time per step of the HOST_OP_ROWS torch ops of most time in any state and "other"; the GPU
    time of the kernels per step; the host time per step under the profiler and the part of it
    spent outside any torch op (Python, Triton launches)."""
    x, dy = setup.inputs(seq, batch, seed=2)
    modules = {state: setup.make_state_module(state) for state in states}

    def make_step(module):
        xr = x.detach().clone().requires_grad_(True)

        def step(timer: HostTimer):
            module.zero_grad(set_to_none=True)
            xr.grad = None
            with timer.span("forward"):
                out = module(xr, attention_mask=None)[0]
            with timer.span("backward"):
                out.backward(dy)

        return step

    steps = {state: make_step(module) for state, module in modules.items()}
    for step in steps.values():
        warm_up(setup, functools.partial(step, HostTimer()), warmup)
    timers = {state: HostTimer() for state in states}
    walls = {state: [] for state in states}
    for i in range(iters):
        for state in rotated_states(states, i):
            with timed_layer_parts(modules[state], timers[state]):
                walls[state].append(step_ms(setup, functools.partial(steps[state],
                                                                     timers[state])))
    results = {"shape": f"S={seq} B={batch}", "states": {}}
    parts, calls, ops = {}, {}, {}
    labels = {"forward": "forward, elsewhere", "backward": "backward"}
    for state in states:
        timer = timers[state]
        parts[state] = {labels.get(k, k): v * 1e3 / iters for k, v in timer.self_s.items()}
        calls[state] = {labels.get(k, k): n / iters for k, n in timer.calls.items()}
        ops[state], gpu_ms, profiled_ms = op_times_ms(
            setup, functools.partial(steps[state], HostTimer()), iters)
        results["states"][state] = dict(
            step_wall_ms_median=statistics.median(walls[state]),
            step_wall_ms_steps=walls[state],
            forward_host_ms=timer.total_s["forward"] * 1e3 / iters,
            backward_host_ms=timer.total_s["backward"] * 1e3 / iters,
            gpu_kernel_ms=gpu_ms, profiled_host_ms=profiled_ms,
            outside_torch_ops_ms=profiled_ms - sum(ops[state].values()))
    results["parts_ms"] = top_rows(parts)
    results["parts_calls_per_step"] = {
        name: {state: calls[state].get(name, 0.0) for state in states}
        for name in results["parts_ms"]}
    results["untimed_submodules"] = UNHOOKED_CHILDREN
    results["ops_ms"] = top_rows(ops, HOST_OP_ROWS)
    del modules, steps
    release(setup)
    return results


def by_shape(part: dict) -> dict[str, dict[str, dict]]:
    """``{"<shape> <state>": entry}`` regrouped as ``{shape: {state: entry}}``."""
    shapes = {}
    for key, entry in part.items():
        shape, state = key.rsplit(" ", 1)
        shapes.setdefault(shape, {})[state] = entry
    return shapes


def speedup_text(entry: dict, key: str) -> str:
    """The speed-ups recorded in ``entry`` under ``key.format(base)``, one per earlier state."""
    bases = [s for s in STATES if key.format(s) in entry]
    return ", ".join(f"{base} {entry[key.format(base)]:.3f}x" for base in bases)


def table_lines(title: str, rows: dict[str, dict[str, float]], states) -> list[str]:
    """``rows`` ({name: {state: value}}) as text, a column per state."""
    width = max([len(name) for name in rows] + [8])
    lines = [title, "  " + " " * width + "".join(f"{state:>10}" for state in states)]
    for name, values in rows.items():
        lines.append(f"  {name:<{width}}"
                     + "".join(f"{values.get(state, float('nan')):10.3f}" for state in states))
    return lines


def summary_lines(results: dict) -> list[str]:
    core = "megatron's torch chunk rule" if results["device"] == "cpu" else "FLA kernels"
    lines = [f"megatron GatedDeltaNet, bf16, {core} ({results['device']}, "
             f"jit_fuser={results['jit_fuser']})"]
    p = results.get("parity")
    if p:
        n = p["norm_section"]
        lines.append(f"parity {p['shape']}: norm section fused vs unfused eager "
                     f"{n['out_bitwise_vs_eager']:.7f} "
                     f"bitwise (max {n['out_max_ulp_vs_eager']} ulp), worst error ratio vs float64 "
                     f"{n['worst_err_ratio_fused_over_eager']:.6f}; whole layer worst error ratio "
                     f"{p['worst_layer_err_ratio_well_sampled']:.3f}")
    for shape, entries in by_shape(results.get("perf", {})).items():
        states = "/".join(entries)

        def each(key, fmt, entries=entries):
            return " / ".join(fmt.format(e.get(key, float("nan"))) for e in entries.values())

        lines.append(f"layer {shape} ({states}): fwd+bwd {each('fwd_bwd_ms_median', '{:.3f}')} "
                     f"ms, peak {each('peak_mib', '{:.1f}')} MiB, kept for backward "
                     f"{each('kept_bytes_per_token', '{:.0f}')} bytes/token")
        for state, entry in entries.items():
            if any(k.startswith("paired_speedup_vs_") for k in entry):
                faster = ", ".join(
                    f"{100 * entry[f'pairs_faster_than_{b}']:.0f} % vs {b}"
                    for b in STATES if f"pairs_faster_than_{b}" in entry)
                lines.append(f"  {state}: paired speed-up "
                             f"{speedup_text(entry, 'paired_speedup_vs_{}')} "
                             f"(faster step pairs {faster})")
    graphs = results.get("graphs", {})
    for shape, entries in by_shape({} if "skipped" in graphs else graphs).items():
        medians = " / ".join(f"{e['fwd_bwd_ms_median']:.3f}" for e in entries.values())
        lines.append(f"layer {shape} ({'/'.join(entries)}), megatron CUDA graphs "
                     f"(TransformerLayer): fwd+bwd {medians} ms, captured "
                     f"{'/'.join(str(e['graphs_captured']) for e in entries.values())}, Python "
                     f"norm calls per step "
                     f"{max(e['python_norm_calls_per_step'] for e in entries.values()):.2f}")
        for state, entry in entries.items():
            bases = [b for b in STATES if f"speedup_vs_{b}_repeats" in entry]
            if bases:
                lines.append(f"  {state}: speed-up per capture " + ", ".join(
                    f"vs {b} {min(r):.3f}-{max(r):.3f}x"
                    for b in bases for r in [entry[f"speedup_vs_{b}_repeats"]]))
    for b in results.get("breakdown", {}).values():
        lines.append(f"norm section {b['shape']}: GPU kernels {b['unfused']['kernel_ms']:.3f} -> "
                     f"{b['fused']['kernel_ms']:.3f} ms "
                     f"(norm + gate kernels {b['gain_from_kernels_ms']:.3f}, "
                     f"copies {b['gain_from_copies_ms']:.3f})")
    for case, k in results.get("kernels", {}).items():
        states = list(k["total_ms"])
        lines += table_lines(f"kernels {case}: {k['measure']}",
                             {**k["ms"], "total": k["total_ms"]}, states)
    for case, h in results.get("host", {}).items():
        states = list(h["states"])
        for state, m in h["states"].items():
            gpu = "n/a" if m["gpu_kernel_ms"] is None else f"{m['gpu_kernel_ms']:.3f} ms"
            lines.append(f"host {case} {state}: step wall {m['step_wall_ms_median']:.3f} ms, GPU "
                         f"kernels {gpu}, host forward {m['forward_host_ms']:.3f} + backward "
                         f"{m['backward_host_ms']:.3f} ms (profiled {m['profiled_host_ms']:.3f} "
                         f"ms, {m['outside_torch_ops_ms']:.3f} outside torch ops)")
        lines += table_lines(f"host {case}: forward parts, host self ms per step", h["parts_ms"],
                             states)
        lines += table_lines(f"host {case}: torch ops, self CPU ms per step", h["ops_ms"], states)
    return lines


def init_single_process(setup: LayerSetup) -> None:
    """parallel_state with TP = 1 in this one process (gloo on the CPU, NCCL on the GPU)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if setup.cpu:
        from core.testing.cpu import init_cpu_model_parallel

        init_cpu_model_parallel(tp_size=1)
        return
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1,
                                             device_id=torch.device("cuda", 0))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


TP_SEQ = 256


def tensor_parallel_grads(tp: int) -> dict:
    """One rank of a TP run started by torchrun: the TP = 1 reference on every rank (same seeds),
    then TP = ``tp``; per case, the out_norm dW's relative error against TP = 1, its tolerance
    and whether all ranks hold the same bits."""
    import tempfile

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from core.testing.gdn_tp import (CASES, case_name, make_reference, ref_key, rel_err, run_rank,
                                     tolerance)

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = torch.distributed.get_rank()
    sizes = dict(QWEN3_NEXT)
    hidden = sizes.pop("hidden_size")
    scratch = tempfile.mkdtemp(prefix=f"gdn_tp_rank{rank}_")
    ref_path = os.path.join(scratch, "ref.pt")
    for size in (1, tp):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=size)
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
        if size == 1:
            make_reference(ref_path, seq=TP_SEQ, batch=2, deterministic_mode=True,
                           hidden_size=hidden, **sizes)
    results = run_rank(rank, tp, ref_path, os.path.join(scratch, f"tp_rank{rank}.pt"))
    ref = torch.load(ref_path, weights_only=False)["ref"]
    summary = {}
    for case in CASES:
        got = results[case_name(case)]["after"]
        gathered = [torch.zeros_like(got).cuda() for _ in range(tp)]
        torch.distributed.all_gather(gathered, got.cuda())
        summary[case_name(case)] = {
            "rel_err_vs_tp1": rel_err(got, ref[ref_key(case)]["dw"]),
            "tolerance": tolerance(case),
            "ranks_identical": all(torch.equal(gathered[0], g) for g in gathered)}
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(
        "Megatron's GatedDeltaNet layer (core.ssm.GatedDeltaNet, no Transformer Engine needed) "
        "with FLA's kernels, bf16, at the GDN shapes of Qwen3-Next, in the states off (both "
        "fusions off), norm (fused_gated_norm) and both (fused_gated_norm and "
        "gdn_pre_gated_delta_rule_fusion): parity of the output norm on the layer's tensors, "
        "eager speed and memory, speed under megatron's local CUDA graphs, where the norm's gain "
        "comes from, the GPU time per kernel and where the host time goes (--parts); with --tp "
        "N under torchrun, the out_norm weight gradient at TP = N against TP = 1."))
    parser.add_argument("--out", default="out/gdn_layer", help="folder for gdn_layer.json")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--states", default=",".join(STATES),
                        help=f"comma-separated, of {', '.join(STATES)}: the states that perf, "
                             f"graphs, kernels and host measure, always in the order "
                             f"{', '.join(STATES)} (parity and breakdown compare off and norm)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed or profiled steps per measurement (perf, host: per state, "
                             "the states alternating; default: 20, --cpu: 2)")
    parser.add_argument("--graph-repeats", type=int, default=GRAPH_REPEATS,
                        help="graphs: layers built and captured per state, in rotating order")
    parser.add_argument("--no-jit", action="store_true", help="disable megatron's jit_fuser")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (dry run)")
    parser.add_argument("--value-heads", type=int, nargs="+", default=None,
                        help="perf, graphs and kernels at these per-rank value-head counts "
                             "(e.g. 32 8 4: TP 1, 4, 8 of Qwen3-Next; default: the model's own, "
                             "32, or 4 with --cpu)")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="SxB",
                        help="perf, graphs and kernels shapes, sequence x batch (default: "
                             "4096x1 8192x2; CPU 64x2); parity and breakdown keep the defaults")
    parser.add_argument("--host-value-heads", type=int, default=HOST_VALUE_HEADS,
                        help=f"host: the per-rank value-head count (default {HOST_VALUE_HEADS}, "
                             "TP 8 of Qwen3-Next)")
    parser.add_argument("--host-shape", default=None, metavar="SxB",
                        help=f"host: sequence x batch (default {HOST_SHAPE[0]}x{HOST_SHAPE[1]}; "
                             f"CPU {CPU_SHAPES[0][0]}x{CPU_SHAPES[0][1]})")
    parser.add_argument("--tp", type=int, default=1,
                        help="TP size > 1: the out_norm dW against TP = 1 (start with torchrun, "
                             "N processes)")
    return parser


def parse_shape(text: str):
    """SEQxBATCH as (seq, batch), both >= 1; None for any other text."""
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    shape = match and (int(match[1]), int(match[2]))
    return shape if shape and min(shape) >= 1 else None


def parse_list(parser, option: str, text: str, known) -> list[str]:
    """A comma-separated option's names: each of ``known`` once, in ``known``'s order."""
    names = text.split(",")
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"{option}: unknown {unknown}, expected some of {', '.join(known)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        parser.error(f"{option}: {repeated} given more than once")
    return [name for name in known if name in names]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked; ``parts`` and ``states`` (lists, in PARTS's and STATES's
    order), ``shapes`` (SEQxBATCH tuples, empty for the defaults) and ``host_shape`` (a tuple,
    None for the default) parsed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if args.tp > 1 and (args.cpu or "LOCAL_RANK" not in os.environ):
        parser.error(f"--tp {args.tp} runs on {args.tp} GPUs over NCCL, one process each: start "
                     f"it with torchrun --nproc-per-node {args.tp} (not with --cpu)")
    args.parts = parse_list(parser, "--parts", args.parts, PARTS)
    args.states = parse_list(parser, "--states", args.states, STATES)
    if args.graph_repeats < 1:
        parser.error(f"--graph-repeats {args.graph_repeats}: must be >= 1")
    if args.iters is not None and args.iters < 1:
        parser.error(f"--iters {args.iters}: must be >= 1")
    shape_texts = args.shapes or []
    args.shapes = tuple(parse_shape(text) for text in shape_texts)
    if None in args.shapes:
        parser.error(f"--shapes {' '.join(shape_texts)}: each must be SEQxBATCH, e.g. 4096x1")
    if args.host_shape is not None:
        text, args.host_shape = args.host_shape, parse_shape(args.host_shape)
        if args.host_shape is None:
            parser.error(f"--host-shape {text}: must be SEQxBATCH, e.g. 4096x1")
    setup = LayerSetup("cpu", dict(TINY)) if args.cpu else LayerSetup()
    for option, heads in [("--value-heads", h) for h in args.value_heads or ()] + [
            ("--host-value-heads", args.host_value_heads)]:
        try:  # the sizes' own rule, before anything is built
            setup.with_value_heads(heads)
        except ValueError as e:
            parser.error(str(e).replace("--value-heads", option, 1))
    return args


def run_tensor_parallel(args) -> None:
    """--tp N: the out_norm dW at TP = N against TP = 1 (one process per GPU)."""
    from tools.bench_common import environment, write_json

    results = {"env": environment(), "tp": tensor_parallel_grads(args.tp)}
    if torch.distributed.get_rank() == 0:
        print(f"wrote {write_json(results, args.out, f'gdn_layer_tp{args.tp}.json')}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_parts(args) -> None:
    """The --parts on one device, written to OUT/gdn_layer.json after each part."""
    if args.cpu:
        from core.testing.cpu import install_cpu_shims

        install_cpu_shims()
        setup, shapes, iters = LayerSetup("cpu", dict(TINY)), CPU_SHAPES, args.iters or 2
        warmup = 1  # nothing to autotune or compile on the CPU
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gdn_layer.py needs a CUDA GPU (--cpu for a dry run)")
        if args.no_jit:
            import megatron.core.jit as mjit

            mjit.disable_jit_fuser()
        setup, shapes, iters = LayerSetup(), GPU_SHAPES, args.iters or 20
        warmup = 3
    perf_shapes = args.shapes or shapes
    per_rank = {h: setup.with_value_heads(h)
                for h in args.value_heads or [setup.sizes["num_value_heads"]]}
    init_single_process(setup)
    if setup.cpu:
        results = {"device": "cpu", "torch": torch.__version__}
    else:
        from tools.bench_common import environment

        results = {"env": environment(), "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__}
    results["jit_fuser"] = not (args.no_jit or args.cpu)
    results["states"] = {state: STATE_FLAGS[state] for state in args.states}
    path = os.path.join(args.out, "gdn_layer.json")
    os.makedirs(args.out, exist_ok=True)

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)

    def case(h: int, seq: int, batch: int) -> str:
        return f"H={h} S={seq} B={batch}"

    def per_state(part: str, measure) -> None:  # every state per head count and shape
        results[part] = {}
        for h, rank_setup in per_rank.items():
            for seq, batch in perf_shapes:
                measured = measure(rank_setup, seq, batch)
                for state in args.states:
                    results[part][f"{case(h, seq, batch)} {state}"] = measured[state]
                save()

    if "parity" in args.parts:
        results["parity"] = layer_parity(setup, *shapes[0])
        save()
    if "perf" in args.parts:
        per_state("perf", lambda s, seq, batch: measure_states(s, seq, batch, iters,
                                                               args.states, warmup))
    if "graphs" in args.parts and setup.cpu:
        results["graphs"] = {"skipped": "megatron's CUDA graphs need a GPU"}
    elif "graphs" in args.parts:
        per_state("graphs", lambda s, seq, batch: measure_graphed_states(
            s, seq, batch, iters, args.graph_repeats, args.states))
    if "breakdown" in args.parts:
        results["breakdown"] = {f"S={seq} B={batch}": breakdown(setup, seq, batch, iters)
                                for seq, batch in shapes}
        save()
    if "kernels" in args.parts:
        results["kernels"] = {}
        for h, rank_setup in per_rank.items():
            for seq, batch in perf_shapes:
                results["kernels"][case(h, seq, batch)] = layer_kernels(
                    rank_setup, seq, batch, iters, args.states, warmup)
                save()
    if "host" in args.parts:
        seq, batch = args.host_shape or (shapes[0] if setup.cpu else HOST_SHAPE)
        h = args.host_value_heads
        results["host"] = {case(h, seq, batch): host_time(setup.with_value_heads(h), seq, batch,
                                                          iters, args.states, warmup)}
        save()
    for line in summary_lines(results):
        print(line)
    print(f"wrote {path}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.tp > 1:
        run_tensor_parallel(args)
    else:
        run_parts(args)


if __name__ == "__main__":
    main()
