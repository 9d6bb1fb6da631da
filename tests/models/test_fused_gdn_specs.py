"""core.models.fused_gdn_specs, the specs for megatron's ``--spec`` that switch the fusions on by
themselves: with megatron's own TransformerConfig (no fusion field, as megatron's pretrain
scripts build it) every GDN layer is ours and fused (the ``*_both_fusions`` specs: the fusion
before the gated delta rule too), and the models train as the unfused ones; the layer's
construction-time rules apply; a config that sets a switch must agree."""

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGDN
from megatron.core.transformer.transformer_config import (
    TransformerConfig as MegatronTransformerConfig,
)

from core.models import fused_gdn_specs, te_to_local
from core.models.gdn_specs import get_gdn_hybrid_block_spec, use_fused_gdn
from core.ssm import GatedDeltaNet
from core.testing.gdn import gdn_config
from tests.gated_norm_checks import assert_language_model_matches_unfused

VOCAB, SEQ = 64, 16

pytestmark = pytest.mark.usefixtures("model_parallel_tp1")


def _megatron_config(**overrides):
    """megatron's own TransformerConfig of a tiny GDN model (what its pretrain scripts build)."""
    kwargs = dict(num_layers=2, linear_attention_freq=2, params_dtype=torch.float32)
    kwargs.update(overrides)
    return gdn_config(config_class=MegatronTransformerConfig, **kwargs)


def _gpt(config, spec):
    return GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def _gdn_layers(model):
    return [m for m in model.modules() if isinstance(m, MegatronGDN)]


class _ModelConfig:
    """The part of megatron.training's GPTModelConfig that a --spec function reads."""

    def __init__(self, transformer):
        self.transformer = transformer


@pytest.mark.cpu_shims
@pytest.mark.parametrize("called_with", ["model_config", "transformer_config"])
def test_gpt_block_spec_fuses_every_gdn_layer_of_megatrons_config(called_with):
    """megatron.training's GPTModelConfig calls the spec function with itself (the transformer
    config in ``.transformer``); a model built by hand passes the transformer config."""
    config = _megatron_config()
    assert not hasattr(config, "fused_gated_norm")
    arg = _ModelConfig(config) if called_with == "model_config" else config
    model = _gpt(config, fused_gdn_specs.gpt_block_spec(arg, vp_stage=None))
    layers = _gdn_layers(model)
    assert [type(m) for m in layers] == [GatedDeltaNet]
    assert all(m.fused_gated_norm for m in layers)
    unfused = _gpt(config, get_gdn_hybrid_block_spec(config))  # the same class, no param: off
    assert not any(m.fused_gated_norm for m in _gdn_layers(unfused))
    assert assert_language_model_matches_unfused(model, unfused, VOCAB, SEQ, seed=4) == 1


@pytest.mark.cpu_shims
def test_hybrid_stack_spec_fuses_every_g_layer_of_megatrons_config():
    """HybridModel with 'G' layers in the decoder and in a multi-token prediction depth."""
    config = _megatron_config(num_layers=4, linear_attention_freq=None,
                              experimental_attention_variant=None, mtp_num_layers=1)

    def build(spec):
        return HybridModel(config, te_to_local(spec), vocab_size=VOCAB, max_sequence_length=SEQ,
                           hybrid_layer_pattern="G*G-/G-")

    model = build(fused_gdn_specs.hybrid_stack_spec)
    layers = _gdn_layers(model)
    assert len(layers) == 3 and all(type(m) is GatedDeltaNet and m.fused_gated_norm
                                    for m in layers)
    unfused = build(use_fused_gdn(hybrid_stack_spec, gated_output_norm=False))
    assert assert_language_model_matches_unfused(model, unfused, VOCAB, SEQ, seed=5) == 3


def test_the_fused_norms_rules_apply_at_construction():
    """What the config's flag would refuse, the spec's param refuses, naming the config field."""
    layer_norm = _megatron_config(normalization="LayerNorm")
    with pytest.raises(ValueError, match="normalization"):
        _gpt(layer_norm, fused_gdn_specs.gpt_block_spec(layer_norm))
    sigmoid = _megatron_config(activation_func=torch.sigmoid, deterministic_mode=False)
    with pytest.raises(ValueError, match="sigmoid gate requires deterministic_mode=True"):
        _gpt(sigmoid, fused_gdn_specs.gpt_block_spec(sigmoid))


@pytest.mark.parametrize("name", ["fused_gated_norm", "gdn_gated_output_norm_fusion"])
def test_a_config_that_sets_the_switch_must_agree(name):
    """Our config: one that turns the fusion off (under either name) is refused; one that turns
    it on, or leaves it unset, builds fused layers."""
    sizes = dict(num_layers=2, linear_attention_freq=2, params_dtype=torch.float32)
    off = gdn_config(**sizes, **{name: False})
    with pytest.raises(ValueError, match=r"spec's param fused_gated_norm=True .* disagrees with "
                                         r"TransformerConfig, which turns the fused output norm "
                                         r"off"):
        _gpt(off, fused_gdn_specs.gpt_block_spec(off))
    for config in (gdn_config(**sizes, **{name: True}), gdn_config(**sizes)):
        model = _gpt(config, fused_gdn_specs.gpt_block_spec(config))
        assert [m.fused_gated_norm for m in _gdn_layers(model)] == [True]


def test_the_both_fusions_specs_turn_the_pre_gated_delta_rule_fusion_on_too():
    """With megatron's own config: every GDN layer runs both fusions; the plain specs leave the
    fusion before the gated delta rule off, and a config that turns it on must use the
    ``*_both_fusions`` ones (the others fail the build, saying how to fix it)."""
    config = _megatron_config()
    both = _gpt(config, fused_gdn_specs.gpt_block_spec_both_fusions(_ModelConfig(config)))
    layers = _gdn_layers(both)
    assert [type(m) for m in layers] == [GatedDeltaNet]
    assert all(m.fused_gated_norm and m.pre_gated_delta_rule_fusion for m in layers)
    plain = _gpt(config, fused_gdn_specs.gpt_block_spec(config))
    assert [m.pre_gated_delta_rule_fusion for m in _gdn_layers(plain)] == [False]
    mixer = fused_gdn_specs.hybrid_stack_spec_both_fusions.submodules.gdn_layer.submodules
    assert mixer.self_attention.params == {"fused_gated_norm": True,
                                           "pre_gated_delta_rule_fusion": True}
    plain_mixer = fused_gdn_specs.hybrid_stack_spec.submodules.gdn_layer.submodules
    assert plain_mixer.self_attention.params["pre_gated_delta_rule_fusion"] is False
    sizes = dict(num_layers=2, linear_attention_freq=2, params_dtype=torch.float32)
    on = gdn_config(**sizes, gdn_pre_gated_delta_rule_fusion=True)
    with pytest.raises(ValueError, match=r"param pre_gated_delta_rule_fusion=False .* disagrees "
                                         r"with TransformerConfig"):
        _gpt(on, fused_gdn_specs.gpt_block_spec(on))
    model = _gpt(on, fused_gdn_specs.gpt_block_spec_both_fusions(on))
    assert [m.pre_gated_delta_rule_fusion for m in _gdn_layers(model)] == [True]
    # a sigmoid gate: the fused output norm takes it (deterministic mode), this fusion does not
    sigmoid = _megatron_config(activation_func=torch.sigmoid, deterministic_mode=True)
    assert _gdn_layers(_gpt(sigmoid, fused_gdn_specs.gpt_block_spec(sigmoid)))
    with pytest.raises(ValueError, match=r"activation_func must be torch\.nn\.functional\.silu "
                                         r".* got 'sigmoid'"):
        _gpt(sigmoid, fused_gdn_specs.gpt_block_spec_both_fusions(sigmoid))


def test_megatrons_spec_option_finds_them():
    """megatron's --spec imports (module, name) with ``vars(module)[name]``: module attributes,
    not lazy ones."""
    from megatron.core.transformer.spec_utils import import_module

    assert import_module(("core.models.fused_gdn_specs", "gpt_block_spec")) is \
        fused_gdn_specs.gpt_block_spec
    assert import_module(("core.models.fused_gdn_specs", "hybrid_stack_spec")) is \
        fused_gdn_specs.hybrid_stack_spec
    for name in fused_gdn_specs.SPEC_NAMES:  # what the module lists for a mistyped name
        assert import_module(("core.models.fused_gdn_specs", name)) is \
            getattr(fused_gdn_specs, name)


def test_a_mistyped_spec_name_is_told_the_valid_ones():
    """The module answers an unknown name with its spec names. megatron's --spec import
    (``vars(module)[name]``) bypasses that and raises a bare KeyError: the launchers check the
    name before megatron does (tests/examples/test_pretrain_gdn_megatron.py)."""
    from megatron.core.transformer.spec_utils import import_module

    with pytest.raises(AttributeError, match=r"module 'core\.models\.fused_gdn_specs' has no spec "
                                             r"'gpt_block_specc'; its specs are: gpt_block_spec, "
                                             r"hybrid_stack_spec, gpt_block_spec_both_fusions, "
                                             r"hybrid_stack_spec_both_fusions$"):
        getattr(fused_gdn_specs, "gpt_block_specc")
    assert not hasattr(fused_gdn_specs, "__wrapped__")  # tools probing dunder names get False
    with pytest.raises(KeyError, match="^'gpt_block_specc'$"):
        import_module(("core.models.fused_gdn_specs", "gpt_block_specc"))
