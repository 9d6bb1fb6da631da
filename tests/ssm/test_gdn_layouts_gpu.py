"""The layout matrix on GPUs over NCCL (``pytest -m gpu``), with the fused norm, against the
eager TP 1 / CP 1 step of the same model (core.testing.parallel, the harness of
tests/ssm/test_gdn_layouts.py). On 2 GPUs, the layouts that the CPU cannot run, or runs only
through stand-ins:

  * cp2      GDN's all-to-all context parallelism, sbhd (megatron's torch chunk rule);
  * thd-cp2  packed THD sequences with CP 2 on FLA's Triton kernels (the CPU runs torch
             stand-ins of them);
  * fsdp-tp2 Megatron-FSDP (``FullyShardedDataParallel``, optim_grads_params) at TP 2, which
             needs CUDA: ``MegatronFSDP.__init__`` compares its device with
             ``torch.device(f"cuda:{torch.cuda.current_device()}")`` (no NVIDIA driver on the
             CPU machines) and creates ``torch.cuda.Stream()`` side streams.

On one GPU, what megatron's training loop adds around a step, on CUDA (the CPU matrix runs them
at TP 2 on gloo): two steps with ``overlap_param_gather``, fp16 under the dynamic loss scaler,
the per-token loss over 2 micro-batches, DDP's ``average_in_collective``.

Every layout runs a second time with the fused pre-recurrence region
(``Layout.pre_fusion``: gdn_pre_gated_delta_rule_fusion), against the same reference.

Each case checks the out_norm weight gradient after the stock finalize_model_grads against the
TP 1 gradient, then every parameter's, then the replicas after the optimizer step.
"""

import dataclasses
import os

import pytest
import torch

from core.testing.gdn import fla_gdn_backward_unavailable
from core.testing.parallel import (Layout, case_key, grad_errors, grad_mismatches,
                                   reference_worker, replica_mismatches, spawn_layouts, tolerance,
                                   twin_mismatches)

pytestmark = pytest.mark.gpu
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices (NCCL); the CPU runs tests/ssm/test_gdn_layouts.py")
needs_a_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device; the CPU runs tests/ssm/test_gdn_layouts.py")



def _with_pre_fusion(layouts: tuple) -> tuple:
    """``layouts``, then each of them with the fused pre-recurrence region."""
    return layouts + tuple(dataclasses.replace(layout, pre_fusion=True) for layout in layouts)


def _layout_id(layout: Layout) -> str:
    return case_key(layout, True).removesuffix("-fused")


LAYOUTS = _with_pre_fusion((
    Layout("cp2", cp=2),
    Layout("thd-cp2", cp=2, packed=True),
    Layout("fsdp-tp2", tp=2, fsdp=True),
))
# Packed sequences run FLA's kernels (megatron refuses them in deterministic_mode).
FLA_UNAVAILABLE = fla_gdn_backward_unavailable()
RUN_LAYOUTS = tuple(layout for layout in LAYOUTS if not (layout.packed and FLA_UNAVAILABLE))
GPU_REFERENCE_CASES = ((("gdn", "sbhd", True),)
                       + ((("gdn", "thd", True),) if not FLA_UNAVAILABLE else ()))
# GPU: cuBLAS / FLA pick kernels by shape, and the shapes differ between the TP 1 run and a rank
# (fewer heads, other token counts): 10x the CPU tolerances. A missing or doubled reduction is
# off by O(1).
TOLERANCE_FACTOR = 10.0


# two steps, the second's parameters gathered in the optimizer step or by DDP's pre-hooks
ONE_GPU_TWINS = (
    Layout("overlap-distopt-2steps", overlap_grad_reduce=True, distributed_optimizer=True,
           steps=2),
    Layout("overlap-param-gather-2steps", overlap_grad_reduce=True, distributed_optimizer=True,
           overlap_param_gather=True, steps=2),
)
PRE_FUSION_TWINS = tuple(dataclasses.replace(layout, pre_fusion=True) for layout in ONE_GPU_TWINS)
ONE_GPU_LAYOUTS = _with_pre_fusion((
    *ONE_GPU_TWINS,
    Layout("fp16", fp16=True),
    Layout("mb2-per-token-loss", micro_batches=2, per_token_loss=True),
    Layout("avg-in-collective-distopt", average_in_collective=True, distributed_optimizer=True),
))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The path of the TP 1 reference, computed on the GPU in its own process (this one holds no
    process group and no CUDA context)."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("layouts_gpu_reference")
    path = str(tmp / "reference.pt")
    mp.spawn(reference_worker, nprocs=1, join=True,
             args=(os.path.join(tmp, "rendezvous_reference"), path, GPU_REFERENCE_CASES))
    return path


@pytest.fixture(scope="module")
def ranks(reference, tmp_path_factory):
    return spawn_layouts(RUN_LAYOUTS, reference, str(tmp_path_factory.mktemp("layouts_gpu")),
                         fused_values=(True,))


@pytest.fixture(scope="module")
def one_gpu_ranks(reference, tmp_path_factory):
    return spawn_layouts(ONE_GPU_LAYOUTS, reference,
                         str(tmp_path_factory.mktemp("layouts_one_gpu")), fused_values=(True,))


@needs_two_gpus
@pytest.mark.parametrize("layout", LAYOUTS, ids=[_layout_id(layout) for layout in LAYOUTS])
def test_out_norm_gradient_matches_tp1(ranks, layout):
    if layout.packed and FLA_UNAVAILABLE:
        pytest.skip(FLA_UNAVAILABLE)
    _check(ranks, layout)


@needs_a_gpu
@pytest.mark.parametrize("layout", ONE_GPU_LAYOUTS,
                         ids=[_layout_id(layout) for layout in ONE_GPU_LAYOUTS])
def test_training_options_match_the_reference_on_one_gpu(one_gpu_ranks, layout):
    _check(one_gpu_ranks, layout)


@needs_a_gpu
@pytest.mark.parametrize("twins", [ONE_GPU_TWINS, PRE_FUSION_TWINS],
                         ids=["output-norm-fusion", "pre-fusion"])
def test_overlapped_param_gather_equals_gather_in_the_optimizer_step_on_one_gpu(one_gpu_ranks,
                                                                                twins):
    gathered_in_step, overlapped = ([rank[case_key(layout, True)] for rank in one_gpu_ranks]
                                    for layout in twins)
    assert len(gathered_in_step) == 1 and len(gathered_in_step[0]["later_grads"]) == 1
    assert twin_mismatches(gathered_in_step, overlapped) == []


def _check(ranks, layout) -> None:
    key = case_key(layout, True)
    records = [rank[key] for rank in ranks]
    for rank, record in enumerate(records):
        if "error" in record:
            pytest.fail(f"{key} raised on rank {rank}:\n{record['error']}")
    assert all(record["pre_fused_modules"] == [layout.pre_fusion] for record in records)
    errors = grad_errors(records)
    out_norm = errors["out_norm.weight"]
    print(f"{key}: out_norm.weight rel err {out_norm:.2e}; largest of all parameters "
          f"{max(errors.values()):.2e}")
    assert out_norm <= tolerance("out_norm.weight", layout.fp16) * TOLERANCE_FACTOR
    mismatches = grad_mismatches(records, tolerance_factor=TOLERANCE_FACTOR)
    print("\n".join(mismatches))
    assert mismatches == []
    assert replica_mismatches(records) == []
