"""Helpers of core.testing.parallel, the layout harness (tests/ssm/test_gdn_layouts.py runs it)."""

import pytest
import torch

from core.testing.parallel import Layout, Offsets, global_name, thd_cp_indices


def test_thd_cp_indices():
    """Each sequence's load-balanced context-parallel chunks: rank r takes chunks r and
    2 * cp - 1 - r of every sequence."""
    cu = torch.tensor([0, 8, 20])
    assert thd_cp_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 10, 17, 18, 19]
    assert thd_cp_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 11, 12, 13, 14, 15, 16]
    with pytest.raises(ValueError, match="not divisible by 2 x cp_size = 4"):
        thd_cp_indices(torch.tensor([0, 6]), 2, 0)


def test_global_name_shifts_layers_and_experts():
    """A rank's parameter names in the one-stage, EP 1 model: pipeline stages shift the layer
    number, expert-parallel ranks the local expert number."""
    name = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    assert global_name(name, Offsets()) == name
    assert global_name(name, Offsets(layer=2, expert=3)) == (
        "decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight")
    assert global_name("decoder.layers.0.self_attention.out_norm.weight", Offsets(2, 3)) == (
        "decoder.layers.2.self_attention.out_norm.weight")


@pytest.mark.parametrize("changes, message", [
    (dict(ep=2, tp=2), "ep or etp > 1 needs model='gpt-moe'"),
    (dict(ep=4, tp=2, model="gpt-moe"), "ep x etp dividing tp x dp"),
    (dict(ep=2, etp=2, tp=2, model="gpt-moe"), "ep x etp dividing tp x dp"),
    (dict(model="moe"), "Layout.model must be one of"),
    (dict(dp=4, model="gpt-moe"), "DP dividing their 2 micro-batches"),
    (dict(vp=2, model="gpt"), "vp > 1 needs pp > 1"),
    (dict(pp=4, vp=2, model="gpt"), "pp x vp dividing its 4 decoder layers"),
    (dict(pp=4, vp=2, model="hybrid"), "pp x vp dividing its 4 decoder layers"),
    (dict(dp=2, distributed_optimizer=True, steps=2, overlap_param_gather=True),
     "overlap_param_gather needs the distributed optimizer and overlap_grad_reduce"),
    (dict(dp=2, distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True),
     "steps > 1"),
    (dict(pp=2, per_token_loss=True, model="gpt"), "per_token_loss is the GDN module's loss"),
    (dict(steps=0), "steps must be >= 1"),
    (dict(pp=2), "pp > 1 needs a GPT or hybrid model"),
    (dict(vp=2, model="hybrid"), "vp > 1 needs pp > 1, a GPT or hybrid model"),
    (dict(tp=2, full_recompute=True, model="hybrid"), "full_recompute needs a GPT model"),
    (dict(tp=2, ep=2, model="gpt-moe", token_dispatcher="flex"),
     r"token_dispatcher must be one of \('alltoall', 'allgather'\), got 'flex'"),
], ids=["ep-without-moe", "ep-not-dividing", "etp-not-dividing", "model", "gpt-dp",
        "vp-without-pp", "vp-too-many", "hybrid-vp-too-many", "param-gather-without-overlap",
        "param-gather-one-step",
        "per-token-gpt", "no-steps", "module-pp", "hybrid-vp-without-pp", "hybrid-full-recompute",
        "dispatcher"])
def test_layout_refuses_what_the_harness_cannot_run(changes, message):
    with pytest.raises(ValueError, match=message):
        Layout("bad", **changes)
    assert Layout("ok", tp=2, ep=2, sequence_parallel=True, model="gpt-moe").world_size == 2


def _twin_record(rank: int = 0, later: int = 1) -> dict:
    weight = torch.arange(4, dtype=torch.float32)
    return dict(coords=dict(rank=rank, tp=0), grads={"w": weight.clone()},
                later_grads=[{"w": weight + 1} for _ in range(later)],
                params={"w": weight + 2})


def test_twin_mismatches_catch_one_ulp_a_missing_step_and_other_coordinates():
    from core.testing.parallel import twin_mismatches

    assert twin_mismatches([_twin_record()], [_twin_record()]) == []
    for where in ("grads", "params"):
        twin = _twin_record()
        twin[where]["w"][1] = torch.nextafter(twin[where]["w"][1], torch.tensor(9.0))
        failures = twin_mismatches([_twin_record()], [twin])
        assert len(failures) == 1 and " w: differs" in failures[0], failures
    twin = _twin_record()
    twin["later_grads"][0]["w"][0] += 1
    assert twin_mismatches([_twin_record()], [twin]) == ["rank 0 step 2 w: differs from the twin's"]
    assert "2 steps, the twin 3" in twin_mismatches([_twin_record()], [_twin_record(later=2)])[0]
    assert "coordinates" in twin_mismatches([_twin_record()], [_twin_record(rank=1)])[0]
    twin = _twin_record()
    twin["params"]["v"] = twin["params"].pop("w")
    assert "names differ" in twin_mismatches([_twin_record()], [twin])[0]


@pytest.mark.parametrize("pp, vp, pattern", [(1, 1, "GG*-/G-"), (2, 1, "GG|*-/G-"),
                                             (2, 2, "G|G|*|-/G-")])
def test_hybrid_pattern_splits_the_decoder_into_pp_x_vp_segments(pp, vp, pattern):
    """megatron gives pipe segment ``vp_stage * pp + pp_rank`` to that virtual stage of that
    rank; the multi-token prediction depth after '/' stays whole."""
    from core.testing.parallel import hybrid_pattern

    assert hybrid_pattern(Layout("h", pp=pp, vp=vp, model="hybrid")) == pattern
