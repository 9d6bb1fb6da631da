"""core.models.te_free_specs: megatron's own TE spec builders run without Transformer Engine
inside ``megatron_te_spec_builders`` (and only there), ``te_to_local`` leaves no TE class in a
tree and keeps its structure, ``NormedColumnParallelLinear`` computes TE's norm-fused linear,
and ``megatron_gdn_block_spec`` is the two steps in one call: a GPTModel builds from it, fused
with ``use_fused_gdn``, and trains as the unfused one."""

import dataclasses
import functools

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import experimental_attention_variant_module_specs as mexp
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGDN
from megatron.core.tensor_parallel import ColumnParallelLinear

import core.models
from core.models import te_free_specs
from core.models.gdn_specs import HAVE_TE, use_fused_gdn
from core.models.te_free_specs import (
    NormedColumnParallelLinear,
    megatron_gdn_block_spec,
    megatron_te_spec_builders,
    te_to_local,
    te_to_local_map,
)
from core.ssm import GatedDeltaNet
from core.testing.gdn import gdn_config
from core.testing.specs import spec_fingerprint
from core.transformer.rms_norm import LocalNorm, RMSNorm
from tests.gated_norm_checks import assert_language_model_matches_unfused

VOCAB, SEQ = 64, 16

pytestmark = pytest.mark.usefixtures("model_parallel_tp1")


def _config(**overrides):
    kwargs = dict(num_layers=4, linear_attention_freq=2, params_dtype=torch.float32)
    kwargs.update(overrides)
    return gdn_config(**kwargs)


# TE's classes, or without TE megatron's stand-ins for them (mock objects, not classes).
TE_NAMES = list(te_to_local_map())


def _layout(node, path="spec", out=None):
    """(path, object) of every class and TE name in a spec tree and (path, ("instance", its
    type)) of every other node, in walk order: two trees with equal layouts hold the same
    classes in the same places."""
    out = [] if out is None else out
    if isinstance(node, type) or any(node is te_name for te_name in TE_NAMES):
        out.append((path, node))
        return out
    out.append((path, ("instance", type(node))))
    if dataclasses.is_dataclass(node):
        children = [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    elif isinstance(node, functools.partial):
        children = list(enumerate((node.func, *node.args, *node.keywords.values())))
    elif isinstance(node, (list, tuple)):
        children = list(enumerate(node))
    elif isinstance(node, dict):
        children = list(node.items())
    else:
        children = []
    for key, child in children:
        _layout(child, f"{path}.{key}", out)
    return out


def _te_names_in(spec) -> list:
    return [path for path, node in _layout(spec) if any(node is te for te in TE_NAMES)]


def test_the_library_exports_them():
    for name in ("megatron_gdn_block_spec", "megatron_te_spec_builders", "te_to_local"):
        assert name in core.models.__all__
        assert getattr(core.models, name) is getattr(te_free_specs, name)


@pytest.mark.skipif(HAVE_TE, reason="with Transformer Engine megatron's builders run as they are")
def test_megatrons_builders_need_the_context_and_get_their_globals_back():
    config = _config()
    with pytest.raises(NameError, match="TESpecProvider"):
        mexp.get_transformer_block_with_experimental_attention_variant_spec(config)
    unset = object()
    before = [vars(module).get("TESpecProvider", unset) for module in (mexp, gpt_layer_specs)]
    assert before == [unset, None]  # what megatron leaves without TE: absent, or None
    with megatron_te_spec_builders():
        block = mexp.get_transformer_block_with_experimental_attention_variant_spec(config)
        layer = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    assert len(block.layer_specs) == 4 and layer.submodules.self_attention is not None
    assert [vars(module).get("TESpecProvider", unset)
            for module in (mexp, gpt_layer_specs)] == before
    with pytest.raises(NameError, match="TESpecProvider"):  # and not only the first time
        mexp.get_transformer_block_with_experimental_attention_variant_spec(config)


def test_te_to_local_leaves_no_te_class_and_keeps_the_tree():
    with megatron_te_spec_builders():
        spec = mexp.get_transformer_block_with_experimental_attention_variant_spec(_config())
    before = spec_fingerprint(spec)
    local = te_to_local(spec)
    assert spec_fingerprint(spec) == before, "te_to_local modified its input"
    assert _te_names_in(spec), "the input holds TE names"
    assert not _te_names_in(local)
    gdn = local.layer_specs[0].submodules.self_attention
    assert gdn.module is MegatronGDN  # only TE classes change
    assert gdn.submodules.in_proj is NormedColumnParallelLinear
    assert gdn.submodules.out_norm is LocalNorm and local.layer_norm is LocalNorm
    swaps = list(te_to_local_map().items())
    assert _layout(local) == [(path, next((new for te, new in swaps if node is te), node))
                              for path, node in _layout(spec)]  # the same tree, TE names swapped
    assert te_to_local(local) is local  # nothing left to replace: the same object back


def test_normed_column_parallel_linear_is_the_norm_then_the_linear():
    config = _config(layernorm_epsilon=1e-5)
    kwargs = dict(config=config, init_method=torch.nn.init.normal_, bias=False,
                  gather_output=False, skip_bias_add=True)
    normed = NormedColumnParallelLinear(32, 48, **kwargs)
    plain = ColumnParallelLinear(32, 48, **kwargs)
    plain.weight.data.copy_(normed.weight.data)
    with torch.no_grad():
        normed.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 2, 32)
    out, _ = normed(x)
    expected, _ = plain(normed.norm(x))
    assert isinstance(normed.norm, RMSNorm) and normed.norm.eps == 1e-5  # the config's norm
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * normed.norm.weight
    torch.testing.assert_close(normed.norm(x), rms)


def test_megatron_gdn_block_spec_is_the_two_steps_and_refuses_the_local_impl():
    config = _config(num_moe_experts=2, moe_layer_freq=[1, 0, 0, 1], moe_router_topk=2,
                     moe_ffn_hidden_size=32)
    with megatron_te_spec_builders():
        manual = te_to_local(
            mexp.get_transformer_block_with_experimental_attention_variant_spec(config))
    assert _layout(megatron_gdn_block_spec(config)) == _layout(manual)
    staged = _config(num_layers=8, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    second = megatron_gdn_block_spec(staged, pp_rank=1)  # megatron's pipeline slicing
    assert len(second.layer_specs) == 4
    local = _config(transformer_impl="local")
    with pytest.raises(ValueError, match=r"config\.transformer_impl='transformer_engine', "
                                         r"got 'local'.*get_gdn_hybrid_block_spec"):
        megatron_gdn_block_spec(local)


@pytest.mark.cpu_shims
def test_a_gpt_model_from_megatron_gdn_block_spec_trains_fused_as_unfused():
    config = _config(fused_gated_norm=True)
    spec = megatron_gdn_block_spec(config)

    def build(layer_spec):
        return GPTModel(config, transformer_layer_spec=layer_spec, vocab_size=VOCAB,
                        max_sequence_length=SEQ)

    model = build(use_fused_gdn(spec))
    gdn = [m for m in model.modules() if isinstance(m, MegatronGDN)]
    assert [type(m) for m in gdn] == [GatedDeltaNet] * 2 and all(m.fused_gated_norm for m in gdn)
    unfused = build(spec)  # megatron's GatedDeltaNet: the unfused output norm
    assert [type(m) for m in unfused.modules() if isinstance(m, MegatronGDN)] == [MegatronGDN] * 2
    assert assert_language_model_matches_unfused(model, unfused, VOCAB, SEQ, seed=6) == 2
