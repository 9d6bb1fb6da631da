"""Summary table, CSV and loss-curve PNG of examples/pretrain_gdn.py (rank 0 only).

A run result is a plain dict (also written as JSON):
    {"label", "fused_gated_norm", "steps", "losses": [per step], "step_times": [s],
     "tokens_per_step", "held_out_loss", "tp_out_norm_max_diff": [per step] or None, ...}
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Optional

THROUGHPUT_SKIP = 0.1  # the first 10 % of steps (at least 2) are warm-up: not timed


def tokens_per_second(run: dict) -> float:
    times = run["step_times"]
    skip = min(max(2, int(len(times) * THROUGHPUT_SKIP)), max(len(times) - 1, 0))
    timed = times[skip:]
    return run["tokens_per_step"] * len(timed) / max(sum(timed), 1e-12)


def tp_check_text(run: dict) -> str:
    diffs = run.get("tp_out_norm_max_diff")
    if not diffs:
        return "n/a (TP=1)"
    bad = [i + 1 for i, d in enumerate(diffs) if d != 0.0]
    if not bad:
        return f"yes, all {len(diffs)} steps"
    return f"NO from step {bad[0]} (max |dw| {max(diffs):.2e})"


def agreement(off: dict, on: dict) -> dict:
    n = min(len(off["losses"]), len(on["losses"]))
    deltas = [on["losses"][i] - off["losses"][i] for i in range(n)]
    absd = [abs(d) for d in deltas]
    rel = [abs(d) / max(abs(off["losses"][i]), 1e-12) for i, d in enumerate(deltas)]
    worst = max(range(n), key=lambda i: absd[i]) if n else 0
    first_diff = next((i + 1 for i in range(n) if deltas[i] != 0.0), None)
    return {
        "steps": n,
        "deltas": deltas,
        "max_abs": max(absd) if n else 0.0,
        "max_abs_step": worst + 1,
        "mean_abs": sum(absd) / n if n else 0.0,
        "max_rel": max(rel) if n else 0.0,
        "identical_steps": sum(1 for d in deltas if d == 0.0),
        "first_differing_step": first_diff,
        "final_delta": deltas[-1] if n else 0.0,
    }


def _fmt_loss(x: Optional[float]) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.5f}"


def summary_table(runs: list[dict], setup: str) -> str:
    """A fixed-width table: one column per run (flag off / on), plus agreement rows."""
    cols = [r["label"] for r in runs]
    rows = [
        ("steps", [str(r["steps"]) for r in runs]),
        ("first loss", [_fmt_loss(r["losses"][0]) for r in runs]),
        ("final loss", [_fmt_loss(r["losses"][-1]) for r in runs]),
        ("mean loss, last 10", [_fmt_loss(sum(r["losses"][-10:]) / len(r["losses"][-10:]))
                                for r in runs]),
        ("held-out loss", [_fmt_loss(r.get("held_out_loss")) for r in runs]),
        ("tokens/s", [f"{tokens_per_second(r):,.0f}" for r in runs]),
        ("wall time (s)", [f"{sum(r['step_times']):.1f}" for r in runs]),
        ("out_norm w equal on TP ranks", [tp_check_text(r) for r in runs]),
    ]
    width0 = max(len(k) for k, _ in rows) + 2
    widths = [max(len(c), *(len(v[i]) for _, v in rows)) + 2 for i, c in enumerate(cols)]
    lines = [setup, "",
             " " * width0 + "".join(c.rjust(w) for c, w in zip(cols, widths)),
             "-" * (width0 + sum(widths))]
    for key, vals in rows:
        lines.append(key.ljust(width0) + "".join(v.rjust(w) for v, w in zip(vals, widths)))
    if len(runs) == 2:
        a = agreement(runs[0], runs[1])
        speed = tokens_per_second(runs[1]) / tokens_per_second(runs[0]) - 1.0
        lines += [
            "-" * (width0 + sum(widths)),
            f"loss agreement, flag on - flag off, step by step over {a['steps']} steps:",
            f"  max |dloss|            {a['max_abs']:.3e}  (step {a['max_abs_step']})",
            f"  mean |dloss|           {a['mean_abs']:.3e}",
            f"  max |dloss| / loss     {a['max_rel']:.3e}",
            f"  final-step dloss       {a['final_delta']:+.3e}",
            f"  bitwise-equal steps    {a['identical_steps']} / {a['steps']}"
            + (f"  (first difference at step {a['first_differing_step']})"
               if a["first_differing_step"] else ""),
            f"  tokens/s, on vs off    {speed * 100:+.1f} %",
        ]
    return "\n".join(lines)


def write_csv(path: str, runs: list[dict]) -> None:
    n = max(len(r["losses"]) for r in runs)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        header = ["step"] + [f"loss[{r['label']}]" for r in runs]
        header += [f"step_time_s[{r['label']}]" for r in runs]
        if len(runs) == 2:
            header.append("dloss(on-off)")
        w.writerow(header)
        for i in range(n):
            row = [i + 1]
            row += [repr(r["losses"][i]) if i < len(r["losses"]) else "" for r in runs]
            row += [f"{r['step_times'][i]:.4f}" if i < len(r["step_times"]) else "" for r in runs]
            if len(runs) == 2:
                row.append(repr(runs[1]["losses"][i] - runs[0]["losses"][i]))
            w.writerow(row)


def plot(path: str, runs: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    two = len(runs) == 2
    fig, axes = plt.subplots(2 if two else 1, 1, figsize=(8, 6.5 if two else 4), sharex=True,
                             gridspec_kw={"height_ratios": [2, 1]} if two else None)
    ax = axes[0] if two else axes
    styles = [dict(color="tab:blue", lw=2.2, alpha=0.7), dict(color="tab:orange", lw=1.0, ls="--")]
    for r, st in zip(runs, styles):
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["label"], **st)
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    if two:
        a = agreement(runs[0], runs[1])
        ax2 = axes[1]
        ax2.plot(range(1, a["steps"] + 1), a["deltas"], color="tab:red", lw=1.0)
        ax2.axhline(0.0, color="k", lw=0.5)
        ax2.set_ylabel("loss(on) - loss(off)")
        ax2.set_title(f"max |dloss| = {a['max_abs']:.2e} (step {a['max_abs_step']}), "
                      f"mean |dloss| = {a['mean_abs']:.2e}, "
                      f"{a['identical_steps']}/{a['steps']} steps bitwise equal", fontsize=9)
        ax2.grid(alpha=0.3)
        lim = max(a["max_abs"], 1e-12) * 1.2
        ax2.set_ylim(-lim, lim)
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    (axes[-1] if two else axes).set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out_dir: str, runs: list[dict], setup: str, title: str) -> str:
    """Writes run_<label>.json, losses.csv, summary.txt and loss_curves.png; returns the table."""
    os.makedirs(out_dir, exist_ok=True)
    for r in runs:
        with open(os.path.join(out_dir, f"run_{r['label'].replace('=', '_')}.json"), "w") as f:
            json.dump(r, f, indent=1)
    write_csv(os.path.join(out_dir, "losses.csv"), runs)
    table = summary_table(runs, setup)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(table + "\n")
    plot(os.path.join(out_dir, "loss_curves.png"), runs, title)
    return table
