"""Megatron distributed checkpoints (dist_checkpointing, torch_dist backend, gloo on the CPU)
of one GatedDeltaNet layer across layouts: saved at TP = 2 with the fused-norm flag off, loaded
at TP = 1 with the flag on, and the reverse. The loaded weights are the saved ones bit for bit
and the layer computes the same function."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from core.testing.cpu import init_cpu_model_parallel
from core.testing.gdn_checkpoint import (build_layer, load_layer, make_reference,
                                         output_of, save_layer, spawn_worker, state_of)

pytestmark = pytest.mark.cpu_shims

TP = 2


def _assert_states_equal(got: dict, expected: dict):
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """TP 1 flag on saves a checkpoint; two TP 2 flag-off ranks save theirs and load the TP 1
    one; then TP 1 flag on loads the TP 2 checkpoint."""
    tmp = tmp_path_factory.mktemp("gdn_ckpt")
    init_cpu_model_parallel(tp_size=1)
    ref_path = str(tmp / "ref.pt")
    ref = make_reference(ref_path)
    tp1_dir, tp2_dir = str(tmp / "tp1_flag_on"), str(tmp / "tp2_flag_off")
    saver = build_layer(fused=True, tp_size=1, seed=31)
    saver.load_state_dict(ref["state"])
    save_layer(saver, tp1_dir)
    mp.spawn(spawn_worker, args=(TP, str(tmp / "rdv"), ref_path, tp2_dir, tp1_dir, str(tmp)),
             nprocs=TP, join=True)
    ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(TP)]
    init_cpu_model_parallel(tp_size=1)
    loader = build_layer(fused=True, tp_size=1, seed=32)
    assert not torch.equal(loader.in_proj.weight, ref["state"]["in_proj.weight"])
    load_layer(loader, tp2_dir)
    return ref, ranks, loader


def test_tp2_flag_off_checkpoint_loads_at_tp1_flag_on(layouts):
    ref, ranks, loader = layouts
    _assert_states_equal(state_of(loader), ref["state"])
    assert torch.equal(output_of(loader, ref["x"]), ref["out_fused"])
    # the TP 2 flag-off layer that wrote the checkpoint computed the same function
    for rank in ranks:
        torch.testing.assert_close(rank["saved_out"], ref["out_fused"], rtol=1e-4, atol=1e-5)


def test_tp1_flag_on_checkpoint_loads_at_tp2_flag_off(layouts):
    ref, ranks, _ = layouts
    for rank in ranks:
        _assert_states_equal(rank["loaded_state"], rank["shard"])
        assert torch.equal(rank["loaded_out"], rank["saved_out"])
        torch.testing.assert_close(rank["loaded_out"], ref["out_unfused"], rtol=1e-4, atol=1e-5)
    assert not torch.equal(ranks[0]["shard"]["in_proj.weight"], ranks[1]["shard"]["in_proj.weight"])
