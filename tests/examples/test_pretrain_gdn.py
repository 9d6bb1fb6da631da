"""examples/pretrain_gdn.py end to end on tiny settings: megatron GPTModel + DDP + optimizer,
flag off then on (``--compare``), in a subprocess (the CPU shims patch torch and megatron
process-wide). Checks: finite losses that go down, the two runs agree per the numerics
contract step by step, the paired check (same weights, fused vs unfused) gives the same loss and
gradients to fp32 rounding, outputs written, and at TP = 2 and TP = 4 (gloo, spawned CPU
processes) the GDN out_norm weight identical on every rank after every step; on the CPU, two
runs of one configuration repeat bit for bit whatever else loads the machine."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from tests.gated_norm_checks import fp32_loss_tolerance


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gdn.py")
# The example's CPU runs, on any machine: a GPU is hidden from them.
CPU_ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
cpu_run = pytest.mark.interpreter_backward
TINY = ["--hidden-size", "32", "--num-layers", "2", "--linear-attention-freq", "2",
        "--ffn-hidden-size", "64", "--num-attention-heads", "2", "--num-query-groups", "2",
        "--kv-channels", "16", "--linear-num-key-heads", "2", "--linear-num-value-heads", "2",
        "--seq-length", "32", "--micro-batch-size", "2", "--eval-batches", "1", "--no-progress"]
# Paired check (same weights and batch, fused vs unfused): fp32 gradients agree to rounding.
MAX_GRAD_REL_FP32 = 1e-5


def _load_example(name):
    path = os.path.join(ROOT, "examples", name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The example's output layer covers its byte vocabulary padded for TP (as megatron pads it).
_padded_vocab_size = _load_example("pretrain_gdn").padded_vocab_size
# At init (weights ~ N(0, 0.02)) the logits are near 0: the first loss is that of a uniform
# prediction over the padded vocabulary, ln(V), within a few hundredths (measured: -0.003 at
# TP 1 and 2, V = 256; -0.017 at TP 4, V = 512).
INIT_LOSS_SLACK = 0.05


def _run(out, *extra):
    cmd = [sys.executable, SCRIPT, "--compare", "--paired-check-every", "1", "--out", str(out),
           *TINY, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = []
    for label in ("off", "on"):
        with open(os.path.join(out, f"run_fused_gated_norm_{label}.json")) as f:
            runs.append(json.load(f))
    for name in ("summary.txt", "losses.csv", "loss_curves.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    assert "max |dloss|" in proc.stdout
    # the CPU run's kernels ran in the Triton interpreter: no speed of the flag is reported
    assert "tokens/s vs reference" not in proc.stdout
    assert "interpreter tokens/s (median step)" in proc.stdout
    # what reproduces the result: versions, date and the command line
    last_line = open(os.path.join(out, "summary.txt")).read().splitlines()[-1]
    assert "megatron-core 0.19" in last_line
    assert "python examples/pretrain_gdn.py --compare" in last_line
    assert all(run["env"]["command"] == runs[0]["env"]["command"] for run in runs)
    return runs


def _fused_calls_per_step(run) -> int:
    """What the flag-on run must make: one fused norm call per GDN layer and micro-batch, and
    one more in the backward where the norm is recomputed."""
    args = run["args"]
    return run["gdn_layers"] * args["num_micro_batches"] * (2 if args["recompute_norm"] else 1)


def _check_agreement(off, on, steps):
    assert off["fused_gated_norm"] is False and on["fused_gated_norm"] is True
    # The flag reached every GDN layer on every step, and the flag-off run never fused.
    assert on["gdn_layers"] > 0 and on["fused_norm_calls"] == steps * _fused_calls_per_step(on)
    assert off["fused_norm_calls"] == 0
    for run in (off, on):
        assert len(run["losses"]) == steps
        assert all(math.isfinite(x) for x in run["losses"]), run["losses"]
        assert math.isfinite(run["held_out_loss"])
        uniform = math.log(_padded_vocab_size(run["args"]["tp"]))
        assert abs(run["losses"][0] - uniform) < INIT_LOSS_SLACK, (run["losses"][0], uniform)
    for step, (a, b) in enumerate(zip(off["losses"], on["losses"]), 1):
        assert abs(a - b) <= fp32_loss_tolerance(a), (step, a, b)
    checks = off["paired_checks"]
    assert [c["step"] for c in checks] == list(range(1, steps + 1))
    for c in checks:
        # Only the paired check's fused pass fused, and it did, in every GDN layer.
        assert c["fused_norm_calls"] == {"off": 0, "repeat": 0, "eager": 0,
                                         "on": _fused_calls_per_step(on)}, c
        assert abs(c["dloss"]) <= fp32_loss_tolerance(c["loss_off"]), c
        assert c["grad_rel"] <= MAX_GRAD_REL_FP32 and c["out_norm_grad_rel"] <= MAX_GRAD_REL_FP32, c
        # The floors: on the CPU (deterministic kernels, no jit_fuser) the unfused path repeats
        # itself bit for bit and its eager code is the same code.
        assert c["repeat_dloss"] == 0.0 and c["repeat_grad_rel"] == 0.0, c
        assert c["eager_dloss"] == 0.0 and c["eager_grad_rel"] == 0.0, c
        assert c["on_vs_eager_grad_rel"] == c["grad_rel"], c


@cpu_run
def test_compare_tp1(tmp_path):
    off, on = _run(tmp_path, "--steps", "4", "--lr", "1e-2")
    _check_agreement(off, on, 4)
    assert off["losses"][-1] < off["losses"][0]
    assert off["tp_out_norm_max_diff"] is None


@cpu_run
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


@cpu_run
def test_compare_tp4_sequence_parallel_recompute(tmp_path):
    off, on = _run(tmp_path, "--steps", "2", "--tp", "4", "--sequence-parallel",
                   "--recompute-norm", "--no-noise-floor", *TP4_HEADS)
    _check_agreement(off, on, 2)
    for run in (off, on):  # out_norm weight identical on all four TP ranks after every step
        assert run["tp_out_norm_max_diff"] == [0.0, 0.0]
        assert run["args"]["tp"] == 4 and run["world_size"] == 4


# The embedding gradient's shape of the example's CPU default (micro-batch 4 x seq 128 x hidden 64
# = 32,768 values): torch's index_put_(accumulate=True) takes its multi-threaded path (from
# 32,768 values), whose atomic additions land in the order the threads happen to run unless
# torch's deterministic algorithms are on (at this shape a step's gradient then often differs in
# its last bits).
REPEAT_SIZE = ["--hidden-size", "64", "--num-layers", "2", "--linear-attention-freq", "2",
               "--ffn-hidden-size", "64", "--num-attention-heads", "2", "--num-query-groups", "2",
               "--kv-channels", "16", "--linear-num-key-heads", "2",
               "--linear-num-value-heads", "2", "--seq-length", "128", "--micro-batch-size", "4",
               "--steps", "40", "--eval-batches", "1", "--no-progress", "--no-fused-gated-norm"]


def _repeat_run(out, env_extra=None):
    cmd = [sys.executable, SCRIPT, "--out", str(out), *REPEAT_SIZE]
    proc = subprocess.run(cmd, cwd=ROOT, env={**CPU_ENV, **(env_extra or {})},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 intra-op threads/process, torch deterministic algorithms" in proc.stdout
    with open(os.path.join(out, "run_fused_gated_norm_off.json")) as f:
        return json.load(f)


@cpu_run
def test_cpu_run_repeats_bitwise_under_load_and_other_thread_settings(tmp_path):
    """One run alone; the same run again with OMP_NUM_THREADS=1 and MKL_NUM_THREADS=1 in its
    environment and a busy-looping process beside it: every loss and the held-out loss equal bit
    for bit. (Alone, the two threads run at the same time, which is when unordered atomic
    additions collide; with the busy loop they are preempted in between.)"""
    alone = _repeat_run(tmp_path / "alone")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        loaded = _repeat_run(tmp_path / "loaded", {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    finally:
        busy.kill()
        busy.wait()
    assert len(alone["losses"]) == 40 and all(math.isfinite(x) for x in alone["losses"])
    assert loaded["losses"] == alone["losses"]
    assert loaded["held_out_loss"] == alone["held_out_loss"]


def test_cpu_threads_default_and_validation(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    example = _load_example("pretrain_gdn")
    monkeypatch.setattr(example, "HAS_CUDA", False)  # the CPU run's defaults, on any machine
    parse = example.build_parser().parse_args
    assert example.resolve_defaults(parse([])).cpu_threads == 2
    assert example.resolve_defaults(parse(["--tp", "2"])).cpu_threads == 1
    assert example.resolve_defaults(parse(["--tp", "2", "--dp", "2"])).cpu_threads == 1
    assert example.resolve_defaults(parse(["--cpu-threads", "3"])).cpu_threads == 3
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun
    assert example.resolve_defaults(parse([])).cpu_threads == 1
    with pytest.raises(SystemExit, match=r"--cpu-threads must be >= 1, got 0"):
        example.resolve_defaults(parse(["--cpu-threads", "0"]))


@pytest.mark.parametrize("argv, message", [
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--dp", "0"], "--dp must be >= 1, got 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--num-micro-batches", "0"], "--num-micro-batches must be >= 1, got 0"),
    (["--linear-attention-freq", "0"], "--linear-attention-freq must be >= 1, got 0"),
    (["--hidden-size", "-1"], "--hidden-size must be >= 1, got -1"),
    (["--steps", "3", "--warmup-steps", "3"], "--warmup-steps must be >= 0 and < --steps 3, got 3"),
    (["--tp", "2", "--sequence-parallel", "--seq-length", "33"],
     "--seq-length 33 must be divisible by --tp 2"),
    (["--eval-batches", "-2"], "--eval-batches must be >= 0, got -2"),
    (["--paired-check-every", "-1"], "--paired-check-every must be >= 0, got -1"),
    (["--seq-length", "14000"], r"--seq-length must be at most 13065 \(the held-out split of the "
                                r"corpus has 13067 tokens\), got 14000"),
    (["--seq-length", "300000", "--eval-batches", "0"],
     r"--seq-length must be at most 248262 \(the training split of the corpus has 248264 tokens\)"),
    (["--num-query-groups", "3"],
     "--num-attention-heads 4 must be a multiple of --num-query-groups 3"),
    # megatron's own rules, from its config, before any rank is spawned
    (["--tp", "3"], r"megatron refuses these model settings: num_attention_heads \(4\) must be a "
                    r"multiple of tensor_model_parallel_size \(3\).* \[options: "
                    r"--num-attention-heads, --tp\]"),
    (["--linear-num-key-heads", "3"], r"megatron refuses these model settings: "
                                      r"linear_num_value_heads \(4\) must be a multiple of "
                                      r"linear_num_key_heads \(3\).* \[options: "
                                      r"--linear-num-value-heads, --linear-num-key-heads\]"),
])
def test_bad_arguments_stop_before_a_model_is_built(monkeypatch, argv, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    example = _load_example("pretrain_gdn")
    monkeypatch.setattr(example, "HAS_CUDA", False)
    with pytest.raises(SystemExit, match=message):
        example.check_config(example.resolve_defaults(example.build_parser().parse_args(argv)))


def test_the_pre_gated_delta_rule_flag_reaches_the_config(monkeypatch):
    """--gdn-pre-gated-delta-rule-fusion (off by default) goes into every run's config, with the
    output norm on or off, and into the setup line of the report."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    example = _load_example("pretrain_gdn")
    monkeypatch.setattr(example, "HAS_CUDA", False)
    parse = example.build_parser().parse_args
    default = example.resolve_defaults(parse([]))
    assert default.gdn_pre_gated_delta_rule_fusion is False
    assert example.build_config(default, True).gdn_pre_gated_delta_rule_fusion is False
    assert "fusion before the gated delta rule off" in example.setup_line(default, 1)
    on = example.resolve_defaults(parse(["--gdn-pre-gated-delta-rule-fusion"]))
    for fused in (False, True):
        config = example.build_config(on, fused)
        assert config.gdn_pre_gated_delta_rule_fusion is True and config.fused_gated_norm is fused
    assert "fusion before the gated delta rule on" in example.setup_line(on, 1)
    example.check_config(on)  # megatron's rules and ours accept it


def test_long_sequences_without_held_out_evaluation(monkeypatch):
    """Without held-out batches only the training split bounds the sequence length."""
    example = _load_example("pretrain_gdn")
    monkeypatch.setattr(example, "HAS_CUDA", False)
    parse = example.build_parser().parse_args
    long_sequence = parse(["--eval-batches", "0", "--seq-length", "20000"])
    assert example.resolve_defaults(long_sequence).seq_length == 20000


def test_warmup_default_leaves_a_decay_step(monkeypatch):
    """megatron's scheduler needs warm-up < decay steps: one step trains with no warm-up."""
    example = _load_example("pretrain_gdn")
    monkeypatch.setattr(example, "HAS_CUDA", False)
    parse = example.build_parser().parse_args
    assert example.resolve_defaults(parse(["--steps", "1"])).warmup_steps == 0
    assert example.resolve_defaults(parse(["--steps", "2"])).warmup_steps == 1
    assert example.resolve_defaults(parse(["--steps", "250"])).warmup_steps == 25


def _report_run(label, losses, checks=()):
    return {"label": label, "steps": len(losses), "losses": losses, "held_out_loss": losses[-1],
            "step_times": [0.1] * len(losses), "tokens_per_step": 64,
            "grad_norms": [1.0] * len(losses),
            "lrs": [1e-3] * len(losses), "tp_out_norm_max_diff": None, "gdn_layers": 1,
            "fused_norm_calls": 0, "paired_checks": list(checks)}


def test_report_states_the_ulps_of_the_largest_paired_difference(tmp_path):
    """The ulp count printed next to the largest |dloss| of the paired checks is that
    difference's, not the largest count of another check (a small loss has small ulps)."""
    report = _load_example("pretrain_report")
    small, large = 0.5, 4.0  # fp32 ulps 5.96e-08 and 4.77e-07
    checks = [{"step": 1, "loss_off": small, "dloss": 2 * report.ulp(small), "grad_rel": 0.0,
               "out_norm_grad_rel": 0.0},
              {"step": 2, "loss_off": large, "dloss": report.ulp(large), "grad_rel": 0.0,
               "out_norm_grad_rel": 0.0}]
    table = report.summary_table([_report_run("off", [large, large], checks)], "setup")
    assert f"{report.ulp(large):.2e} (1.0 ulp)" in table


@pytest.mark.parametrize("interpreted", [False, True], ids=["gpu", "triton_interpreter"])
def test_report_compares_speed_only_outside_the_interpreter(interpreted):
    """Interpreter time says nothing about the fused norm's speed: a run in the Triton
    interpreter gets its times labelled as the interpreter's and no speed comparison."""
    report = _load_example("pretrain_report")
    runs = [_report_run("off", [2.0, 1.0]), _report_run("on", [2.0, 1.0])]
    runs[1]["step_times"] = [0.2, 0.2]
    for run in runs:
        run["triton_interpreter"] = interpreted
    table = report.summary_table(runs, "setup")
    assert ("tokens/s vs reference" in table) is not interpreted
    assert ("interpreter tokens/s (median step)" in table) is interpreted
    assert ("say nothing about the flag's speed" in table) is interpreted
    if not interpreted:
        assert "-50.0 %" in table


def test_report_leaves_only_this_runs_files(tmp_path):
    report = _load_example("pretrain_report")
    report.write_outputs(str(tmp_path),
                         [_report_run("off", [2.0, 1.0]), _report_run("on", [2.0, 1.0])],
                         "setup", "title")
    report.write_outputs(str(tmp_path), [_report_run("on", [2.0, 1.5, 1.0])], "setup", "title")
    assert sorted(p.name for p in tmp_path.glob("run_*.json")) == ["run_on.json"]
    assert json.loads((tmp_path / "run_on.json").read_text())["steps"] == 3


def test_recorded_command_runs_from_the_repository_root(monkeypatch, tmp_path):
    """Whatever the working directory: the script's path from the repository root, arguments
    quoted for a shell, and torchrun's launcher under torchrun."""
    report = _load_example("pretrain_report")
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    argv = [SCRIPT, "--out", "my runs/x", "--tp", "2"]
    assert report.command_line(argv) == "python examples/pretrain_gdn.py --out 'my runs/x' --tp 2"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert report.command_line([SCRIPT, "--tp", "8"]) == (
        "torchrun --nproc-per-node=4 --nnodes=2 examples/pretrain_gdn.py --tp 8")
    with pytest.raises(ValueError, match="argv must start with the script's path"):
        report.command_line([])
