"""TransformerConfig: the fused_gated_norm flag and megatron main's name of it
(gdn_gated_output_norm_fusion), their __post_init__ rules, megatron main's switch of the fusion
before the gated delta rule (gdn_pre_gated_delta_rule_fusion: its type, its rule, its spec
param), and the GDN output-norm zero-centring override."""

import dataclasses
import importlib.util
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig as MegatronConfig

import core.transformer.transformer_config as our_config_module
from core.testing.gdn import gdn_config
from core.transformer import (TransformerConfig, gated_output_norm_fusion,
                              gdn_out_norm_zero_centered, pre_gated_delta_rule_fusion_setting,
                              validate_gdn_config, validate_pre_gated_delta_rule_config)

NAMES = ("fused_gated_norm", "gdn_gated_output_norm_fusion")


def test_defaults_leave_megatron_unchanged():
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    assert config.fused_gated_norm is False and config.gdn_gated_output_norm_fusion is False
    assert gated_output_norm_fusion(config) is None  # neither name set
    assert config.gdn_out_norm_zero_centered_gamma is None
    assert config.gdn_pre_gated_delta_rule_fusion is None  # not set: the spec decides
    assert pre_gated_delta_rule_fusion_setting(config) is None


@pytest.mark.parametrize("activation", [F.silu, torch.sigmoid])
def test_flag_accepted_with_gdn_rmsnorm_and_supported_gate(activation):
    config = gdn_config(fused_gated_norm=True, activation_func=activation, deterministic_mode=True)
    assert config.fused_gated_norm


def test_flag_accepted_without_the_gpt_variant():
    # A HybridModel builds its 'G' layers with experimental_attention_variant=None.
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               normalization="RMSNorm", activation_func=F.silu,
                               fused_gated_norm=True)
    assert config.fused_gated_norm and config.experimental_attention_variant is None


def test_sigmoid_gate_requires_deterministic_mode():
    with pytest.raises(ValueError, match="sigmoid gate requires deterministic_mode=True"):
        gdn_config(fused_gated_norm=True, activation_func=torch.sigmoid, deterministic_mode=False)


def test_flag_requires_rmsnorm():
    with pytest.raises(ValueError,
                       match=r"fused_gated_norm requires normalization='RMSNorm'.*'LayerNorm'"):
        gdn_config(fused_gated_norm=True, normalization="LayerNorm")


@pytest.mark.parametrize("activation", [F.gelu, torch.nn.SiLU])
def test_flag_requires_supported_gate_activation(activation):
    with pytest.raises(ValueError,
                       match=r"fused_gated_norm requires activation_func .*got '(gelu|SiLU)'"):
        gdn_config(fused_gated_norm=True, activation_func=activation)


@pytest.mark.parametrize("eps, error", [(0.0, ValueError), (-1e-6, ValueError),
                                        (float("nan"), ValueError), ("1e-6", TypeError)])
def test_flag_requires_a_positive_epsilon(eps, error):
    """The kernels take eps as a normal fp32 number: refused when the config is built, not at
    the first forward; the unfused path keeps megatron's rules."""
    with pytest.raises(error, match="TransformerConfig with fused_gated_norm: layernorm_epsilon "
                                    "must be"):
        gdn_config(fused_gated_norm=True, layernorm_epsilon=eps)
    if error is ValueError:
        assert gdn_config(fused_gated_norm=False, layernorm_epsilon=eps).layernorm_epsilon is eps


def test_zero_centered_override_must_be_bool_or_none():
    with pytest.raises(TypeError, match="gdn_out_norm_zero_centered_gamma must be None"):
        gdn_config(gdn_out_norm_zero_centered_gamma="yes")


@pytest.mark.parametrize(
    "global_flag, override, expected",
    [(False, None, False), (True, None, True), (True, False, False), (False, True, True)],
)
def test_zero_centered_resolution(global_flag, override, expected):
    config = gdn_config(layernorm_zero_centered_gamma=global_flag,
                        gdn_out_norm_zero_centered_gamma=override)
    assert gdn_out_norm_zero_centered(config) is expected


def test_zero_centered_resolution_on_plain_megatron_config():
    config = MegatronConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            layernorm_zero_centered_gamma=True)
    assert gdn_out_norm_zero_centered(config) is True


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", ["false", 1, 0.0])
def test_flag_must_be_a_bool_or_none(name, value):
    with pytest.raises(TypeError, match=rf"TransformerConfig: {name} must be a bool \(True or "
                                        rf"False\) or None \(not set\), got {value!r}"):
        gdn_config(**{name: value})


# --- megatron main's name: one switch ---------------------------------------------------------


@pytest.mark.parametrize("given", [dict(fused_gated_norm=True),
                                   dict(gdn_gated_output_norm_fusion=True),
                                   dict(fused_gated_norm=True, gdn_gated_output_norm_fusion=True),
                                   dict(fused_gated_norm=True, gdn_gated_output_norm_fusion=None),
                                   dict(fused_gated_norm=None, gdn_gated_output_norm_fusion=True)],
                         ids=["ours", "megatron_main", "both", "ours_other_none",
                              "megatron_main_other_none"])
def test_either_name_turns_the_fusion_on_and_both_read_it(given):
    config = gdn_config(**given)
    assert config.fused_gated_norm is True and config.gdn_gated_output_norm_fusion is True
    assert gated_output_norm_fusion(config) is True and validate_gdn_config(config) is True


@pytest.mark.parametrize("name", NAMES)
def test_either_name_turns_it_off_explicitly(name):
    config = gdn_config(**{name: False})
    assert config.fused_gated_norm is False and config.gdn_gated_output_norm_fusion is False
    assert gated_output_norm_fusion(config) is False  # off, not merely unset
    with pytest.raises(ValueError, match="disagrees with TransformerConfig, which turns the "
                                         "fused output norm off"):
        validate_gdn_config(config, True)  # a spec that asks for it


@pytest.mark.parametrize("on", NAMES)
def test_one_name_on_and_the_other_off_is_refused_naming_both(on):
    off = next(name for name in NAMES if name != on)
    with pytest.raises(ValueError, match=rf"TransformerConfig: {NAMES[0]}=\w+, {NAMES[1]}=\w+ "
                                         r"contradict each other: .* one switch"):
        gdn_config(**{on: True, off: False})


def test_deterministic_mode_stays_supported_under_megatron_mains_name():
    """megatron main refuses its own fused output norm in deterministic mode; ours runs there."""
    for activation in (F.silu, torch.sigmoid):
        config = gdn_config(gdn_gated_output_norm_fusion=True, deterministic_mode=True,
                            activation_func=activation)
        assert config.deterministic_mode and config.fused_gated_norm is True


def test_megatron_mains_name_carries_the_fusions_rules():
    with pytest.raises(ValueError, match=r"fused_gated_norm requires normalization='RMSNorm'"):
        gdn_config(gdn_gated_output_norm_fusion=True, normalization="LayerNorm")


def test_a_name_assigned_after_construction_is_the_setting():
    """__post_init__ writes the resolved bool into both names; a later assignment to either one
    is read as the setting (the other still holds what __post_init__ wrote)."""
    config = gdn_config()
    config.gdn_gated_output_norm_fusion = True
    assert gated_output_norm_fusion(config) is True and validate_gdn_config(config) is True
    config = gdn_config(fused_gated_norm=True)
    config.fused_gated_norm = False
    assert gated_output_norm_fusion(config) is False and validate_gdn_config(config) is False
    config.gdn_gated_output_norm_fusion = False  # both assigned, in agreement
    assert gated_output_norm_fusion(config) is False
    config = gdn_config(fused_gated_norm=False)
    # False again in the other name is what __post_init__ wrote there: no setting of its own
    config.fused_gated_norm, config.gdn_gated_output_norm_fusion = True, False
    assert gated_output_norm_fusion(config) is True


def test_a_config_of_another_class_carries_either_name():
    """megatron's own config with the names as plain attributes (a Megatron-Bridge provider):
    the same one switch, no record of a __post_init__ of ours."""
    config = MegatronConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    assert gated_output_norm_fusion(config) is None
    config.gdn_gated_output_norm_fusion = True
    assert gated_output_norm_fusion(config) is True
    config.fused_gated_norm = False
    with pytest.raises(ValueError, match="TransformerConfig: fused_gated_norm=False, "
                                         "gdn_gated_output_norm_fusion=True contradict"):
        gated_output_norm_fusion(config)


# --- a megatron-core release that declares megatron main's fields itself --------------------


@dataclass
class FutureMegatronConfig(MegatronConfig):
    """megatron-core as megatron main declares its two GDN fusions (default False)."""

    gdn_gated_output_norm_fusion: bool = False
    gdn_pre_gated_delta_rule_fusion: bool = False


def _our_config_module_on(parent, monkeypatch):
    """core/transformer/transformer_config.py executed afresh over ``parent`` in place of
    megatron's TransformerConfig: what our class declares is decided when it is created."""
    import megatron.core.transformer.transformer_config as megatron_module

    monkeypatch.setattr(megatron_module, "TransformerConfig", parent)
    spec = importlib.util.spec_from_file_location("config_over_a_future_megatron",
                                                  our_config_module.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_a_field_megatron_declares_is_not_declared_again(monkeypatch):
    assert "gdn_gated_output_norm_fusion" in vars(TransformerConfig)["__annotations__"]  # today
    module = _our_config_module_on(FutureMegatronConfig, monkeypatch)
    ours = {f.name: f for f in dataclasses.fields(module.TransformerConfig)}
    megatrons = {f.name: f for f in dataclasses.fields(FutureMegatronConfig)}
    assert "gdn_gated_output_norm_fusion" not in vars(module.TransformerConfig)["__annotations__"]
    assert ours["gdn_gated_output_norm_fusion"] is megatrons["gdn_gated_output_norm_fusion"]
    assert ours["fused_gated_norm"].default is None
    for given in NAMES:
        config = gdn_config(config_class=module.TransformerConfig, **{given: True})
        assert config.fused_gated_norm is True and config.gdn_gated_output_norm_fusion is True
    config = gdn_config(config_class=module.TransformerConfig)
    assert config.fused_gated_norm is False and config.gdn_gated_output_norm_fusion is False
    # megatron's declared default False cannot be told from unset: the spec may decide
    assert module.gated_output_norm_fusion(config) is None
    assert module.validate_gdn_config(config, True) is True
    # megatron's declaration of the fusion before the gated delta rule: the same
    assert "gdn_pre_gated_delta_rule_fusion" not in vars(module.TransformerConfig)[
        "__annotations__"]
    assert ours["gdn_pre_gated_delta_rule_fusion"] is megatrons["gdn_pre_gated_delta_rule_fusion"]
    assert module.pre_gated_delta_rule_fusion_setting(config) is None  # False: not told from unset
    assert module.validate_pre_gated_delta_rule_config(config, True) is True
    on = gdn_config(config_class=module.TransformerConfig, gdn_pre_gated_delta_rule_fusion=True)
    assert module.pre_gated_delta_rule_fusion_setting(on) is True
    with pytest.raises(ValueError, match="disagrees with TransformerConfig, which turns the "
                                         "fusion before the gated delta rule on"):
        module.validate_pre_gated_delta_rule_config(on, False)
    with pytest.raises(ValueError, match="activation_func must be torch.nn.functional.silu"):
        gdn_config(config_class=module.TransformerConfig, gdn_pre_gated_delta_rule_fusion=True,
                   activation_func=F.gelu)


# --- the fusion before the gated delta rule (megatron main's gdn_pre_gated_delta_rule_fusion) --


def test_the_pre_gated_delta_rule_field_is_ours_while_megatron_lacks_it():
    """megatron-core 0.19 has no such field: ours declares it, default None (not set), and keeps
    what it was given (no bool is written over None)."""
    assert "gdn_pre_gated_delta_rule_fusion" not in {
        f.name for f in dataclasses.fields(MegatronConfig)}
    field = {f.name: f for f in dataclasses.fields(TransformerConfig)}[
        "gdn_pre_gated_delta_rule_fusion"]
    assert field.default is None
    assert field.metadata["argparse_meta"]["arg_names"] == ["--gdn-pre-gated-delta-rule-fusion"]
    for value in (True, False, None):
        config = gdn_config(gdn_pre_gated_delta_rule_fusion=value)
        assert config.gdn_pre_gated_delta_rule_fusion is value
        assert pre_gated_delta_rule_fusion_setting(config) is value
        assert validate_pre_gated_delta_rule_config(config) is bool(value)


@pytest.mark.parametrize("value", ["false", 1, 0.0])
def test_the_pre_gated_delta_rule_switch_must_be_a_bool_or_none(value):
    with pytest.raises(TypeError, match=rf"TransformerConfig: gdn_pre_gated_delta_rule_fusion "
                                        rf"must be None \(not set\), True or False, got "
                                        rf"{value!r}"):
        gdn_config(gdn_pre_gated_delta_rule_fusion=value)


@pytest.mark.parametrize("activation", [F.gelu, torch.sigmoid, torch.nn.SiLU])
def test_the_pre_gated_delta_rule_fusion_requires_silu(activation):
    """megatron applies activation_func after the short convolution; the fused kernel computes
    SiLU there. Off, any activation megatron takes is left to megatron."""
    with pytest.raises(ValueError, match=r"TransformerConfig with gdn_pre_gated_delta_rule_fusion: "
                                         r"activation_func must be torch\.nn\.functional\.silu "
                                         r"\(megatron applies it after the short convolution.*\), "
                                         r"got '(gelu|sigmoid|SiLU)'"):
        gdn_config(gdn_pre_gated_delta_rule_fusion=True, activation_func=activation)
    assert gdn_config(gdn_pre_gated_delta_rule_fusion=False,
                      activation_func=activation).activation_func is activation


def test_the_two_fusions_are_independent_and_compose():
    """Each switch leaves the other as it is; validate_gdn_config still returns the output
    norm's state."""
    both = gdn_config(fused_gated_norm=True, gdn_pre_gated_delta_rule_fusion=True)
    assert both.fused_gated_norm is True and both.gdn_pre_gated_delta_rule_fusion is True
    assert validate_gdn_config(both) is True and validate_pre_gated_delta_rule_config(both)
    pre_only = gdn_config(gdn_pre_gated_delta_rule_fusion=True)
    assert pre_only.fused_gated_norm is False and gated_output_norm_fusion(pre_only) is None
    assert validate_gdn_config(pre_only) is False
    assert validate_pre_gated_delta_rule_config(pre_only) is True
    norm_only = gdn_config(fused_gated_norm=True)
    assert validate_pre_gated_delta_rule_config(norm_only) is False
    # the fusion before the gated delta rule takes no RMSNorm rule of the output norm's
    layer_norm = gdn_config(gdn_pre_gated_delta_rule_fusion=True, normalization="LayerNorm")
    assert validate_pre_gated_delta_rule_config(layer_norm) is True


def test_the_pre_gated_delta_rule_spec_param_resolves_against_the_config():
    """The GDN spec's param ``pre_gated_delta_rule_fusion`` (core.models.use_fused_gdn sets it):
    a bool decides, and a config that sets the switch must agree (ValueError naming both and
    the fix); None leaves it to the config; anything else is a TypeError."""
    unset = gdn_config()
    assert validate_pre_gated_delta_rule_config(unset, None) is False
    assert validate_pre_gated_delta_rule_config(unset, False) is False
    assert validate_pre_gated_delta_rule_config(unset, True) is True
    on = gdn_config(gdn_pre_gated_delta_rule_fusion=True)
    assert validate_pre_gated_delta_rule_config(on, True) is True
    assert validate_pre_gated_delta_rule_config(on, None) is True
    with pytest.raises(ValueError, match=r"the GDN spec's param pre_gated_delta_rule_fusion=False "
                                         r"\(from core\.models\.use_fused_gdn\(spec, "
                                         r"pre_gated_delta_rule=False\)\) disagrees with "
                                         r"TransformerConfig, which turns the fusion before the "
                                         r"gated delta rule on \(gdn_pre_gated_delta_rule_fusion="
                                         r"True\): build from use_fused_gdn\(spec, "
                                         r"pre_gated_delta_rule=True\), or leave "
                                         r"gdn_pre_gated_delta_rule_fusion unset \(None\)"):
        validate_pre_gated_delta_rule_config(on, False)
    off = gdn_config(gdn_pre_gated_delta_rule_fusion=False)
    assert validate_pre_gated_delta_rule_config(off, False) is False
    with pytest.raises(ValueError, match=r"param pre_gated_delta_rule_fusion=True .* turns the "
                                         r"fusion before the gated delta rule off"):
        validate_pre_gated_delta_rule_config(off, True)
    for value in ("yes", 1):
        with pytest.raises(TypeError, match=rf"GatedDeltaNet spec params: "
                                            rf"pre_gated_delta_rule_fusion must be a bool \(True "
                                            rf"or False\), got {value!r}"):
            validate_pre_gated_delta_rule_config(unset, value)
    gelu = gdn_config(activation_func=F.gelu)  # the param on brings the rule with it
    with pytest.raises(ValueError, match=r"activation_func must be torch\.nn\.functional\.silu"):
        validate_pre_gated_delta_rule_config(gelu, True)
    assert validate_pre_gated_delta_rule_config(gelu, False) is False


def test_a_config_of_another_class_carries_the_pre_gated_delta_rule_switch():
    """megatron's own config with the field as a plain attribute (a Megatron-Bridge provider, a
    megatron that declares it): validate_gdn_config checks its type and, when on, its rule;
    without the attribute nothing is set."""
    config = MegatronConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    assert pre_gated_delta_rule_fusion_setting(config) is None
    assert validate_pre_gated_delta_rule_config(config) is False
    config.gdn_pre_gated_delta_rule_fusion = False
    assert validate_gdn_config(config) is False
    assert pre_gated_delta_rule_fusion_setting(config) is False  # no declared default: set
    config.gdn_pre_gated_delta_rule_fusion = True
    with pytest.raises(ValueError, match=r"activation_func must be .* got 'gelu'"):  # megatron's
        validate_gdn_config(config)
    config.activation_func = F.silu
    assert validate_gdn_config(config) is False  # the output norm's state, as before
    assert validate_pre_gated_delta_rule_config(config) is True
    config.gdn_pre_gated_delta_rule_fusion = "yes"
    with pytest.raises(TypeError, match="gdn_pre_gated_delta_rule_fusion must be None"):
        validate_gdn_config(config)


def test_zero_centered_override_is_not_an_int():
    with pytest.raises(TypeError, match="gdn_out_norm_zero_centered_gamma must be None"):
        gdn_config(gdn_out_norm_zero_centered_gamma=0)


def test_rules_apply_to_a_config_of_another_class():
    """A config that only carries the fields as attributes (e.g. a Megatron-Bridge provider, a
    subclass of megatron's config) gets the same rules, from validate_gdn_config."""
    config = MegatronConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            normalization="LayerNorm")
    validate_gdn_config(config)  # no fields: nothing asked
    config.fused_gated_norm = True
    with pytest.raises(ValueError, match="fused_gated_norm requires normalization='RMSNorm'"):
        validate_gdn_config(config)
    config.fused_gated_norm = "true"
    with pytest.raises(TypeError, match=r"fused_gated_norm must be a bool \(True or False\)"):
        validate_gdn_config(config)
    config.fused_gated_norm = None  # not set
    assert validate_gdn_config(config) is False


def test_the_spec_param_switches_a_config_without_the_field():
    """A GDN spec's ``fused_gated_norm`` param (megatron's own config has no such field): the
    fused norm's rules for True, none for False or None; a bool only; a config that sets the
    switch must agree, one that leaves it unset follows the param. validate_gdn_config returns
    whether the fused norm is on."""
    config = MegatronConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            normalization="LayerNorm")
    assert validate_gdn_config(config, None) is False
    assert validate_gdn_config(config, False) is False
    with pytest.raises(ValueError, match="fused_gated_norm requires normalization='RMSNorm'"):
        validate_gdn_config(config, True)
    config.normalization = "RMSNorm"
    with pytest.raises(ValueError, match=r"activation_func .* got 'gelu'"):  # megatron's default
        validate_gdn_config(config, True)
    config.activation_func = F.silu
    assert validate_gdn_config(config, True) is True
    with pytest.raises(TypeError, match=r"GatedDeltaNet spec params: fused_gated_norm must be a "
                                        r"bool \(True or False\), got 'yes'"):
        validate_gdn_config(config, "yes")
    ours = gdn_config(fused_gated_norm=True)
    assert validate_gdn_config(ours, True) is True and validate_gdn_config(ours) is True
    with pytest.raises(ValueError, match=r"param fused_gated_norm=False \(from core.models."
                                         r"use_fused_gdn\(spec, gated_output_norm=False\)\) "
                                         r"disagrees with TransformerConfig, which turns the fused "
                                         r"output norm on \(fused_gated_norm=True, "
                                         r"gdn_gated_output_norm_fusion=True\): build from "
                                         r"use_fused_gdn\(spec, gated_output_norm=True\)"):
        validate_gdn_config(ours, False)
    unset = gdn_config()
    assert validate_gdn_config(unset, True) is True and validate_gdn_config(unset, False) is False
    assert validate_gdn_config(unset) is False


def test_zero_centered_resolution_refuses_a_string_global_flag():
    config = gdn_config()
    config.layernorm_zero_centered_gamma = "false"  # would read as True
    with pytest.raises(TypeError,
                       match=r"layernorm_zero_centered_gamma must be a bool \(True or False\)"):
        gdn_out_norm_zero_centered(config)
    config.gdn_out_norm_zero_centered_gamma = False  # the override decides; the flag is not read
    assert gdn_out_norm_zero_centered(config) is False
