"""Report of a benchmark.json (tools/benchmark.py): ours against the fastest peer, the summary
table, the CSV and the plot. Needs no GPU:

    python tools/benchmark.py --report docs/results/benchmark.json --out DIR
"""

from __future__ import annotations

import csv
import math
import os

from tools.bench_common import log

PHASES = ("fwd", "bwd")
SAME_BYTES_COPY = "same_bytes_copy"  # a case's key for the copy moving its bytes (GPU time)
PLOT_ORDER = ("ours", "megatron_main", "compile_casts", "compile", "fla", "eager")
CSV_FIELDS = ("label", "rows", "impl", "fwd_graph_us", "fwd_graph_pct", "bwd_graph_us",
              "bwd_graph_pct", "fwd_us", "fwd_GBps", "fwd_pct", "bwd_us", "bwd_GBps", "bwd_pct")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def peer_comparison(results: dict) -> list[dict]:
    """Per timed case, ours against the fastest other implementation in GPU time (the graph
    columns): forward, backward, and forward + backward together, where the memory floor also
    bounds what any kernel could gain over that peer; and, per phase, ours as % of the speed of
    the kernel that moves the same bytes (``of_same_bytes_copy_pct``). Variants (strided gate,
    sbhd output) are also compared with the plain layout of the same shape."""
    plain = {tuple(t["shape"]): t for t in results["timings"] if t["variant"] == "plain"}
    rows = []
    for t in results["timings"]:
        ours = t["impls"].get("ours")
        if ours is None:
            continue
        peers = {name: r for name, r in t["impls"].items() if name != "ours"}
        row = {"label": t["label"], "rows": t["rows"],  # peers left out of the comparison
               "failed": dict(t.get("errors", {})), "not timed": dict(t.get("not_timed", {}))}
        for phase in PHASES:
            times = {name: r[f"{phase}_graph_us"] for name, r in peers.items()
                     if _finite(r[f"{phase}_graph_us"])}
            if times:
                best = min(times, key=times.get)
                row[phase] = {"ours_us": ours[f"{phase}_graph_us"],
                              "ours_pct": ours[f"{phase}_graph_pct"],
                              "best_peer": best, "best_peer_us": times[best],
                              "slower_pct": 100 * (ours[f"{phase}_graph_us"] / times[best] - 1)}
            copy = t.get(SAME_BYTES_COPY)
            if copy is not None and phase in row:
                row[phase]["of_same_bytes_copy_pct"] = (100 * copy[f"{phase}_graph_us"]
                                                        / ours[f"{phase}_graph_us"])
        totals = {name: r["fwd_graph_us"] + r["bwd_graph_us"] for name, r in peers.items()
                  if _finite(r["fwd_graph_us"] + r["bwd_graph_us"])}
        if totals:
            best = min(totals, key=totals.get)
            floor = t["floor_us"]["fwd"] + t["floor_us"]["bwd"]
            ours_total = ours["fwd_graph_us"] + ours["bwd_graph_us"]
            row["fwd_bwd"] = {"best_peer": best, "speedup": totals[best] / ours_total,
                              "max_possible_speedup": totals[best] / floor}
        base = plain.get(tuple(t["shape"]))
        if t["variant"] != "plain" and base is not None and "ours" in base["impls"]:
            base_ours = base["impls"]["ours"]
            row["vs_plain_pct"] = {
                phase: 100 * (ours[f"{phase}_graph_us"] / base_ours[f"{phase}_graph_us"] - 1)
                for phase in PHASES}
        rows.append(row)
    return rows


def peer_comparison_lines(rows: list[dict]) -> list[str]:
    lines = ["ours vs the fastest peer, GPU time (+ = ours slower):"]
    for row in rows:
        parts = []
        for phase in PHASES:
            if phase in row:
                c = row[phase]
                copy = (f", {c['of_same_bytes_copy_pct']:3.0f} % of a copy"
                        if "of_same_bytes_copy_pct" in c else "")
                parts.append(f"{phase} {c['ours_us']:7.1f} us ({c['ours_pct']:3.0f} %{copy}) vs "
                             f"{c['best_peer']} {c['best_peer_us']:7.1f}: "
                             f"{c['slower_pct']:+5.1f} %")
        if "fwd_bwd" in row:
            c = row["fwd_bwd"]
            parts.append(f"fwd+bwd {c['speedup']:.2f}x {c['best_peer']} "
                         f"(floor allows {c['max_possible_speedup']:.2f}x)")
        if "vs_plain_pct" in row:
            parts.append("vs plain layout fwd {fwd:+.1f} % bwd {bwd:+.1f} %".format(
                **row["vs_plain_pct"]))
        for kind in ("failed", "not timed"):
            if row.get(kind):
                parts.append(f"{kind}: " + ", ".join(f"{name} ({why})"
                                                     for name, why in row[kind].items()))
        lines.append(f"  {row['label']:28s} " + (" | ".join(parts) or "no peer timed"))
    return lines


def absent_peer_lines(results: dict) -> list[str]:
    """One line per peer asked for but not available in that run (``absent_peers``; a result
    without that key names none), saying why."""
    return [f"{name} absent: {why}" for name, why in results.get("absent_peers", {}).items()]


def summary_lines(results: dict) -> list[str]:
    """The table printed at the end of a run: per case, the floor and every implementation."""
    env = results["env"]
    megatron = f"  megatron_main {env['megatron_main']}" if env.get("megatron_main") else ""
    lines = [f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  fla {env.get('fla')}"
             f"{megatron}  copy ceiling {results['ceiling']['GBps']:.0f} GB/s",
             f"{'shape':30s} {'impl':14s} {'fwd us':>8s} {'%':>4s} | {'bwd us':>8s} {'%':>4s} "
             f"|| eager: {'fwd us':>8s} {'bwd us':>8s}   (GPU time in a CUDA graph; % of the "
             "ceiling)"]
    for entry in results["timings"]:
        floor = entry["floor_us"]
        lines.append(f"{entry['label']:30s} {'floor':14s} {floor['fwd']:8.1f} {'':>4s} | "
                     f"{floor['bwd']:8.1f}")
        copy = entry.get(SAME_BYTES_COPY)
        if copy is not None:
            lines.append(f"{'':30s} {'same-bytes copy':14s} {copy['fwd_graph_us']:8.1f} "
                         f"{copy['fwd_graph_pct']:4.0f} | {copy['bwd_graph_us']:8.1f} "
                         f"{copy['bwd_graph_pct']:4.0f}")
        for name, r in entry["impls"].items():
            lines.append(f"{'':30s} {name:14s} {r['fwd_graph_us']:8.1f} "
                         f"{r['fwd_graph_pct']:4.0f} | {r['bwd_graph_us']:8.1f} "
                         f"{r['bwd_graph_pct']:4.0f} ||        {r['fwd_us']:8.1f} "
                         f"{r['bwd_us']:8.1f}")
        if entry.get("inference"):
            lines.append(f"{'':30s} inference entry: {entry['inference']}")
    units = results.get("host_cost", {}).get("own_work_units")
    if units:
        quartiles = "; " + _quartiles_text(units) if "quartiles" in units else ""
        lines.append(f"host: own work of one eager forward + backward through autograd "
                     f"{units['median']:.1f} tiny torch ops (median of {len(units['per_round'])} "
                     f"interleaved rounds{quartiles})")
        signature = results["host_cost"].get("same_signature_units")
        if signature:
            spread = f" ({_quartiles_text(signature)})" if "quartiles" in signature else ""
            lines.append(f"      a Function of the same signature doing one tiny op each way: "
                         f"{signature['median']:.1f}{spread}")
    return lines


def _quartiles_text(units: dict) -> str:
    """The quartiles of the per-round units (results that predate them hold none: callers
    check)."""
    low, high = units["quartiles"]
    return f"quartiles {low:.1f}-{high:.1f}"


def write_csv(results: dict, path: str) -> None:
    """One row per (case, implementation), and one for the same-bytes copy (GPU time only)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for entry in results["timings"]:
            for name, r in entry["impls"].items():
                writer.writerow({"label": entry["label"], "rows": entry["rows"], "impl": name,
                                 **{k: r[k] for k in CSV_FIELDS[3:]}})
            if SAME_BYTES_COPY in entry:
                writer.writerow({"label": entry["label"], "rows": entry["rows"],
                                 "impl": SAME_BYTES_COPY, **entry[SAME_BYTES_COPY]})


def plot_pct(r: dict, phase: str) -> float:
    """GPU time (graph); 0 when not timed (the eager time is no GPU time: bench_common.bench)."""
    pct = r.get(f"{phase}_graph_pct", float("nan"))
    return pct if _finite(pct) else 0


def plot(results: dict, path: str) -> None:
    """% of the copy ceiling per case and implementation, forward above, backward below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timings = results["timings"]
    labels = [f"{t['label']}\n{t['rows'] // 1024}k rows" for t in timings]
    impls = [k for k in PLOT_ORDER if any(k in t["impls"] for t in timings)]
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 0.85 * len(labels) + 2), 9), sharex=True)
    width = 0.8 / len(impls)
    for ax, phase in zip(axes, PHASES):
        for i, impl in enumerate(impls):
            values = [plot_pct(t["impls"].get(impl, {}), phase) for t in timings]
            ax.bar([j + (i - (len(impls) - 1) / 2) * width for j in range(len(labels))], values,
                   width, label=impl)
        copies = [(j, t[SAME_BYTES_COPY][f"{phase}_graph_pct"]) for j, t in enumerate(timings)
                  if SAME_BYTES_COPY in t]
        if copies:
            ax.scatter(*zip(*copies), marker="_", s=600, color="k", zorder=3,
                       label="same-bytes copy")
        ax.axhline(100, color="k", lw=0.8, ls="--")
        ax.set_title(f"{'forward' if phase == 'fwd' else 'backward'}: % of the copy ceiling "
                     f"({results['ceiling']['GBps']:.0f} GB/s), GPU time (CUDA graph)")
        ax.set_ylim(0, 130)
        ax.set_ylabel("% of copy bandwidth (higher is better)")
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(range(len(labels)))
    axes[1].set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
    axes[0].legend(fontsize=8, ncol=len(impls))
    env = results["env"]
    fig.suptitle(f"Fused gated RMSNorm, bf16, {env['gpu']}, torch {env['torch']}, "
                 f"triton {env['triton']} ({env['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: dict, out_dir: str) -> None:
    """Print the absent peers and the comparison, and (re)write benchmark.csv and benchmark.png
    under ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    for line in absent_peer_lines(results) + peer_comparison_lines(peer_comparison(results)):
        log(line)
    write_csv(results, os.path.join(out_dir, "benchmark.csv"))
    plot(results, os.path.join(out_dir, "benchmark.png"))
