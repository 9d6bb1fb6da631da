"""tools/host_profile.py on the CPU: it runs with every launch stubbed and reports our own host
work as the difference of its timings, in units of the tiny op timed beside them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.interpreter_backward
def test_host_profile_reports_own_work_from_its_timings():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "tools/host_profile.py", "--rounds", "2", "--calls", "5"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    values = {name: float(value) for name, value in (line.split() for line in proc.stdout.splitlines())}
    assert {"forward_autograd_us", "backward_autograd_us", "ref_autograd_function_backward_us",
            "ref_torch_add_us", "ref_same_signature_forward_us", "ref_same_signature_backward_us",
            "validation_us", "own_us", "own_units", "same_signature_units"} == set(values)
    trivial = values["ref_autograd_function_backward_us"]
    own = values["forward_autograd_us"] + values["backward_autograd_us"] - trivial
    assert values["own_us"] == pytest.approx(own, abs=0.02)  # printed with two decimals
    assert values["own_units"] == pytest.approx(values["own_us"] / values["ref_torch_add_us"],
                                                rel=0.01)
    signature = (values["ref_same_signature_forward_us"]
                 + values["ref_same_signature_backward_us"] - trivial)
    assert values["same_signature_units"] == pytest.approx(
        signature / values["ref_torch_add_us"], rel=0.01, abs=0.02)


@pytest.mark.parametrize("flag", ["--rounds", "--calls"])
def test_counts_must_be_positive(flag):
    proc = subprocess.run([sys.executable, "tools/host_profile.py", flag, "0"], cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and f"{flag} must be >= 1, got 0" in proc.stderr
