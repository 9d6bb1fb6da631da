"""The measurement scripts' pure logic, on the CPU: shapes, byte counts, rates, inputs, the host
timer's bookkeeping, the sweep's candidate blocks, and the parity-sources measurement under the
Triton interpreter."""

from __future__ import annotations

import types

import pytest
import torch

from tools import benchmark, host_cost, launch_sweep
from tools.bench_common import (bytes_moved, gbps, make_inputs, parse_positive_ints,
                                parse_shape, pct_of_ceiling, same_bytes_copy, shape_label)
from tools.host_cost import (OWN_WORK_PARTS, SAME_SIGNATURE_PARTS, HostTimer, measure_inside,
                             own_work_calls, own_work_units, same_signature_units)
from tools.launch_sweep import ALTERNATIONS, ELEMENTS_PER_THREAD, best_lines, candidate_blocks
from tools.parity_sources import parity_sources


def test_parse_shape():
    assert parse_shape("1x4096x32x128") == (1, 4096, 32, 128)
    for bad in ("1x4096x32", "1x0x32x128", "1x4096x32xD", "-1x2x3x4"):
        with pytest.raises(ValueError, match="BxSxHxD"):
            parse_shape(bad)


@pytest.mark.parametrize("text", ["4,8,16", "12"])
def test_parse_positive_ints(text):
    assert parse_positive_ints("--stages", text) == tuple(int(t) for t in text.split(","))


@pytest.mark.parametrize("text", ["", "4,,8", "0", "-1", "2.5", "three"])
def test_parse_positive_ints_rejects_anything_else(text):
    with pytest.raises(ValueError, match="--stages"):
        parse_positive_ints("--stages", text)


def test_shape_label():
    assert shape_label((2, 8192, 32, 128)) == "2x8192x32x128"
    assert shape_label((2, 8192, 32, 128), "sbhd") == "2x8192x32x128 sbhd"


def test_bytes_moved_and_rates():
    elements, rows = 1 * 4096 * 32 * 128, 1 * 4096 * 32
    moved = bytes_moved((1, 4096, 32, 128))
    assert moved == {"fwd": 6 * elements + 4 * rows, "bwd": 10 * elements + 4 * rows, "infer": 6 * elements}
    assert gbps(4_000_000, 1000.0) == pytest.approx(4.0)  # 4 MB in 1 ms
    assert pct_of_ceiling(4_000_000, 1000.0, 8.0) == pytest.approx(50.0)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.interpreter
def test_same_bytes_copy_moves_each_phase_s_bytes(backward):
    """The yardstick kernel reads two tensors and writes one (forward), or reads three and
    writes two (backward), over elements past one block."""
    n = 2048 + 5
    a, b, c = (torch.randn(n, dtype=torch.bfloat16) for _ in range(3))
    summed, copied = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    same_bytes_copy((a, b, c, summed, copied), backward)
    torch.testing.assert_close(summed, a + b)  # rounded (GPU) or truncated (interpreter)
    assert torch.equal(copied, c if backward else torch.zeros_like(c))


def test_strided_gate_is_a_slice_of_the_packed_projection():
    x, gate, weight, dy, leaves = make_inputs((2, 3, 4, 8), "strided_gate", device="cpu")
    packed = leaves[1]
    assert packed.shape == (2, 3, 64) and gate._base is packed
    assert gate.shape == x.shape == dy.shape and weight.shape == (8,)
    assert torch.equal(gate, packed[..., 32:].unflatten(-1, (4, 8)))
    assert all(t.requires_grad for t in leaves)
    again = make_inputs((2, 3, 4, 8), "strided_gate", device="cpu")
    assert torch.equal(again[0], x)  # seeded


def test_benchmark_shapes_include_tensor_parallel_ranks():
    rows = {s[0] * s[1] * s[2] for s in benchmark.SHAPES if s[3] == 128 and s[0] == 1}
    assert {16384, 32768, 65536, 131072, 262144} <= rows
    for heads in (4, 8, 16, 32):
        for seq in (4096, 8192):
            assert (1, seq, heads, 128) in benchmark.SHAPES
    for heads in (8, 16):
        assert (1, 4096, heads, 256) in benchmark.SHAPES
    assert len(benchmark.SHAPES) == len(set(benchmark.SHAPES))


def test_host_timer_keeps_mean_and_best_round():
    timer = HostTimer()
    timer.record("validation_us", [3.0, 2.0, 4.0])
    timer.record("direct_launcher_us", [10.0, 12.0, 11.0])
    timer.add_sum("validation_plus_launch_us", "validation_us", "direct_launcher_us")
    result = timer.result()
    assert result["validation_us"] == pytest.approx(3.0)
    assert result["validation_plus_launch_us"] == pytest.approx(14.0)
    assert result["best_round_us"] == {"validation_us": 2.0, "direct_launcher_us": 10.0,
                                       "validation_plus_launch_us": 12.0}


def test_measure_inside_times_only_the_inner_function_and_puts_it_back(monkeypatch):
    clock = iter(range(10**6))  # every reading of the clock is one second later
    monkeypatch.setattr(host_cost, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))

    def inner(value):
        return value + 1

    module = types.SimpleNamespace(inner=inner)
    results = []

    def outer():
        next(clock)  # time spent outside the inner function is not counted
        results.append(module.inner(1))

    timer = HostTimer(rounds=3, calls=4, warmup=2)
    measure_inside(timer, "inner_us", module, "inner", outer)
    assert results == [2] * (2 + 3 * 4) and module.inner is inner
    assert timer.mean["inner_us"] == timer.best["inner_us"] == 1e6  # one reading apart


def test_own_work_units_are_formed_per_interleaved_round():
    """The four timings of the figure of merit are taken in turn within each round and the
    ratio is formed per round: a round where the host ran at half speed scales all four alike
    and gives the same units."""
    calls = []
    timer = HostTimer(warmup=1)
    fns = {name: (lambda name=name: calls.append(name)) for name in OWN_WORK_PARTS}
    times = timer.measure_interleaved(fns, rounds=3, calls=2)
    assert calls[len(OWN_WORK_PARTS):len(OWN_WORK_PARTS) * 3] == [
        name for name in OWN_WORK_PARTS for _ in range(2)]  # after the warm-up: in turn
    assert all(len(t) == 3 for t in times.values())
    steady = {"forward_autograd_us": [40.0, 80.0], "backward_autograd_us": [150.0, 300.0],
              "ref_autograd_function_backward_us": [100.0, 200.0], "ref_torch_add_us": [10.0, 20.0]}
    units = own_work_units(steady)
    assert units["per_round"] == [pytest.approx(9.0), pytest.approx(9.0)]
    assert units["median"] == pytest.approx(9.0) and units["best_round"] == pytest.approx(9.0)
    timer.extra["own_work_units"] = units
    assert timer.result()["own_work_units"] is units


def test_same_signature_units_take_the_same_formula_with_the_reference_function():
    times = {"forward_autograd_us": [40.0], "backward_autograd_us": [150.0],
             "ref_autograd_function_backward_us": [100.0], "ref_torch_add_us": [10.0],
             "ref_same_signature_forward_us": [30.0], "ref_same_signature_backward_us": [130.0]}
    assert own_work_units(times)["per_round"] == [pytest.approx(9.0)]
    assert same_signature_units(times)["per_round"] == [pytest.approx(6.0)]


@pytest.mark.interpreter
def test_own_work_calls_run_and_the_same_signature_reference_mirrors_ours():
    """Every timed call runs on the CPU (interpreter), and the reference Function takes our
    Function's arguments and gives gradients of the same shapes."""
    x, g, w, dy, leaves = make_inputs((1, 4, 2, 16), device="cpu")
    calls = own_work_calls(x, g, w, dy, leaves, tiny=torch.zeros(16))
    assert set(calls) == set(OWN_WORK_PARTS) | set(SAME_SIGNATURE_PARTS)
    results = {name: call() for name, call in calls.items()}
    ours = results["backward_autograd_us"]
    reference = results["ref_same_signature_backward_us"]
    assert [t.shape for t in reference] == [t.shape for t in ours] == [x.shape, g.shape, w.shape]
    assert results["ref_same_signature_forward_us"].shape == results["forward_autograd_us"].shape


@pytest.mark.parametrize("dim", [64, 128, 256, 1000])
def test_sweep_candidates_keep_the_elements_per_thread_in_range(dim):
    blocks = candidate_blocks(dim)
    assert blocks
    width = 1 << (dim - 1).bit_length()
    low, high = ELEMENTS_PER_THREAD
    assert all(low <= bt * width // (32 * warps) <= high for bt, warps in blocks)
    if dim == 128:
        # the shipped forward and backward blocks, and the backward rule's 2-warp block
        assert {(16, 8), (4, 1), (4, 2)} <= set(blocks)


def test_sweep_best_lines_rank_by_time():
    results = [{"kernel": "fwd", "shape": (1, 8, 2, 128), "bt": bt, "warps": 4, "us": us, "pct": 1.0}
               for bt, us in ((8, 3.0), (16, 2.0))]
    results.append({"kernel": "fwd", "shape": (1, 8, 2, 128), "bt": 4, "warps": 2, "pdl": True,
                    "us": 2.5, "pct": 1.0, "shipped": True})
    fwd_line = best_lines(results)[0]
    assert fwd_line.startswith("fwd (1, 8, 2, 128): shipped bt4 w2 pdl 2.5 us")
    assert fwd_line.index("bt16") < fwd_line.index("bt8")


@pytest.mark.interpreter
def test_sweep_times_the_forwards_parts_in_turn(monkeypatch):
    """forward_parts runs each part once per alternation, every part before the next
    alternation, and reports the median of each; the launch into the output allocated once
    writes what the shipped forward returns."""
    order, outputs = [], []

    def one_run(fn):  # stands in for bench_graph: runs the part, "times" it by its position
        result = fn()
        if isinstance(result, tuple):  # forward_impl's (out, rstd)
            outputs.append(result[0].clone())
        order.append(fn)
        return float(len(order))

    monkeypatch.setattr(launch_sweep, "bench_graph", one_run)
    x, g, w, _, _ = make_inputs((1, 8, 2, 64), device="cpu")
    medians = launch_sweep.forward_parts(x.detach(), g.detach(), w.detach())
    names = ("forward_us", "forward_one_output_us", "same_bytes_copy_us")
    assert tuple(medians) == names
    assert len(order) == ALTERNATIONS * len(names)
    middle = ALTERNATIONS // 2
    assert medians == {name: float(middle * len(names) + i + 1) for i, name in enumerate(names)}
    assert len(outputs) == 2 * ALTERNATIONS
    assert all(torch.equal(out, outputs[0]) for out in outputs)


@pytest.mark.interpreter
def test_sweep_times_the_backwards_parts_in_turn(monkeypatch):
    """backward_parts runs each part (the interpreter runs the kernels) once per alternation,
    every part before the next alternation, and reports the median of each; the row kernel's
    partials, summed by the dW sum, give backward_impl's dW."""
    import core.fusions.fused_gated_norm as fgn

    order = []

    def one_run(fn):  # stands in for bench_graph: runs the part, "times" it by its position
        fn()
        order.append(fn)
        return float(len(order))

    monkeypatch.setattr(launch_sweep, "bench_graph", one_run)
    x, g, w, dy, _ = make_inputs((1, 8, 2, 64), device="cpu")
    x, g, w = x.detach(), g.detach(), w.detach()
    _, rstd = fgn.forward_impl(x, g, w, 1e-6)
    sums = []
    summing = fgn.launch_dw_sum.launch
    monkeypatch.setattr(fgn.launch_dw_sum, "launch",
                        lambda grid, tensors, prepared, device=None: (
                            summing(grid, tensors, prepared, device),
                            sums.append(tensors[1].clone())))
    medians = launch_sweep.backward_parts(x, g, w, rstd, dy)
    names = ("row_kernel_us", "row_kernel_then_empty_us", "row_kernel_then_dw_sum_us",
             "dw_sum_us", "torch_dw_sum_us", "same_bytes_copy_us")
    assert tuple(medians) == names
    assert len(order) == ALTERNATIONS * len(names)
    middle = ALTERNATIONS // 2  # the median alternation: part i ran at position middle * 6 + i + 1
    assert medians == {name: float(middle * len(names) + i + 1) for i, name in enumerate(names)}
    summed = list(sums)  # backward_impl below sums through the same wrapped launch
    assert len(summed) == 2 * ALTERNATIONS  # after the row kernel, and alone
    dweight = fgn.backward_impl(x, g, w, rstd, dy)[2]
    assert all(torch.equal(s, dweight) for s in summed)


@pytest.mark.interpreter
def test_parity_sources_on_the_cpu():
    """The interpreter's sum of squares (numpy's order) differs from torch's CPU one on ~16 % of
    rows and flips a rounding in a few of 8192 rows, by one ulp. Given our rstd, the unfused path
    equals our output but where the activation's last bit differs (numpy's exp against torch's;
    at most 1 element in 10^5, one ulp), and every other differing row has a differing rstd.
    The GPU test makes the same check at 1M rows."""
    result = parity_sources((1, 1024, 8, 128), device="cpu")
    assert result["rstd_vs_torch"]["differ"] > 0.05
    assert result["rows_with_a_difference"] > 0  # else the row check below checks nothing
    assert result["out_vs_unfused"]["max_ulp"] == 1
    with_our_rstd = result["out_vs_unfused_with_our_rstd"]
    assert with_our_rstd["differ"] <= 1e-5 and with_our_rstd["max_ulp"] <= 1
    activation_rows = round(with_our_rstd["differ"] * result["elements"])
    assert result["of_them_rstd_differs"] >= result["rows_with_a_difference"] - activation_rows


@pytest.mark.parametrize("argv, message", [
    (["--stages", "0"], "--stages '0': expected comma-separated positive integers"),
    (["--programs-per-sm", "8,x"], "--programs-per-sm '8,x': expected comma-separated positive integers"),
    (["--shapes", "1x2"], "shape '1x2': expected BxSxHxD with four positive integers"),
])
def test_launch_sweep_arguments_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        launch_sweep.main(argv)
    assert message in capsys.readouterr().err
