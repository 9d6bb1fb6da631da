"""Megatron distributed checkpoints (dist_checkpointing, torch_dist backend, gloo on the CPU)
of one GatedDeltaNet layer across layouts and fusion settings: saved at TP = 1 with a setting
"on", loaded at TP = 2 with the setting "off", and the reverse. Two switches
(:data:`SWITCHES`): the fused output norm (on / off), and the fused pre-recurrence region
(gdn_pre_gated_delta_rule_fusion on / off, the output norm fused on both sides). The loaded
weights are the saved ones bit for bit and the layer computes the same function."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from core.testing.cpu import init_cpu_model_parallel
from core.testing.gdn_checkpoint import (build_layer, load_layer, make_reference,
                                         output_of, save_layer, spawn_worker, state_of)

pytestmark = pytest.mark.cpu_shims

TP = 2
# switch -> (the TP 1 side's setting "on", the TP 2 side's setting "off")
SWITCHES = {
    "fused-norm": (dict(fused=True), dict(fused=False)),
    "pre-fusion": (dict(fused=True, pre_fusion=True), dict(fused=True, pre_fusion=False)),
}


def _assert_states_equal(got: dict, expected: dict):
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


@pytest.fixture(scope="module", params=list(SWITCHES), ids=list(SWITCHES))
def layouts(request, tmp_path_factory):
    """TP 1 with the setting on saves a checkpoint; two TP 2 ranks with it off save theirs and
    load the TP 1 one; then TP 1 with it on loads the TP 2 checkpoint."""
    on, off = SWITCHES[request.param]
    tmp = tmp_path_factory.mktemp(f"gdn_ckpt_{request.param}")
    init_cpu_model_parallel(tp_size=1)
    ref_path = str(tmp / "ref.pt")
    ref = make_reference(ref_path, on, off)
    tp1_dir, tp2_dir = str(tmp / "tp1_on"), str(tmp / "tp2_off")
    saver = build_layer(tp_size=1, seed=31, **on)
    saver.load_state_dict(ref["state"])
    save_layer(saver, tp1_dir)
    mp.spawn(spawn_worker, args=(TP, str(tmp / "rdv"), ref_path, tp2_dir, tp1_dir, str(tmp), off),
             nprocs=TP, join=True)
    ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(TP)]
    init_cpu_model_parallel(tp_size=1)
    loader = build_layer(tp_size=1, seed=32, **on)
    assert not torch.equal(loader.in_proj.weight, ref["state"]["in_proj.weight"])
    load_layer(loader, tp2_dir)
    return ref, ranks, loader


def test_tp2_off_checkpoint_loads_at_tp1_on(layouts):
    ref, ranks, loader = layouts
    _assert_states_equal(state_of(loader), ref["state"])
    assert torch.equal(output_of(loader, ref["x"]), ref["out_on"])
    # the TP 2 layer (setting off) that wrote the checkpoint computed the same function
    for rank in ranks:
        torch.testing.assert_close(rank["saved_out"], ref["out_on"], rtol=1e-4, atol=1e-5)


def test_tp1_on_checkpoint_loads_at_tp2_off(layouts):
    ref, ranks, _ = layouts
    for rank in ranks:
        _assert_states_equal(rank["loaded_state"], rank["shard"])
        assert torch.equal(rank["loaded_out"], rank["saved_out"])
        torch.testing.assert_close(rank["loaded_out"], ref["out_off"], rtol=1e-4, atol=1e-5)
    assert not torch.equal(ranks[0]["shard"]["in_proj.weight"], ranks[1]["shard"]["in_proj.weight"])


def test_pre_fusion_keeps_state_dict_and_sharded_state_dict_keys():
    """The fused pre-recurrence region adds and renames nothing: the state dict (names, shapes)
    and the sharded state dict (the checkpoint's keys, global shapes and offsets, in_proj's and
    conv1d's sections included) of a layer with it equal those of the same layer without it."""
    init_cpu_model_parallel(tp_size=1)
    with_it, without = (build_layer(fused=True, tp_size=1, seed=41, pre_fusion=pre)
                        for pre in (True, False))
    assert with_it.pre_gated_delta_rule_fusion and not without.pre_gated_delta_rule_fusion

    def shapes(state):
        return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}

    def layout(sharded):  # a factory (in_proj, conv1d: split per section) by what it builds
        entries = {}
        for name, value in sharded.items():
            built = value.build() if hasattr(value, "build") else [value]
            entries[name] = [(type(v).__name__, v.key, tuple(v.global_shape),
                              tuple(v.global_offset)) for v in built]
        return entries

    assert list(with_it.state_dict()) == list(without.state_dict())
    assert shapes(with_it.state_dict()) == shapes(without.state_dict())
    assert layout(with_it.sharded_state_dict()) == layout(without.sharded_state_dict())
