"""TP = 2 on gloo (two spawned processes): after the stock finalize_model_grads, the GDN
out_norm weight gradient equals the TP = 1 gradient on every rank, with sequence parallelism on
and off, with and without DDP-style fp32 main_grad, fused and unfused paths."""

from core.testing.cpu import init_cpu_model_parallel, install_cpu_shims

install_cpu_shims()

import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from core.testing.gdn_tp import CASES, case_name, make_reference, spawn_worker  # noqa: E402

TP = 2


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gdn_tp")
    init_cpu_model_parallel(tp_size=1)
    ref_path = str(tmp / "ref.pt")
    make_reference(ref_path)
    mp.spawn(spawn_worker, args=(TP, str(tmp / "rdv"), ref_path, str(tmp)), nprocs=TP, join=True)
    ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(TP)]
    return torch.load(ref_path, weights_only=False)["ref"], ranks


@pytest.mark.parametrize("case", CASES, ids=[case_name(c) for c in CASES])
def test_out_norm_grad_matches_tp1_on_every_rank(tp_results, case):
    ref, ranks = tp_results
    name = case_name(case)
    expected = ref[case["fused"]]["dw"]
    for rank, results in enumerate(ranks):
        got = results[name]
        if case["main_grad"]:
            assert got["grad_is_none"], "DDP-style hook must have moved .grad into main_grad"
        torch.testing.assert_close(got["after"], expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} rank {rank}: {m}")
    # every rank ends with the same bits; before the reduction each held a (scaled) partial
    assert torch.equal(ranks[0][name]["after"], ranks[1][name]["after"])
    assert not torch.allclose(ranks[0][name]["before"], ranks[1][name]["before"])
    torch.testing.assert_close(ranks[0][name]["before"] + ranks[1][name]["before"],
                               TP * expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [c for c in CASES if not c["main_grad"]],
                         ids=[case_name(c) for c in CASES if not c["main_grad"]])
def test_tp2_output_matches_tp1(tp_results, case):
    """Sanity of the sharding: the TP = 2 layer computes the TP = 1 function."""
    ref, ranks = tp_results
    expected = ref[case["fused"]]["out"]
    name = case_name(case)
    if case["sequence_parallel"]:
        got = torch.cat([ranks[r][name]["out"] for r in range(TP)], dim=0)
    else:
        got = ranks[0][name]["out"]
        assert torch.equal(got, ranks[1][name]["out"])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
