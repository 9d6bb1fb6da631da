"""TP = 2 and TP = 4 on gloo (spawned CPU processes): one GatedDeltaNet layer wrapped in
megatron's real DistributedDataParallel (grad_reduce_in_fp32 and use_distributed_optimizer on and
off; fp32 and bf16 params, so main_grad is fp32 or bf16), then the stock finalize_model_grads and
megatron's optimizer step. The out_norm weight gradient (DDP's main_grad) equals the TP = 1
gradient on every rank and is bitwise identical across the ranks, with sequence parallelism on
and off, fused and unfused paths; so is the weight after the optimizer step. The weight carries
no hook and no Python object (torch.load(weights_only=True) takes it), and a megatron that sums
the out_norm gradient itself is left to do so alone. Under megatron's torch FSDP2 wrapper
(TorchFullyShardedDataParallel) the gradient after finalize_model_grads equals the TP = 1 one
too."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from core.testing.cpu import init_cpu_model_parallel
from core.testing.gdn_tp import (CASES, MEGATRON_SUMS_CASES, TORCH_FSDP2_CASES, TP_OVERRIDES,
                                 case_name, make_reference, ref_key, rel_err, spawn_worker,
                                 tolerance)

pytestmark = pytest.mark.cpu_shims

TP_SIZES = (2, 4)
SEQ = 24  # divisible by every TP size (sequence parallelism splits it)
TP_TAG = "average_gradients_across_tp_domain"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """TP = 1 reference, shared by the TP sizes (the layer sizes split over TP 1, 2, 4, 8)."""
    tmp = tmp_path_factory.mktemp("gdn_tp_ref")
    init_cpu_model_parallel(tp_size=1)
    ref_path = str(tmp / "ref.pt")
    make_reference(ref_path, seq=SEQ, **TP_OVERRIDES)
    return ref_path, torch.load(ref_path, weights_only=False)["ref"]


@pytest.fixture(scope="module", params=TP_SIZES, ids=[f"tp{t}" for t in TP_SIZES])
def tp_results(request, reference, tmp_path_factory):
    tp = request.param
    ref_path, ref = reference
    tmp = tmp_path_factory.mktemp(f"gdn_tp{tp}")
    mp.spawn(spawn_worker, args=(tp, str(tmp / "rdv"), ref_path, str(tmp)), nprocs=tp, join=True)
    ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(tp)]
    return tp, ref, ranks


def _check_grad_matches_tp1(tp, ref, ranks, case, name):
    expected = ref[ref_key(case)]["dw"]
    tol = tolerance(case)
    for rank, results in enumerate(ranks):
        got = results[name]
        assert got["grad_is_none"], "megatron's DDP moves .grad into main_grad"
        assert got["main_grad_dtype"] == ref[ref_key(case)]["main_grad_dtype"]
        assert got["after"].dtype == expected.dtype
        err = rel_err(got["after"], expected)
        assert err <= tol, f"{name} TP {tp} rank {rank}: rel err {err:.2e} > {tol:.0e}"
    # every rank ends with the same bits; before the reduction each held scale x its partial
    for r in range(1, tp):
        assert torch.equal(ranks[0][name]["after"], ranks[r][name]["after"]), (name, r)
        assert not torch.allclose(ranks[0][name]["before"], ranks[r][name]["before"])
    scale = ranks[0][name]["grad_scale"]
    partial_sum = sum(ranks[r][name]["before"] for r in range(tp)) / scale
    assert rel_err(partial_sum, expected.float()) <= tol


@pytest.mark.parametrize("case", CASES, ids=[case_name(c) for c in CASES])
def test_out_norm_grad_matches_tp1_on_every_rank(tp_results, case):
    tp, ref, ranks = tp_results
    name = case_name(case)
    _check_grad_matches_tp1(tp, ref, ranks, case, name)
    # megatron-core 0.19 sums the weight's grad over TP itself only with sequence parallelism
    # (its sequence_parallel tag); without it the backward scales by tp and finalize averages.
    for results in ranks:
        got = results[name]
        if case["sequence_parallel"]:
            assert got["grad_scale"] == 1.0 and not got["avg_tag"]
        else:
            assert got["grad_scale"] == float(tp) and got["avg_tag"]


@pytest.mark.parametrize("case", CASES, ids=[case_name(c) for c in CASES])
def test_out_norm_weight_identical_on_every_rank_after_optimizer_step(tp_results, case):
    tp, _, ranks = tp_results
    name = case_name(case)
    stepped = [results[name]["weight_after_step"] for results in ranks]
    assert all(results[name]["update_ok"] for results in ranks)
    assert not torch.equal(stepped[0], ranks[0][name]["weight_before_step"])  # it did move
    for r in range(1, tp):
        assert torch.equal(stepped[0], stepped[r]), (name, r)


@pytest.mark.parametrize("case", [c for c in CASES if c["grad_reduce_in_fp32"]
                                  and not c["distributed_optimizer"]],
                         ids=[case_name(c) for c in CASES if c["grad_reduce_in_fp32"]
                              and not c["distributed_optimizer"]])
def test_out_norm_weight_has_no_hook_and_loads_with_weights_only(tp_results, case):
    """No hook and only plain tags on the parameter: torch.save of it loads back with
    weights_only=True at TP > 1, flag on and off, tags included."""
    tp, _, ranks = tp_results
    for results in ranks:
        got = results[case_name(case)]
        assert got["backward_hooks"] == 0
        assert {t for t, _ in got["attrs"].values()} <= {"bool"}, got["attrs"]
        assert got["load_error"] is None, got["load_error"]
        assert got["loaded_equal"]
        assert got["loaded_attrs"] == {k: v for k, (_, v) in got["attrs"].items()}
        assert got["attrs"].get(TP_TAG, ("bool", False))[1] == (not case["sequence_parallel"])


@pytest.mark.parametrize("case", MEGATRON_SUMS_CASES,
                         ids=[case_name(c) for c in MEGATRON_SUMS_CASES])
def test_megatron_that_sums_out_norm_grad_itself_gets_tp1_grad(tp_results, case):
    """Under core.testing.gdn_tp.megatron_summing_out_norm_grad (a finalize_model_grads that
    SUM-reduces every *out_norm.weight itself), the module sees it, neither scales nor tags, and
    the gradient is the TP = 1 one (scaling as well would give tp x)."""
    tp, ref, ranks = tp_results
    name = f"megatron-sums-{case_name(case)}"
    for results in ranks:
        assert results[name]["grad_scale"] == 1.0 and not results[name]["avg_tag"]
    _check_grad_matches_tp1(tp, ref, ranks, case, name)


@pytest.mark.parametrize("case", [c for c in CASES if c["dtype"] == "fp32"
                                  and c["grad_reduce_in_fp32"]],
                         ids=[case_name(c) for c in CASES if c["dtype"] == "fp32"
                              and c["grad_reduce_in_fp32"]])
def test_tp_output_matches_tp1(tp_results, case):
    """Sanity of the sharding: the TP layer computes the TP = 1 function."""
    tp, ref, ranks = tp_results
    expected = ref[ref_key(case)]["out"]
    name = case_name(case)
    if case["sequence_parallel"]:
        got = torch.cat([ranks[r][name]["out"] for r in range(tp)], dim=0)
    else:
        got = ranks[0][name]["out"]
        for r in range(1, tp):
            assert torch.equal(got, ranks[r][name]["out"])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", TORCH_FSDP2_CASES, ids=[case_name(c) for c in TORCH_FSDP2_CASES])
def test_out_norm_grad_under_torch_fsdp2_matches_tp1(tp_results, case):
    """FSDP2 runs the forward on an unsharded parameter of its own, without the TP tag; the
    module finds the sharded parameter that carries it, and finalize completes the sum. A weight
    replaced after a step by one without the tags is refused at the next forward: SP off, for
    the tag of finalize's AVG; SP on, for the sequence_parallel tag megatron sums it for."""
    tp, ref, ranks = tp_results
    name = f"torch-fsdp2-{case_name(case)}"
    expected = ref[ref_key(case)]["dw"]
    for rank, results in enumerate(ranks):
        got = results[name]
        assert got["grad_scale"] == (1.0 if case["sequence_parallel"] else float(tp))
        assert got["avg_tag"] == (not case["sequence_parallel"])
        err = rel_err(got["after"], expected)
        assert err <= tolerance(case), f"{name} TP {tp} rank {rank}: rel err {err:.2e}"
        assert torch.equal(got["after"], ranks[0][name]["after"])
        if case["sequence_parallel"]:  # megatron sums it for its sequence_parallel tag
            assert "lost its sequence_parallel tag" in got["replaced_error"]
        else:
            assert "lost its average_gradients_across_tp_domain tag" in got["replaced_error"]
    assert not torch.allclose(ranks[0][name]["before"], ranks[1][name]["before"])  # partials
