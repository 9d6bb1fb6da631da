"""tools/gdn_layer.py on the CPU: its kernel grouping, and a dry run of the script at tiny sizes
(megatron's torch chunk path, the Triton interpreter) that must write every section."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import tools.gdn_layer as gdn_layer
from tools.gdn_layer import QWEN3_NEXT, LayerSetup, kernel_group, paired_speedup

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
                           "--value-heads", "4", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gdn_layer.json").read_text())
    assert {"parity", "perf", "breakdown"} <= set(results)
    assert results["graphs"] == {"skipped": "megatron's CUDA graphs need a GPU"}
    for entry in results["perf"].values():  # the summaries are those of the recorded steps
        steps = entry["fwd_bwd_ms_steps"]
        assert entry["fwd_bwd_ms_min"] == min(steps)
        assert entry["fwd_bwd_ms_median"] == statistics.median(steps)
    section = results["parity"]["norm_section"]
    assert section["out_bitwise_vs_eager"] >= 0.999 and section["out_max_ulp_vs_eager"] <= 1
    assert set(section["rel_err_vs_float64"]) == {"out", "dx", "dgate", "dweight"}
    assert set(results["perf"]) == {"S=64 B=2 off", "S=64 B=2 on", "H=2 S=64 B=2 off",
                                     "H=2 S=64 B=2 on"}
    for shape in ("S=64 B=2", "H=2 S=64 B=2"):
        off, on = results["perf"][f"{shape} off"], results["perf"][f"{shape} on"]
        assert 0 < on["kept_bytes_per_token"] <= off["kept_bytes_per_token"]
        assert len(off["fwd_bwd_ms_steps"]) == len(on["fwd_bwd_ms_steps"]) == 2  # CPU: 2 iters
        # the paired speed-up is that of the recorded step pairs (step i off against step i on)
        ratios = [a / b for a, b in zip(off["fwd_bwd_ms_steps"], on["fwd_bwd_ms_steps"])]
        assert on["paired_speedup_median"] == pytest.approx(statistics.median(ratios))
        assert on["pairs_faster_on"] == sum(r > 1 for r in ratios) / len(ratios)
    # half the heads keep less per token
    assert results["perf"]["H=2 S=64 B=2 on"]["kept_bytes_per_token"] < \
        results["perf"]["S=64 B=2 on"]["kept_bytes_per_token"]
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


def test_paired_speedup_compares_neighbouring_steps():
    # The host slows down 2x half-way: the medians of the two layers' steps mix both speeds,
    # the pairs do not.
    off = [10.0, 10.0, 20.0, 20.0]
    on = [9.0, 9.5, 18.0, 21.0]
    paired = paired_speedup(off, on)
    assert paired["paired_speedup_median"] == pytest.approx((10 / 9.5 + 20 / 18) / 2)
    assert paired["pairs_faster_on"] == 0.75


def test_per_rank_head_counts_of_qwen3_next():
    setup = LayerSetup("cpu", dict(QWEN3_NEXT))
    for tp, heads, key_heads in ((1, 32, 16), (4, 8, 4), (8, 4, 2)):
        sizes = setup.with_value_heads(heads).sizes
        assert (sizes["num_value_heads"], sizes["num_key_heads"]) == (heads, key_heads), tp
        assert sizes["hidden_size"] == QWEN3_NEXT["hidden_size"]
    for bad in (3, 0, 64):
        with pytest.raises(ValueError, match=f"--value-heads {bad}"):
            setup.with_value_heads(bad)


def test_graphed_pair_alternates_the_flags_and_takes_medians(monkeypatch):
    """measure_graphed_pair builds the flag-off and flag-on layers in turn, alternating which
    goes first, and reports per flag the median of the captures' medians and per capture pair
    the speed-up."""
    order = []
    times = {False: iter([10.0, 12.0, 11.0]), True: iter([8.0, 9.0, 10.0])}

    def measured(setup, seq, batch, fused, iters):  # stands in for one build, capture and replay
        order.append(fused)
        ms = next(times[fused])
        return dict(fwd_bwd_ms_median=ms, fwd_bwd_ms_min=ms - 1, graphs_captured=True,
                    python_norm_calls_per_step=0.0)

    monkeypatch.setattr(gdn_layer, "measure_graphed", measured)
    pair = gdn_layer.measure_graphed_pair(LayerSetup("cpu", dict(QWEN3_NEXT)), 64, 1, 2, repeats=3)
    assert order == [False, True, True, False, False, True]
    assert pair[False]["fwd_bwd_ms_median"] == 11.0 and pair[True]["fwd_bwd_ms_median"] == 9.0
    assert pair[False]["fwd_bwd_ms_min"] == 9.0 and pair[True]["fwd_bwd_ms_min"] == 7.0
    assert pair[True]["speedup_repeats"] == [10 / 8, 12 / 9, 11 / 10]
    assert pair[True]["graphs_captured"] and pair[True]["python_norm_calls_per_step"] == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--cpu", "--shapes", "64"], "--shapes 64: each must be SEQxBATCH"),
    (["--cpu", "--shapes", "64x0"], "--shapes 64x0: each must be SEQxBATCH"),
    (["--cpu", "--tp", "2"], "start it with torchrun --nproc-per-node 2"),
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--cpu", "--iters", "0"], "--iters 0: must be >= 1"),
])
def test_bad_arguments_stop_before_any_setup(monkeypatch, capsys, argv, message):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit):
        gdn_layer.main(argv)
    assert message in capsys.readouterr().err
