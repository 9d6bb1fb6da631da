"""use_fused_gdn on megatron's own GDN specs (the GPT block spec of the gated_delta_net variant,
dense and MoE; the hybrid stack spec; lists, tuples, import paths): only the GDN class and its
fusion params change, the input is untouched, and the models built from both specs have the same
state-dict and sharded-state-dict keys. The layers it builds run the fusions asked for with any
config that does not turn them off (megatron's own included). assert_fused_gdn refuses anything
but a Megatron model, and a model with a GDN layer that does not run a fusion asked for."""

import copy
import dataclasses
import functools

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import experimental_attention_variant_module_specs as mexp
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGDN
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import (
    TransformerConfig as MegatronTransformerConfig,
)

from core.models.gdn_specs import (assert_fused_gdn, get_attention_layer_spec,
                                   get_gdn_hybrid_block_spec, use_fused_gdn)
from core.models.te_free_specs import megatron_te_spec_builders, te_to_local
from core.ssm import GatedDeltaNet
from core.testing.gdn import gdn_config
from core.testing.specs import checkpoint_keys, compare_gdn_swap, spec_fingerprint
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


# The params use_fused_gdn(spec) sets on our GDN specs, with its default keywords.
DEFAULT_PARAMS = {"fused_gated_norm": True, "pre_gated_delta_rule_fusion": False}


def _fusion_param_checked_and_dropped(node, memo=None):
    """A copy of a spec tree built by use_fused_gdn with the params it sets on our GDN specs
    (:data:`DEFAULT_PARAMS`, asserted on each) dropped: compare_gdn_swap then judges the rest
    as a pure class swap. Shared nodes stay shared."""
    memo = {} if memo is None else memo
    if id(node) in memo:
        return memo[id(node)]
    if isinstance(node, type) or not (dataclasses.is_dataclass(node) or isinstance(
            node, (list, tuple, dict, functools.partial))):
        return node
    drop = functools.partial(_fusion_param_checked_and_dropped, memo=memo)
    if isinstance(node, functools.partial):
        new = functools.partial(drop(node.func), *map(drop, node.args),
                                **{k: drop(v) for k, v in node.keywords.items()})
    elif isinstance(node, (list, tuple)):
        new = type(node)(map(drop, node))
    elif isinstance(node, dict):
        new = {k: drop(v) for k, v in node.items()}
    else:
        new = copy.copy(node)
        for field in dataclasses.fields(node):
            object.__setattr__(new, field.name, drop(getattr(node, field.name)))
        if isinstance(node, ModuleSpec) and node.module is GatedDeltaNet:
            assert {k: node.params[k] for k in DEFAULT_PARAMS} == DEFAULT_PARAMS, node
            new.params = {k: v for k, v in new.params.items() if k not in DEFAULT_PARAMS}
    memo[id(node)] = new
    return new


def _check_swap(spec, expected_swaps):
    before = spec_fingerprint(spec)
    fused = use_fused_gdn(spec)
    assert compare_gdn_swap(spec, _fusion_param_checked_and_dropped(fused)) == expected_swaps
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
def test_gated_output_norm_sets_the_param_of_every_gdn_spec(value):
    """The switch in the spec (what a config without the field, megatron's own, needs): set on
    our GDN specs (megatron's shared mixer spec stays one shared copy), nothing else touched,
    the input untouched; applying it again gives the same object back."""
    spec = _megatron_block_spec(_config())
    before = spec_fingerprint(spec)
    fused = use_fused_gdn(spec, gated_output_norm=value)
    mixers = [layer.submodules.self_attention for layer in fused.layer_specs]
    assert mixers[0] is mixers[2] and mixers[0].module is GatedDeltaNet
    assert mixers[0].params == {**spec.layer_specs[0].submodules.self_attention.params,
                                "fused_gated_norm": value, "pre_gated_delta_rule_fusion": False}
    assert "fused_gated_norm" not in mixers[1].params  # the attention layer's
    assert fused.layer_specs[1] is spec.layer_specs[1]
    assert spec_fingerprint(spec) == before
    assert use_fused_gdn(fused, gated_output_norm=value) is fused
    assert (use_fused_gdn(fused) is fused) is value  # the default asks for the fusion
    flipped = use_fused_gdn(fused, gated_output_norm=not value)
    assert flipped.layer_specs[0].submodules.self_attention.params["fused_gated_norm"] is not value


def test_the_default_asks_for_the_fusion_in_the_specs_a_spec_function_builds():
    fused_fn = use_fused_gdn(mexp.get_transformer_block_with_experimental_attention_variant_spec)
    with megatron_te_spec_builders():
        spec = fused_fn(_config(), vp_stage=None)
    assert spec.layer_specs[0].submodules.self_attention.params["fused_gated_norm"] is True


@pytest.mark.parametrize("entry", [use_fused_gdn, assert_fused_gdn])
@pytest.mark.parametrize("keyword", ["gated_output_norm", "pre_gated_delta_rule"])
@pytest.mark.parametrize("value", ["true", 1, None])
def test_the_fusion_keywords_are_bools(entry, keyword, value):
    with pytest.raises(TypeError, match=rf"{entry.__name__}: {keyword} must be a bool \(True or "
                                        rf"False\), got {value!r}"):
        entry(hybrid_stack_spec, **{keyword: value})


@pytest.mark.parametrize("gated_output_norm", [True, False])
@pytest.mark.parametrize("pre_gated_delta_rule", [True, False])
def test_both_fusion_keywords_set_their_params_independently(gated_output_norm,
                                                             pre_gated_delta_rule):
    """Each keyword sets its own param of every GDN spec (megatron main's second fusion,
    gdn_pre_gated_delta_rule_fusion, as the spec param pre_gated_delta_rule_fusion)."""
    spec = _megatron_block_spec(_config())
    fused = use_fused_gdn(spec, gated_output_norm=gated_output_norm,
                          pre_gated_delta_rule=pre_gated_delta_rule)
    mixer = fused.layer_specs[0].submodules.self_attention
    assert mixer.module is GatedDeltaNet
    assert mixer.params["fused_gated_norm"] is gated_output_norm
    assert mixer.params["pre_gated_delta_rule_fusion"] is pre_gated_delta_rule
    assert use_fused_gdn(fused, gated_output_norm=gated_output_norm,
                         pre_gated_delta_rule=pre_gated_delta_rule) is fused
    flipped = use_fused_gdn(fused, gated_output_norm=gated_output_norm,
                            pre_gated_delta_rule=not pre_gated_delta_rule)
    params = flipped.layer_specs[0].submodules.self_attention.params
    assert params["pre_gated_delta_rule_fusion"] is not pre_gated_delta_rule
    assert params["fused_gated_norm"] is gated_output_norm


def test_the_keywords_are_keyword_only():
    with pytest.raises(TypeError, match="positional argument"):
        use_fused_gdn(hybrid_stack_spec, True)


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
    assert compare_gdn_swap(spec, _fusion_param_checked_and_dropped(fused)) == 2


def test_a_partial_of_a_module_class_stays_a_spec_node():
    """megatron's MLP / MoE builders are partials of a class: their arguments are rewritten, they
    are not wrapped as spec functions."""
    import functools

    builder = functools.partial(ModuleSpec, module=MegatronGDN)
    assert use_fused_gdn(builder).keywords["module"] is GatedDeltaNet


@pytest.mark.parametrize("spec", ["megatron.core.ssm.gated_delta_net.GatedDeltaNet", b"GDN", 42])
def test_what_is_no_spec_is_refused(spec):
    with pytest.raises(TypeError, match="replace_modules: spec must be a spec, a list of specs "
                                        "or a spec function"):
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
    prediction depth ("G*G-/G-"), built from use_fused_gdn of megatron's hybrid stack spec with a
    config that leaves the switch unset: every GDN layer, the MTP one included, is ours and runs
    the fused norm, and the loss and every gradient (the MTP loss's included) equal those of the
    model built with gated_output_norm=False within fp32 rounding."""
    config = _config(linear_attention_freq=None, experimental_attention_variant=None,
                     mtp_num_layers=1)

    def build(fused):
        spec = use_fused_gdn(te_to_local(hybrid_stack_spec), gated_output_norm=fused)
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


def _gdn_flags(model):
    return [m.fused_gated_norm for m in model.modules() if isinstance(m, GatedDeltaNet)]


def test_megatrons_own_config_builds_fused_layers_from_use_fused_gdn():
    """megatron's TransformerConfig has no fusion field: the spec switches the fusion on, and
    the model passes; the same config with our GDN class and no param builds unfused layers,
    which assert_fused_gdn refuses naming them (a ValueError: the class is right, the switch is
    off), and which pass when no fusion is asked for."""
    config = _config(config_class=MegatronTransformerConfig)
    model = _gpt(config, use_fused_gdn(te_to_local(_megatron_block_spec(config))))
    assert _gdn_flags(model) == [True, True]
    assert_fused_gdn(model)
    unfused = _gpt(config, get_gdn_hybrid_block_spec(config))  # the config decides: unset, off
    assert _gdn_flags(unfused) == [False, False]
    with pytest.raises(ValueError, match=r"assert_fused_gdn\(gated_output_norm=True\): these GDN "
                                         r"layers are ours with the fused output norm off .*: "
                                         r"decoder\.layers\.0\.self_attention; "
                                         r"decoder\.layers\.2\.self_attention\. Build the "
                                         r"model from core\.models\.use_fused_gdn\(spec\)"):
        assert_fused_gdn(unfused)
    assert_fused_gdn(unfused, gated_output_norm=False)


def test_a_config_that_turns_the_fusion_off_fails_the_build_saying_how_to_fix_it():
    spec = te_to_local(_megatron_block_spec(_config()))
    for name in ("fused_gated_norm", "gdn_gated_output_norm_fusion"):
        off = _config(**{name: False})
        with pytest.raises(ValueError, match=r"use_fused_gdn\(spec, gated_output_norm=True\)\) "
                                             r"disagrees with TransformerConfig, which turns the "
                                             r"fused output norm off .*: build from "
                                             r"use_fused_gdn\(spec, gated_output_norm=False\)"):
            _gpt(off, use_fused_gdn(spec))
        assert _gdn_flags(_gpt(off, use_fused_gdn(spec, gated_output_norm=False))) == [False] * 2
    on = _config(gdn_gated_output_norm_fusion=True)  # megatron main's name
    assert _gdn_flags(_gpt(on, use_fused_gdn(spec))) == [True, True]


def _pre_flags(model):
    return [m.pre_gated_delta_rule_fusion for m in model.modules()
            if isinstance(m, GatedDeltaNet)]


def test_the_spec_param_builds_layers_with_the_pre_gated_delta_rule_fusion():
    """use_fused_gdn(spec, pre_gated_delta_rule=True) with megatron's own config (no field):
    every GDN layer is ours with the fusion on, with or without the fused output norm."""
    config = _config(config_class=MegatronTransformerConfig)
    spec = te_to_local(_megatron_block_spec(config))
    for gated_output_norm in (True, False):
        model = _gpt(config, use_fused_gdn(spec, gated_output_norm=gated_output_norm,
                                           pre_gated_delta_rule=True))
        assert _pre_flags(model) == [True, True]
        assert _gdn_flags(model) == [gated_output_norm] * 2
    assert _pre_flags(_gpt(config, use_fused_gdn(spec))) == [False, False]  # the default


def test_the_pre_gated_delta_rule_fusion_follows_the_config_where_the_spec_leaves_it():
    """Our config's field (or the attribute of megatron's, as a release that declares it would
    carry it): with no param (the get_gdn_* builders) it decides; a use_fused_gdn spec whose
    keyword disagrees fails the build saying how to fix it."""
    on = _config(gdn_pre_gated_delta_rule_fusion=True)
    assert _pre_flags(_gpt(on, get_gdn_hybrid_block_spec(on))) == [True, True]
    assert _pre_flags(_gpt(_config(), get_gdn_hybrid_block_spec(_config()))) == [False, False]
    megatrons = _config(config_class=MegatronTransformerConfig)
    spec = te_to_local(_megatron_block_spec(megatrons))
    megatrons.gdn_pre_gated_delta_rule_fusion = True
    with pytest.raises(ValueError, match=r"param pre_gated_delta_rule_fusion=False \(from "
                                         r"core\.models\.use_fused_gdn\(spec, "
                                         r"pre_gated_delta_rule=False\)\) disagrees with "
                                         r"TransformerConfig, which turns the fusion before the "
                                         r"gated delta rule on .*: build from use_fused_gdn\(spec, "
                                         r"pre_gated_delta_rule=True\)"):
        _gpt(megatrons, use_fused_gdn(spec))
    assert _pre_flags(_gpt(megatrons, use_fused_gdn(spec, pre_gated_delta_rule=True))) == [True] * 2
    megatrons.activation_func = torch.nn.functional.gelu
    with pytest.raises(ValueError, match="activation_func must be torch.nn.functional.silu"):
        _gpt(megatrons, use_fused_gdn(spec, pre_gated_delta_rule=True))
    megatrons.gdn_pre_gated_delta_rule_fusion = False
    with pytest.raises(ValueError, match=r"param pre_gated_delta_rule_fusion=True .* turns the "
                                         r"fusion before the gated delta rule off"):
        _gpt(megatrons, use_fused_gdn(spec, gated_output_norm=False, pre_gated_delta_rule=True))


def test_assert_fused_gdn_checks_the_pre_gated_delta_rule_fusion():
    """pre_gated_delta_rule=True: every GDN layer must be ours with the fusion on (ValueError
    naming the paths where it is off; a layer of megatron's class is a TypeError); the two
    fusions are checked independently."""
    config = _config()
    spec = te_to_local(_megatron_block_spec(config))
    both = _gpt(config, use_fused_gdn(spec, pre_gated_delta_rule=True))
    assert_fused_gdn(both, pre_gated_delta_rule=True)
    assert_fused_gdn(both, gated_output_norm=False, pre_gated_delta_rule=True)
    pre_only = _gpt(config, use_fused_gdn(spec, gated_output_norm=False,
                                          pre_gated_delta_rule=True))
    assert_fused_gdn(pre_only, gated_output_norm=False, pre_gated_delta_rule=True)
    with pytest.raises(ValueError, match=r"ours with the fused output norm off"):
        assert_fused_gdn(pre_only, pre_gated_delta_rule=True)
    norm_only = _gpt(config, use_fused_gdn(spec))
    assert_fused_gdn(norm_only)
    with pytest.raises(ValueError, match=r"assert_fused_gdn\(gated_output_norm=True, "
                                         r"pre_gated_delta_rule=True\): these GDN layers are "
                                         r"ours with the fusion before the gated delta rule off "
                                         r"\(their config turns it off or leaves it unset, and "
                                         r"their spec does not switch it on\): "
                                         r"decoder\.layers\.0\.self_attention; "
                                         r"decoder\.layers\.2\.self_attention\. Build the model "
                                         r"from core\.models\.use_fused_gdn\(spec, "
                                         r"gated_output_norm=True, pre_gated_delta_rule=True\)"):
        assert_fused_gdn(norm_only, pre_gated_delta_rule=True)
    unfused = _gpt(config, get_gdn_hybrid_block_spec(config))
    with pytest.raises(ValueError, match=r"ours with the fused output norm off .* and these GDN "
                                         r"layers are ours with the fusion before the gated delta "
                                         r"rule off"):
        assert_fused_gdn(unfused, pre_gated_delta_rule=True)
    with pytest.raises(TypeError, match=r"would silently ignore the fusion before the gated delta "
                                        r"rule: decoder\.layers\.0\.self_attention \(megatron\."):
        assert_fused_gdn(_gpt(config, spec), gated_output_norm=False, pre_gated_delta_rule=True)


def test_assert_fused_gdn_names_megatron_layers():
    """megatron's class has no fused output norm: refused whenever the fusion is asked for
    (its config need not ask: the call does), and with gated_output_norm=False only where its
    config asks for something only ours does."""
    plain = _config()
    spec = te_to_local(_megatron_block_spec(plain))
    with pytest.raises(TypeError, match=r"another GatedDeltaNet class .* would silently ignore "
                                        r"the fused output norm: "
                                        r"decoder\.layers\.0\.self_attention \(megatron\."):
        assert_fused_gdn(_gpt(plain, spec))
    assert_fused_gdn(_gpt(plain, spec), gated_output_norm=False)  # nothing asked of it
    config = _config(fused_gated_norm=True)
    model = _gpt(config, spec)
    for asked in (True, False):
        with pytest.raises(TypeError, match="fused_gated_norm=True") as info:
            assert_fused_gdn(model, gated_output_norm=asked)
    message = str(info.value)
    assert "decoder.layers.0.self_attention" in message
    assert "decoder.layers.2.self_attention" in message
    assert "decoder.layers.1" not in message
    with pytest.raises(TypeError, match=r"\[1\]\.decoder\.layers\.0\.self_attention"):
        assert_fused_gdn([_gpt(config, use_fused_gdn(spec)), model])  # model chunks
    assert_fused_gdn(_gpt(config, use_fused_gdn(spec)))  # ours: passes


def test_assert_fused_gdn_reports_both_kinds_of_layer_as_a_type_error():
    config = _config()
    spec = te_to_local(_megatron_block_spec(config))
    chunks = [_gpt(config, spec), _gpt(config, get_gdn_hybrid_block_spec(config))]
    with pytest.raises(TypeError, match=r"\[0\]\.decoder\.layers\.0\.self_attention .* and "
                                        r"these GDN layers are ours with the fused output norm "
                                        r"off .*\[1\]\.decoder\.layers\.0\.self_attention"):
        assert_fused_gdn(chunks)


class TheirGDN(MegatronGDN):
    """Someone else's subclass of megatron's layer: use_fused_gdn leaves it alone."""


def test_assert_fused_gdn_names_a_foreign_subclass():
    config = _config(fused_gated_norm=True)
    spec = te_to_local(_megatron_block_spec(config))  # a spec of its own, built for this test
    mixer = spec.layer_specs[0].submodules.self_attention  # shared by the GDN layers 0 and 2
    assert mixer is spec.layer_specs[2].submodules.self_attention
    mixer.module = TheirGDN
    model = _gpt(config, spec)
    assert _gdn_types(model) == [TheirGDN] * 2
    with pytest.raises(TypeError, match=r"decoder\.layers\.0\.self_attention \(.*TheirGDN\)"):
        assert_fused_gdn(model)


def test_assert_fused_gdn_names_megatron_layers_whose_config_asks_for_the_pre_fusion():
    """megatron's class ignores gdn_pre_gated_delta_rule_fusion: a config that turns it on is
    named even when the call asks for no fusion."""
    config = _config(gdn_pre_gated_delta_rule_fusion=True)
    model = _gpt(config, te_to_local(_megatron_block_spec(config)))
    with pytest.raises(TypeError, match=r"would silently ignore gdn_pre_gated_delta_rule_fusion="
                                        r"True: decoder\.layers\.0\.self_attention"):
        assert_fused_gdn(model, gated_output_norm=False)


def test_assert_fused_gdn_zero_centring_override():
    override = _config(layernorm_zero_centered_gamma=True, gdn_out_norm_zero_centered_gamma=False)
    spec = te_to_local(_megatron_block_spec(override))
    with pytest.raises(TypeError, match="gdn_out_norm_zero_centered_gamma=False"):
        assert_fused_gdn(_gpt(override, spec), gated_output_norm=False)


def test_a_stage_without_gdn_layers_passes():
    """A pipeline stage (or any Megatron model) that holds no GDN layer: nothing to check."""
    config = _config(num_layers=2)
    assert_fused_gdn(_gpt(config, get_attention_layer_spec(use_te=False)))


@pytest.mark.parametrize("model, got", [
    (torch.nn.Linear(2, 2), "got Linear"),
    ("model", "got str"),
    ([], "got an empty list"),
    ((torch.nn.Linear(2, 2),), r"got Linear \(chunk 0\)"),
], ids=["linear", "string", "empty_list", "tuple_of_linear"])
def test_assert_fused_gdn_refuses_what_is_not_a_megatron_model(model, got):
    with pytest.raises(TypeError, match=rf"assert_fused_gdn: model must be a Megatron model: a "
                                        rf"megatron\.core\.transformer\.module\.MegatronModule "
                                        rf".*, {got}"):
        assert_fused_gdn(model)


def test_assert_fused_gdn_looks_inside_megatrons_wrappers():
    """Float16Module (megatron's bf16 wrapper): around a Megatron model it is that model, with
    its paths; around anything else it is refused."""
    config = _config(params_dtype=torch.bfloat16)
    spec = te_to_local(_megatron_block_spec(config))
    assert_fused_gdn(Float16Module(config, _gpt(config, use_fused_gdn(spec))))
    with pytest.raises(TypeError, match=r"module\.decoder\.layers\.0\.self_attention"):
        assert_fused_gdn([Float16Module(config, _gpt(config, spec))])
    with pytest.raises(TypeError, match="got Float16Module wrapping Linear"):
        assert_fused_gdn(Float16Module(config, torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("field, value", [("fused_gated_norm", "false"),
                                          ("gdn_pre_gated_delta_rule_fusion", "false"),
                                          ("gdn_out_norm_zero_centered_gamma", 0)])
def test_assert_fused_gdn_names_a_field_of_the_wrong_type(field, value):
    """A config field set from text (a provider's YAML) is named, not read as a truth value."""
    config = _config()
    model = _gpt(config, te_to_local(_megatron_block_spec(config)))
    setattr(config, field, value)
    with pytest.raises(TypeError, match=rf"TransformerConfig: {field} must be .*, got {value!r}"):
        assert_fused_gdn(model, gated_output_norm=False)
