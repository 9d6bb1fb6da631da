"""The layout matrix on 2 GPUs over NCCL (``pytest -m gpu``): the layouts that the CPU cannot
run, or runs only through stand-ins, with the fused norm, against the eager TP 1 / CP 1 step of
the same model (core.testing.parallel, the harness of tests/ssm/test_gdn_layouts.py):

  * cp2      GDN's all-to-all context parallelism, sbhd (megatron's torch chunk rule);
  * thd-cp2  packed THD sequences with CP 2 on FLA's Triton kernels (the CPU runs torch
             stand-ins of them);
  * fsdp-tp2 Megatron-FSDP (``FullyShardedDataParallel``, optim_grads_params) at TP 2, which
             needs CUDA: ``MegatronFSDP.__init__`` compares its device with
             ``torch.device(f"cuda:{torch.cuda.current_device()}")`` (no NVIDIA driver on the
             CPU machines) and creates ``torch.cuda.Stream()`` side streams.

Each case checks the out_norm weight gradient after the stock finalize_model_grads against the
TP 1 gradient, then every parameter's, then the replicas after the optimizer step.
"""

import os

import pytest
import torch

from core.testing.gdn import fla_gdn_backward_unavailable
from core.testing.parallel import (FP32_TOLERANCE, Layout, case_key, grad_errors,
                                   grad_mismatches, reference_worker, replica_mismatches,
                                   spawn_layouts)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason="needs 2 CUDA devices (NCCL); the CPU runs tests/ssm/test_gdn_layouts.py"),
]

LAYOUTS = (
    Layout("cp2", cp=2),
    Layout("thd-cp2", cp=2, packed=True),
    Layout("fsdp-tp2", tp=2, fsdp=True),
)
# Packed sequences run FLA's kernels (megatron refuses them in deterministic_mode).
FLA_UNAVAILABLE = fla_gdn_backward_unavailable()
RUN_LAYOUTS = tuple(layout for layout in LAYOUTS if not (layout.packed and FLA_UNAVAILABLE))
GPU_REFERENCE_CASES = (("gdn", "sbhd", True),) + ((("gdn", "thd", True),) if not FLA_UNAVAILABLE else ())
# GPU: cuBLAS / FLA pick kernels by shape, and the shapes differ between the TP 1 run and a rank
# (fewer heads, other token counts): 10x the CPU tolerances. A missing or doubled reduction is
# off by O(1).
TOLERANCE_FACTOR = 10.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("layouts_gpu")
    reference = str(tmp / "reference.pt")
    # the reference in its own process: this one holds no process group and no CUDA context
    mp.spawn(reference_worker, nprocs=1, join=True,
             args=(os.path.join(tmp, "rendezvous_reference"), reference, GPU_REFERENCE_CASES))
    return spawn_layouts(RUN_LAYOUTS, reference, str(tmp), fused_values=(True,))


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_out_norm_gradient_matches_tp1(ranks, layout):
    if layout.packed and FLA_UNAVAILABLE:
        pytest.skip(FLA_UNAVAILABLE)
    key = case_key(layout, True)
    records = [rank[key] for rank in ranks]
    for rank, record in enumerate(records):
        if "error" in record:
            pytest.fail(f"{key} raised on rank {rank}:\n{record['error']}")
    errors = grad_errors(records)
    out_norm = errors["out_norm.weight"]
    print(f"{key}: out_norm.weight rel err {out_norm:.2e}; largest of all parameters "
          f"{max(errors.values()):.2e}")
    assert out_norm <= FP32_TOLERANCE * TOLERANCE_FACTOR
    mismatches = grad_mismatches(records, tolerance_factor=TOLERANCE_FACTOR)
    print("\n".join(mismatches))
    assert mismatches == []
    assert replica_mismatches(records) == []
