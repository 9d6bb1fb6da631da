"""use_fused_gdn on megatron's own GDN specs (the GPT block spec of the gated_delta_net variant,
dense and MoE; the hybrid stack spec; lists, tuples, import paths): only the GDN class changes,
the input is untouched, and the models built from both specs have the same state-dict and
sharded-state-dict keys. assert_fused_gdn rejects a model that asks for the fusion but holds
megatron's class."""

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import experimental_attention_variant_module_specs as mexp
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGDN
from megatron.core.transformer.spec_utils import ModuleSpec

from core.models.gdn_specs import assert_fused_gdn, use_fused_gdn
from core.ssm import GatedDeltaNet
from core.testing.gdn import gdn_config
from core.testing.specs import (
    checkpoint_keys,
    compare_gdn_swap,
    megatron_te_spec_builders,
    spec_fingerprint,
    te_to_local,
)
from tests.gated_norm_checks import assert_language_model_matches_unfused

VOCAB, SEQ = 64, 16

pytestmark = pytest.mark.usefixtures("model_parallel_tp1")


def _config(moe: bool = False, **overrides):
    kwargs = dict(num_layers=4, linear_attention_freq=2, params_dtype=torch.float32)
    if moe:
        kwargs.update(num_moe_experts=2, moe_layer_freq=[1, 0, 0, 1], moe_router_topk=2,
                      moe_ffn_hidden_size=32)
    kwargs.update(overrides)
    return gdn_config(**kwargs)


def _megatron_block_spec(config):
    with megatron_te_spec_builders():
        return mexp.get_transformer_block_with_experimental_attention_variant_spec(config)


def _check_swap(spec, expected_swaps):
    before = spec_fingerprint(spec)
    fused = use_fused_gdn(spec)
    assert compare_gdn_swap(spec, fused) == expected_swaps
    assert spec_fingerprint(spec) == before, "use_fused_gdn modified its input"
    assert use_fused_gdn(fused) is fused  # nothing left to replace: the same object back
    return fused


# --- spec trees --------------------------------------------------------------------------------


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gpt_block_spec_of_the_gdn_variant(moe):
    spec = _megatron_block_spec(_config(moe=moe))
    fused = _check_swap(spec, expected_swaps=2)  # layers 0 and 2 are GDN (freq 2)
    gdn = [layer.submodules.self_attention for layer in fused.layer_specs]
    assert gdn[0] is gdn[2], "megatron's shared mixer spec stays shared"
    assert fused.layer_specs[1] is spec.layer_specs[1]  # attention layers: the same objects
    if moe:  # the MoE builder of layer 0 is untouched
        assert fused.layer_specs[0].submodules.mlp.func.__name__ == "MoELayer"
        assert fused.layer_specs[0].submodules.mlp is spec.layer_specs[0].submodules.mlp


def test_layer_spec_list_and_tuple_and_local_backend():
    config = _config()
    with megatron_te_spec_builders():
        layers = mexp.get_transformer_layer_with_experimental_attention_variant_spec(config)
    fused = _check_swap(layers, expected_swaps=2)
    assert isinstance(fused, list)
    assert isinstance(_check_swap(tuple(layers), expected_swaps=2), tuple)
    from megatron.core.models.backends import LocalSpecProvider

    local = mexp.get_gated_delta_net_module_spec(config, backend=LocalSpecProvider())
    assert _check_swap(local, expected_swaps=1).module is GatedDeltaNet


def test_hybrid_stack_spec():
    fused = _check_swap(hybrid_stack_spec, expected_swaps=1)
    assert fused.submodules.gdn_layer.submodules.self_attention.module is GatedDeltaNet
    for name in ("mamba_layer", "attention_layer", "mlp_layer", "moe_layer", "mtp_block_spec"):
        assert getattr(fused.submodules, name) is getattr(hybrid_stack_spec.submodules, name)


def test_bare_class_import_path_and_foreign_subclass():
    assert use_fused_gdn(MegatronGDN) is GatedDeltaNet
    by_path = ModuleSpec(module=("megatron.core.ssm.gated_delta_net", "GatedDeltaNet"))
    assert use_fused_gdn(by_path).module is GatedDeltaNet
    other = ModuleSpec(module=("megatron.core.transformer.attention", "SelfAttention"))
    assert use_fused_gdn(other) is other

    class TheirGDN(MegatronGDN):
        pass

    theirs = ModuleSpec(module=TheirGDN)
    assert use_fused_gdn(theirs) is theirs


def test_classes_in_a_specs_params_dict_are_replaced():
    """A spec whose ``params`` dict names the GDN class (a wrapper module taking its mixer as an
    argument): the dict is rewritten in a copy, its other entries kept, the input untouched."""
    params = {"mixer": MegatronGDN, "mixers": [MegatronGDN], "width": 8}
    spec = ModuleSpec(module=torch.nn.Module, params=params)
    fused = use_fused_gdn(spec)
    assert fused.params == {"mixer": GatedDeltaNet, "mixers": [GatedDeltaNet], "width": 8}
    assert params == {"mixer": MegatronGDN, "mixers": [MegatronGDN], "width": 8}
    assert spec.params is params and fused.params is not params
    assert use_fused_gdn(fused) is fused


@pytest.mark.parametrize("value", [True, False])
def test_fused_gated_norm_sets_the_param_of_every_gdn_spec(value):
    """The switch for configs without the field: set on our GDN specs (megatron's shared mixer
    spec stays one shared copy), nothing else touched, the input untouched; applying it again
    gives the same object back."""
    spec = _megatron_block_spec(_config())
    before = spec_fingerprint(spec)
    fused = use_fused_gdn(spec, fused_gated_norm=value)
    mixers = [layer.submodules.self_attention for layer in fused.layer_specs]
    assert mixers[0] is mixers[2] and mixers[0].module is GatedDeltaNet
    assert mixers[0].params == {**spec.layer_specs[0].submodules.self_attention.params,
                                "fused_gated_norm": value}
    assert "fused_gated_norm" not in mixers[1].params  # the attention layer's
    assert fused.layer_specs[1] is spec.layer_specs[1]
    assert spec_fingerprint(spec) == before
    assert use_fused_gdn(fused, fused_gated_norm=value) is fused
    assert use_fused_gdn(fused) is fused  # None: the params stay as they are
    flipped = use_fused_gdn(fused, fused_gated_norm=not value)
    assert flipped.layer_specs[0].submodules.self_attention.params["fused_gated_norm"] is not value


def test_fused_gated_norm_reaches_the_specs_a_spec_function_builds():
    fused_fn = use_fused_gdn(mexp.get_transformer_block_with_experimental_attention_variant_spec,
                             fused_gated_norm=True)
    with megatron_te_spec_builders():
        spec = fused_fn(_config(), vp_stage=None)
    assert spec.layer_specs[0].submodules.self_attention.params["fused_gated_norm"] is True


@pytest.mark.parametrize("value", ["true", 1, 0.0])
def test_fused_gated_norm_is_a_bool_or_none(value):
    with pytest.raises(TypeError, match=rf"use_fused_gdn: fused_gated_norm must be None \(leave "
                                        rf"the switch to config.fused_gated_norm\), True or "
                                        rf"False, got {value!r}"):
        use_fused_gdn(hybrid_stack_spec, fused_gated_norm=value)


class _SpecBuilder:
    def __call__(self, config, vp_stage=None):
        return mexp.get_transformer_block_with_experimental_attention_variant_spec(
            config, vp_stage=vp_stage)


@pytest.mark.parametrize("kind", ["function", "partial", "callable_object"])
def test_spec_function_gives_a_spec_function_with_its_signature(kind):
    """megatron.training's GPTModelConfig and Megatron-Bridge's providers take a spec function as
    transformer_layer_spec (Bridge's are often functools.partial) and call it with vp_stage when
    its signature has one."""
    import functools
    import inspect

    megatron_fn = mexp.get_transformer_block_with_experimental_attention_variant_spec
    spec_fn = {"function": megatron_fn, "partial": functools.partial(megatron_fn, pp_rank=None),
               "callable_object": _SpecBuilder()}[kind]
    fused_fn = use_fused_gdn(spec_fn)
    assert callable(fused_fn) and fused_fn is not spec_fn
    assert inspect.signature(fused_fn) == inspect.signature(spec_fn)
    assert "vp_stage" in inspect.signature(fused_fn).parameters
    config = _config()
    with megatron_te_spec_builders():
        spec, fused = spec_fn(config, vp_stage=None), fused_fn(config, vp_stage=None)
    assert compare_gdn_swap(spec, fused) == 2


def test_a_partial_of_a_module_class_stays_a_spec_node():
    """megatron's MLP / MoE builders are partials of a class: their arguments are rewritten, they
    are not wrapped as spec functions."""
    import functools

    builder = functools.partial(ModuleSpec, module=MegatronGDN)
    assert use_fused_gdn(builder).keywords["module"] is GatedDeltaNet


@pytest.mark.parametrize("spec", ["megatron.core.ssm.gated_delta_net.GatedDeltaNet", b"GDN", 42])
def test_what_is_no_spec_is_refused(spec):
    with pytest.raises(TypeError, match="replace_modules: spec must be a spec, a list of specs or a spec function"):
        use_fused_gdn(spec)


def test_none_is_megatrons_default_spec_and_refused():
    """megatron.training's GPTModelConfig.transformer_layer_spec and HybridModelConfig's
    hybrid_stack_spec default to None: megatron then builds its own spec, with its own GDN."""
    with pytest.raises(TypeError, match="spec is None, which megatron reads as its default spec"):
        use_fused_gdn(None)


# --- built models: same keys -------------------------------------------------------------------


def _keys(model):
    state = {k: tuple(v.shape) for k, v in model.state_dict().items() if torch.is_tensor(v)}
    return state, checkpoint_keys(model)


def _gdn_types(model):
    return [type(m) for m in model.modules() if isinstance(m, MegatronGDN)]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gpt_model_keys_unchanged(moe):
    config = _config(moe=moe)
    spec = te_to_local(_megatron_block_spec(config))
    megatron_model = GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB,
                              max_sequence_length=SEQ)
    ours = GPTModel(config, transformer_layer_spec=use_fused_gdn(spec), vocab_size=VOCAB,
                    max_sequence_length=SEQ)
    assert _gdn_types(megatron_model) == [MegatronGDN] * 2
    assert _gdn_types(ours) == [GatedDeltaNet] * 2
    if moe:
        assert type(ours.decoder.layers[0].mlp).__name__ == "MoELayer"
    state_a, sharded_a = _keys(megatron_model)
    state_b, sharded_b = _keys(ours)
    assert state_a == state_b
    assert sharded_a == sharded_b
    assert sharded_a["decoder.layers.0.self_attention.out_norm.weight"] == \
        "decoder.layers.0.self_attention.out_norm.weight"


def test_hybrid_model_keys_unchanged():
    config = _config(num_layers=4, linear_attention_freq=None, experimental_attention_variant=None)
    spec = te_to_local(hybrid_stack_spec)
    kwargs = dict(vocab_size=VOCAB, max_sequence_length=SEQ, hybrid_layer_pattern="G*G-")
    megatron_model = HybridModel(config, spec, **kwargs)
    ours = HybridModel(config, use_fused_gdn(spec), **kwargs)
    assert _gdn_types(megatron_model) == [MegatronGDN] * 2
    assert _gdn_types(ours) == [GatedDeltaNet] * 2
    state_a, sharded_a = _keys(megatron_model)
    state_b, sharded_b = _keys(ours)
    assert state_a == state_b
    assert sharded_a == sharded_b


@pytest.mark.cpu_shims
def test_hybrid_model_with_gdn_mtp_trains_as_unfused():
    """A HybridModel whose pattern puts GDN layers in the decoder and in its multi-token
    prediction depth ("G*G-/G-"), built from use_fused_gdn of megatron's hybrid stack spec: every
    GDN layer, the MTP one included, is ours and runs the fused norm, and the loss and every
    gradient (the MTP loss's included) equal the flag-off model's within fp32 rounding."""
    spec = use_fused_gdn(te_to_local(hybrid_stack_spec))

    def build(fused):
        config = _config(linear_attention_freq=None, experimental_attention_variant=None,
                         fused_gated_norm=fused, mtp_num_layers=1)
        return HybridModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                           hybrid_layer_pattern="G*G-/G-")

    model = build(True)
    gdn_names = [name for name, m in model.named_modules() if isinstance(m, MegatronGDN)]
    assert gdn_names == ["decoder.layers.0.self_attention", "decoder.layers.2.self_attention",
                         "mtp.layers.0.mtp_model_layer.layers.0.self_attention"]
    assert _gdn_types(model) == [GatedDeltaNet] * 3
    assert_fused_gdn(model)
    assert assert_language_model_matches_unfused(model, build(False), VOCAB, SEQ, seed=3) == 3
    mtp_out_norm = model.get_parameter(gdn_names[2] + ".out_norm.weight")
    assert mtp_out_norm.grad.abs().sum() > 0  # the MTP loss reaches the MTP layer's norm


# --- assert_fused_gdn ------------------------------------------------------------------------


def _gpt(config, spec):
    return GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def test_assert_fused_gdn_names_megatron_layers():
    config = _config(fused_gated_norm=True)
    spec = te_to_local(_megatron_block_spec(config))
    model = _gpt(config, spec)
    with pytest.raises(TypeError, match="fused_gated_norm=True") as info:
        assert_fused_gdn(model)
    message = str(info.value)
    assert "decoder.layers.0.self_attention" in message
    assert "decoder.layers.2.self_attention" in message
    assert "decoder.layers.1" not in message
    with pytest.raises(TypeError, match=r"\[1\]\.decoder\.layers\.0\.self_attention"):
        assert_fused_gdn([_gpt(config, use_fused_gdn(spec)), model])  # model chunks
    assert_fused_gdn(_gpt(config, use_fused_gdn(spec)))  # ours: passes


class TheirGDN(MegatronGDN):
    """Someone else's subclass of megatron's layer: use_fused_gdn leaves it alone."""


def test_assert_fused_gdn_names_a_foreign_subclass():
    config = _config(fused_gated_norm=True)
    spec = use_fused_gdn(te_to_local(_megatron_block_spec(config)))
    mixer = spec.layer_specs[0].submodules.self_attention  # shared by the GDN layers 0 and 2
    assert mixer is spec.layer_specs[2].submodules.self_attention
    mixer.module = TheirGDN
    model = _gpt(config, spec)
    assert _gdn_types(model) == [TheirGDN] * 2
    with pytest.raises(TypeError, match=r"decoder\.layers\.0\.self_attention \(.*TheirGDN\)"):
        assert_fused_gdn(model)


def test_assert_fused_gdn_zero_centring_override_and_no_op():
    override = _config(layernorm_zero_centered_gamma=True, gdn_out_norm_zero_centered_gamma=False)
    spec = te_to_local(_megatron_block_spec(override))
    with pytest.raises(TypeError, match="gdn_out_norm_zero_centered_gamma=False"):
        assert_fused_gdn(_gpt(override, spec))
    plain = _config()
    assert_fused_gdn(_gpt(plain, te_to_local(_megatron_block_spec(plain))))  # nothing asked
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        assert_fused_gdn("model")


@pytest.mark.parametrize("field, value", [("fused_gated_norm", "false"),
                                          ("gdn_out_norm_zero_centered_gamma", 0)])
def test_assert_fused_gdn_names_a_field_of_the_wrong_type(field, value):
    """A config field set from text (a provider's YAML) is named, not read as a truth value."""
    config = _config()
    model = _gpt(config, te_to_local(_megatron_block_spec(config)))
    setattr(config, field, value)
    with pytest.raises(TypeError, match=rf"TransformerConfig: {field} must be .*True or False\)?, "
                                        rf"got {value!r}"):
        assert_fused_gdn(model)
