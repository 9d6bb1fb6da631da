"""tools/gdn_layer.py on the CPU: its kernel grouping, and a dry run of the script at tiny sizes
(megatron's torch chunk path, the Triton interpreter) that must write every section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.gdn_layer import kernel_group

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name, group", [
    ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", "copies"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("triton_poi_fused__to_copy_mul_0", "rest"),  # inductor's fused math, casts included
    ("gated_norm_fwd", "rest"),
    ("void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>", "fills"),
    ("Memset (Device)", "fills"),
    ("ampere_bf16_s16816gemm", "rest"),
])
def test_kernel_group(name, group):
    assert kernel_group(name) == group


def test_cpu_dry_run_writes_every_section(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "tools/gdn_layer.py", "--cpu", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gdn_layer.json").read_text())
    assert {"parity", "perf", "breakdown"} <= set(results)
    section = results["parity"]["norm_section"]
    assert section["out_bitwise_vs_eager"] == 1.0  # the CPU's summation orders agree
    assert set(section["rel_err_vs_float64"]) == {"out", "dx", "dgate", "dweight"}
    assert set(results["perf"]) == {"S=64 B=2 off", "S=64 B=2 on"}
    for split in results["breakdown"].values():
        assert split["unfused"]["kernel_ms"] > 0 and split["fused"]["kernel_ms"] > 0
        assert split["unfused"]["copy_calls"] > split["fused"]["copy_calls"]  # the copies removed
