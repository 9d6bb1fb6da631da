"""The GPU check scripts cost device time to run, so a broken one is found late. Their CPU dry
runs (tiny shapes, megatron's torch chunk path, the Triton interpreter) run here: every stage
must run and every check must pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_check_gdn_layer_smoke_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "tests/gpu/check_gdn_layer.py", "--smoke-cpu"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "check_gdn_layer.json").read_text())
    assert {"parity", "recompute", "perf", "breakdown"} <= set(results)
    for split in results["breakdown"].values():  # the profiler attributed time to both variants
        assert split["unfused"]["kernel_ms"] > 0 and split["fused"]["kernel_ms"] > 0
        assert split["unfused"]["copy_calls"] > split["fused"]["copy_calls"]  # the copies removed
    checks = results["checks"]
    assert any(name.startswith("norm section") for name in checks)
    assert all(c["ok"] for c in checks.values()), checks
