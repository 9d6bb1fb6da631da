"""tools/host_profile.py on the CPU: it runs with every launch stubbed and reports our own host
work as the difference of its timings, in units of the tiny op timed beside them."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.interpreter_backward
def test_host_profile_reports_own_work_from_its_timings():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "tools/host_profile.py", "--rounds", "3", "--calls", "5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    values = {name: float(value)
              for name, value in (line.split() for line in proc.stdout.splitlines())}
    assert {"forward_autograd_us", "backward_autograd_us", "ref_autograd_function_backward_us",
            "ref_torch_add_us", "ref_same_signature_forward_us", "ref_same_signature_backward_us",
            "validation_us", "own_units", "own_units_q1", "own_units_q3",
            "same_signature_units"} == set(values)
    # differences of timings: their sign is the host's, only the quartiles' order is the tool's
    assert all(math.isfinite(value) for value in values.values())
    assert values["own_units_q1"] <= values["own_units"] <= values["own_units_q3"]


@pytest.mark.interpreter  # the calls it times take CPU tensors, as in the tool's own process
@pytest.mark.interpreter_backward
def test_units_are_host_costs_per_round_formula(monkeypatch):
    """host_profile forms the units as host_cost does: per round, then the median, from the
    rounds it timed (here fixed timings: a round at half speed gives the same units)."""
    from tools import host_profile
    from tools.host_cost import HostTimer, own_work_units, same_signature_units

    times = {"forward_autograd_us": [40.0, 80.0, 44.0],
             "backward_autograd_us": [150.0, 300.0, 150.0],
             "ref_autograd_function_backward_us": [100.0, 200.0, 100.0],
             "ref_torch_add_us": [10.0, 20.0, 10.0],
             "ref_same_signature_forward_us": [30.0, 60.0, 30.0],
             "ref_same_signature_backward_us": [120.0, 240.0, 120.0],
             "validation_us": [2.0, 4.0, 2.0]}
    monkeypatch.setattr(HostTimer, "measure_interleaved", lambda self, fns, rounds, calls: times)
    result = host_profile.measure(rounds=3, calls=1)
    assert result["own_units"] == own_work_units(times)["median"] == pytest.approx(9.0)
    assert result["same_signature_units"] == same_signature_units(times)["median"]
    assert result["forward_autograd_us"] == 44.0  # the median over the rounds


@pytest.mark.parametrize("flag", ["--rounds", "--calls"])
def test_counts_must_be_positive(flag):
    proc = subprocess.run([sys.executable, "tools/host_profile.py", flag, "0"], cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and f"{flag} must be >= 1, got 0" in proc.stderr
