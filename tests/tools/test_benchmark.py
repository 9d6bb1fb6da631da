"""tools/benchmark.py: the shapes it measures, and its run end to end on the CPU (the GPU-only
timers replaced by one call each) with the peers it may time, Megatron-LM main's
fused_gated_norm among them (a stand-in file or module here)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from tools import bench_common, bench_report, benchmark


def test_benchmark_shapes_include_tensor_parallel_ranks():
    rows = {s[0] * s[1] * s[2] for s in benchmark.SHAPES if s[3] == 128 and s[0] == 1}
    assert {16384, 32768, 65536, 131072, 262144} <= rows
    for heads in (4, 8, 16, 32):
        for seq in (4096, 8192):
            assert (1, seq, heads, 128) in benchmark.SHAPES
    for heads in (8, 16):
        assert (1, 4096, heads, 256) in benchmark.SHAPES
    assert len(benchmark.SHAPES) == len(set(benchmark.SHAPES))


SHAPE = (1, 4, 2, 64)
ODD_HEAD_DIM = (1, 4, 2, 48)  # not a power of two: megatron main's kernels refuse it
LOADED_FILE_MODULE = bench_common._MEGATRON_MAIN_FILE_MODULE

# A torch stand-in for Megatron-LM main's megatron/core/fusions/fused_gated_norm.py, with its
# signature; it records whether each gate it was handed was contiguous, and refuses a gate
# whose values are all zero (a rule of the test, to see a refusal mid-run).
STAND_IN = '''import torch

GATES_CONTIGUOUS = []


def fused_gated_norm(x, gate, weight, eps, zero_centered=False, gate_activation="silu"):
    if not gate.any():
        raise ValueError("an all-zero gate")
    GATES_CONTIGUOUS.append(gate.is_contiguous())
    xf = x.float()
    norm = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
            * (weight.float() + zero_centered)).to(x.dtype)
    return (norm.float() * torch.nn.functional.silu(gate.float())).to(x.dtype)
'''


@pytest.fixture
def cpu_run(monkeypatch):
    """benchmark.run on the CPU: every GPU-only timer calls its function once and returns the
    running count of such calls (so later calls take longer: fwd + bwd > fwd)."""
    calls = []

    def one_call(fn, *args, **kwargs):
        calls.append(fn())
        return float(len(calls))

    monkeypatch.setattr(bench_common, "DEVICE", "cpu")
    monkeypatch.setattr(benchmark, "DEVICE", "cpu")
    for name in ("bench", "bench_graph"):
        monkeypatch.setattr(benchmark, name, one_call)
    monkeypatch.setattr(bench_common, "bench_graph", one_call)  # the same-bytes copy's timer
    monkeypatch.setattr(benchmark, "copy_ceiling", lambda: {"us": 1.0, "GBps": 4000.0})
    monkeypatch.setattr(benchmark, "environment", lambda **extra: {
        "gpu": "cpu", "torch": "x", "triton": "x", "date": "2026-01-01", **extra})
    monkeypatch.setattr(benchmark, "warm_up_capture", lambda: None)
    # FLA needs a GPU
    monkeypatch.setattr(benchmark, "load_fla_rms_norm_gated", lambda: (None, None))
    monkeypatch.setattr(benchmark, "SERVING_TOKENS", (1, 3))
    monkeypatch.setattr(benchmark.host_cost, "host_cost", lambda: {"validation_us": 1.0})
    yield benchmark.run
    sys.modules.pop(LOADED_FILE_MODULE, None)


@pytest.mark.interpreter
def test_a_run_on_the_cpu_writes_what_the_report_reads(cpu_run, tmp_path):
    """The JSON a run writes is what the report reads (the timers' arithmetic is tested in
    test_bench_report.py)."""
    results = cpu_run([SHAPE], [(SHAPE, "strided_gate"), (SHAPE, "sbhd")], ["ours", "eager"],
                      str(tmp_path))
    assert json.loads((tmp_path / "benchmark.json").read_text())["timings"] == json.loads(
        json.dumps(results["timings"]))
    assert [t["label"] for t in results["timings"]] == [
        "1x4x2x64", "1x4x2x64 strided_gate", "1x4x2x64 sbhd"]
    for entry in results["timings"]:
        assert set(entry["impls"]) == {"ours", "eager"} and "errors" not in entry
        assert entry["impls"]["ours"]["bwd_graph_us"] == 1.0  # fwd+bwd graph minus fwd graph
        copy = entry["same_bytes_copy"]
        assert copy["bwd_graph_us"] == copy["fwd_graph_us"] + 1  # timed one after the other
        assert copy["fwd_graph_pct"] == pytest.approx(
            bench_common.pct_of_ceiling(entry["bytes"]["fwd"], copy["fwd_graph_us"], 4000.0))
    assert set(results["timings"][0]["inference"]) == {"ours_us"}
    assert [r["tokens"] for r in results["inference_serving"]] == [1, 3]
    assert results["host_cost"] == {"validation_us": 1.0}
    assert results["absent_peers"] == {}  # no peer was asked for that is missing
    assert len(results["vs_peers"]) == 3 and "vs_plain_pct" in results["vs_peers"][1]
    bench_report.write_report(results, str(tmp_path))


@pytest.mark.interpreter
def test_megatron_main_from_a_file_is_timed_as_a_peer(cpu_run, monkeypatch, tmp_path, capsys):
    """--megatron-fused-gated-norm FILE.py: the command line times that file's fused_gated_norm
    as megatron_main at every case, on the same inputs as the others (the strided gate as the
    view the layer hands over), skips a head dim its kernels refuse, and the report and its
    files show it."""
    path = tmp_path / "fused_gated_norm.py"
    path.write_text(STAND_IN)
    monkeypatch.setattr(benchmark, "require_cuda", lambda script: None)
    monkeypatch.setattr(benchmark, "SHAPES", [SHAPE, ODD_HEAD_DIM])
    monkeypatch.setattr(benchmark, "VARIANTS", [(SHAPE, "strided_gate"), (SHAPE, "sbhd")])
    out = tmp_path / "out"
    benchmark.main(["--impls", "ours,eager,megatron_main", "--megatron-fused-gated-norm",
                    str(path), "--out", str(out)])
    results = json.loads((out / "benchmark.json").read_text())
    assert results["env"]["megatron_main"] == f"file {path}"
    assert results["absent_peers"] == {}
    plain, odd, strided, sbhd = results["timings"]
    for entry in (plain, strided, sbhd):
        assert set(entry["impls"]) == {"ours", "eager", "megatron_main"}
        assert entry["impls"]["megatron_main"]["bwd_graph_us"] == 1.0
        assert "not_timed" not in entry and "errors" not in entry
    assert set(odd["impls"]) == {"ours", "eager"}
    assert odd["not_timed"] == {"megatron_main": "head dim 48: megatron main's kernels take "
                                                 "power-of-two head dims only"}
    # plain and sbhd hand it contiguous gates, the strided case the packed projection's slice
    assert not all(sys.modules[LOADED_FILE_MODULE].GATES_CONTIGUOUS)
    printed = capsys.readouterr().out
    assert "megatron_main file" in printed  # the summary's header names the source
    assert "not timed: megatron_main (head dim 48: megatron main's kernels" in printed
    csv_text = (out / "benchmark.csv").read_text()
    assert csv_text.count(",megatron_main,") == 3


@pytest.mark.interpreter
def test_a_case_the_peer_refuses_is_skipped_and_the_run_goes_on(cpu_run, monkeypatch,
                                                                tmp_path):
    """A ValueError (or NotImplementedError) from megatron main's function is its refusal of
    that case: recorded with the reason as not timed, and the next cases still run."""
    path = tmp_path / "fused_gated_norm.py"
    path.write_text(STAND_IN)
    peer = bench_common.load_megatron_main_fused_gated_norm(str(path))
    real_make_inputs = benchmark.make_inputs

    def zero_gate_at_two_rows(shape, *args, **kwargs):  # the stand-in refuses all-zero gates
        inputs = real_make_inputs(shape, *args, **kwargs)
        if shape[1] == 2:
            inputs[1].detach().zero_()
        return inputs

    monkeypatch.setattr(benchmark, "make_inputs", zero_gate_at_two_rows)
    results = cpu_run([(1, 2, 2, 64), SHAPE], [], ["eager", "megatron_main"], str(tmp_path),
                      peer)
    refused, timed = results["timings"]
    assert refused["not_timed"] == {"megatron_main": "refused: ValueError: an all-zero gate"}
    assert set(refused["impls"]) == {"eager"}
    assert set(timed["impls"]) == {"eager", "megatron_main"} and "not_timed" not in timed


@pytest.mark.interpreter
def test_megatron_main_is_detected_in_the_installed_megatron(cpu_run, monkeypatch, tmp_path):
    """Without the flag, a megatron that has megatron.core.fusions.fused_gated_norm (a stand-in
    module here) provides the peer."""
    module = types.ModuleType(bench_common.MEGATRON_MAIN_MODULE)
    exec(STAND_IN, module.__dict__)
    monkeypatch.setitem(sys.modules, bench_common.MEGATRON_MAIN_MODULE, module)
    results = cpu_run([SHAPE], [], ["eager", "megatron_main"], str(tmp_path))
    assert results["env"]["megatron_main"].startswith(
        "module megatron.core.fusions.fused_gated_norm (")
    assert set(results["timings"][0]["impls"]) == {"eager", "megatron_main"}
    assert module.GATES_CONTIGUOUS  # that module's function is what ran


@pytest.mark.interpreter
def test_an_absent_megatron_main_is_named_in_one_line(cpu_run, monkeypatch, tmp_path, capsys):
    """No megatron.core.fusions.fused_gated_norm (as in megatron-core 0.19) and no flag: the peer
    is left out, and the report of the run says why in one line."""
    monkeypatch.setitem(sys.modules, bench_common.MEGATRON_MAIN_MODULE, None)
    results = cpu_run([SHAPE], [], ["eager", "megatron_main"], str(tmp_path))
    assert set(results["timings"][0]["impls"]) == {"eager"}
    assert results["env"]["megatron_main"] is None
    why = results["absent_peers"]["megatron_main"]
    assert "has no megatron.core.fusions.fused_gated_norm" in why
    capsys.readouterr()
    benchmark.main(["--report", str(tmp_path / "benchmark.json"), "--out", str(tmp_path)])
    absent = [line for line in capsys.readouterr().out.splitlines() if "megatron_main" in line]
    assert absent == [f"megatron_main absent: {why}"]


@pytest.mark.parametrize("name, body", [("missing.py", None), ("notes.txt", "x = 1\n"),
                                        ("empty.py", "")])
def test_a_bad_megatron_main_file_fails_before_anything_runs(tmp_path, name, body):
    """Checked before the GPU is looked for (without one, that check would end the run)."""
    path = tmp_path / name
    if body is not None:
        path.write_text(body)
    with pytest.raises(ValueError, match=r"--megatron-fused-gated-norm .*must name an existing "
                                         r"\.py file that defines a callable fused_gated_norm"):
        benchmark.main(["--megatron-fused-gated-norm", str(path), "--out", str(tmp_path)])
    assert not (tmp_path / "benchmark.json").exists()


def test_the_megatron_main_flag_needs_the_peer_and_a_run(capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--impls", "ours,fla", "--megatron-fused-gated-norm", "f.py"])
    assert "--impls leaves out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--report", "b.json", "--megatron-fused-gated-norm", "f.py"])
    assert "--report times nothing" in capsys.readouterr().err
    assert benchmark.parse_args(["--megatron-fused-gated-norm", "f.py"]).impls.split(",") == list(
        benchmark.IMPLS)
