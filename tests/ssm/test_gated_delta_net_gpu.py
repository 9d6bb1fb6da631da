"""Megatron's GatedDeltaNet with FLA's kernels on a CUDA GPU, at Qwen3-Next's GDN shapes, flag
on vs off: the numerics contract on the layer's own tensors, the whole layer as accurate as
unfused, the gdn_norm_out recompute bit for bit, and (two GPUs) the out_norm dW after megatron's
finalize_model_grads at TP = 2 over NCCL equal to TP = 1. tools/gdn_layer.py records the same
quantities with the layer's speed and memory. The same checks at tiny sizes run on the CPU in
tests/ssm (gloo, Triton interpreter).

Needs megatron-core and fla-core; on Hopper, FLA 0.6's GDN backward needs triton >= 3.7.1.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.testing.gdn import fla_gdn_backward_unavailable
from tools.gdn_layer import LayerSetup, fwd_bwd, init_single_process, layer_parity

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.gpu

PARITY_SHAPE = (4096, 1)  # (sequence, batch)
LAYER_ERR_SLACK = 1.05  # FLA's bf16 kernels dominate the layer's error; the norm's own contract
#                         is checked on the norm section


requires_fla = pytest.mark.skipif(bool(fla_gdn_backward_unavailable()),
                                  reason=fla_gdn_backward_unavailable() or "-")
# deterministic_mode runs megatron's torch chunk rule and torch conv, so only FLA's l2norm (which
# megatron imports in any mode) is needed, at any triton.
requires_fla_installed = pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                                            reason="fla-core is not installed")


@pytest.fixture(scope="module")
def setup():
    layer = LayerSetup()
    init_single_process(layer)
    return layer


@pytest.fixture(scope="module")
def parity(setup):
    return layer_parity(setup, *PARITY_SHAPE)


@requires_fla
def test_norm_section_keeps_the_numerics_contract(parity):
    """On what the layer hands its output norm: the forward >= 99.9 % bitwise equal to megatron's
    eager unfused norm, within 2 ulp; out, dx, dgate, dW no less accurate against float64."""
    section = parity["norm_section"]
    assert section["out_bitwise_vs_eager"] >= 0.999
    assert section["out_max_ulp_vs_eager"] <= 2
    assert section["worst_err_ratio_fused_over_eager"] <= 1 + 1e-3, section["rel_err_vs_float64"]


@requires_fla
def test_whole_layer_is_as_accurate_as_unfused(parity):
    assert parity["out_bitwise_off_vs_off"] == 1.0  # flag off is repeatable
    assert parity["worst_layer_err_ratio_well_sampled"] <= LAYER_ERR_SLACK, (
        parity["rel_err_vs_fp32_layer"])


@requires_fla_installed
def test_recompute_of_the_norm_repeats_every_bit(setup):
    plain = setup.make_module(True, deterministic=True)
    recomputed = setup.make_module(True, deterministic=True, recompute_granularity="selective",
                                   recompute_modules=["gdn_norm_out"])
    recomputed.load_state_dict(plain.state_dict())
    x, dy = setup.inputs(*PARITY_SHAPE, seed=1)
    a, b = fwd_bwd(plain, x, dy), fwd_bwd(recomputed, x, dy)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(a[2][n], b[2][n]) for n in a[2])


@requires_fla
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (TP = 2 over NCCL)")
def test_tp2_out_norm_grad_equals_tp1(tmp_path):
    """tools/gdn_layer.py --tp 2 under torchrun: every case of core.testing.gdn_tp (flag on and
    off, SP on and off, fp32/bf16 params, DDP grad_reduce_in_fp32 and distributed optimizer on
    and off), the out_norm dW after finalize_model_grads against TP = 1, on every rank."""
    from core.testing.gdn_tp import CASES

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "tools/gdn_layer.py", "--tp", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = json.loads((tmp_path / "gdn_layer_tp2.json").read_text())["tp"]
    assert len(cases) == len(CASES)
    for name, case in cases.items():
        assert case["ranks_identical"], name
        assert case["rel_err_vs_tp1"] <= case["tolerance"], name
