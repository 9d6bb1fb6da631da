"""Spec functions of core.models.gdn_specs without Transformer Engine: module, layer and hybrid
block specs; a GPTModel built from the hybrid block spec trains a step on the CPU with the flag."""

from core.testing.cpu import init_cpu_model_parallel, install_cpu_shims

install_cpu_shims()

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer.attention import SelfAttention  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402

from core.models import (  # noqa: E402
    get_attention_layer_spec,
    get_gdn_hybrid_block_spec,
    get_gdn_layer_spec,
    get_gdn_module_spec,
)
from core.models import gdn_specs  # noqa: E402
from core.ssm import GatedDeltaNet  # noqa: E402
from core.testing.gdn import gdn_config  # noqa: E402
from core.transformer import LocalNorm, RMSNorm  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _model_parallel():
    init_cpu_model_parallel(tp_size=1)


def test_gdn_module_spec_without_te():
    spec = get_gdn_module_spec(use_te=False)
    assert spec.module is GatedDeltaNet
    assert spec.submodules.in_proj is ColumnParallelLinear
    assert spec.submodules.out_norm is LocalNorm
    assert spec.submodules.out_proj is RowParallelLinear
    assert spec.metainfo["fuse_input_layernorm"] is False
    assert get_gdn_module_spec(use_te=None).submodules == spec.submodules  # no TE here


@pytest.mark.skipif(gdn_specs.HAVE_TE, reason="checks the error raised without Transformer Engine")
@pytest.mark.parametrize("fn", [get_gdn_module_spec, get_gdn_layer_spec, get_attention_layer_spec])
def test_use_te_true_without_te_raises(fn):
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
    assert _mixers(spec) == ["GatedDeltaNet"] * 3 + ["SelfAttention"] + ["GatedDeltaNet"] * 3 + ["SelfAttention"]
    assert spec.layer_norm is LocalNorm
    listed = get_gdn_hybrid_block_spec(gdn_config(num_layers=3, linear_attention_freq=[0, 1, 1]))
    assert _mixers(listed) == ["SelfAttention", "GatedDeltaNet", "GatedDeltaNet"]


def test_hybrid_block_requires_gdn_config():
    from core.transformer import TransformerConfig

    with pytest.raises(ValueError, match="experimental_attention_variant='gated_delta_net'"):
        get_gdn_hybrid_block_spec(TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4))


def test_gpt_model_from_hybrid_spec_trains_with_flag():
    from megatron.core.models.gpt import GPTModel

    config = gdn_config(num_layers=2, linear_attention_freq=2, params_dtype=torch.float32,
                        fused_gated_norm=True)
    model = GPTModel(config, transformer_layer_spec=get_gdn_hybrid_block_spec(config),
                     vocab_size=64, max_sequence_length=16)
    assert [type(l.self_attention).__name__ for l in model.decoder.layers] == ["GatedDeltaNet", "SelfAttention"]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).expand(2, 16)
    mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
    loss = model(ids, pos, attention_mask=mask, labels=ids)
    assert loss.shape == (2, 16) and torch.isfinite(loss).all()
    loss.mean().backward()
    w = model.decoder.layers[0].self_attention.out_norm.weight
    assert w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


def test_hybrid_block_with_moe_mlps_runs():
    from megatron.core.models.gpt import GPTModel

    config = gdn_config(num_layers=2, linear_attention_freq=2, params_dtype=torch.float32,
                        fused_gated_norm=True, num_moe_experts=2, moe_layer_freq=[1, 0],
                        moe_router_topk=2, moe_ffn_hidden_size=32)
    model = GPTModel(config, transformer_layer_spec=get_gdn_hybrid_block_spec(config),
                     vocab_size=64, max_sequence_length=16)
    assert [type(l.mlp).__name__ for l in model.decoder.layers] == ["MoELayer", "MLP"]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
    loss = model(ids, torch.arange(16).expand(2, 16), attention_mask=mask, labels=ids)
    loss.mean().backward()
    assert torch.isfinite(loss).all()
