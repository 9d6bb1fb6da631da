"""Summary table, CSV and loss-curve PNG of examples/pretrain_gdn.py (rank 0 only), and what
every example result records to be reproduced (``run_environment``: date, versions, command
line; run_megatron_pairs.py's summary too).

A run result is a plain dict (also written as JSON):
    {"label", "fused_gated_norm", "out_norm_nudged", "steps", "losses": [per step],
     "step_times": [s], "tokens_per_step", "held_out_loss", "tp_out_norm_max_diff",
     "triton_interpreter", ...}
The first run is the reference (flag off); every other run is compared with it step by step.
Runs whose kernels ran in the Triton interpreter (the CPU run) are timed as the interpreter's,
and their speeds are not compared: interpreter time says nothing about the fused norm's speed.
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
from typing import Optional

THROUGHPUT_SKIP = 0.1  # the first 10 % of steps (at least 2) are warm-up: not timed
ULP_AGREEMENT = 8  # "agrees" = within this many fp32 ulps of the loss
LATE_FRACTION = 0.2  # the "late" window: the last 20 % of steps


def default_warmup_steps(steps: int) -> int:
    """The learning-rate warm-up of both example runners: a tenth of the steps, at least one,
    and at least one step left after it (megatron's scheduler decays after the warm-up)."""
    return min(max(1, steps // 10), steps - 1)


def tokens_per_second(run: dict) -> float:
    """Tokens per step / the median step time after warm-up (robust to a busy machine)."""
    times = run["step_times"]
    skip = min(max(2, int(len(times) * THROUGHPUT_SKIP)), max(len(times) - 1, 0))
    return run["tokens_per_step"] / max(statistics.median(times[skip:]), 1e-12)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command_line(argv: list) -> str:
    """``argv`` (the script's path first) as a shell command run from the repository root;
    under torchrun, with its launcher and the process count."""
    if not argv:
        raise ValueError("command_line: argv must start with the script's path")
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT)
    launcher = ["python"]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = os.environ["WORLD_SIZE"]
        local = os.environ.get("LOCAL_WORLD_SIZE", world)
        launcher = ["torchrun", f"--nproc-per-node={local}"]
        if world != local:
            launcher.append(f"--nnodes={int(world) // int(local)}")
    return shlex.join([*launcher, script, *argv[1:]])


def run_environment(argv: Optional[list] = None) -> dict:
    """What a result needs to be reproduced: date, versions and the command line (from the
    repository root)."""
    def version(dist: str) -> Optional[str]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    import torch
    import triton

    argv = sys.argv if argv is None else argv
    return {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
            "torch": torch.__version__, "triton": triton.__version__,
            "megatron_core": version("megatron-core"), "fla_core": version("fla-core"),
            "command": command_line(argv)}


def environment_line(env: dict) -> str:
    versions = ", ".join(f"{name.replace('_', '-')} {env[name]}" for name in
                         ("python", "torch", "triton", "megatron_core", "fla_core")
                         if env.get(name))
    return f"{env['date']}; {versions}; {env['command']}"


def ulp(x: float) -> float:
    """fp32 unit in the last place at |x|."""
    return 2.0 ** (math.frexp(abs(x))[1] - 24) if x else 2.0 ** -149


def late_mean(losses: list[float]) -> float:
    k = max(1, int(len(losses) * LATE_FRACTION))
    return sum(losses[-k:]) / k


def agreement(ref: dict, run: dict) -> dict:
    """Step-by-step comparison of ``run`` with the reference run."""
    n = min(len(ref["losses"]), len(run["losses"]))
    deltas = [run["losses"][i] - ref["losses"][i] for i in range(n)]
    absd = [abs(d) for d in deltas]
    ulps = [absd[i] / ulp(ref["losses"][i]) for i in range(n)]
    worst = max(range(n), key=lambda i: absd[i]) if n else 0
    lead = next((i for i in range(n) if ulps[i] > ULP_AGREEMENT), n)
    first_diff = next((i + 1 for i in range(n) if deltas[i] != 0.0), None)
    ho_ref, ho_run = ref.get("held_out_loss"), run.get("held_out_loss")
    return {
        "steps": n,
        "deltas": deltas,
        "max_abs": max(absd) if n else 0.0,
        "max_abs_step": worst + 1,
        "mean_abs": sum(absd) / n if n else 0.0,
        "ulp_agreed_steps": lead,  # leading steps within ULP_AGREEMENT ulps
        "max_ulps_while_agreed": max(ulps[:lead]) if lead else 0.0,
        "identical_steps": sum(1 for d in deltas if d == 0.0),
        "first_differing_step": first_diff,
        "final_delta": deltas[-1] if n else 0.0,
        "late_mean_delta": (late_mean(run["losses"][:n]) - late_mean(ref["losses"][:n])
                            if n else 0.0),
        "held_out_delta": (ho_run - ho_ref) if ho_ref is not None and ho_run is not None else None,
    }


def _f(x: Optional[float], fmt: str = ".5f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def tp_check_text(run: dict) -> str:
    diffs = run.get("tp_out_norm_max_diff")
    if not diffs:
        return "n/a (TP=1)"
    bad = [i + 1 for i, d in enumerate(diffs) if d != 0.0]
    if not bad:
        return f"yes, all {len(diffs)} steps"
    return f"NO from step {bad[0]} (max {max(diffs):.1e})"


def _table(header: list[str], rows: list[tuple[str, list[str]]]) -> list[str]:
    width0 = max(len(k) for k, _ in rows) + 2
    widths = [max(len(c), *(len(v[i]) for _, v in rows)) + 2 for i, c in enumerate(header)]
    lines = [" " * width0 + "".join(c.rjust(w) for c, w in zip(header, widths)),
             "-" * (width0 + sum(widths))]
    lines += [k.ljust(width0) + "".join(v.rjust(w) for v, w in zip(vals, widths))
              for k, vals in rows]
    return lines


def fused_calls_text(run: dict) -> str:
    """The fused output norm's calls per training step on rank 0, and its GDN layer count."""
    if "fused_norm_calls" not in run:
        return "n/a"
    return f"{run['fused_norm_calls'] / run['steps']:g} ({run['gdn_layers']} GDN layers)"


INTERPRETER_NOTE = ("Times under the Triton interpreter (CPU) measure the interpreter, not the "
                    "fused norm:",
                    "they say nothing about the flag's speed, and none is compared here "
                    "(GPU timings: docs/benchmarks.md).")


def summary_table(runs: list[dict], setup: str) -> str:
    """One column per run; then, for every run after the first, its agreement with the first
    (and its speed against the first's, unless a run's kernels ran in the Triton interpreter)."""
    late = f"mean loss, last {max(1, int(runs[0]['steps'] * LATE_FRACTION))} steps"
    interpreted = any(r.get("triton_interpreter") for r in runs)
    speed = "interpreter tokens/s (median step)" if interpreted else "tokens/s (median step)"
    wall = "interpreter wall time (s)" if interpreted else "wall time (s)"
    rows = [
        ("steps", [str(r["steps"]) for r in runs]),
        ("first loss", [_f(r["losses"][0]) for r in runs]),
        ("final loss", [_f(r["losses"][-1]) for r in runs]),
        (late, [_f(late_mean(r["losses"])) for r in runs]),
        ("held-out loss", [_f(r.get("held_out_loss")) for r in runs]),
        (speed, [f"{tokens_per_second(r):,.0f}" for r in runs]),
        (wall, [f"{sum(r['step_times']):.1f}" for r in runs]),
        ("out_norm w equal on TP ranks", [tp_check_text(r) for r in runs]),
        ("fused norm calls per step", [fused_calls_text(r) for r in runs]),
    ]
    lines = [setup, ""] + _table([r["label"] for r in runs], rows)
    if interpreted:
        lines += ["", *INTERPRETER_NOTE]
    if len(runs) > 1:
        ref = runs[0]
        ags = [agreement(ref, r) for r in runs[1:]]
        rows = [
            ("max |dloss|", [f"{a['max_abs']:.2e} (step {a['max_abs_step']})" for a in ags]),
            ("mean |dloss|", [f"{a['mean_abs']:.2e}" for a in ags]),
            (f"leading steps within {ULP_AGREEMENT} ulp",
             [f"{a['ulp_agreed_steps']} / {a['steps']}" for a in ags]),
            ("  max ulps over those", [f"{a['max_ulps_while_agreed']:.1f}" for a in ags]),
            ("bitwise-equal steps", [f"{a['identical_steps']} / {a['steps']}" for a in ags]),
            ("final-step dloss", [f"{a['final_delta']:+.2e}" for a in ags]),
            (f"d({late.split(',')[0]}, last {late.split('last ')[1]})",
             [f"{a['late_mean_delta']:+.2e}" for a in ags]),
            ("d(held-out loss)", [_f(a["held_out_delta"], "+.2e") for a in ags]),
        ]
        if not interpreted:
            rows.append(("tokens/s vs reference",
                         [f"{(tokens_per_second(r) / tokens_per_second(ref) - 1) * 100:+.1f} %"
                          for r in runs[1:]]))
        lines += ["", f"step by step against '{ref['label']}' (dloss = loss - reference loss):"]
        lines += _table([r["label"] for r in runs[1:]], rows)
    checks = runs[0].get("paired_checks") or []
    if checks:
        worst = max(checks, key=lambda c: abs(c["dloss"]))
        ulps = abs(worst["dloss"]) / ulp(worst["loss_off"])  # of that difference
        lines += [
            "",
            f"same weights, same batch (steps {', '.join(str(c['step']) for c in checks)} of "
            f"'{runs[0]['label']}', fused path switched on for that step's forward/backward):",
            f"  max |loss(on) - loss(off)|          {abs(worst['dloss']):.2e} ({ulps:.1f} ulp), "
            f"{sum(1 for c in checks if c['dloss'] == 0.0)} / {len(checks)} bitwise equal",
            f"  max ||grad(on) - grad(off)|| / ||grad(off)||, all params    "
            f"{max(c['grad_rel'] for c in checks):.2e}",
            f"  max ||grad(on) - grad(off)|| / ||grad(off)||, GDN out_norm  "
            f"{max(c['out_norm_grad_rel'] for c in checks):.2e}",
        ]
        # The floors at the same weights and batch: the unfused path against itself (run-to-run
        # noise of the other kernels) and against its eager code (the norm's rounding as
        # written, which torch.compile's jit_fuser drops); the fused path reproduces the latter.
        for prefix, label in (("repeat_", "unfused again vs unfused (run-to-run floor)"),
                              ("eager_", "unfused eager vs unfused"),
                              ("on_vs_eager_", "fused vs unfused eager")):
            if prefix + "dloss" not in checks[0]:
                continue
            lines.append(
                f"  {label}: max |dloss| {max(abs(c[prefix + 'dloss']) for c in checks):.2e}, "
                f"grads {max(c[prefix + 'grad_rel'] for c in checks):.2e}, "
                f"out_norm grads {max(c[prefix + 'out_norm_grad_rel'] for c in checks):.2e}")
    return "\n".join(lines)


def _file_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")


def write_csv(path: str, runs: list[dict]) -> None:
    n = max(len(r["losses"]) for r in runs)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        header = ["step"] + [f"loss[{r['label']}]" for r in runs]
        header += [f"dloss[{r['label']}]" for r in runs[1:]]
        header += [f"step_time_s[{r['label']}]" for r in runs]
        w.writerow(header)
        for i in range(n):
            row = [i + 1]
            row += [repr(r["losses"][i]) if i < len(r["losses"]) else "" for r in runs]
            row += [repr(r["losses"][i] - runs[0]["losses"][i])
                    if i < min(len(r["losses"]), len(runs[0]["losses"])) else "" for r in runs[1:]]
            row += [f"{r['step_times'][i]:.4f}" if i < len(r["step_times"]) else "" for r in runs]
            w.writerow(row)


def plot(path: str, runs: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    many = len(runs) > 1
    fig, axes = plt.subplots(2 if many else 1, 1, figsize=(9, 7 if many else 4), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2]} if many else None)
    ax = axes[0] if many else axes
    styles = [dict(color="tab:blue", lw=2.4, alpha=0.6),
              dict(color="tab:orange", lw=1.0, ls="--"),
              dict(color="0.45", lw=0.8, ls=":")]
    for r, st in zip(runs, styles):
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["label"], **st)
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend()
    if many:
        ax2 = axes[1]
        ref = runs[0]
        zero = ulp(min(ref["losses"])) / 8  # where bitwise-equal steps are drawn
        steps = range(1, len(ref["losses"]) + 1)
        ax2.plot(steps, [ulp(x) for x in ref["losses"]], color="k", lw=0.6, ls="--",
                 label="1 fp32 ulp of the loss")
        for r, st in zip(runs[1:], styles[1:]):
            a = agreement(ref, r)
            st = dict(st, ls="-", lw=1.0 if r is runs[1] else 0.8)
            ax2.plot(range(1, a["steps"] + 1), [max(abs(d), zero) for d in a["deltas"]], label=(
                f"{r['label']}: max {a['max_abs']:.1e}, first {a['ulp_agreed_steps']} steps "
                f"within {ULP_AGREEMENT} ulp"), **st)
        checks = ref.get("paired_checks") or []
        if checks:
            ax2.plot([c["step"] for c in checks], [max(abs(c["dloss"]), zero) for c in checks],
                     "o", color="tab:green", ms=4,
                     label="same weights & batch, fused vs unfused (paired check)")
        ax2.set_yscale("log")
        ax2.set_ylim(bottom=zero / 2)
        ax2.set_ylabel(f"|loss - loss[{ref['label']}]|\n(bottom row: bitwise equal)", fontsize=8)
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=7, loc="upper left")
    (axes[-1] if many else axes).set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out_dir: str, runs: list[dict], setup: str, title: str,
                  env: Optional[dict] = None) -> str:
    """Writes run_<label>.json, losses.csv, summary.txt and loss_curves.png; returns the table.
    The run files and the plot of an earlier run into ``out_dir`` are removed first, so the
    folder holds this run's only. ``env`` (run_environment) goes into every run file and ends
    summary.txt."""
    env = env or run_environment()
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):
        if (name.startswith("run_") and name.endswith(".json")) or name == "loss_curves.png":
            os.remove(os.path.join(out_dir, name))
    for r in runs:
        with open(os.path.join(out_dir, f"run_{_file_label(r['label'])}.json"), "w") as f:
            json.dump({**r, "env": env}, f, indent=1)
    write_csv(os.path.join(out_dir, "losses.csv"), runs)
    table = summary_table(runs, setup)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(f"{table}\n\n{environment_line(env)}\n")
    try:
        plot(os.path.join(out_dir, "loss_curves.png"), runs, title)
    except ImportError:
        print("matplotlib is not installed: no loss_curves.png (losses.csv has the numbers)")
    return table
