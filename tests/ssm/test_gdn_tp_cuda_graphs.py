"""The out_norm weight gradient of a GDN TransformerLayer (flag on, bf16, megatron's DDP and
finalize_model_grads) at TP 2 with sequence parallelism, and at TP 2 under megatron's local
CUDA graphs (cuda_graph_impl="local", forward and backward captured and replayed), equals the
eager TP 1 step's on both ranks: the scaling of the partial dW happens once, inside the captured
backward. core/testing/gdn_layer_tp.py has the cases.

GPU (2 CUDA devices, NCCL):

    python -m pytest tests/ssm/test_gdn_tp_cuda_graphs.py -m gpu -v

The eager cases also run on the CPU (gloo, Triton interpreter) as a dry run of the harness."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from core.testing.gdn_layer_tp import spawn_worker
from core.testing.gdn_tp import rel_err, tolerance

TP = 2
BF16_TOLERANCE = tolerance({"dtype": "bf16"})  # about one bf16 ulp of the largest element
EXPECTED_SCALE = {"tp2-sp": 1.0, "tp2": 2.0, "tp2-cuda-graph": 2.0}


def _run(tmp_path, cuda_graphs: bool, env: dict = None) -> list:
    """Spawn the TP ranks (with ``env`` added to the environment they inherit); their results."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        mp.spawn(spawn_worker, args=(TP, str(tmp_path / "rdv"), str(tmp_path), cuda_graphs),
                 nprocs=TP, join=True)
    return [torch.load(os.path.join(tmp_path, f"rank{r}.pt"), weights_only=False)
            for r in range(TP)]


def _check_matches_tp1(ranks: list, case: str) -> None:
    for rank, results in enumerate(ranks):
        expected, got = results["tp1"]["dw"], results[case]["dw"]
        assert got.dtype == torch.float32  # grad_reduce_in_fp32
        err = rel_err(got, expected)
        assert err <= BF16_TOLERANCE, f"{case} rank {rank}: rel err {err:.2e} vs TP 1"
        assert results[case]["grad_scale"] == EXPECTED_SCALE[case]
    assert torch.equal(ranks[0][case]["dw"], ranks[1][case]["dw"]), f"{case}: ranks differ"


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < TP,
                              reason="needs 2 CUDA devices (TP 2 over NCCL, CUDA graphs)")


@pytest.fixture(scope="module")
def gpu_ranks(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("tp_cuda_graphs"), cuda_graphs=True)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("case", ["tp2-sp", "tp2"])
def test_tp2_matches_tp1_over_nccl(gpu_ranks, case):
    _check_matches_tp1(gpu_ranks, case)


@pytest.mark.gpu
@two_gpus
def test_tp2_under_local_cuda_graphs_matches_tp1(gpu_ranks):
    for rank, results in enumerate(gpu_ranks):
        if "error" in results["tp2-cuda-graph"]:
            pytest.fail(f"rank {rank}:\n{results['tp2-cuda-graph']['error']}")
    _check_matches_tp1(gpu_ranks, "tp2-cuda-graph")
    for results in gpu_ranks:
        graphed = results["tp2-cuda-graph"]
        assert graphed["graphs"] and all(fwd and bwd for fwd, bwd in graphed["graphs"])
        assert graphed["python_norm_calls_in_replay"] == 0  # step 2 replayed the graphs
        # the recorded eager step and the replayed one give the same gradient
        assert rel_err(graphed["dw"], graphed["eager_dw"]) <= BF16_TOLERANCE


@pytest.mark.skipif(torch.cuda.device_count() >= TP,
                    reason="the GPU tests above run these cases over NCCL")
@pytest.mark.interpreter_backward  # the ranks interpret the kernels
def test_eager_cases_cpu_dry_run(tmp_path):
    """The harness's eager cases (TP 2 + SP, TP 2) on gloo: the GPU test's code path runs. The
    ranks see no GPU (on a machine with one GPU, too few for the GPU tests, as on one without)."""
    ranks = _run(tmp_path, cuda_graphs=False,
                 env={"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"})
    for case in ("tp2-sp", "tp2"):
        _check_matches_tp1(ranks, case)
