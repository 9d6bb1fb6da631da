"""tools/host_cost.py's bookkeeping on the CPU: the host timer, the timing of an inner function,
and the units formed per interleaved round."""

from __future__ import annotations

import types

import pytest
import torch

from tools import host_cost
from tools.bench_common import make_inputs
from tools.host_cost import (OWN_WORK_PARTS, SAME_SIGNATURE_PARTS, HostTimer, measure_after,
                             measure_inside, own_work_calls, own_work_units, same_signature_units)


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


def test_measure_after_times_each_call_alone_right_after_its_predecessor(monkeypatch):
    clock = iter(range(10**6))  # every reading of the clock is one second later
    monkeypatch.setattr(host_cost, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    order = []

    def before():
        next(clock)  # time spent in the predecessor is not counted
        order.append("before")

    timer = HostTimer(rounds=2, calls=3, warmup=1)
    measure_after(timer, "call_us", before, lambda: order.append("call"))
    assert order == ["before", "call"] * (1 + 2 * 3)
    assert timer.mean["call_us"] == timer.best["call_us"] == 1e6  # one reading apart


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
    assert units["median"] == pytest.approx(9.0)
    assert units["quartiles"] == [pytest.approx(9.0), pytest.approx(9.0)]
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


def test_units_report_quartiles_not_the_fastest_round():
    """The fastest round of a difference is the round whose subtracted terms were disturbed
    most: the quartiles say how the rounds spread instead."""
    times = {"forward_autograd_us": [40.0] * 4, "backward_autograd_us": [150.0] * 4,
             "ref_autograd_function_backward_us": [100.0, 100.0, 100.0, 180.0],  # one disturbed
             "ref_torch_add_us": [10.0] * 4}
    units = own_work_units(times)
    assert units["per_round"][3] == pytest.approx(1.0) and units["median"] == pytest.approx(9.0)
    low, high = units["quartiles"]
    assert low < 9.0 <= high and "best_round" not in units
