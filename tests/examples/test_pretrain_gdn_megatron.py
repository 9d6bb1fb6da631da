"""examples/pretrain_gdn_megatron.py (megatron.training.pretrain of a GDN hybrid) through its
driver examples/run_megatron_pairs.py, on the CPU (gloo, core.testing.cpu's training-loop
shims): flag off and on at TP 1, megatron's checkpoints saved with the flag off and resumed with
it on and the reverse (four launches, two at a time; the driver's TP 2 pair, sequence parallel with
gdn_norm_out recompute, runs the same way with ``--tp-sizes 1 2`` and is left to the GPU run
to keep CI short); the indexed dataset of examples/data; the driver's comparisons."""

import concurrent.futures
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy
import pytest

from tests.gated_norm_checks import fp32_loss_tolerance

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(ROOT, "examples", "run_megatron_pairs.py")
LAUNCHER = os.path.join(ROOT, "examples", "pretrain_gdn_megatron.py")
STOCK = "--megatron-transformer-config"  # megatron's own config, as its pretrain scripts build it
STEPS, SAVE_AT = 3, 2


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_indexed_dataset_is_the_corpus_in_bytes(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    build = _module(os.path.join(ROOT, "examples", "data", "build_indexed.py"), "build_indexed")
    prefix = build.build_indexed_dataset(str(tmp_path / "corpus"))
    dataset = IndexedDataset(prefix)
    docs = build.documents()
    assert len(dataset) == len(docs) == len(dataset.document_indices) - 1 > 1000
    for i in (0, 1, len(docs) - 1):
        tokens = dataset[i]
        assert tokens.dtype == numpy.uint8 and tokens[-1] == build.EOD
        assert bytes(tokens[:-1]) == docs[i]


def test_indexed_dataset_refuses_a_corpus_with_the_eod_byte(tmp_path):
    build = _module(os.path.join(ROOT, "examples", "data", "build_indexed.py"), "build_indexed")
    corpus = tmp_path / "bad.txt"
    corpus.write_bytes(b"text\n\nmore\xff text")
    with pytest.raises(ValueError, match="byte 255 occurs in the corpus"):
        build.build_indexed_dataset(str(tmp_path / "bad"), str(corpus))


def _run(iterations, name, fused, loaded=None, layers=1, memory=None):
    rows = []
    for i, loss in iterations:
        rows.append({"iteration": i, "loss": loss, "tokens": 64,
                     "seconds_since_previous": None if i == iterations[0][0] else 0.5,
                     "forward_kept_bytes": memory})
    return {"name": name, "fused_gated_norm": fused, "iterations": rows, "gdn_layers": layers,
            "gdn_layers_fused": layers if fused else 0, "global_batch_size": 2, "seq_length": 32,
            "loaded_iteration": loaded, "max_memory_allocated": None, "device": "cpu"}


def test_driver_comparisons():
    driver = _module(DRIVER, "run_megatron_pairs")
    its = range(1, 9)
    off = _run([(i, 5.0 - 0.1 * i) for i in its], "tp1_off", False, memory=1000)
    on = _run([(i, 5.0 - 0.1 * i + (0.0 if i < 4 else 1e-6 * i)) for i in its], "tp1_on", True,
              memory=900)
    pair = driver.pair_summary(off, on)
    assert pair["losses"]["leading_bitwise_equal"] == 3
    assert pair["losses"]["max_abs_diff"] == pytest.approx(8e-6)
    assert pair["gdn_layers_fused"] == [0, 1]
    assert pair["tokens_per_second"] == [128.0, 128.0] and pair["speedup"] == 1.0
    assert pair["forward_kept_bytes"] == [1000, 900]
    assert pair["forward_kept_ratio"] == pytest.approx(0.9)
    resumed = _run([(i, 5.0 - 0.1 * i) for i in range(5, 9)], "tp1_off_resumed_on", True,
                   loaded=4)
    res = driver.resume_summary(off, resumed, on, save_at=4)
    assert res["loaded_iteration"] == 4 and res["first_iteration"] == 5
    assert res["vs_saver"]["max_abs_diff"] == 0.0
    assert res["vs_uninterrupted_on"]["max_abs_diff"] == pytest.approx(8e-6)
    text = driver.table({"device": "cpu", "steps": 8, "seed": 1, "ckpt_format": "torch",
                         "gdn_kernels": "torch", "pairs": {"tp1": pair},
                         "resumes": {"tp1_off_resumed_on": res}})
    assert "tp1" in text and "3/8" in text and "loaded iteration 4" in text


def test_gdn_kernels_choice_without_fla_backward(monkeypatch):
    driver = _module(DRIVER, "run_megatron_pairs")
    monkeypatch.setattr(driver, "HAS_CUDA", False)  # the default TP sizes need no GPUs
    monkeypatch.setattr(driver, "fla_backward_unavailable", lambda: "no GPU")
    assert driver.parse_args(["--gdn-kernels", "auto"]).gdn_kernels == "torch"
    assert driver.parse_args(["--gdn-kernels", "torch"]).gdn_kernels == "torch"
    with pytest.raises(SystemExit):
        driver.parse_args(["--gdn-kernels", "fla"])
    monkeypatch.setattr(driver, "fla_backward_unavailable", lambda: "")
    assert driver.parse_args([]).gdn_kernels == "fla"


def test_driver_arguments(monkeypatch, capsys):
    driver = _module(DRIVER, "run_megatron_pairs")
    monkeypatch.setattr(driver, "fla_backward_unavailable", lambda: "no GPU")
    monkeypatch.setattr(driver, "HAS_CUDA", False)
    args = driver.parse_args(["--steps", "1", "--no-resume"])  # no checkpoint to place
    assert args.steps == 1 and args.save_at is None
    assert driver.parse_args(["--steps", "4"]).save_at == 2
    for argv, message in (
            (["--steps", "0"], "--steps must be >= 1, got 0"),
            (["--steps", "1"], "--save-at 1 must be in [1, --steps 1) (or pass --no-resume)"),
            (["--tp-sizes", "0"], "--tp-sizes must be >= 1, got 0"),
            (["--timeout", "-1"], "--timeout must be >= 1 (seconds per launch), got -1"),
            (["--jobs", "0"], "--jobs must be >= 1, got 0")):
        with pytest.raises(SystemExit):
            driver.parse_args(argv)
        assert message in capsys.readouterr().err, argv


def test_a_launch_past_its_timeout_is_stopped_with_everything_it_started(tmp_path):
    """As torchrun's ranks: a child the launched process started dies with it."""
    driver = _module(DRIVER, "run_megatron_pairs")
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)")
    with open(tmp_path / "log", "w") as log:
        assert driver.run_or_stop([sys.executable, "-c", script], dict(os.environ), log, 3) is None
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is delivered at once; reaping by init may take a moment
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split()[2] == "Z":  # a zombie: dead, not yet reaped
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {child} still running")
    with open(tmp_path / "log", "w") as log:
        assert driver.run_or_stop([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ),
                                  log, 30) == 3


@pytest.mark.interpreter_backward
def test_pairs_through_megatrons_training_loop(tmp_path):
    out = tmp_path / "pairs"
    cmd = [sys.executable, DRIVER, "--out", str(out), "--tp-sizes", "1", "--jobs", "2",
           "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--ckpt-format", "torch_dist"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=600)  # the CPU runs, anywhere
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loaded iteration 2" in proc.stdout
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["ckpt_format"] == "torch_dist" and summary["steps"] == STEPS
    assert summary["gdn_kernels"] == "torch"  # auto without a GPU: megatron's torch chunk rule
    assert summary["env"]["megatron_core"].startswith("0.19")
    assert summary["env"]["command"].startswith("python examples/run_megatron_pairs.py --out")
    assert "--deterministic-mode" in (out / "logs" / "tp1_on.log").read_text().splitlines()[0]

    assert list(summary["pairs"]) == ["tp1"]
    for name, pair in summary["pairs"].items():
        loss = pair["losses"]
        layers = pair["gdn_layers"]
        assert layers == 1 and pair["gdn_layers_fused"] == [0, layers], name
        assert loss["iterations"] == [1, STEPS], name
        assert all(math.isfinite(x) for x in loss["mean_last_10"]), name
        assert loss["max_abs_diff"] <= fp32_loss_tolerance(loss["mean_last_10"][0]), (name, loss)

    for name, res in summary["resumes"].items():
        assert res["loaded_iteration"] == SAVE_AT and res["first_iteration"] == SAVE_AT + 1
        saver_loss, resumed_loss = res["first_loss"]
        assert abs(resumed_loss - saver_loss) <= fp32_loss_tolerance(saver_loss), (name, res)
        key = next(k for k in res if k.startswith("vs_uninterrupted"))
        assert res[key]["iterations"] == [SAVE_AT + 1, STEPS]
        assert res[key]["max_abs_diff"] <= fp32_loss_tolerance(saver_loss), (name, res)
    assert set(summary["resumes"]) == {"tp1_off_resumed_on", "tp1_on_resumed_off"}

    # megatron's own logging and checkpointing did the work
    logs = out / "logs"
    saver = (logs / "tp1_off.log").read_text()
    assert f"iteration        {STEPS}/       {STEPS}" in saver and "lm loss:" in saver
    assert f"successfully saved checkpoint from iteration       {SAVE_AT}" in saver
    resumed = (logs / "tp1_off_resumed_on.log").read_text()
    assert f"successfully loaded checkpoint from {out / 'checkpoints' / 'tp1_off'}" in resumed
    assert (out / "checkpoints" / "tp1_on" / f"iter_{SAVE_AT:07d}").is_dir()


@pytest.mark.parametrize("size", ["gpu", "cpu"])
def test_every_split_the_driver_asks_for_holds_a_sample(size):
    """megatron's sampler refuses a split with no sample (``no sample to consume: 0``): every
    split of non-zero weight must hold one sequence of the driver's length, for the GPU model
    as for the CPU one. The shipped corpus is split by documents, in megatron's proportions."""
    driver = _module(DRIVER, "run_megatron_pairs")
    build = _module(os.path.join(ROOT, "examples", "data", "build_indexed.py"), "build_indexed")
    args = driver.MODEL[size] + driver.COMMON
    seq = int(args[args.index("--seq-length") + 1])
    weights = [float(w) for w in args[args.index("--split") + 1].split(",")]
    tokens = sum(len(doc) + 1 for doc in build.documents())  # + the end-of-document token
    for weight in weights:
        if weight:
            assert tokens * weight / sum(weights) > 2 * (seq + 1), (size, weights, seq)


def _launcher_args(metrics_path, *extra, drop=(), iterations=1, warmup=0, model=None) -> list:
    """The launcher's command line with the driver's tiny model (or ``model``, its arguments) on
    the CPU, ``drop`` flags (with their value, if any) left out."""
    driver = _module(DRIVER, "run_megatron_pairs")
    args = [*(model or driver.MODEL["cpu"]), *driver.COMMON, *driver.CPU_ONLY, "--mock-data",
            "--deterministic-mode", "--train-iters", str(iterations), "--lr-warmup-iters",
            str(warmup), "--gdn-metrics-out", str(metrics_path), *extra]
    for flag in drop:
        i = args.index(flag)
        del args[i:i + (2 if i + 1 < len(args) and not args[i + 1].startswith("--") else 1)]
    return args


def _launch(out_dir, *extra, **options):
    """The launcher on the CPU through torchrun with _launcher_args (``options``: those of
    :func:`_launch_together`); returns the process and the path of its --gdn-metrics-out
    file."""
    return _launch_together(out_dir, [(extra, options)])[0]


def _launch_together(out_dir, runs) -> list:
    """Start every run of ``runs`` ((extra flags, options) pairs; options: ``drop``,
    ``iterations``, ``warmup``, ``nproc`` (torchrun's processes), ``model``, ``metrics`` (the
    file's name)) at once, each through the driver's run_or_stop (a new process group, stopped
    whole past 600 s), then wait for all: a launch spends most of its time importing, in one
    process per rank, so two of them share the CPU's cores. Returns, in order, each run's
    completed process (stdout: its log, stderr included; returncode -SIGKILL when stopped) and
    the path of its --gdn-metrics-out file."""
    driver = _module(DRIVER, "run_megatron_pairs")
    commands = []
    for i, (extra, options) in enumerate(runs):
        options = {"metrics": "metrics.json", "nproc": 1, **options}
        metrics_path = out_dir / options.pop("metrics")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(options.pop("nproc")), LAUNCHER, *_launcher_args(metrics_path, *extra,
                                                                    **options)]
        commands.append((cmd, out_dir / f"launch{i}.log", metrics_path))

    def run(command):
        cmd, log_path, metrics_path = command
        with open(log_path, "w") as log:
            code = driver.run_or_stop(cmd, _cpu_env(), log, 600)
        return (subprocess.CompletedProcess(cmd, -signal.SIGKILL if code is None else code,
                                            log_path.read_text(), ""), metrics_path)

    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(run, commands))


def _cpu_env() -> dict:
    """The environment of a launcher process on the CPU: no GPU visible, the repository first
    on PYTHONPATH, then whatever the caller's holds (a megatron checkout)."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}


@pytest.mark.interpreter_backward
def test_metrics_hold_the_whole_batch_at_data_parallel_2(tmp_path):
    """At DP 2 each rank computes the loss of its half of the batch; the launcher's metrics sum
    both halves: the same losses and token counts as one process with the whole batch."""
    driver = _module(DRIVER, "run_megatron_pairs")
    args = list(driver.MODEL["cpu"])
    args[args.index("--global-batch-size") + 1] = "4"  # micro-batch 2 x 2 micro-batches or ranks
    seq = int(args[args.index("--seq-length") + 1])
    runs = {}
    launches = _launch_together(tmp_path, [
        (("--fused-gated-norm",), dict(iterations=2, warmup=1, nproc=dp, model=args,
                                       metrics=f"dp{dp}.json")) for dp in (1, 2)])
    for dp, (proc, metrics) in zip((1, 2), launches):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[dp] = json.loads(metrics.read_text())["iterations"]
    assert len(runs[1]) == len(runs[2]) == 2
    for one, two in zip(runs[1], runs[2]):
        assert one["tokens"] == two["tokens"] == 4 * seq
        # the same batch: equal up to the fp32 order of the gradient's sum over the ranks
        assert abs(one["loss"] - two["loss"]) <= 1e-5 * abs(one["loss"]), (runs[1], runs[2])


# The launcher's refusals: (id, extra flags, flags dropped, what the message says).
REFUSALS = [
    ("transformer_engine_without_te", (), ("--transformer-impl",),
     "--transformer-impl transformer_engine (megatron's default) needs Transformer Engine, which "
     "is not installed"),
    ("spec_that_does_not_import", ("--spec", "no.such.module", "nothing"), (),
     "--spec no.such.module nothing: megatron could not import it"),
    ("spec_name_mistyped", ("--spec", "core.models.fused_gdn_specs", "gpt_block_specc"), (),
     "--spec core.models.fused_gdn_specs gpt_block_specc: module 'core.models.fused_gdn_specs' "
     "has no spec 'gpt_block_specc'; its specs are: gpt_block_spec, hybrid_stack_spec, "
     "gpt_block_spec_both_fusions, hybrid_stack_spec_both_fusions"),
    ("spec_name_not_in_the_module",
     ("--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_specc"), (),
     "--spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_specc: "
     "megatron.core.models.hybrid.hybrid_layer_specs has no attribute 'hybrid_stack_specc'; its "
     "specs and functions are: hybrid_inference_stack_spec, hybrid_stack_spec, "),
    ("spec_without_a_name", ("--spec", "core.models.fused_gdn_specs"), (),
     "--spec takes MODULE NAME, got 1 value(s): core.models.fused_gdn_specs"),
    ("mtp", ("--mtp-num-layers", "1"), (),
     "--mtp-num-layers: megatron.training 0.19's GPTModelConfig builds the MTP block from "
     "get_gpt_decoder_layer_specs"),
    ("cpu_flags", (), ("--deterministic-mode", "--distributed-backend"),
     "without a GPU the launcher runs on the CPU, which needs --deterministic-mode (megatron's "
     "torch chunk rule"),
    ("hybrid_and_gpt_variant", ("--hybrid-layer-pattern", "G*G-"), ("--num-layers",),
     "--hybrid-layer-pattern builds megatron's HybridModel, whose 'G' layers are the GDN: leave "
     "out --experimental-attention-variant"),
    ("hybrid_without_gdn", ("--hybrid-layer-pattern", "*-*-"),
     ("--num-layers", "--experimental-attention-variant"),
     "--hybrid-layer-pattern '*-*-' has no GDN layer ('G')"),
    ("megatron_config_without_spec", (STOCK,), (),
     "--megatron-transformer-config: megatron's TransformerConfig has no fusion field, so the "
     "spec switches the fusion: pass --spec"),
    ("megatron_config_with_the_flag",
     (STOCK, "--fused-gated-norm", "--spec", "core.models.fused_gdn_specs", "gpt_block_spec"), (),
     "--megatron-transformer-config: megatron's TransformerConfig has no field for "
     "--fused-gated-norm"),
    ("megatron_config_with_the_pre_gated_delta_rule_flag",
     (STOCK, "--gdn-pre-gated-delta-rule-fusion", "--spec", "core.models.fused_gdn_specs",
      "gpt_block_spec_both_fusions"), (),
     "--megatron-transformer-config: megatron's TransformerConfig has no field for "
     "--gdn-pre-gated-delta-rule-fusion"),
]
# Started as a user starts the launcher: one refusal of its scope rules and the one that comes
# from building the model. The others run through the same parser and rules in one process.
LAUNCHED_REFUSALS = ("transformer_engine_without_te", "spec_that_does_not_import")


def _te_default_runs(drop) -> bool:
    from core.models.gdn_specs import HAVE_TE

    return HAVE_TE and "--transformer-impl" in drop


@pytest.mark.parametrize("name, extra, drop, message",
                         [r for r in REFUSALS if r[0] in LAUNCHED_REFUSALS],
                         ids=list(LAUNCHED_REFUSALS))
def test_launcher_refuses_before_training(tmp_path, name, extra, drop, message):
    if _te_default_runs(drop):
        pytest.skip("Transformer Engine is installed: megatron's default implementation runs")
    proc, metrics = _launch(tmp_path, *extra, drop=drop)
    assert proc.returncode != 0 and not metrics.exists()
    assert message in proc.stdout + proc.stderr


# In a launcher process (the launcher module imported, its CPU shims installed): each command
# line through megatron's parse_args and validate_args, as parse_and_validate_args runs them
# (less its global state, set once per process), then the launcher's scope rules.
CHECK_SCOPE = r"""
import importlib.util, json, sys
launcher_path, cases = sys.argv[1], json.loads(sys.argv[2])
spec = importlib.util.spec_from_file_location("launcher", launcher_path)
launcher = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launcher)
from megatron.training.arguments import parse_args, validate_args
for name, argv, told in cases:
    sys.argv = [launcher_path, *argv]
    args = parse_args(extra_args_provider=launcher.add_launcher_args)
    validate_args(args, {"tokenizer_type": "NullTokenizer"})
    kept = {key: getattr(launcher, key) for key in told}
    vars(launcher).update(told)  # what the launcher is told about the machine (HAS_CUDA, HAVE_TE)
    try:
        launcher.check_launcher_scope(args)
    except ValueError as error:
        print("RESULT", json.dumps([name, str(error)]))
    else:
        print("RESULT", json.dumps([name, None]))
    finally:
        vars(launcher).update(kept)
"""


@pytest.fixture(scope="module")
def scope_refusals(tmp_path_factory) -> dict:
    """Case id -> the launcher's message (None: accepted), from one launcher process: every
    refusal of the scope rules, the plain command line ("accepted"), and a hybrid model on a
    machine the launcher is told has a GPU, without and with Transformer Engine."""
    metrics = tmp_path_factory.mktemp("scope") / "metrics.json"
    cases = [["accepted", _launcher_args(metrics), {}]]
    cases += [[name, _launcher_args(metrics, *extra, drop=drop), {}]
              for name, extra, drop, _ in REFUSALS if name != "spec_that_does_not_import"]
    hybrid = _launcher_args(metrics, "--fused-gated-norm", "--hybrid-layer-pattern", "G*G-",
                            drop=HYBRID_DROP)
    cases += [["hybrid_on_a_gpu_without_te", hybrid, {"HAS_CUDA": True, "HAVE_TE": False}],
              ["hybrid_on_a_gpu_with_te", hybrid, {"HAS_CUDA": True, "HAVE_TE": True}],
              ["hybrid_on_the_cpu", hybrid, {}]]
    proc = subprocess.run([sys.executable, "-c", CHECK_SCOPE, LAUNCHER, json.dumps(cases)],
                          cwd=ROOT, env=_cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not metrics.exists()
    return dict(json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
                if line.startswith("RESULT "))


@pytest.mark.parametrize("name, extra, drop, message",
                         [r for r in REFUSALS if r[0] != "spec_that_does_not_import"],
                         ids=[r[0] for r in REFUSALS if r[0] != "spec_that_does_not_import"])
def test_launcher_scope_refuses_on_megatrons_parsed_arguments(scope_refusals, name, extra, drop,
                                                             message):
    assert scope_refusals["accepted"] is None  # the same command line without the change passes
    if _te_default_runs(drop):
        assert scope_refusals[name] is None
    else:
        assert message in scope_refusals[name]


def test_launcher_refuses_the_hybrid_model_on_a_gpu_without_te(scope_refusals):
    """megatron's hybrid stack is made of Transformer Engine modules: on a GPU without TE the
    launcher refuses the pattern before building (its CPU run swaps in megatron-core's modules
    instead). The launcher's checks run in a CPU process told that it has a GPU, then TE."""
    assert scope_refusals["hybrid_on_a_gpu_without_te"].startswith(
        "--hybrid-layer-pattern: megatron's HybridModel needs Transformer Engine (its hybrid "
        "stack spec and its final norm are TE modules), which is not installed")
    assert scope_refusals["hybrid_on_a_gpu_with_te"] is None
    assert scope_refusals["hybrid_on_the_cpu"] is None


# megatron's HybridModel: the layers come from the pattern, the GDN ones are its 'G' layers
HYBRID_DROP = ("--experimental-attention-variant", "--linear-attention-freq", "--num-layers")


def _logged_mtp_losses(stdout: str) -> list:
    """The "mtp_1 loss" of each iteration in megatron's log lines (7 significant digits)."""
    return [float(v) for v in re.findall(r"mtp_1 loss: ([0-9.E+-]+)", stdout)]


@pytest.mark.interpreter_backward
@pytest.mark.parametrize("pattern, layout", [
    ("G*G-/G-", ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
    ("G*|G-/G-", ("--pipeline-model-parallel-size", "2")),  # the stages at '|'
], ids=["tp2-sp", "pp2"])
def test_launcher_trains_a_hybrid_model_with_gdn_in_its_mtp_depth(tmp_path, pattern, layout):
    """--hybrid-layer-pattern: megatron's HybridModel (HybridModelConfig, hybrid stack spec
    through use_fused_gdn) with a multi-token prediction depth holding a GDN layer, at TP 2 with
    sequence parallelism, and over two pipeline stages (the last holds the MTP depth, to which
    the launcher's batch gives the tokens too). With the flag every GDN layer (the MTP one
    included) is fused, and the first iteration's main and MTP losses equal the flag-off run's
    within fp32 rounding (and megatron's 7-digit log of the MTP loss)."""
    runs = {}
    launches = _launch_together(tmp_path, [
        ((*(("--fused-gated-norm",) if fused else ()), "--hybrid-layer-pattern", pattern,
          *layout), dict(drop=HYBRID_DROP, iterations=2, warmup=1, nproc=2,
                         metrics=f"fused{fused}.json")) for fused in (True, False)])
    for fused, (proc, metrics) in zip((True, False), launches):
        runs[fused] = _losses(proc, metrics), _logged_mtp_losses(proc.stdout)
        summary = json.loads(metrics.read_text())
        assert (summary["hybrid_layer_pattern"], summary["mtp_num_layers"]) == (pattern, 1)
        assert (summary["gdn_layers"], summary["gdn_layers_fused"]) == (3, 3 if fused else 0)
    (main_on, mtp_on), (main_off, mtp_off) = runs[True], runs[False]
    assert len(mtp_on) == len(mtp_off) == 2, runs
    assert abs(main_on[0] - main_off[0]) <= fp32_loss_tolerance(main_off[0]), runs
    assert abs(mtp_on[0] - mtp_off[0]) <= fp32_loss_tolerance(mtp_off[0]) + 1e-6 * mtp_off[0], runs


@pytest.mark.interpreter_backward
def test_launcher_trains_moe_mlps_over_expert_parallel_ranks(tmp_path):
    """megatron's MoE flags on the launcher's command line: TP 2 with SP, the MLPs' 4 experts
    over EP 2 and not split over TP, tokens sent by megatron's all-to-all dispatcher (as
    Qwen3-Next trains), every GDN layer fused."""
    proc, metrics = _launch(tmp_path, "--fused-gated-norm", "--tensor-model-parallel-size", "2",
                            "--sequence-parallel", "--num-experts", "4",
                            "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
                            "1", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
                            "--moe-router-load-balancing-type", "none",
                            "--moe-token-dispatcher-type", "alltoall", iterations=2, warmup=1,
                            nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(metrics.read_text())
    assert (summary["tensor_model_parallel_size"], summary["expert_model_parallel_size"],
            summary["num_experts"]) == (2, 2, 4)
    assert summary["gdn_layers"] == summary["gdn_layers_fused"] == 1
    assert re.search(r"moe_token_dispatcher_type \.+ alltoall", proc.stdout)  # megatron's args
    losses = [it["loss"] for it in summary["iterations"]]
    assert len(losses) == 2 and all(math.isfinite(loss) and loss > 0 for loss in losses)


def _model_args(**changes):
    """The driver's tiny CPU model with ``changes`` (``--flag``: value) applied."""
    driver = _module(DRIVER, "run_megatron_pairs")
    args = list(driver.MODEL["cpu"])
    for flag, value in changes.items():
        args[args.index(flag) + 1] = str(value)
    return args


def _losses(proc, metrics) -> list:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [it["loss"] for it in json.loads(metrics.read_text())["iterations"]]


@pytest.mark.interpreter_backward
def test_launcher_trains_across_virtual_pipeline_stages(tmp_path):
    """PP 2 with two virtual stages of one layer each (megatron's interleaved schedule; layers
    GDN, attention, GDN, attention): the GDN layers of both pipeline ranks are fused, and the
    first iteration's loss, from the same initial weights, equals the flag-off run's within
    fp32 rounding."""
    model = _model_args(**{"--num-layers": 4, "--micro-batch-size": 1})
    pipeline = ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                "1")
    runs = {}
    launches = _launch_together(tmp_path, [
        ((*(("--fused-gated-norm",) if fused else ()), *pipeline),
         dict(iterations=2, warmup=1, nproc=2, model=model, metrics=f"fused{fused}.json"))
        for fused in (True, False)])
    for fused, (proc, metrics) in zip((True, False), launches):
        runs[fused] = _losses(proc, metrics)
        summary = json.loads(metrics.read_text())
        assert (summary["gdn_layers"], summary["gdn_layers_fused"]) == (2, 2 if fused else 0)
    assert abs(runs[True][0] - runs[False][0]) <= fp32_loss_tolerance(runs[False][0]), runs


@pytest.mark.interpreter_backward
def test_launcher_splits_sequences_over_context_parallel_ranks(tmp_path):
    """CP 2 (megatron's load-balanced split of each sequence, GDN's all-to-all) trains the same
    iterations as one rank with the whole sequence. All layers are GDN: megatron's local
    attention has no context parallelism (TE's has), and rope's CP split needs CUDA, so
    positions are learned."""
    model = _model_args(**{"--linear-attention-freq": 3})  # 2 layers: no attention layer
    runs = {}
    launches = _launch_together(tmp_path, [
        (("--fused-gated-norm", "--context-parallel-size", str(cp), "--position-embedding-type",
          "learned_absolute"), dict(iterations=2, warmup=1, nproc=cp, model=model,
                                    metrics=f"cp{cp}.json")) for cp in (1, 2)])
    for cp, (proc, metrics) in zip((1, 2), launches):
        runs[cp] = _losses(proc, metrics)
        assert json.loads(metrics.read_text())["gdn_layers_fused"] == 2
    for one, two in zip(runs[1], runs[2]):
        assert abs(one - two) <= fp32_loss_tolerance(one), runs


@pytest.mark.interpreter_backward
@pytest.mark.parametrize("spec_name, model, drop, layers", [
    ("gpt_block_spec", (), (), 1),
    ("hybrid_stack_spec", ("--hybrid-layer-pattern", "G*G-/G-"), HYBRID_DROP, 3),
], ids=["gpt", "hybrid-mtp"])
def test_megatrons_own_config_with_a_fused_spec_trains_as_the_flag(tmp_path, spec_name, model,
                                                                   drop, layers):
    """As megatron's own pretrain_gpt.py / pretrain_hybrid.py build the model (megatron's
    TransformerConfig, without a fusion field, and the --spec as given), a spec of
    core.models.fused_gdn_specs fuses every GDN layer, the hybrid model's MTP depth included,
    and trains the same iterations, bit for bit, as this package's config with
    --fused-gated-norm."""
    runs = {}
    flags = {"spec": (STOCK, "--spec", "core.models.fused_gdn_specs", spec_name),
             "flag": ("--fused-gated-norm",)}
    launches = _launch_together(tmp_path, [
        ((*extra, *model), dict(drop=drop, iterations=2, warmup=1, metrics=f"{name}.json"))
        for name, extra in flags.items()])
    for name, (proc, metrics) in zip(flags, launches):
        runs[name] = _losses(proc, metrics)
        summary = json.loads(metrics.read_text())
        assert summary["megatron_transformer_config"] is (name == "spec")
        assert summary["transformer_config_class"] == (
            "megatron.core.transformer.transformer_config.TransformerConfig" if name == "spec"
            else "core.transformer.transformer_config.TransformerConfig"), name
        assert summary["gdn_layers"] == summary["gdn_layers_fused"] == layers, name
    assert len(runs["spec"]) == 2 and runs["spec"] == runs["flag"], runs


@pytest.mark.interpreter_backward
def test_every_route_turns_the_pre_gated_delta_rule_fusion_on(tmp_path):
    """--gdn-pre-gated-delta-rule-fusion (with the fused output norm's flag: they compose) on our
    config, megatron's --spec through use_fused_gdn with the flags, and megatron's own config
    with a ``*_both_fusions`` spec: every GDN layer runs both fusions, the post-wrap check
    passes, and the metrics say so; without the flag no layer runs it."""
    routes = {
        "flags": ("--fused-gated-norm", "--gdn-pre-gated-delta-rule-fusion"),
        "spec_option": ("--fused-gated-norm", "--gdn-pre-gated-delta-rule-fusion", "--spec",
                        "core.models.gdn_specs", "get_gdn_hybrid_block_spec"),
        "stock_spec": (STOCK, "--spec", "core.models.fused_gdn_specs",
                       "gpt_block_spec_both_fusions"),
        "norm_only": ("--fused-gated-norm",),
    }
    launches = _launch_together(tmp_path, [(extra, dict(metrics=f"{name}.json"))
                                           for name, extra in routes.items()])
    for name, (proc, metrics) in zip(routes, launches):
        assert proc.returncode == 0, (name, proc.stdout[-3000:] + proc.stderr[-3000:])
        summary = json.loads(metrics.read_text())
        pre_fused = 0 if name == "norm_only" else 1  # layer 1 of 2 is attention
        assert summary["gdn_layers"] == summary["gdn_layers_fused"] == 1, name
        assert summary["gdn_layers_pre_fused"] == pre_fused, name
        asked = None if name == "stock_spec" else bool(pre_fused)  # stock: the spec decides
        assert summary["gdn_pre_gated_delta_rule_fusion"] is asked, name


@pytest.mark.interpreter_backward
def test_launcher_builds_the_model_from_megatrons_spec_option(tmp_path):
    """megatron's --spec (module, name) builds the model, through use_fused_gdn: our block spec
    function given by name and called as megatron's GPTModelConfig calls it (with the model
    config) fuses every GDN layer."""
    proc, metrics = _launch(tmp_path, "--fused-gated-norm", "--spec", "core.models.gdn_specs",
                            "get_gdn_hybrid_block_spec")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(metrics.read_text())
    assert summary["gdn_layers"] == summary["gdn_layers_fused"] == 1  # layer 1 of 2 is attention
