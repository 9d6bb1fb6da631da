#!/usr/bin/env python
"""The fused GDN output norm through megatron's training loop: flag off vs on, and checkpoints
that switch it, with examples/pretrain_gdn_megatron.py.

    python examples/run_megatron_pairs.py                  # 2 GPUs; without a GPU: tiny, gloo

Launches (each a fresh ``torchrun --standalone``, same seed, bf16 on a GPU, the indexed dataset
of examples/data written first; the GDN core runs FLA's kernels or, with
``--deterministic-mode``, megatron's torch chunk rule: ``--gdn-kernels``):

  * TP 1: flag off, flag on (``--steps`` iterations each, a checkpoint at ``--save-at``);
  * TP 2 with ``--sequence-parallel`` and selective recompute of ``gdn_norm_out``: off, on;
  * resume: the TP 1 flag-off checkpoint with the flag on, the flag-on checkpoint with it off
    (``--load ... --ckpt-step``), up to the same last iteration.

Then it compares the exact per-iteration losses (the launcher's ``--gdn-metrics-out``):
leading iterations with bit-identical losses, the largest difference over the first 10 and over
all iterations; tokens/s (median over iterations after the first 5: global batch x sequence
length / wall time between iteration starts) and the memory a micro-batch's forward keeps for
backward (``torch.cuda.memory_allocated`` after minus before the forward: saved activations
plus the output), flag on vs off; for each resume, the loaded iteration, the first loss after
it against the same iteration of the run that saved it, and the largest difference over the
resumed iterations. Writes ``<out>/summary.json`` and prints a table.

Checkpoints: ``--ckpt-format auto`` (default) takes megatron's default ``torch_dist`` when
``psutil`` is importable (its writer needs it; megatron-core does not declare it), else
megatron's per-rank ``torch`` format; the choice is printed and recorded.
"""

import argparse
import concurrent.futures
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAUNCHER = os.path.join(HERE, "pretrain_gdn_megatron.py")
HAS_CUDA = torch.cuda.is_available()

# A small Qwen3-Next-style hybrid (GDN layers, an attention layer every 4th), as megatron flags.
MODEL = {
    "gpu": ["--num-layers", "4", "--hidden-size", "512", "--ffn-hidden-size", "1408",
            "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
            "--kv-channels", "64", "--linear-attention-freq", "4",
            "--linear-key-head-dim", "64", "--linear-value-head-dim", "64",
            "--linear-num-key-heads", "4", "--linear-num-value-heads", "8",
            "--seq-length", "1024", "--max-position-embeddings", "1024",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--bf16"],
    "cpu": ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64",
            "--num-attention-heads", "2", "--group-query-attention", "--num-query-groups", "2",
            "--kv-channels", "16", "--linear-attention-freq", "2",
            "--linear-key-head-dim", "16", "--linear-value-head-dim", "16",
            "--linear-num-key-heads", "2", "--linear-num-value-heads", "2",
            "--seq-length", "32", "--max-position-embeddings", "32",
            "--micro-batch-size", "2", "--global-batch-size", "2"],
}
COMMON = [
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear",
    "--qk-layernorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--experimental-attention-variant", "gated_delta_net", "--linear-conv-kernel-dim", "4",
    "--transformer-impl", "local",
    # torch paths: no Transformer Engine, apex or megatron's CUDA extensions
    "--no-rope-fusion", "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
    "--clip-grad", "1.0", "--adam-beta2", "0.95", "--init-method-std", "0.02",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--split", "98,2,0",
]
CPU_ONLY = ["--use-cpu-initialization", "--distributed-backend", "gloo"]
RECOMPUTE = ["--recompute-granularity", "selective", "--recompute-modules", "gdn_norm_out"]
WARMUP_ITERATIONS = 5  # left out of tokens/s


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=os.path.join("runs", "megatron_pairs"),
                   help="output folder (data, checkpoints, logs, summary.json)")
    p.add_argument("--steps", type=int, default=None,
                   help="training iterations per run (default: GPU 60, CPU 4)")
    p.add_argument("--save-at", type=int, default=None,
                   help="iteration of the checkpoint the resume runs load (default: steps / 2)")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2],
                   help="tensor-parallel sizes of the off/on pairs (TP > 1: sequence parallel "
                        "and gdn_norm_out recompute)")
    p.add_argument("--no-resume", action="store_true", help="skip the two resume runs")
    p.add_argument("--ckpt-format", choices=["auto", "torch_dist", "torch"], default="auto")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=int, default=420, help="seconds per launch")
    p.add_argument("--jobs", type=int, default=1,
                   help="launches run at once: the pairs, then the resumes (more than 1 shares "
                        "the machine between launches: leave 1 where tokens/s matters)")
    p.add_argument("--gdn-kernels", choices=["auto", "fla", "torch"], default="auto",
                   help="the GDN core: FLA's Triton kernels (the speed a user gets), or megatron's "
                        "torch chunk rule under --deterministic-mode (host-bound: tokens/s then "
                        "says nothing about the norm); auto: FLA where its backward runs on this "
                        "machine (a GPU; triton >= 3.7.1 on Hopper), else torch")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 60 if HAS_CUDA else 4
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.timeout < 1:
        p.error(f"--timeout must be >= 1 (seconds per launch), got {args.timeout}")
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.no_resume:
        args.save_at = None  # nothing to resume: no checkpoints
    else:
        if args.save_at is None:
            args.save_at = max(1, args.steps // 2)
        if not 1 <= args.save_at < args.steps:
            p.error(f"--save-at {args.save_at} must be in [1, --steps {args.steps}) "
                    "(or pass --no-resume)")
    if args.ckpt_format == "auto":
        args.ckpt_format = "torch_dist" if importlib.util.find_spec("psutil") else "torch"
    elif args.ckpt_format == "torch_dist" and not importlib.util.find_spec("psutil"):
        p.error("--ckpt-format torch_dist: megatron's checkpoint writer needs psutil "
                "(pip install psutil), or use --ckpt-format torch")
    fla_unavailable = fla_backward_unavailable()
    if args.gdn_kernels == "auto":
        args.gdn_kernels = "torch" if fla_unavailable else "fla"
    elif args.gdn_kernels == "fla" and fla_unavailable:
        p.error(f"--gdn-kernels fla: {fla_unavailable}")
    for tp in args.tp_sizes:
        if tp < 1:
            p.error(f"--tp-sizes must be >= 1, got {tp}")
        if HAS_CUDA and tp > torch.cuda.device_count():
            p.error(f"--tp-sizes {tp}: needs {tp} GPUs, {torch.cuda.device_count()} visible")
    return args


def fla_backward_unavailable() -> str:
    """Why FLA's GDN kernels cannot train here ('' when they can): no GPU (FLA's chunk kernel
    does not run in the Triton interpreter), no fla-core, or triton < 3.7.1 on Hopper."""
    if not HAS_CUDA:
        return "no GPU (FLA's chunk kernel does not run in the Triton interpreter)"
    sys.path.insert(0, ROOT)
    from core.testing.gdn import fla_gdn_backward_unavailable

    return fla_gdn_backward_unavailable()


# ----------------------------------------------------------------------------------------------
# Launches
# ----------------------------------------------------------------------------------------------


def launch(args, name: str, tp: int, fused: bool, extra: list[str]) -> dict:
    """One torchrun of the launcher; returns its --gdn-metrics-out summary (+ wall time, log)."""
    metrics = os.path.join(args.out, "metrics", f"{name}.json")
    log = os.path.join(args.out, "logs", f"{name}.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(tp), LAUNCHER,
           *MODEL["gpu" if HAS_CUDA else "cpu"], *COMMON, *([] if HAS_CUDA else CPU_ONLY),
           "--tensor-model-parallel-size", str(tp), "--seed", str(args.seed),
           "--data-path", args.data_prefix, "--data-cache-path", os.path.join(args.out, "cache"),
           "--ckpt-format", args.ckpt_format, "--gdn-metrics-out", metrics,
           *(["--deterministic-mode"] if args.gdn_kernels == "torch" else []),
           *(["--sequence-parallel", *RECOMPUTE] if tp > 1 else []),
           *(["--fused-gated-norm"] if fused else []), *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # FLA's autotuning: once for all launches
    start = time.time()
    print(f"[{time.strftime('%H:%M:%S')}] {name}: TP {tp}, fused_gated_norm "
          f"{'on' if fused else 'off'} {' '.join(extra)}", flush=True)
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        returncode = run_or_stop(cmd, env, f, args.timeout)
    seconds = time.time() - start
    if returncode is None:
        raise SystemExit(f"{name} ran past --timeout {args.timeout} s and was stopped with its "
                         f"ranks; raise --timeout or see {log}")
    if returncode != 0:
        with open(log) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"{name} failed (exit {returncode}, {seconds:.0f} s); {log}:\n{tail}")
    with open(metrics) as f:
        result = json.load(f)
    result.update(name=name, wall_seconds=seconds, log=log)
    print(f"    {seconds:.0f} s, {len(result['iterations'])} iterations", flush=True)
    return result


def launch_all(args, launches: dict) -> dict:
    """name -> (tp, fused, extra flags): :func:`launch` each, ``--jobs`` at a time; name ->
    its summary, in the order given."""
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {name: pool.submit(launch, args, name, *launch_args)
                   for name, launch_args in launches.items()}
        return {name: future.result() for name, future in futures.items()}


def run_or_stop(cmd: list, env: dict, log, timeout: float):
    """Run ``cmd`` as the leader of a new process group, output to ``log``; its exit code, or
    None when it ran past ``timeout`` seconds: then the whole process group is killed (torchrun
    and the ranks it started, which would otherwise live on)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


# ----------------------------------------------------------------------------------------------
# Comparisons
# ----------------------------------------------------------------------------------------------


def losses(run: dict) -> dict[int, float]:
    return {row["iteration"]: row["loss"] for row in run["iterations"]}


def loss_agreement(reference: dict, other: dict) -> dict:
    """Per-iteration loss differences over the iterations both runs have."""
    ref, oth = losses(reference), losses(other)
    common = sorted(set(ref) & set(oth))
    if not common:
        raise ValueError(f"{reference['name']} and {other['name']} share no iteration")
    diffs = [oth[i] - ref[i] for i in common]
    leading_equal = next((n for n, d in enumerate(diffs) if d != 0.0), len(diffs))
    return {
        "iterations": [common[0], common[-1]],
        "leading_bitwise_equal": leading_equal,
        "max_abs_diff_first_10": max(abs(d) for d in diffs[:10]),
        "max_abs_diff": max(abs(d) for d in diffs),
        "mean_last_10": [statistics.fmean(ref[i] for i in common[-10:]),
                         statistics.fmean(oth[i] for i in common[-10:])],
    }


def tokens_per_second(run: dict) -> float | None:
    tokens = run["global_batch_size"] * run["seq_length"]
    times = [row["seconds_since_previous"] for row in run["iterations"]
             if row["seconds_since_previous"] and row["iteration"] > WARMUP_ITERATIONS]
    return tokens / statistics.median(times) if times else None


def forward_kept_bytes(run: dict) -> int | None:
    values = [row["forward_kept_bytes"] for row in run["iterations"]
              if row["forward_kept_bytes"] is not None]
    return int(statistics.median(values)) if values else None


def pair_summary(off: dict, on: dict) -> dict:
    speed_off, speed_on = tokens_per_second(off), tokens_per_second(on)
    mem_off, mem_on = forward_kept_bytes(off), forward_kept_bytes(on)
    return {
        "runs": [off["name"], on["name"]],
        "gdn_layers_fused": [off["gdn_layers_fused"], on["gdn_layers_fused"]],
        "gdn_layers": on["gdn_layers"],
        "losses": loss_agreement(off, on),
        "tokens_per_second": [speed_off, speed_on],
        "speedup": speed_on / speed_off if speed_off and speed_on else None,
        "forward_kept_bytes": [mem_off, mem_on],
        "forward_kept_ratio": mem_on / mem_off if mem_off and mem_on else None,
        "max_memory_allocated": [off["max_memory_allocated"], on["max_memory_allocated"]],
    }


def resume_summary(saver: dict, resumed: dict, uninterrupted_same_flag: dict,
                   save_at: int) -> dict:
    """resumed: ``saver``'s checkpoint at ``save_at`` trained on with the other flag setting;
    compared with the saver (same weights at save_at, other flag) and with the uninterrupted run
    of the resumed run's own flag setting."""
    first = save_at + 1
    return {
        "runs": [saver["name"], resumed["name"]],
        "loaded_iteration": resumed["loaded_iteration"],
        "first_iteration": min(losses(resumed)),
        "first_loss": [losses(saver)[first], losses(resumed)[first]],
        "vs_saver": loss_agreement(saver, resumed),
        "vs_uninterrupted_" + ("on" if resumed["fused_gated_norm"] else "off"):
            loss_agreement(uninterrupted_same_flag, resumed),
    }


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, spec)


def table(summary: dict) -> str:
    lines = [f"{summary['device']}; {summary['steps']} iterations, seed {summary['seed']}, "
             f"checkpoints {summary['ckpt_format']}, "
             f"GDN kernels {summary.get('gdn_kernels', 'n/a')}"]
    head = (f"{'pair':<22}{'GDN fused':>10}{'bitwise':>9}{'max|dL| 1-10':>14}{'max|dL|':>10}"
            f"{'last-10 mean off/on':>22}{'tok/s off/on':>20}{'fwd kept MiB off/on':>22}")
    lines += [head, "-" * len(head)]
    for name, pair in summary["pairs"].items():
        loss = pair["losses"]
        speeds = pair["tokens_per_second"]
        mem = [None if b is None else b / 2**20 for b in pair["forward_kept_bytes"]]
        lines.append(
            f"{name:<22}{'%s/%s' % tuple(pair['gdn_layers_fused']):>10}"
            f"{'%d/%d' % (loss['leading_bitwise_equal'], loss['iterations'][1]):>9}"
            f"{_fmt(loss['max_abs_diff_first_10'], '.2e'):>14}"
            f"{_fmt(loss['max_abs_diff'], '.2e'):>10}"
            f"{'%.5f/%.5f' % tuple(loss['mean_last_10']):>22}"
            f"{_fmt(speeds[0], '.0f') + '/' + _fmt(speeds[1], '.0f'):>20}"
            f"{_fmt(mem[0], '.1f') + '/' + _fmt(mem[1], '.1f'):>22}")
    for name, res in summary["resumes"].items():
        key = next(k for k in res if k.startswith("vs_uninterrupted"))
        lines.append(
            f"{name}: loaded iteration {res['loaded_iteration']}, loss at {res['first_iteration']}"
            f" {res['first_loss'][1]:.7f} (saver {res['first_loss'][0]:.7f}); max|dL| vs saver "
            f"{res['vs_saver']['max_abs_diff']:.2e}, vs uninterrupted "
            f"{key[len('vs_uninterrupted_'):]} {res[key]['max_abs_diff']:.2e} "
            f"({res[key]['leading_bitwise_equal']} leading bitwise equal)")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.time()
    if os.path.exists(args.out):
        for sub in ("checkpoints", "metrics", "logs"):
            shutil.rmtree(os.path.join(args.out, sub), ignore_errors=True)
    sys.path.insert(0, os.path.join(HERE, "data"))
    from build_indexed import build_indexed_dataset

    args.data_prefix = build_indexed_dataset(os.path.join(args.out, "data", "stdlib_docstrings"))
    ckpt = os.path.join(args.out, "checkpoints")
    sys.path.insert(0, HERE)
    from pretrain_report import default_warmup_steps, run_environment

    train = ["--train-iters", str(args.steps), "--lr-warmup-iters",
             str(default_warmup_steps(args.steps))]
    pairs = {}
    for tp in args.tp_sizes:
        for fused in (False, True):
            name = f"tp{tp}_{'on' if fused else 'off'}"
            save = [] if args.no_resume else ["--save-interval", str(args.save_at),
                                              "--save", os.path.join(ckpt, name)]
            pairs[name] = (tp, fused, train + save)
    runs = launch_all(args, pairs)
    resumes = {}
    if not args.no_resume:
        tp = args.tp_sizes[0]
        savers = {f"tp{tp}_off_resumed_on": (f"tp{tp}_off", True),
                  f"tp{tp}_on_resumed_off": (f"tp{tp}_on", False)}
        runs.update(launch_all(args, {name: (tp, fused, train + [
            "--load", os.path.join(ckpt, saver), "--ckpt-step", str(args.save_at)])
            for name, (saver, fused) in savers.items()}))
        for name, (saver, fused) in savers.items():
            same_flag = runs[f"tp{tp}_{'on' if fused else 'off'}"]
            resumes[name] = resume_summary(runs[saver], runs[name], same_flag, args.save_at)
    summary = {
        "device": runs[next(iter(runs))]["device"],
        "env": run_environment([__file__, *(sys.argv[1:] if argv is None else argv)]),
        "steps": args.steps, "save_at": args.save_at, "seed": args.seed,
        "ckpt_format": args.ckpt_format, "gdn_kernels": args.gdn_kernels,
        "pairs": {f"tp{tp}" + (" +SP +recompute" if tp > 1 else ""):
                  pair_summary(runs[f"tp{tp}_off"], runs[f"tp{tp}_on"])
                  for tp in args.tp_sizes},
        "resumes": resumes,
        "wall_seconds": time.time() - start,
        "run_wall_seconds": {name: run["wall_seconds"] for name, run in runs.items()},
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print()
    print(table(summary))
    print(f"\n{len(runs)} launches, {summary['wall_seconds']:.0f} s; "
          f"{os.path.join(args.out, 'summary.json')}")
    return summary


if __name__ == "__main__":
    main()
