"""core.ssm.fsdp_tags: a tag reaches Megatron-FSDP's distributed copy of a parameter (found again
only when the copy changed), torch FSDP2's sharded parameter behind the forward's unsharded one
is found and read (a real ``fully_shard`` on a one-process gloo group); megatron-core still drops
the tag from its copies (its private names: test_private_names.py). The layer's use of them is
in test_gdn_tp_grad.py."""

import importlib
import importlib.metadata
import inspect

import pytest
import torch

from core.ssm import fsdp_tags
from core.ssm.fsdp_tags import (
    carry_tag_to_megatron_fsdp_param,
    fsdp_copy_tagged,
    keep_tag_on_megatron_fsdp_copy,
    torch_fsdp2_param,
    torch_fsdp2_sharded_param_tagged,
)
from core.ssm.tp_grad_reduction import TP_AVG_TAG

pytestmark = [pytest.mark.cpu_shims, pytest.mark.usefixtures("model_parallel_tp1")]



def test_megatron_fsdp_still_drops_the_tp_tag():
    """The layout the carrying relies on, read from megatron-core's source: MegatronFSDP's
    forward swaps the module's own parameters in (marking them ``_megatron_fsdp_model``), and its
    distributed parameters keep ``orig_param`` and a fixed attribute list without the TP tag.
    When a megatron-core changes this, the test says so."""
    release = f"megatron-core {importlib.metadata.version('megatron-core')}"
    fsdp = importlib.import_module(
        "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp")
    buffers = importlib.import_module(
        "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer")
    assert "_replace_param_with_raw_if_needed" in inspect.getsource(fsdp.MegatronFSDP.forward), (
        f"{release}: MegatronFSDP.forward no longer swaps in the raw parameters")
    assert "_megatron_fsdp_model = self" in inspect.getsource(
        fsdp.MegatronFSDP._replace_param_with_raw_if_needed), (
        f"{release}: the raw parameters are no longer marked _megatron_fsdp_model")
    source = inspect.getsource(buffers.ParamAndGradBuffer._init_optimizer_named_parameters)
    assert '"orig_param", orig_param' in source, (
        f"{release}: the distributed parameters no longer keep orig_param")
    # if megatron copies it one day, the carrying is redundant
    assert TP_AVG_TAG not in source, f"{release} copies {TP_AVG_TAG} itself"


def _megatron_fsdp(param, *copies):
    """A stand-in of what Megatron-FSDP leaves on ``param``: its wrapper, whose buffer holds the
    distributed parameters ``copies`` (each a (name, Parameter, original) triple)."""
    named = []
    for name, dist_param, original in copies:
        dist_param.orig_param = original
        named.append((name, dist_param))
    buffer = type("Buffer", (), {"optimizer_named_parameters": named})()
    param._megatron_fsdp_model = type("FSDP", (), {"param_and_grad_buffer": buffer})()
    return named


def test_tag_reaches_megatron_fsdp_copy_only():
    weight, other = torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(2))
    dist_other, dist_weight = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(4))
    _megatron_fsdp(weight, ("other", dist_other, other), ("out_norm.weight", dist_weight, weight))
    assert carry_tag_to_megatron_fsdp_param(weight, TP_AVG_TAG) is None  # untagged: nothing carried
    assert not hasattr(dist_weight, TP_AVG_TAG)
    setattr(weight, TP_AVG_TAG, True)
    assert carry_tag_to_megatron_fsdp_param(weight, TP_AVG_TAG) == 1
    assert getattr(dist_weight, TP_AVG_TAG) is True and not hasattr(dist_other, TP_AVG_TAG)
    assert fsdp_copy_tagged(weight, TP_AVG_TAG, 1) and not fsdp_copy_tagged(weight, TP_AVG_TAG, 0)
    assert not fsdp_copy_tagged(weight, TP_AVG_TAG, None)
    assert not fsdp_copy_tagged(weight, TP_AVG_TAG, 5)
    assert carry_tag_to_megatron_fsdp_param(torch.nn.Parameter(torch.ones(1)), TP_AVG_TAG) is None


def test_megatron_fsdp_copy_searched_again_only_when_it_changed(monkeypatch):
    weight = torch.nn.Parameter(torch.ones(8))
    setattr(weight, TP_AVG_TAG, True)
    # no Megatron-FSDP: nothing to do
    keep_tag_on_megatron_fsdp_copy(weight, TP_AVG_TAG, "weight", {})
    searches = []
    real_search = fsdp_tags.carry_tag_to_megatron_fsdp_param
    monkeypatch.setattr(fsdp_tags, "carry_tag_to_megatron_fsdp_param",
                        lambda *args: searches.append(1) or real_search(*args))
    dist_weight = torch.nn.Parameter(torch.ones(4))
    _megatron_fsdp(weight, ("out_norm.weight", dist_weight, weight))
    known = {}
    for _ in range(2):
        keep_tag_on_megatron_fsdp_copy(weight, TP_AVG_TAG, "weight", known)
    assert known == {"weight": 0} and len(searches) == 1 and getattr(dist_weight, TP_AVG_TAG)
    delattr(dist_weight, TP_AVG_TAG)  # the copy lost the tag
    keep_tag_on_megatron_fsdp_copy(weight, TP_AVG_TAG, "weight", known)
    assert len(searches) == 2 and getattr(dist_weight, TP_AVG_TAG)
    rebuilt = torch.nn.Parameter(torch.ones(4))  # a new buffer, the copy at another index
    _megatron_fsdp(weight, ("other", torch.nn.Parameter(torch.ones(2)), None),
                   ("out_norm.weight", rebuilt, weight))
    keep_tag_on_megatron_fsdp_copy(weight, TP_AVG_TAG, "weight", known)
    assert known == {"weight": 1} and len(searches) == 3 and getattr(rebuilt, TP_AVG_TAG)


def test_torch_fsdp2_sharded_param_found_behind_the_unsharded_one():
    """torch FSDP2 runs the forward on an unsharded parameter without the original's tags; the
    sharded one (what FSDP2 registers outside the forward) keeps them and is found from it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    norm = model[1]
    fully_shard(norm, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = norm.weight
    setattr(sharded, TP_AVG_TAG, True)
    assert torch_fsdp2_param(norm, "weight") is None  # outside the forward: the sharded one
    seen = {}

    def pre_hook(module, args):
        record = torch_fsdp2_param(module, "weight")
        known = {}
        seen["unsharded"] = module.weight is not sharded
        seen["found"] = record is not None and record.sharded_param is sharded
        seen["tagged"] = torch_fsdp2_sharded_param_tagged(module, "weight", module.weight,
                                                          TP_AVG_TAG, known)
        seen["kept"] = known["weight"]() is record
        seen["other tag"] = torch_fsdp2_sharded_param_tagged(module, "weight", module.weight,
                                                             "sequence_parallel", known)
        seen["bias"] = torch_fsdp2_param(module, "bias").sharded_param is not sharded

    norm.register_forward_pre_hook(pre_hook)
    model(torch.randn(2, 4))
    assert seen == {"unsharded": True, "found": True, "tagged": True, "kept": True,
                    "other tag": False, "bias": True}
    plain = torch.nn.LayerNorm(4)
    assert not torch_fsdp2_sharded_param_tagged(plain, "weight", plain.weight, TP_AVG_TAG, {})
