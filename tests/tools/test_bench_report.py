"""tools/bench_report.py and the benchmark's command line, on the CPU: the comparison, table,
CSV and plot of a small synthetic benchmark.json, and ``--report`` on the recorded H200 run."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tools import bench_report, benchmark

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "docs" / "results" / "benchmark.json"


def impl(fwd_graph, bwd_graph, ceiling=4000.0, nbytes=(6e6, 10e6)):
    r = {"fwd_graph_us": fwd_graph, "bwd_graph_us": bwd_graph, "fwd_us": 2 * fwd_graph,
         "bwd_us": 2 * bwd_graph}
    for phase, n in zip(("fwd", "bwd"), nbytes):
        for key in (f"{phase}_graph", phase):
            r[f"{key}_pct"] = 100 * n / r[f"{key}_us"] / 1e3 / ceiling
        r[f"{phase}_GBps"] = n / r[f"{phase}_us"] / 1e3
    return r


def case(shape, variant, impls):
    return {"label": benchmark.shape_label(shape, variant), "shape": list(shape),
            "variant": variant, "rows": shape[0] * shape[1] * shape[2],
            "floor_us": {"fwd": 1.5, "bwd": 2.5}, "impls": impls}


@pytest.fixture
def results():
    shape = (1, 64, 4, 128)
    return {"env": {"gpu": "Test GPU", "torch": "2.x", "triton": "3.x", "fla": None,
                    "date": "2026-01-01"},
            "ceiling": {"us": 1.0, "GBps": 4000.0},
            "timings": [{**case(shape, "plain", {"ours": impl(2.0, 3.0), "eager": impl(8.0, 9.0),
                                                 "fla": impl(1.9, 4.0),
                                                 "compile": impl(2.5, float("nan"))}),
                         "same_bytes_copy": {"fwd_graph_us": 1.6, "fwd_graph_pct": 94.0,
                                             "bwd_graph_us": 2.7, "bwd_graph_pct": 93.0}},
                        case(shape, "strided_gate", {"ours": impl(2.2, 3.3),
                                                     "fla": impl(6.0, 4.0)})]}


def test_peer_comparison_picks_the_fastest_peer_per_phase(results):
    plain, strided = bench_report.peer_comparison(results)
    assert (plain["fwd"]["best_peer"], plain["fwd"]["best_peer_us"]) == ("fla", 1.9)
    assert plain["fwd"]["slower_pct"] == pytest.approx(100 * (2.0 / 1.9 - 1))
    assert plain["bwd"]["best_peer"] == "fla"  # compile's NaN backward (not captured) is skipped
    assert plain["fwd_bwd"]["best_peer"] == "fla"
    assert plain["fwd_bwd"]["speedup"] == pytest.approx(5.9 / 5.0)
    assert plain["fwd_bwd"]["max_possible_speedup"] == pytest.approx(5.9 / 4.0)
    assert "vs_plain_pct" not in plain
    assert plain["fwd"]["of_same_bytes_copy_pct"] == pytest.approx(80.0)  # 1.6 us vs ours 2.0
    assert plain["bwd"]["of_same_bytes_copy_pct"] == pytest.approx(90.0)
    assert "of_same_bytes_copy_pct" not in strided["fwd"]  # no copy timed for that case
    assert strided["vs_plain_pct"]["fwd"] == pytest.approx(10.0)
    assert strided["vs_plain_pct"]["bwd"] == pytest.approx(10.0)


def test_report_writes_csv_and_plot(results, tmp_path, capsys):
    bench_report.write_report(results, str(tmp_path))
    assert "ours vs the fastest peer" in capsys.readouterr().out
    with open(tmp_path / "benchmark.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["label"], r["impl"]) for r in rows][:2] == [("1x64x4x128", "ours"),
                                                           ("1x64x4x128", "eager")]
    assert len(rows) == 7 and float(rows[0]["fwd_graph_us"]) == 2.0
    copy = rows[4]
    assert (copy["impl"], float(copy["bwd_graph_us"]), copy["fwd_us"]) == (
        "same_bytes_copy", 2.7, "")
    assert (tmp_path / "benchmark.png").stat().st_size > 10_000


def test_summary_table_lists_every_implementation(results):
    lines = bench_report.summary_lines(results)
    assert lines[0].startswith("Test GPU") and "4000 GB/s" in lines[0]
    assert sum(" ours " in line for line in lines) == 2
    copy = [line for line in lines if "same-bytes copy" in line]
    assert len(copy) == 1 and copy[0].split()[-5:] == ["1.6", "94", "|", "2.7", "93"]


def test_command_line(tmp_path):
    args = benchmark.parse_args([])
    assert (args.out, args.quick, args.report) == ("out/benchmark", False, None)
    assert args.impls.split(",") == list(benchmark.IMPLS)
    assert benchmark.parse_args(["--quick", "--impls", "ours,fla"]).quick
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--impls", "ours,cudnn"])


def test_report_of_the_recorded_run_needs_no_gpu(tmp_path, capsys):
    benchmark.main(["--report", str(RECORDED), "--out", str(tmp_path)])
    assert "1x32768x32x128" in capsys.readouterr().out
    recorded = json.loads(RECORDED.read_text())
    for row in bench_report.peer_comparison(recorded):
        if "fwd_bwd" in row:  # no kernel beats the memory floor
            assert 0 < row["fwd_bwd"]["speedup"] < row["fwd_bwd"]["max_possible_speedup"]
    assert (tmp_path / "benchmark.png").stat().st_size > 10_000


def test_report_names_a_file_of_another_kind(tmp_path):
    other = tmp_path / "versions.json"
    other.write_text(json.dumps({"runs": {"3.6.0": {}}, "command": "..."}))
    with pytest.raises(SystemExit, match=r"not a benchmark.py result .*\['command', 'runs'\]"):
        benchmark.main(["--report", str(other), "--out", str(tmp_path / "out")])


def test_a_run_of_ours_alone_says_no_peer_was_timed(results):
    for timing in results["timings"]:
        timing["impls"] = {"ours": timing["impls"]["ours"]}
    plain, strided = bench_report.peer_comparison_lines(bench_report.peer_comparison(results))[1:]
    assert plain == f"  {results['timings'][0]['label']:28s} no peer timed"
    assert strided.endswith("vs plain layout fwd +10.0 % bwd +10.0 %")  # ours against ours


def test_failed_and_untimed_peers_are_named_not_dropped(results):
    """A peer that failed at a shape, or was not timed there (torch.compile for the layout
    variants), is named next to the comparison it is missing from."""
    plain, strided = results["timings"]
    del plain["impls"]["fla"]
    plain["errors"] = {"fla": "RuntimeError: out of memory"}
    strided["not_timed"] = {"compile": "torch.compile: plain layout only"}
    lines = bench_report.peer_comparison_lines(bench_report.peer_comparison(results))
    assert lines[1].endswith("failed: fla (RuntimeError: out of memory)")
    assert "vs compile" in lines[1]  # the fastest of the peers that ran
    assert lines[2].endswith("not timed: compile (torch.compile: plain layout only)")


def test_plot_shows_gpu_time_only(results):
    """An implementation without a graph time gets no bar rather than its eager time, which is no
    GPU time (the L2 flush before each eager call hides its host work)."""
    compile_ = results["timings"][0]["impls"]["compile"]
    assert bench_report.plot_pct(compile_, "bwd") == 0
    assert bench_report.plot_pct(compile_, "fwd") == compile_["fwd_graph_pct"]


def test_host_lines_give_the_quartiles_where_recorded(results):
    results["host_cost"] = {
        "own_work_units": {"median": 9.0, "quartiles": [8.0, 10.0], "per_round": [8.0, 9.0, 10.0]},
        "same_signature_units": {"median": 3.0, "quartiles": [2.9, 3.1], "per_round": [3.0]}}
    own, signature = bench_report.summary_lines(results)[-2:]
    assert own.endswith("9.0 tiny torch ops (median of 3 interleaved rounds; quartiles 8.0-10.0)")
    assert signature.endswith("each way: 3.0 (quartiles 2.9-3.1)")
    for units in results["host_cost"].values():  # a result recorded before the quartiles
        del units["quartiles"]
    own, signature = bench_report.summary_lines(results)[-2:]
    assert own.endswith("(median of 3 interleaved rounds)") and signature.endswith("each way: 3.0")


def test_absent_peers_are_named_first_and_the_megatron_source_in_the_header(results, tmp_path,
                                                                            capsys):
    assert bench_report.absent_peer_lines(results) == []  # a result that records none
    results["absent_peers"] = {"megatron_main": "no megatron.core.fusions.fused_gated_norm"}
    results["env"]["megatron_main"] = "file /src/fused_gated_norm.py"
    bench_report.write_report(results, str(tmp_path))
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == ["megatron_main absent: no megatron.core.fusions.fused_gated_norm",
                           "ours vs the fastest peer, GPU time (+ = ours slower):"]
    assert "fla None  megatron_main file /src/fused_gated_norm.py  copy ceiling" in (
        bench_report.summary_lines(results)[0])


def test_every_implementation_has_a_bar_in_the_plot():
    assert set(benchmark.IMPLS) <= set(bench_report.PLOT_ORDER)
