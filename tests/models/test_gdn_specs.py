"""Spec functions of core.models.gdn_specs without Transformer Engine: module, layer and hybrid
block specs; a GPTModel built from the hybrid block spec trains a step on the CPU with the flag."""

import pytest
import torch

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from core.models import (
    get_attention_layer_spec,
    get_gdn_hybrid_block_spec,
    get_gdn_layer_spec,
    get_gdn_module_spec,
)
from core.models import gdn_specs
from core.ssm import GatedDeltaNet
from core.testing.gdn import gdn_config
from core.transformer import LocalNorm, RMSNorm
from tests.gated_norm_checks import assert_language_model_matches_unfused

pytestmark = pytest.mark.usefixtures("model_parallel_tp1")


def test_gdn_module_spec_without_te(monkeypatch):
    monkeypatch.setattr(gdn_specs, "HAVE_TE", False)  # as on a machine without TE, on any machine
    spec = get_gdn_module_spec(use_te=False)
    assert spec.module is GatedDeltaNet
    assert spec.submodules.in_proj is ColumnParallelLinear
    assert spec.submodules.out_norm is LocalNorm
    assert spec.submodules.out_proj is RowParallelLinear
    assert spec.metainfo["fuse_input_layernorm"] is False
    assert get_gdn_module_spec(use_te=None).submodules == spec.submodules  # no TE here


@pytest.mark.parametrize("fn", [get_gdn_module_spec, get_gdn_layer_spec, get_attention_layer_spec])
def test_use_te_true_without_te_raises(fn, monkeypatch):
    monkeypatch.setattr(gdn_specs, "HAVE_TE", False)  # as on a machine without TE, on any machine
    with pytest.raises(ImportError, match="Transformer Engine is not installed"):
        fn(use_te=True)


def test_gdn_layer_has_real_input_norm_without_te():
    layer = build_module(get_gdn_layer_spec(use_te=False), config=gdn_config(), layer_number=1)
    assert isinstance(layer.input_layernorm, RMSNorm)
    assert isinstance(layer.pre_mlp_layernorm, RMSNorm)
    assert isinstance(layer.self_attention, GatedDeltaNet)
    assert isinstance(layer.self_attention.out_norm, RMSNorm)


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_attention_layer_spec_without_te(qk_layernorm):
    spec = get_attention_layer_spec(use_te=False, qk_layernorm=qk_layernorm)
    attn = spec.submodules.self_attention
    assert attn.module is SelfAttention
    assert attn.submodules.core_attention is DotProductAttention
    assert attn.submodules.linear_qkv is ColumnParallelLinear
    assert spec.submodules.input_layernorm is LocalNorm
    assert attn.submodules.q_layernorm is (LocalNorm if qk_layernorm else IdentityOp)
    layer = build_module(spec, config=gdn_config(layernorm_zero_centered_gamma=True,
                                                 qk_layernorm=qk_layernorm), layer_number=1)
    assert isinstance(layer.input_layernorm, RMSNorm) and layer.input_layernorm.zero_centered_gamma


def _mixers(block_spec):
    return [s.submodules.self_attention.module.__name__ for s in block_spec.layer_specs]


def test_hybrid_block_pattern_follows_megatron_convention():
    spec = get_gdn_hybrid_block_spec(gdn_config(num_layers=8, linear_attention_freq=4))
    assert isinstance(spec, TransformerBlockSubmodules)
    assert _mixers(spec) == (["GatedDeltaNet"] * 3 + ["SelfAttention"]) * 2
    assert spec.layer_norm is LocalNorm
    listed = get_gdn_hybrid_block_spec(gdn_config(num_layers=3, linear_attention_freq=[0, 1, 1]))
    assert _mixers(listed) == ["SelfAttention", "GatedDeltaNet", "GatedDeltaNet"]


def test_hybrid_block_requires_gdn_config():
    from core.transformer import TransformerConfig

    with pytest.raises(ValueError, match="experimental_attention_variant='gated_delta_net'"):
        get_gdn_hybrid_block_spec(
            TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4))


@pytest.mark.cpu_shims
def test_gpt_model_from_hybrid_spec_trains_with_flag():
    from megatron.core.models.gpt import GPTModel

    config = gdn_config(num_layers=2, linear_attention_freq=2, params_dtype=torch.float32,
                        fused_gated_norm=True)
    model = GPTModel(config, transformer_layer_spec=get_gdn_hybrid_block_spec(config),
                     vocab_size=64, max_sequence_length=16)
    assert [type(layer.self_attention).__name__ for layer in model.decoder.layers] == \
        ["GatedDeltaNet", "SelfAttention"]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).expand(2, 16)
    mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
    loss = model(ids, pos, attention_mask=mask, labels=ids)
    assert loss.shape == (2, 16) and torch.isfinite(loss).all()
    loss.mean().backward()
    w = model.decoder.layers[0].self_attention.out_norm.weight
    assert w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


@pytest.mark.cpu_shims
def test_hybrid_block_with_moe_mlps_matches_unfused():
    from megatron.core.models.gpt import GPTModel

    def build(fused):
        config = gdn_config(num_layers=2, linear_attention_freq=2, params_dtype=torch.float32,
                            fused_gated_norm=fused, num_moe_experts=2, moe_layer_freq=[1, 0],
                            moe_router_topk=2, moe_ffn_hidden_size=32)
        return GPTModel(config, transformer_layer_spec=get_gdn_hybrid_block_spec(config),
                        vocab_size=64, max_sequence_length=16)

    model = build(True)
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == ["MoELayer", "MLP"]
    assert assert_language_model_matches_unfused(model, build(False), vocab=64, seq=16, seed=1) == 1
    assert model.decoder.layers[0].self_attention.out_norm.weight.grad.abs().sum() > 0


@pytest.mark.cpu_shims
def test_gpt_model_with_mtp_from_the_hybrid_block_matches_unfused():
    """A GPTModel with multi-token prediction, its MTP block from megatron's
    get_gpt_mtp_block_spec over our block spec (the MTP layer is the decoder's last, attention
    here: megatron 0.19's MTP layer accepts only attention mixers): with the flag the decoder's
    GDN layer runs the fused norm, and the loss and every gradient, the MTP loss's included,
    equal the flag-off model's within fp32 rounding."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    def build(fused):
        config = gdn_config(num_layers=2, linear_attention_freq=2, params_dtype=torch.float32,
                            fused_gated_norm=fused, mtp_num_layers=1)
        block = get_gdn_hybrid_block_spec(config)
        return GPTModel(config, transformer_layer_spec=block, vocab_size=64,
                        max_sequence_length=16,
                        mtp_block_spec=get_gpt_mtp_block_spec(config, block,
                                                              use_transformer_engine=False))

    model = build(True)
    assert type(model.mtp.layers[0].mtp_model_layer.self_attention).__name__ == "SelfAttention"
    assert assert_language_model_matches_unfused(model, build(False), vocab=64, seq=16, seed=2) == 1
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0  # the MTP loss's gradient


# --- built on megatron's own spec functions ---------------------------------------------------


def test_use_te_is_a_bool_and_agrees_with_transformer_impl(monkeypatch):
    monkeypatch.setattr(gdn_specs, "HAVE_TE", True)  # auto must then follow transformer_impl
    with pytest.raises(TypeError, match=r"gdn_specs: use_te must be None \(Transformer Engine "
                                        r"when installed and transformer_impl asks for it\), True "
                                        r"or False"):
        get_gdn_module_spec(use_te="yes")
    local = gdn_config(transformer_impl="local")
    with pytest.raises(ValueError, match="use_te=True requires config.transformer_impl"):
        get_gdn_hybrid_block_spec(local, use_te=True)
    assert get_gdn_hybrid_block_spec(local).layer_norm is LocalNorm  # auto: megatron-core modules


def test_te_specs_are_megatrons_with_our_gdn(monkeypatch):
    """With Transformer Engine the specs are megatron's own, only the GDN class swapped (built
    here from megatron's TE builders without TE: the spec objects only)."""
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as mexp

    from core.models import megatron_te_spec_builders, use_fused_gdn
    from core.testing.specs import compare_gdn_swap

    monkeypatch.setattr(gdn_specs, "HAVE_TE", True)
    config = gdn_config(num_layers=4, linear_attention_freq=2, num_moe_experts=2,
                        moe_layer_freq=[0, 1, 0, 1], moe_router_topk=2, moe_ffn_hidden_size=32)
    with megatron_te_spec_builders():
        block = get_gdn_hybrid_block_spec(config)
        megatron_block = mexp.get_transformer_block_with_experimental_attention_variant_spec(config)
        module = get_gdn_module_spec(config=config)
        megatron_module = mexp.get_gated_delta_net_module_spec(config)
        default_module = get_gdn_module_spec(use_te=True)
        layer = get_gdn_layer_spec(use_te=True)
    assert compare_gdn_swap(megatron_block, block) == 2
    assert compare_gdn_swap(megatron_module, module) == 1
    assert default_module.submodules == module.submodules and default_module.module is GatedDeltaNet
    assert layer.submodules.self_attention.module is GatedDeltaNet
    assert layer.submodules.self_attention.submodules.in_proj is te.TELayerNormColumnParallelLinear
    assert layer.submodules.input_layernorm is IdentityOp  # fused into in_proj, as in megatron
    mixer = block.layer_specs[0].submodules.self_attention
    assert "fused_gated_norm" not in mixer.params  # the config decides
    fused = use_fused_gdn(block)
    assert fused.layer_specs[0].submodules.self_attention.params["fused_gated_norm"] is True
    assert use_fused_gdn(fused) is fused


@pytest.mark.parametrize("pipeline", [
    dict(num_layers=8, pipeline_model_parallel_size=2),
    dict(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    dict(num_layers=6, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|t*5L"),
], ids=["pp2", "pp2-vp2", "pp2-layout"])
def test_blocks_slice_the_pipeline_as_megatron_does(pipeline, monkeypatch):
    """Each (pp_rank, vp_stage) of the no-TE block, and of the TE one, holds the layers
    megatron's own builder gives that stage (its TE spec objects, built here without TE), for an
    even split, virtual stages and an uneven pipeline_model_parallel_layout; the stages in model
    order make the pattern."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as mexp

    from core.models import megatron_te_spec_builders

    monkeypatch.setattr(gdn_specs, "HAVE_TE", True)  # the TE spec objects, built without TE
    pattern = [1, 1, 0, 1, 0, 0, 1, 0][:pipeline["num_layers"]]  # 1 = GDN
    config = gdn_config(linear_attention_freq=pattern, pipeline_dtype=torch.float32, **pipeline)
    virtual = (0, 1) if "virtual_pipeline_model_parallel_size" in pipeline else (None,)
    in_model_order = []
    for vp_stage in virtual:
        for pp_rank in (0, 1):
            local = get_gdn_hybrid_block_spec(config, use_te=False, vp_stage=vp_stage,
                                              pp_rank=pp_rank)
            with megatron_te_spec_builders():
                megatrons = mexp.get_transformer_block_with_experimental_attention_variant_spec(
                    config, vp_stage=vp_stage, pp_rank=pp_rank)
                # the TE block is megatron's, sliced by the same stage arguments
                te_block = get_gdn_hybrid_block_spec(config, use_te=True, vp_stage=vp_stage,
                                                     pp_rank=pp_rank)
            assert _mixers(local) == _mixers(megatrons) == _mixers(te_block), (vp_stage, pp_rank)
            in_model_order += _mixers(local)
    assert in_model_order == ["GatedDeltaNet" if p else "SelfAttention" for p in pattern]


def _leaf_objects(node, seen=None):
    import dataclasses
    import functools

    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    yield node
    if isinstance(node, type):
        return
    if dataclasses.is_dataclass(node):
        children = [getattr(node, f.name) for f in dataclasses.fields(node)]
    elif isinstance(node, functools.partial):
        children = [node.func, *node.args, *node.keywords.values()]
    elif isinstance(node, (list, tuple)):
        children = list(node)
    elif isinstance(node, dict):
        children = list(node.values())
    else:
        children = []
    for child in children:
        yield from _leaf_objects(child, seen)


def test_local_block_is_megatrons_local_layers_with_gdn_mixers():
    """No TE: every layer is megatron's get_gpt_layer_local_spec (here with qk_l2_norm and MoE
    from the config), LocalNorm instead of WrappedTorchNorm, and the GDN mixer where the
    pattern says so."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import L2Norm, WrappedTorchNorm

    from core.models import replace_modules
    from core.testing.specs import compare_gdn_swap

    config = gdn_config(num_layers=4, linear_attention_freq=2, qk_l2_norm=True, num_moe_experts=2,
                        moe_layer_freq=[1, 1, 0, 0], moe_router_topk=2, moe_ffn_hidden_size=32)
    block = get_gdn_hybrid_block_spec(config)
    objects = list(_leaf_objects(block))
    assert WrappedTorchNorm not in objects and LocalNorm in objects
    for i, moe in ((1, True), (3, False)):  # the attention layers
        expected = get_gpt_layer_local_spec(
            num_experts=2 if moe else None, qk_l2_norm=True, normalization="RMSNorm")
        expected = replace_modules(expected, {WrappedTorchNorm: LocalNorm})
        assert compare_gdn_swap(expected, block.layer_specs[i]) == 0
        assert block.layer_specs[i].submodules.self_attention.submodules.q_layernorm is L2Norm
    for i in (0, 2):  # the GDN layers: same layer, mixer swapped
        gdn_layer = block.layer_specs[i].submodules
        attention_layer = block.layer_specs[i + 1].submodules
        assert gdn_layer.self_attention.module is GatedDeltaNet
        assert gdn_layer.mlp is attention_layer.mlp
        assert gdn_layer.input_layernorm is LocalNorm


def test_local_gdn_layers_checkpoint_in_the_te_layout():
    """Sharded keys of the separate input norm of a local GDN layer are those of TE's fused one
    (self_attention.in_proj.layer_norm_weight), as megatron maps a local attention layer's onto
    linear_qkv; zero-centred gamma builds (WrappedTorchNorm would refuse it)."""
    from megatron.core.models.gpt import GPTModel

    config = gdn_config(num_layers=2, linear_attention_freq=2, params_dtype=torch.float32,
                        layernorm_zero_centered_gamma=True)
    model = GPTModel(config, transformer_layer_spec=get_gdn_hybrid_block_spec(config),
                     vocab_size=64, max_sequence_length=16)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 + 2 + 1 + 1 and all(n.zero_centered_gamma for n in norms)
    assert "decoder.layers.0.input_layernorm.weight" in model.state_dict()
    from core.testing.specs import checkpoint_keys

    keys = checkpoint_keys(model)
    assert keys["decoder.layers.0.input_layernorm.weight"] == \
        "decoder.layers.0.self_attention.in_proj.layer_norm_weight"
    assert keys["decoder.layers.0.pre_mlp_layernorm.weight"] == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert keys["decoder.layers.1.input_layernorm.weight"] == \
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"  # megatron's own map
    assert keys["decoder.layers.0.self_attention.out_norm.weight"] == \
        "decoder.layers.0.self_attention.out_norm.weight"
