"""examples/pretrain_gdn.py end to end on tiny settings: megatron GPTModel + DDP + optimizer,
flag off then on (``--compare``), in a subprocess (the CPU shims patch torch and megatron
process-wide). Checks: finite losses that go down, the two runs agree per the numerics
contract step by step, the paired check (same weights, fused vs unfused) gives the same loss and
gradients to fp32 rounding, outputs written, and at TP = 2 and TP = 4 (gloo, spawned CPU
processes) the GDN out_norm weight identical on every rank after every step."""

import importlib.util
import json
import math
import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gdn.py")
TINY = ["--hidden-size", "32", "--num-layers", "2", "--linear-attention-freq", "2",
        "--ffn-hidden-size", "64", "--num-attention-heads", "2", "--num-query-groups", "2",
        "--kv-channels", "16", "--linear-num-key-heads", "2", "--linear-num-value-heads", "2",
        "--seq-length", "32", "--micro-batch-size", "2", "--eval-batches", "1", "--no-progress"]
# fp32: the fused kernel differs from megatron's unfused norm only in the fp32 summation order of
# mean(x^2), so over a few steps the losses agree to a few fp32 ulps (measured: 0 or 1).
MAX_ULPS_FP32 = 8
# Paired check (same weights and batch, fused vs unfused): fp32 gradients agree to rounding.
MAX_GRAD_REL_FP32 = 1e-5


def _report_module():
    spec = importlib.util.spec_from_file_location(
        "pretrain_report", os.path.join(ROOT, "examples", "pretrain_report.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ulp = _report_module().ulp  # fp32 ulp at |x|, as the example's report counts it


def _run(out, *extra):
    cmd = [sys.executable, SCRIPT, "--compare", "--paired-check-every", "1", "--out", str(out),
           *TINY, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = []
    for label in ("off", "on"):
        with open(os.path.join(out, f"run_fused_gated_norm_{label}.json")) as f:
            runs.append(json.load(f))
    for name in ("summary.txt", "losses.csv", "loss_curves.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    assert "max |dloss|" in proc.stdout
    return runs


def _check_agreement(off, on, steps):
    assert off["fused_gated_norm"] is False and on["fused_gated_norm"] is True
    for run in (off, on):
        assert len(run["losses"]) == steps
        assert all(math.isfinite(x) for x in run["losses"]), run["losses"]
        assert math.isfinite(run["held_out_loss"])
        assert 4.0 < run["losses"][0] < 6.5  # ~ln(256) at init
    for step, (a, b) in enumerate(zip(off["losses"], on["losses"]), 1):
        assert abs(a - b) <= MAX_ULPS_FP32 * _ulp(a), (step, a, b)
    checks = off["paired_checks"]
    assert [c["step"] for c in checks] == list(range(1, steps + 1))
    for c in checks:
        assert abs(c["dloss"]) <= MAX_ULPS_FP32 * _ulp(c["loss_off"]), c
        assert c["grad_rel"] <= MAX_GRAD_REL_FP32 and c["out_norm_grad_rel"] <= MAX_GRAD_REL_FP32, c
        # The floors: on the CPU (deterministic kernels, no jit_fuser) the unfused path repeats
        # itself bit for bit and its eager code is the same code.
        assert c["repeat_dloss"] == 0.0 and c["repeat_grad_rel"] == 0.0, c
        assert c["eager_dloss"] == 0.0 and c["eager_grad_rel"] == 0.0, c
        assert c["on_vs_eager_grad_rel"] == c["grad_rel"], c


def test_compare_tp1(tmp_path):
    off, on = _run(tmp_path, "--steps", "4", "--lr", "1e-2")
    _check_agreement(off, on, 4)
    assert off["losses"][-1] < off["losses"][0]
    assert off["tp_out_norm_max_diff"] is None


def test_compare_tp2_sequence_parallel_recompute(tmp_path):
    off, on = _run(tmp_path, "--steps", "2", "--tp", "2", "--sequence-parallel",
                   "--recompute-norm")
    _check_agreement(off, on, 2)
    for run in (off, on):  # out_norm weight identical on both TP ranks after every step
        assert run["tp_out_norm_max_diff"] == [0.0, 0.0]


# TP = 4 needs every head count divisible by 4 (attention heads, query groups, GDN key heads);
# 8 GDN value heads: 2 per rank, so each rank's partial dW sums over more than one head.
TP4_HEADS = ["--num-attention-heads", "4", "--num-query-groups", "4", "--kv-channels", "8",
             "--linear-num-key-heads", "4", "--linear-num-value-heads", "8"]


def test_compare_tp4_sequence_parallel_recompute(tmp_path):
    off, on = _run(tmp_path, "--steps", "2", "--tp", "4", "--sequence-parallel",
                   "--recompute-norm", "--no-noise-floor", *TP4_HEADS)
    _check_agreement(off, on, 2)
    for run in (off, on):  # out_norm weight identical on all four TP ranks after every step
        assert run["tp_out_norm_max_diff"] == [0.0, 0.0]
        assert run["args"]["tp"] == 4 and run["world_size"] == 4
