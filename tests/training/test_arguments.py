"""core.training.arguments: the fusion flags on megatron's own command line (parse_args with our
extra_args_provider), the config megatron's core_transformer_config_from_args builds from them,
and the config's checks reported with the flags a Megatron user types."""

import argparse
import copy
import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import (
    TransformerConfig as MegatronTransformerConfig,
)
from megatron.training.argument_utils import ArgumentGroupFactory
from megatron.training.arguments import add_megatron_arguments, parse_args, validate_args

from core.training import add_gdn_fusion_args, transformer_config_from_args
from core.training.arguments import GROUP_TITLE
from core.transformer import (TransformerConfig, gated_output_norm_fusion,
                              gdn_out_norm_zero_centered, pre_gated_delta_rule_fusion_setting)

# A small Qwen3-Next-style GDN hybrid as a Megatron user writes it (no TE, no apex).
GDN_COMMAND_LINE = """
    --tensor-model-parallel-size 1 --num-layers 4 --hidden-size 64 --ffn-hidden-size 192
    --num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 16
    --seq-length 128 --max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 4
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear --qk-layernorm
    --position-embedding-type rope --no-rope-fusion --untie-embeddings-and-output-weights
    --experimental-attention-variant gated_delta_net --linear-attention-freq 4
    --linear-conv-kernel-dim 4 --linear-key-head-dim 16 --linear-value-head-dim 16
    --linear-num-key-heads 2 --linear-num-value-heads 4
    --recompute-granularity selective --recompute-modules gdn_norm_out --deterministic-mode
    --bf16 --lr 1e-3 --train-iters 10 --transformer-impl local --mock-data
    --tokenizer-type NullTokenizer --vocab-size 256
""".split()


def megatron_args(monkeypatch, *extra: str) -> argparse.Namespace:
    """megatron's parse_args + validate_args on GDN_COMMAND_LINE + extra, with our provider."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gdn_megatron.py", *GDN_COMMAND_LINE, *extra])
    args = parse_args(extra_args_provider=add_gdn_fusion_args)
    validate_args(args)
    return args


def test_gdn_command_line_lands_in_our_config(monkeypatch):
    args = megatron_args(monkeypatch, "--fused-gated-norm", "--apply-layernorm-1p",
                         "--no-gdn-out-norm-zero-centered-gamma")
    assert args.fused_gated_norm is True and args.gdn_out_norm_zero_centered_gamma is False
    assert args.gdn_gated_output_norm_fusion is None  # not given
    config = transformer_config_from_args(args)
    assert type(config) is TransformerConfig
    assert config.fused_gated_norm is True and config.gdn_gated_output_norm_fusion is True
    assert config.gdn_out_norm_zero_centered_gamma is False
    assert config.layernorm_zero_centered_gamma is True
    assert gdn_out_norm_zero_centered(config) is False
    # megatron's own flags keep their meaning
    assert config.activation_func is F.silu and config.gated_linear_unit
    assert config.experimental_attention_variant == "gated_delta_net"
    assert config.linear_attention_freq == 4 and config.linear_num_value_heads == 4
    assert config.recompute_granularity == "selective"
    assert config.recompute_modules == ["gdn_norm_out"]
    assert config.deterministic_mode and config.params_dtype == torch.bfloat16
    assert config.num_query_groups == 2 and not config.add_bias_linear


@pytest.mark.parametrize("flags", [("--gdn-gated-output-norm-fusion",),
                                   ("--fused-gated-norm", "--gdn-gated-output-norm-fusion")],
                         ids=["megatron_main", "both"])
def test_megatron_mains_flag_is_the_same_switch(monkeypatch, flags):
    args = megatron_args(monkeypatch, *flags)
    assert args.gdn_gated_output_norm_fusion is True
    config = transformer_config_from_args(args)
    assert config.fused_gated_norm is True and config.gdn_gated_output_norm_fusion is True


def test_the_two_names_contradicting_each_other_are_named_with_their_flags(monkeypatch):
    args = megatron_args(monkeypatch, "--fused-gated-norm")
    args.gdn_gated_output_norm_fusion = False  # e.g. a launcher that sets it from elsewhere
    with pytest.raises(ValueError, match=r"fused_gated_norm=True, gdn_gated_output_norm_fusion="
                                         r"False contradict each other.* \[command line: "
                                         r"--fused-gated-norm, --gdn-gated-output-norm-fusion\]"):
        transformer_config_from_args(args)


@pytest.mark.parametrize("norm_flags", [(), ("--fused-gated-norm",)], ids=["alone", "with_norm"])
def test_the_pre_gated_delta_rule_flag_lands_in_our_config(monkeypatch, norm_flags):
    """megatron main's --gdn-pre-gated-delta-rule-fusion: its own switch, alone or with the
    fused output norm's."""
    args = megatron_args(monkeypatch, "--gdn-pre-gated-delta-rule-fusion", *norm_flags)
    assert args.gdn_pre_gated_delta_rule_fusion is True
    config = transformer_config_from_args(args)
    assert config.gdn_pre_gated_delta_rule_fusion is True
    assert pre_gated_delta_rule_fusion_setting(config) is True
    assert config.fused_gated_norm is bool(norm_flags)


def test_defaults_flag_unset_and_zero_centring_follows_apply_layernorm_1p(monkeypatch):
    args = megatron_args(monkeypatch, "--apply-layernorm-1p")
    assert args.fused_gated_norm is None and args.gdn_gated_output_norm_fusion is None  # not set
    assert args.gdn_out_norm_zero_centered_gamma is None
    assert args.gdn_pre_gated_delta_rule_fusion is None
    config = transformer_config_from_args(args)
    assert config.fused_gated_norm is False and config.gdn_out_norm_zero_centered_gamma is None
    assert gated_output_norm_fusion(config) is None  # a spec may switch it on
    assert config.gdn_pre_gated_delta_rule_fusion is None  # the same
    assert gdn_out_norm_zero_centered(config) is True
    args = megatron_args(monkeypatch, "--gdn-out-norm-zero-centered-gamma")
    config = transformer_config_from_args(args)
    assert config.layernorm_zero_centered_gamma is False
    assert config.gdn_out_norm_zero_centered_gamma is True and gdn_out_norm_zero_centered(config)


def test_help_lists_the_flags(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["pretrain_gdn_megatron.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        parse_args(extra_args_provider=add_gdn_fusion_args)
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"{GROUP_TITLE}:" in text
    assert "--fused-gated-norm Compute the Gated DeltaNet output norm and its gate" in text
    assert ("--gdn-gated-output-norm-fusion megatron main's name of --fused-gated-norm: the "
            "same switch") in text
    assert "--gdn-out-norm-zero-centered-gamma, --no-gdn-out-norm-zero-centered-gamma" in text
    assert "Zero-centred gamma" in text
    assert ("--gdn-pre-gated-delta-rule-fusion Fuse everything between the GDN in_proj and the "
            "gated delta rule") in text


def test_layernorm_refused_naming_the_flags(monkeypatch):
    args = megatron_args(monkeypatch, "--fused-gated-norm", "--normalization", "LayerNorm")
    with pytest.raises(ValueError, match=r"fused_gated_norm requires normalization='RMSNorm'.*"
                                         r"'LayerNorm' \[command line: --fused-gated-norm, "
                                         r"--normalization\]"):
        transformer_config_from_args(args)


def test_zero_epsilon_refused_naming_the_flags(monkeypatch):
    args = megatron_args(monkeypatch, "--fused-gated-norm", "--norm-epsilon", "0")
    with pytest.raises(ValueError, match=r"layernorm_epsilon must be finite and > 0.* got 0\.0 "
                                         r"\[command line: --fused-gated-norm, --norm-epsilon\]"):
        transformer_config_from_args(args)


@pytest.mark.parametrize("flag", ["--fused-gated-norm", "--gdn-pre-gated-delta-rule-fusion"])
def test_gelu_gate_refused_naming_swiglu(monkeypatch, flag):
    # Without --swiglu megatron's activation (the GDN gate activation, and the activation after
    # the short convolution) is gelu.
    line = [a for a in GDN_COMMAND_LINE if a != "--swiglu"]
    monkeypatch.setattr(sys, "argv", ["x", *line, flag])
    args = parse_args(extra_args_provider=add_gdn_fusion_args)
    validate_args(args)
    with pytest.raises(ValueError, match=rf"got 'gelu' \[command line: {flag}, --swiglu"):
        transformer_config_from_args(args)


def test_yaml_config_is_refused(monkeypatch):
    args = megatron_args(monkeypatch)
    args.yaml_cfg = "model.yaml"
    with pytest.raises(ValueError,
                       match="--yaml-cfg: megatron then builds args from the YAML file"):
        transformer_config_from_args(args)


def test_flags_are_named_once_and_only_for_config_fields():
    from core.training.arguments import _flags_named_in

    assert _flags_named_in("layernorm_epsilon and again layernorm_epsilon") == ["--norm-epsilon"]
    assert _flags_named_in("no field named here") == []


def test_string_is_not_a_bool(monkeypatch):
    args = megatron_args(monkeypatch)
    args.fused_gated_norm = "false"
    with pytest.raises(TypeError, match=r"fused_gated_norm must be a bool \(True or False\) or "
                                        r"None \(not set\), got 'false' \[command line: "
                                        r"--fused-gated-norm\]"):
        transformer_config_from_args(args)
    args.fused_gated_norm = False
    args.gdn_out_norm_zero_centered_gamma = 1
    with pytest.raises(TypeError, match="gdn_out_norm_zero_centered_gamma must be None"):
        transformer_config_from_args(args)
    args.gdn_out_norm_zero_centered_gamma = None
    args.gdn_pre_gated_delta_rule_fusion = "false"
    with pytest.raises(TypeError, match=r"gdn_pre_gated_delta_rule_fusion must be None \(not "
                                        r"set\), True or False, got 'false' \[command line: "
                                        r"--gdn-pre-gated-delta-rule-fusion\]"):
        transformer_config_from_args(args)


def test_args_without_our_provider_refused(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["x", *GDN_COMMAND_LINE])
    args = parse_args()
    validate_args(args)
    with pytest.raises(ValueError, match="extra_args_provider=core.training.add_gdn_fusion_args"):
        transformer_config_from_args(args)


@pytest.mark.parametrize("flag, name, value", [
    ("--multi-latent-attention", "multi_latent_attention", True),
    ("--heterogeneous-layers-config-path", "heterogeneous_layers_config_path", "layers.json"),
])
def test_megatron_config_classes_refused(monkeypatch, flag, name, value):
    args = copy.copy(megatron_args(monkeypatch, "--fused-gated-norm"))
    setattr(args, name, value)
    with pytest.raises(ValueError, match=f"{flag} makes megatron build"):
        transformer_config_from_args(args)


def test_argument_group_factory_takes_our_config():
    """megatron builds its transformer flags with ArgumentGroupFactory(TransformerConfig,
    exclude=...): with our config in its place and the same exclusions it builds the same flags
    plus ours. Every field's annotation must be a type, not a string: the factory calls it to
    convert the flag's value ("'bool' is not callable" otherwise)."""
    assert not [f.name for f in dataclasses.fields(TransformerConfig) if isinstance(f.type, str)]
    megatron_parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    group = next(g for g in megatron_parser._action_groups
                 if g.title == "transformer configuration")
    megatron_dests = {a.dest for a in group._group_actions}
    excluded = {f.name for f in dataclasses.fields(MegatronTransformerConfig)} - megatron_dests
    ours = ArgumentGroupFactory(TransformerConfig, exclude=list(excluded)).build_group(
        argparse.ArgumentParser(), "transformer configuration")
    assert {a.dest for a in ours._group_actions} == megatron_dests | {
        "fused_gated_norm", "gdn_gated_output_norm_fusion", "gdn_pre_gated_delta_rule_fusion",
        "gdn_out_norm_zero_centered_gamma"}


FUSION_DESTS = ("fused_gated_norm", "gdn_gated_output_norm_fusion",
                "gdn_pre_gated_delta_rule_fusion", "gdn_out_norm_zero_centered_gamma")


@pytest.mark.parametrize("dest", ["gdn_gated_output_norm_fusion",
                                  "gdn_pre_gated_delta_rule_fusion"])
def test_a_flag_megatrons_parser_already_has_is_not_added_again(dest):
    """A megatron-core release that puts one of megatron main's flags on its own parser (a
    stand-in parser here): argparse would refuse the flag twice, so it stays the parser's, the
    rest of the group is added, and it parses into its own destination. The same destination
    under another option string is the parser's too."""
    flag = "--" + dest.replace("_", "-")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    theirs = parser.add_argument(flag, action="store_true")
    add_gdn_fusion_args(parser)
    assert parser._option_string_actions[flag] is theirs
    dests = [a.dest for a in parser._actions]
    assert dests.count(dest) == 1
    assert set(FUSION_DESTS) - {dest} <= set(dests)
    args = parser.parse_args([flag])
    assert getattr(args, dest) is True and args.fused_gated_norm is None
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--another-name", dest=dest, action="store_true")
    add_gdn_fusion_args(parser)
    assert flag not in parser._option_string_actions


def test_every_fusion_flag_is_on_the_parser():
    parser = add_gdn_fusion_args(argparse.ArgumentParser(allow_abbrev=False))
    assert {"--fused-gated-norm", "--gdn-gated-output-norm-fusion",
            "--gdn-pre-gated-delta-rule-fusion",
            "--gdn-out-norm-zero-centered-gamma"} <= set(parser._option_string_actions)
