"""Megatron's GatedDeltaNet with FLA's kernels on a CUDA GPU, at Qwen3-Next's GDN shapes, flag
on vs off: the numerics contract on the layer's own tensors, the whole layer as accurate as
unfused, the gdn_norm_out recompute bit for bit, and (two GPUs) the out_norm dW after megatron's
finalize_model_grads at TP = 2 over NCCL equal to TP = 1. tools/gdn_layer.py records the same
quantities with the layer's speed and memory. The same checks at tiny sizes run on the CPU in
tests/ssm (gloo, Triton interpreter).

Needs megatron-core and fla-core; on Hopper, FLA 0.6's GDN backward needs triton >= 3.7.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # the TP worker, started by torchrun from the test below
    sys.path.insert(0, str(ROOT))

from tools.gdn_layer import QWEN3_NEXT, LayerSetup, fwd_bwd, init_single_process, layer_parity  # noqa: E402

pytestmark = pytest.mark.gpu

PARITY_SHAPE = (4096, 1)  # (sequence, batch)
LAYER_ERR_SLACK = 1.05  # FLA's bf16 kernels dominate the layer's error; the norm's own contract
#                         is checked on the norm section
TP_SEQ = 256


def _fla_gdn_backward_missing() -> str:
    """Why FLA's GDN kernels cannot run here ('' when they can)."""
    try:
        import fla  # noqa: F401
        import triton
    except ImportError as e:
        return f"fla-core is not installed ({e})"
    if not torch.cuda.is_available():
        return ""  # the gpu marker skips the test already
    hopper = torch.cuda.get_device_capability()[0] == 9
    version = tuple(int(p) for p in triton.__version__.split(".")[:3] if p.isdigit())
    if hopper and version < (3, 7, 1):
        return f"FLA 0.6's GDN backward needs triton >= 3.7.1 on Hopper (installed: {triton.__version__})"
    return ""


requires_fla = pytest.mark.skipif(bool(_fla_gdn_backward_missing()), reason=_fla_gdn_backward_missing() or "-")


@pytest.fixture(scope="module")
def setup():
    from core.testing.cpu import patch_checkpoint_without_output_fp8

    patch_checkpoint_without_output_fp8()  # gdn_norm_out recompute without Transformer Engine
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
    assert parity["worst_layer_err_ratio_well_sampled"] <= LAYER_ERR_SLACK, parity["rel_err_vs_fp32_layer"]


@requires_fla
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
    out = tmp_path / "tp2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(Path(__file__)), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = json.loads(out.read_text())
    assert cases
    for name, case in cases.items():
        assert case["ranks_identical"], name
        assert case["rel_err_vs_tp1"] <= case["tolerance"], name


def tp_worker(out_path: str) -> None:
    """One rank of the TP run: the TP = 1 reference on every rank (same seeds), then TP = 2;
    rank 0 writes, per case, the out_norm dW's error against TP = 1 and whether the ranks agree."""
    import tempfile

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from core.testing.gdn_tp import CASES, case_name, make_reference, ref_key, rel_err, run_rank, tolerance

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, tp = torch.distributed.get_rank(), torch.distributed.get_world_size()
    sizes = dict(QWEN3_NEXT)
    hidden = sizes.pop("hidden_size")
    scratch = tempfile.mkdtemp(prefix=f"gdn_tp_rank{rank}_")
    ref_path = os.path.join(scratch, "ref.pt")
    for size in (1, tp):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=size)
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
        if size == 1:
            make_reference(ref_path, seq=TP_SEQ, batch=2, deterministic_mode=True, hidden_size=hidden, **sizes)
    results = run_rank(rank, tp, ref_path, os.path.join(scratch, f"tp_rank{rank}.pt"))
    ref = torch.load(ref_path, weights_only=False)["ref"]
    summary = {}
    for case in CASES:
        got = results[case_name(case)]["after"].cuda()
        gathered = [torch.zeros_like(got) for _ in range(tp)]
        torch.distributed.all_gather(gathered, got)
        summary[case_name(case)] = {"rel_err_vs_tp1": rel_err(got.cpu(), ref[ref_key(case)]["dw"]),
                                    "tolerance": tolerance(case),
                                    "ranks_identical": all(torch.equal(gathered[0], g) for g in gathered)}
    if rank == 0:
        Path(out_path).write_text(json.dumps(summary, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    tp_worker(sys.argv[1])
