"""TransformerConfig: the fused_gated_norm flag, its __post_init__ rules, and the GDN
output-norm zero-centring override."""

import pytest
import torch
import torch.nn.functional as F

from core.testing.gdn import gdn_config
from core.transformer import TransformerConfig, gdn_out_norm_zero_centered


def test_defaults_leave_megatron_unchanged():
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    assert config.fused_gated_norm is False
    assert config.gdn_out_norm_zero_centered_gamma is None


@pytest.mark.parametrize("activation", [F.silu, torch.sigmoid])
def test_flag_accepted_with_gdn_rmsnorm_and_supported_gate(activation):
    config = gdn_config(fused_gated_norm=True, activation_func=activation, deterministic_mode=True)
    assert config.fused_gated_norm


def test_flag_accepted_without_the_gpt_variant():
    # A HybridModel builds its 'G' layers with experimental_attention_variant=None.
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               normalization="RMSNorm", activation_func=F.silu, fused_gated_norm=True)
    assert config.fused_gated_norm and config.experimental_attention_variant is None


def test_sigmoid_gate_requires_deterministic_mode():
    with pytest.raises(ValueError, match="sigmoid gate requires deterministic_mode=True"):
        gdn_config(fused_gated_norm=True, activation_func=torch.sigmoid, deterministic_mode=False)


def test_flag_requires_rmsnorm():
    with pytest.raises(ValueError, match=r"fused_gated_norm requires normalization='RMSNorm'.*'LayerNorm'"):
        gdn_config(fused_gated_norm=True, normalization="LayerNorm")


@pytest.mark.parametrize("activation", [F.gelu, torch.nn.SiLU])
def test_flag_requires_supported_gate_activation(activation):
    with pytest.raises(ValueError, match=r"fused_gated_norm requires activation_func .*got '(gelu|SiLU)'"):
        gdn_config(fused_gated_norm=True, activation_func=activation)


@pytest.mark.parametrize("eps, error", [(0.0, ValueError), (-1e-6, ValueError),
                                        (float("nan"), ValueError), ("1e-6", TypeError)])
def test_flag_requires_a_positive_epsilon(eps, error):
    """The kernels take eps as a normal fp32 number: refused when the config is built, not at
    the first forward; the unfused path keeps megatron's rules."""
    with pytest.raises(error, match="TransformerConfig with fused_gated_norm: layernorm_epsilon must be"):
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
    from megatron.core.transformer import TransformerConfig as MegatronConfig

    config = MegatronConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            layernorm_zero_centered_gamma=True)
    assert gdn_out_norm_zero_centered(config) is True


@pytest.mark.parametrize("value", ["false", 1, None])
def test_flag_must_be_a_bool(value):
    with pytest.raises(TypeError, match=r"fused_gated_norm must be a bool \(True or False\)"):
        gdn_config(fused_gated_norm=value)


def test_zero_centered_override_is_not_an_int():
    with pytest.raises(TypeError, match="gdn_out_norm_zero_centered_gamma must be None"):
        gdn_config(gdn_out_norm_zero_centered_gamma=0)


def test_rules_apply_to_a_config_of_another_class():
    """A config that only carries the fields as attributes (e.g. a Megatron-Bridge provider, a
    subclass of megatron's config) gets the same rules, from validate_gdn_config."""
    from megatron.core.transformer import TransformerConfig as MegatronConfig

    from core.transformer import validate_gdn_config

    config = MegatronConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            normalization="LayerNorm")
    validate_gdn_config(config)  # no fields: nothing asked
    config.fused_gated_norm = True
    with pytest.raises(ValueError, match="fused_gated_norm requires normalization='RMSNorm'"):
        validate_gdn_config(config)
    config.fused_gated_norm = "true"
    with pytest.raises(TypeError, match=r"fused_gated_norm must be a bool \(True or False\)"):
        validate_gdn_config(config)


def test_the_spec_param_switches_a_config_without_the_field():
    """A GDN spec's ``fused_gated_norm`` param (megatron's own config has no such field): the
    fused norm's rules for True, none for False or None; a bool only; a config with the field
    must agree. validate_gdn_config returns whether the fused norm is on."""
    from megatron.core.transformer import TransformerConfig as MegatronConfig

    from core.transformer import validate_gdn_config

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
    with pytest.raises(ValueError, match="param fused_gated_norm=False disagrees with "
                                         "TransformerConfig.fused_gated_norm=True"):
        validate_gdn_config(ours, False)


def test_zero_centered_resolution_refuses_a_string_global_flag():
    config = gdn_config()
    config.layernorm_zero_centered_gamma = "false"  # would read as True
    with pytest.raises(TypeError, match=r"layernorm_zero_centered_gamma must be a bool \(True or False\)"):
        gdn_out_norm_zero_centered(config)
    config.gdn_out_norm_zero_centered_gamma = False  # the override decides; the flag is not read
    assert gdn_out_norm_zero_centered(config) is False
