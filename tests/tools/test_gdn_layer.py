"""tools/gdn_layer.py on the CPU: its kernel grouping, tables, host timer and state order, and
a dry run of the script at tiny sizes (megatron's torch chunk path, the Triton interpreter) that
must write every section for the three states."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import tools.gdn_layer as gdn_layer
from tools.gdn_layer import (KERNEL_NAME_CHARS, KERNEL_ROWS, QWEN3_NEXT, STATES, TINY, HostTimer,
                             LayerSetup, kernel_group, paired_speedup, rotated_states, short_name,
                             top_rows)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name, group", [
    ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", "copies"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("triton_poi_fused__to_copy_mul_0", "rest"),  # inductor's fused math, casts included
    ("gated_norm_fwd", "rest"),
    ("void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>", "fills"),
    ("Memset (Device)", "fills"),
    ("ampere_bf16_s16816gemm", "rest"),
])
def test_kernel_group(name, group):
    assert kernel_group(name) == group


@pytest.mark.interpreter_backward
def test_cpu_dry_run_writes_every_section(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "tools/gdn_layer.py", "--cpu", "--out", str(tmp_path),
                           "--value-heads", "4", "2", "--shapes", "16x1",  # a short sequence:
                           "--host-value-heads", "2", "--host-shape", "16x1"],  # the interpreter
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gdn_layer.json").read_text())
    assert {"parity", "perf", "breakdown", "kernels", "host"} <= set(results)
    assert results["graphs"] == {"skipped": "megatron's CUDA graphs need a GPU"}
    assert list(results["states"]) == list(STATES)
    for entry in results["perf"].values():  # the summaries are those of the recorded steps
        steps = entry["fwd_bwd_ms_steps"]
        assert entry["fwd_bwd_ms_min"] == min(steps)
        assert entry["fwd_bwd_ms_median"] == statistics.median(steps)
    section = results["parity"]["norm_section"]
    assert section["out_bitwise_vs_eager"] >= 0.999 and section["out_max_ulp_vs_eager"] <= 1
    assert set(section["rel_err_vs_float64"]) == {"out", "dx", "dgate", "dweight"}
    shapes = ("H=4 S=16 B=1", "H=2 S=16 B=1")
    assert set(results["perf"]) == {f"{shape} {state}" for shape in shapes for state in STATES}
    for shape in shapes:
        off, norm, both = (results["perf"][f"{shape} {state}"] for state in STATES)
        assert 0 < both["kept_bytes_per_token"] <= norm["kept_bytes_per_token"] \
            <= off["kept_bytes_per_token"]
        for entry in (off, norm, both):
            assert len(entry["fwd_bwd_ms_steps"]) == 2  # CPU: 2 iters
        assert not any(key.startswith("paired_speedup") for key in off)
        # each state's paired speed-ups over the states before it are those of the recorded
        # step pairs (step i of one against step i of the other)
        for later, bases in ((norm, {"off": off}), (both, {"off": off, "norm": norm})):
            assert {k for k in later if k.startswith("paired_speedup_vs_")} == {
                f"paired_speedup_vs_{name}" for name in bases}
            for name, base in bases.items():
                ratios = [a / b for a, b in zip(base["fwd_bwd_ms_steps"],
                                                later["fwd_bwd_ms_steps"])]
                assert later[f"paired_speedup_vs_{name}"] == pytest.approx(
                    statistics.median(ratios))
                assert later[f"pairs_faster_than_{name}"] == sum(r > 1 for r in ratios) / 2
    # half the heads keep less per token
    for state in STATES:
        assert results["perf"][f"H=2 S=16 B=1 {state}"]["kept_bytes_per_token"] < \
            results["perf"][f"H=4 S=16 B=1 {state}"]["kept_bytes_per_token"]
    for split in results["breakdown"].values():
        for variant in ("unfused", "fused"):  # the totals add up the per-kernel times
            times = split[variant]
            assert times["kernels"], variant  # the profiler saw the section's kernels
            assert times["kernel_ms"] == pytest.approx(sum(times["kernels"].values()))
            assert times["kernel_ms"] == pytest.approx(
                times["copies_ms"] + times["fills_ms"] + times["rest_ms"])
        u, f = split["unfused"], split["fused"]
        for gain, key in (("gain_wall_ms", "wall_ms"), ("gain_kernel_ms", "kernel_ms"),
                          ("gain_from_kernels_ms", "rest_ms"), ("gain_from_copies_ms", "copies_ms"),
                          ("gain_from_fills_ms", "fills_ms")):
            assert split[gain] == pytest.approx(u[key] - f[key]), gain
        assert u["copy_calls"] > f["copy_calls"]  # the copies removed
    assert set(results["kernels"]) == set(shapes)
    for kernels in results["kernels"].values():
        table = kernels["ms"]
        assert list(table)[-1] == "other" and len(table) == KERNEL_ROWS + 1
        assert all(len(name) <= KERNEL_NAME_CHARS for name in table)
        for state in STATES:  # the table's column adds up to the state's total
            assert kernels["total_ms"][state] == pytest.approx(
                sum(row[state] for row in table.values()))
            assert kernels["total_ms"][state] > 0 and kernels["launches_per_step"][state] > 0
        # the torch convolution of megatron's deterministic path is gone with the fused region
        convs = [row for name, row in table.items() if "convolution" in name]
        assert convs and all(row["both"] == 0 for row in convs)
        assert max(row["off"] for row in convs) > 0 and max(row["norm"] for row in convs) > 0
    check_host(results["host"], proc.stdout)


def check_host(host: dict, stdout: str) -> None:
    """The host part of the dry run: its parts add up, each part ran in the states that use it,
    and the profiled ops name the fusions of each state."""
    assert list(host) == ["H=2 S=16 B=1"]
    entry = host["H=2 S=16 B=1"]
    assert list(entry["states"]) == list(STATES)
    parts, calls, ops = entry["parts_ms"], entry["parts_calls_per_step"], entry["ops_ms"]
    for state, measured in entry["states"].items():
        assert measured["step_wall_ms_median"] == statistics.median(measured["step_wall_ms_steps"])
        assert len(measured["step_wall_ms_steps"]) == 2
        assert measured["gpu_kernel_ms"] is None  # no GPU
        # the self times of the parts add up to the forward and backward calls
        assert sum(row[state] for row in parts.values()) == pytest.approx(
            measured["forward_host_ms"] + measured["backward_host_ms"])
        # inside the steps' wall times (2 steps: their median is their mean)
        assert measured["forward_host_ms"] + measured["backward_host_ms"] <= \
            measured["step_wall_ms_median"]
        assert ops["other"][state] >= 0 and measured["profiled_host_ms"] > 0
    assert calls["backward"] == calls["forward, elsewhere"] == calls["in_proj"] == {
        "off": 1, "norm": 1, "both": 1}
    assert calls["fused_pre_gated_delta_rule"] == {"off": 0, "norm": 0, "both": 1}
    for unfused_step in ("_prepare_input_for_gated_delta_rule", "_compute_g_and_beta"):
        assert calls[unfused_step] == {"off": 1, "norm": 1, "both": 0}
    assert "conv1d" not in calls and "out_norm" in entry["untimed_submodules"]
    assert set(ops["_FusedPreGatedDeltaRule"]) == set(STATES)
    assert ops["_FusedPreGatedDeltaRule"]["both"] > 0 == ops["_FusedPreGatedDeltaRule"]["norm"]
    assert ops["_FusedGatedNorm"]["norm"] > 0 == ops["_FusedGatedNorm"]["off"]
    assert len(ops) == gdn_layer.HOST_OP_ROWS + 1
    for title in ("kernels H=4 S=16 B=1:", "host H=2 S=16 B=1 both: step wall",
                  "host H=2 S=16 B=1: forward parts", "host H=2 S=16 B=1: torch ops"):
        assert title in stdout, title


def test_paired_speedup_compares_neighbouring_steps():
    # The host slows down 2x half-way: the medians of the two layers' steps mix both speeds,
    # the pairs do not.
    off = [10.0, 10.0, 20.0, 20.0]
    norm = [9.0, 9.5, 18.0, 21.0]
    paired = paired_speedup(off, norm, "off")
    assert paired == {"paired_speedup_vs_off": pytest.approx((10 / 9.5 + 20 / 18) / 2),
                      "pairs_faster_than_off": 0.75}
    assert set(paired_speedup(norm, off, "norm")) == {"paired_speedup_vs_norm",
                                                      "pairs_faster_than_norm"}


def test_states_rotate_so_none_always_follows_the_same_one():
    assert [rotated_states(STATES, i) for i in range(4)] == [
        ("off", "norm", "both"), ("norm", "both", "off"), ("both", "off", "norm"),
        ("off", "norm", "both")]
    assert [rotated_states(["off", "norm"], i) for i in range(2)] == [("off", "norm"),
                                                                       ("norm", "off")]


def test_top_rows_keeps_each_states_total():
    per_state = {"off": {"a": 5.0, "b": 1.0, "c": 0.5}, "both": {"b": 2.0, "d": 7.0}}
    table = top_rows(per_state, 2)
    # ranked by the largest value in any state; absent is 0; the rest summed per state
    assert table == {"d": {"off": 0.0, "both": 7.0}, "a": {"off": 5.0, "both": 0.0},
                     "other": {"off": 1.5, "both": 2.0}}
    assert list(top_rows(per_state)) == ["d", "a", "b", "c"]  # no rows cap: no "other"


def test_short_name_cuts_long_kernel_names():
    long = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"
    assert short_name("gated_norm_fwd") == "gated_norm_fwd"
    assert len(short_name(long)) == KERNEL_NAME_CHARS and short_name(long).endswith("...")
    assert short_name(long)[:-3] == long[:KERNEL_NAME_CHARS - 3]


def test_host_timer_self_times_add_up():
    clock = iter([0.0, 1.0, 3.0, 4.0, 10.0, 10.0, 10.5, 11.0, 12.0])  # at each enter and exit
    timer = HostTimer(clock=lambda: next(clock))
    inner = timer.wrap("inner", lambda value: value + 1)
    with timer.span("outer"):  # 0 .. 10, holding inner 1 .. 3 and 4 .. 10
        assert inner(1) == 2
        with timer.span("inner"):
            pass
    with timer.span("outer"):  # 10.5 .. 11
        pass
    assert timer.calls == {"inner": 2, "outer": 2}
    assert timer.total_s == {"inner": 2.0 + 6.0, "outer": 10.0 + 0.5}
    assert timer.self_s == {"inner": 8.0, "outer": 2.5}
    with pytest.raises(RuntimeError, match="span 'outer' closed, but the open span is None"):
        timer.exit("outer")


@pytest.mark.cpu_shims
@pytest.mark.interpreter
def test_timed_layer_parts_restores_the_layer(model_parallel_tp1):
    """The host part's timing leaves nothing behind: no hooks, no wrapped steps or functions."""
    from core.ssm import pre_gated_delta_rule_forward
    from core.ssm.megatron_gdn_import import import_megatron_gdn

    setup = LayerSetup("cpu", dict(TINY))
    module = setup.make_state_module("both")
    assert module.fused_gated_norm and module.pre_gated_delta_rule_fusion
    functions = [(owner, name, getattr(owner, name)) for owner, name in gdn_layer.layer_functions()]
    assert functions[1][:2] == (pre_gated_delta_rule_forward, "fused_pre_gated_delta_rule")
    assert functions[0][0] is import_megatron_gdn().gdn
    x, dy = setup.inputs(8, 1)
    step, _ = gdn_layer.layer_step(module, x, dy)
    step()  # the attributes a forward sets
    own = dict(module.__dict__)
    timer = HostTimer()
    with gdn_layer.timed_layer_parts(module, timer):
        step()
    assert timer.calls == {"in_proj": 1, "fused_pre_gated_delta_rule": 1, "gated_delta_rule": 1,
                           "_gated_norm_and_a2a": 1, "_apply_gated_norm": 1, "out_proj": 1}
    assert dict(module.__dict__) == own
    assert all(getattr(owner, name) is fn for owner, name, fn in functions)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def test_per_rank_head_counts_of_qwen3_next():
    setup = LayerSetup("cpu", dict(QWEN3_NEXT))
    for tp, heads, key_heads in ((1, 32, 16), (4, 8, 4), (8, 4, 2)):
        sizes = setup.with_value_heads(heads).sizes
        assert (sizes["num_value_heads"], sizes["num_key_heads"]) == (heads, key_heads), tp
        assert sizes["hidden_size"] == QWEN3_NEXT["hidden_size"]
    for bad in (3, 0, 64):
        with pytest.raises(ValueError, match=f"--value-heads {bad}"):
            setup.with_value_heads(bad)


def test_graphed_states_rotate_and_take_medians(monkeypatch):
    """measure_graphed_states builds the layers of the three states in turn, rotating which goes
    first, and reports per state the median of the captures' medians and, per earlier state,
    the speed-up of each capture."""
    order = []
    times = {"off": iter([10.0, 12.0, 11.0]), "norm": iter([8.0, 9.0, 10.0]),
             "both": iter([5.0, 6.0, 4.0])}

    def measured(setup, seq, batch, state, iters):  # stands in for one build, capture and replay
        order.append(state)
        ms = next(times[state])
        return dict(fwd_bwd_ms_median=ms, fwd_bwd_ms_min=ms - 1, graphs_captured=True,
                    python_norm_calls_per_step=0.0)

    monkeypatch.setattr(gdn_layer, "measure_graphed", measured)
    runs = gdn_layer.measure_graphed_states(LayerSetup("cpu", dict(QWEN3_NEXT)), 64, 1, 2,
                                            repeats=3)
    assert order == ["off", "norm", "both", "norm", "both", "off", "both", "off", "norm"]
    assert [runs[s]["fwd_bwd_ms_median"] for s in STATES] == [11.0, 9.0, 5.0]
    assert [runs[s]["fwd_bwd_ms_min"] for s in STATES] == [9.0, 7.0, 3.0]
    assert "speedup_vs_off_repeats" not in runs["off"]
    assert runs["norm"]["speedup_vs_off_repeats"] == [10 / 8, 12 / 9, 11 / 10]
    assert runs["both"]["speedup_vs_off_repeats"] == [10 / 5, 12 / 6, 11 / 4]
    assert runs["both"]["speedup_vs_norm_repeats"] == [8 / 5, 9 / 6, 10 / 4]
    assert runs["both"]["graphs_captured"] and runs["both"]["python_norm_calls_per_step"] == 0.0
    times["norm"] = iter([7.0])
    only = gdn_layer.measure_graphed_states(LayerSetup("cpu", dict(QWEN3_NEXT)), 64, 1, 2,
                                            repeats=1, states=["norm"])
    assert list(only) == ["norm"] and not any(k.startswith("speedup") for k in only["norm"])


@pytest.mark.parametrize("argv, message", [
    (["--cpu", "--shapes", "64"], "--shapes 64: each must be SEQxBATCH"),
    (["--cpu", "--shapes", "64x0"], "--shapes 64x0: each must be SEQxBATCH"),
    (["--cpu", "--tp", "2"], "start it with torchrun --nproc-per-node 2"),
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--cpu", "--iters", "0"], "--iters 0: must be >= 1"),
    (["--cpu", "--states", "off,fused"], "--states: unknown ['fused'], expected some of off, "
                                         "norm, both"),
    (["--cpu", "--states", "off,norm,off"], "--states: ['off'] given more than once"),
    (["--cpu", "--parts", "perf,speed"], "--parts: unknown ['speed']"),
    (["--cpu", "--host-shape", "4096"], "--host-shape 4096: must be SEQxBATCH"),
    (["--cpu", "--host-value-heads", "3"], "--host-value-heads 3: must divide 4 value heads"),
    (["--value-heads", "32", "5"], "--value-heads 5: must divide 32 value heads"),
])
def test_bad_arguments_stop_before_any_setup(monkeypatch, capsys, argv, message):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit):
        gdn_layer.main(argv)
    assert message in capsys.readouterr().err


def test_states_and_parts_are_measured_in_their_own_order():
    args = gdn_layer.parse_args(["--cpu", "--states", "both,off", "--parts", "host,perf",
                                 "--host-shape", "32x1"])
    assert args.states == ["off", "both"] and args.parts == ["perf", "host"]
    assert args.host_shape == (32, 1) and args.host_value_heads == gdn_layer.HOST_VALUE_HEADS
    assert gdn_layer.parse_args(["--cpu"]).states == list(STATES)
