"""megatron-core's TransformerConfig with the switches of the fused GDN output gated norm and of
the fusion before the gated delta rule.

No ``from __future__ import annotations`` here: megatron's ArgumentGroupFactory (which builds
megatron's command line from the config dataclass, see core.training.arguments) reads each
field's type object, and postponed annotations would turn them into strings.
"""

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megatron.core.transformer.transformer_config import (
    TransformerConfig as _MegatronTransformerConfig,
)

from core.fusions.gated_norm_validation import (check_bool, check_norm_and_gate,
                                                 check_positive_number, gate_activation_name)

# The two names of the fused output norm's switch: this package's and megatron main's.
GATED_OUTPUT_NORM_NAMES = ("fused_gated_norm", "gdn_gated_output_norm_fusion")
# The switch of the fusion before the recurrence: one name, megatron main's.
PRE_GATED_DELTA_RULE_NAME = "gdn_pre_gated_delta_rule_fusion"

# The fields of the installed megatron-core's config: a field it declares itself is not
# declared again here (a redefinition would replace megatron's default, help text and checks).
_MEGATRON_FIELDS = frozenset(f.name for f in dataclasses.fields(_MegatronTransformerConfig))

# The instance attribute where __post_init__ records the resolved switch (None: neither name was
# set), so that the bools it writes into both fields are not read later as a user's setting.
_RESOLVED_SWITCH = "_gdn_gated_output_norm_fusion_resolved"
_NOT_RESOLVED = object()


def _store_true(flag: str, help_text: Optional[str] = None) -> dict:
    """A field's argparse metadata for megatron's ArgumentGroupFactory: a flag that sets True,
    absent leaves the field None (not set)."""
    meta = {"arg_names": [flag], "action": "store_true"}
    if help_text is not None:
        meta["help"] = help_text
    return {"argparse_meta": meta}


@dataclass
class TransformerConfig(_MegatronTransformerConfig):
    """megatron-core's TransformerConfig plus the switches of the GDN fusions (the output norm,
    and the fusion before the gated delta rule).

    Use it wherever megatron's config goes (GPTModel, the GDN specs of ``core.models``); every
    megatron field and check is unchanged.
    """

    fused_gated_norm: Optional[bool] = field(default=None,
                                             metadata=_store_true("--fused-gated-norm"))
    """Compute the Gated DeltaNet output norm and its gate, ``out_proj``'s input
    ``round(round(rms_norm(x) * w) * act(gate))``, in one Triton kernel per direction
    (``core.fusions.fused_gated_norm``) instead of megatron's norm + gate + transpose copy. The
    same switch as megatron main's gdn_gated_output_norm_fusion (either name turns it on; one
    True and the other False is refused); None: not set, the GDN spec decides
    (``core.models.use_fused_gdn(spec)`` turns it on), else off. After construction both names
    read the resolved bool. Takes effect in every ``core.ssm.gated_delta_net.GatedDeltaNet`` and
    nowhere else: ``core.models.use_fused_gdn(spec)`` puts that class into any megatron spec,
    and ``core.models.assert_fused_gdn(model)`` names the layers of a built model that do not
    run the fusion. Requires normalization='RMSNorm' and activation_func (the GDN gate
    activation, which megatron also applies after the short convolution) F.silu, or
    torch.sigmoid with deterministic_mode (outside deterministic mode megatron's convolution
    kernel takes silu only); deterministic_mode is supported. On megatron's command line
    (core.training.arguments): --fused-gated-norm (or --gdn-gated-output-norm-fusion) with
    --normalization RMSNorm and --swiglu (silu)."""

    if "gdn_gated_output_norm_fusion" not in _MEGATRON_FIELDS:
        # megatron main's name of fused_gated_norm; declared here only while the installed
        # megatron-core does not declare it itself.
        gdn_gated_output_norm_fusion: Optional[bool] = field(
            default=None,
            metadata=_store_true(
                "--gdn-gated-output-norm-fusion",
                "megatron main's name of --fused-gated-norm: the same switch (either flag turns "
                "the fused GDN output gated norm on)"),
        )

    if "gdn_pre_gated_delta_rule_fusion" not in _MEGATRON_FIELDS:
        # megatron main's name; declared here only while the installed megatron-core does not
        # declare it itself. The help text is given explicitly: megatron's ArgumentGroupFactory
        # reads the docstrings of the class body's own statements only, not of this block's.
        gdn_pre_gated_delta_rule_fusion: Optional[bool] = field(
            default=None,
            metadata=_store_true(
                "--gdn-pre-gated-delta-rule-fusion",
                "Fuse everything between the GDN in_proj and the gated delta rule (causal "
                "conv1d + SiLU, the split into heads, q/k L2 norm, head repeat, g and beta), "
                "forward and backward, in Triton (core.fusions.fused_pre_gated_delta_rule). "
                "Requires --swiglu (silu). Independent of --fused-gated-norm and composable "
                "with it"),
        )
        """Compute everything between the Gated DeltaNet ``in_proj`` and the recurrence -- the
        causal conv1d + SiLU, the split into q, k, v heads, the q/k L2 norm, the head repeat,
        ``g`` and ``beta`` -- forward and backward in Triton
        (``core.fusions.fused_pre_gated_delta_rule``) instead of megatron's separate ops. None:
        not set, the GDN spec decides (``core.models.use_fused_gdn(spec,
        pre_gated_delta_rule=True)`` turns it on), else off; True or False: the setting, which
        a spec param must agree with (:func:`validate_pre_gated_delta_rule_config`). The field
        keeps what was given (no bool is written over None). Requires activation_func F.silu
        (the activation megatron applies after the short convolution). Independent of the
        fused output norm (``fused_gated_norm`` / ``gdn_gated_output_norm_fusion``) and
        composable with it. Takes effect in ``core.ssm.gated_delta_net.GatedDeltaNet`` only
        (``core.models.assert_fused_gdn(model, pre_gated_delta_rule=True)`` names the layers
        that do not run it). On megatron's command line (core.training.arguments):
        --gdn-pre-gated-delta-rule-fusion with --swiglu."""

    gdn_out_norm_zero_centered_gamma: Optional[bool] = field(
        default=None,
        # Three states on the command line: unset (None) follows --apply-layernorm-1p.
        metadata={"argparse_meta": {"arg_names": ["--gdn-out-norm-zero-centered-gamma"],
                                    "action": argparse.BooleanOptionalAction}},
    )
    """Zero-centred gamma (``w_eff = 1 + w``) for the GDN output norm only. None follows
    layernorm_zero_centered_gamma. Qwen3-Next's GDN output norm is NOT zero-centred while its
    other norms are: set layernorm_zero_centered_gamma=True and this to False to load such
    checkpoints without shifting the output-norm weight by 1. Honoured by the fused and the
    unfused path alike. On megatron's command line: --gdn-out-norm-zero-centered-gamma /
    --no-gdn-out-norm-zero-centered-gamma (unset follows --apply-layernorm-1p)."""

    def __post_init__(self):
        super().__post_init__()
        validate_gdn_config(self)
        resolved = gated_output_norm_fusion(self)
        setattr(self, _RESOLVED_SWITCH, resolved)
        for name in GATED_OUTPUT_NORM_NAMES:
            setattr(self, name, bool(resolved))


def gated_output_norm_fusion(config) -> Optional[bool]:
    """The fused output norm's switch as ``config`` sets it: True (on), False (off) or None
    (neither name set). The one reader of the switch: every other reader goes through it.

    Its two names are one switch: this package's ``fused_gated_norm`` and megatron main's
    ``gdn_gated_output_norm_fusion``, each read where the config has it (any config class: ours,
    megatron's, a Megatron-Bridge provider carrying them as attributes). A name is set when it
    holds a bool, except
      * None, the "not set" default of the fields this package declares;
      * False in a field whose class declares the default False (megatron's own declaration of
        gdn_gated_output_norm_fusion, where False cannot be told from unset);
      * the bool our ``__post_init__`` wrote into both names, until one of them is assigned
        another value (that assignment is then the setting).
    Raises TypeError for a value that is no bool or None (a string 'false' would read as True)
    and ValueError when one name is True and the other False."""
    owner = type(config).__name__
    resolved = getattr(config, _RESOLVED_SWITCH, _NOT_RESOLVED)
    declared = getattr(type(config), "__dataclass_fields__", {})
    settings = {}
    for name in GATED_OUTPUT_NORM_NAMES:
        value = getattr(config, name, None)
        if value is not None and type(value) is not bool:
            raise TypeError(f"{owner}: {name} must be a bool (True or False) or None (not set), "
                            f"got {value!r}")
        if value is None or (value is False and name in declared
                             and declared[name].default is False):
            continue
        if resolved is not _NOT_RESOLVED and value is bool(resolved):
            continue  # as __post_init__ wrote it
        settings[name] = value
    if len(set(settings.values())) > 1:
        given = ", ".join(f"{name}={value}" for name, value in settings.items())
        raise ValueError(
            f"{owner}: {given} contradict each other: fused_gated_norm and megatron main's "
            "gdn_gated_output_norm_fusion are one switch (the fused GDN output norm); set one "
            "of them, or both to the same value")
    if settings:
        return next(iter(settings.values()))
    return None if resolved is _NOT_RESOLVED else resolved


def _switch_values(config) -> str:
    """The names of the switch that ``config`` has, with their values, for a message."""
    return ", ".join(f"{name}={getattr(config, name)}" for name in GATED_OUTPUT_NORM_NAMES
                     if hasattr(config, name))


def _zero_centered_override(config) -> Optional[bool]:
    """``gdn_out_norm_zero_centered_gamma`` checked (None: follow the global flag)."""
    return check_bool(type(config).__name__, "gdn_out_norm_zero_centered_gamma",
                      getattr(config, "gdn_out_norm_zero_centered_gamma", None),
                      "follow layernorm_zero_centered_gamma")


def pre_gated_delta_rule_fusion_setting(config) -> Optional[bool]:
    """The fusion before the gated delta rule as ``config`` sets it: True (on), False (off) or
    None (not set). ``gdn_pre_gated_delta_rule_fusion`` is read where the config has it (any
    config class: ours, megatron's, a Megatron-Bridge provider carrying it as an attribute); a
    config without it sets nothing. False in a field whose class declares the default False (a
    megatron-core release that declares the field itself) cannot be told from unset, and reads
    as None. TypeError for a value that is no bool or None (a string 'false' would read as
    True)."""
    value = getattr(config, PRE_GATED_DELTA_RULE_NAME, None)
    check_bool(type(config).__name__, PRE_GATED_DELTA_RULE_NAME, value, "not set")
    declared = getattr(type(config), "__dataclass_fields__", {})
    if (value is False and PRE_GATED_DELTA_RULE_NAME in declared
            and declared[PRE_GATED_DELTA_RULE_NAME].default is False):
        return None
    return value


def validate_pre_gated_delta_rule_config(
        config, pre_gated_delta_rule_fusion: Optional[bool] = None) -> bool:
    """Whether the fusion before the gated delta rule runs under ``config`` and the GDN spec's
    param ``pre_gated_delta_rule_fusion`` (set by ``core.models.use_fused_gdn``), with its
    rules checked when it does; any megatron TransformerConfig (a config without the field sets
    nothing).

    The switch is :func:`pre_gated_delta_rule_fusion_setting` of the config, unless the param is a
    bool: then the param decides, and a config that sets the switch must agree with it
    (ValueError naming both and the fix). None leaves the choice to the config (off where it
    sets nothing). TypeError for a field or param that is no bool (None allowed).

    Rule when on: ``activation_func`` is ``torch.nn.functional.silu`` (megatron applies it after
    the short convolution; the fused kernel computes SiLU there), else ValueError."""
    owner = type(config).__name__
    setting = pre_gated_delta_rule_fusion_setting(config)
    fused = bool(setting)
    if pre_gated_delta_rule_fusion is not None:
        param = check_bool("GatedDeltaNet spec params", "pre_gated_delta_rule_fusion",
                           pre_gated_delta_rule_fusion)
        if setting is not None and param != setting:
            raise ValueError(
                f"the GDN spec's param pre_gated_delta_rule_fusion={param} (from "
                f"core.models.use_fused_gdn(spec, pre_gated_delta_rule={param})) disagrees with "
                f"{owner}, which turns the fusion before the gated delta rule "
                f"{'on' if setting else 'off'} ({PRE_GATED_DELTA_RULE_NAME}={setting}): build "
                f"from use_fused_gdn(spec, pre_gated_delta_rule={setting}), or leave "
                f"{PRE_GATED_DELTA_RULE_NAME} unset (None) so that the spec decides")
        fused = param
    if not fused:
        return False
    activation = config.activation_func
    if gate_activation_name(activation) != "silu":
        raise ValueError(
            f"{owner} with {PRE_GATED_DELTA_RULE_NAME}: activation_func must be "
            "torch.nn.functional.silu (megatron applies it after the short convolution, and "
            "the fused kernel computes SiLU there), got "
            f"{getattr(activation, '__name__', activation)!r}")
    return True


def validate_gdn_config(config, fused_gated_norm: Optional[bool] = None) -> bool:
    """The rules of the GDN fields, on any megatron TransformerConfig (ours runs them in
    ``__post_init__``; ``core.ssm.GatedDeltaNet`` runs them again at construction, so a config of
    another class that carries the fields as plain attributes -- e.g. a Megatron-Bridge model
    provider -- is checked too). A config without the fields passes. TypeError for a field of
    the wrong type (a string or an int is not a bool), ValueError for a combination the fused
    norm does not implement, or that the fusion before the gated delta rule does not implement
    where the config turns that on (:func:`validate_pre_gated_delta_rule_config` with no spec
    param). Returns whether the fused norm is on.

    The switch is :func:`gated_output_norm_fusion` of the config, unless ``fused_gated_norm``
    (the GDN spec's param of that name, which ``core.models.use_fused_gdn`` sets) is a bool:
    then the param decides, and a config that sets the switch must agree with it (ValueError):
    nothing decides between two settings silently. None leaves the choice to the config (off
    where it sets nothing)."""
    validate_pre_gated_delta_rule_config(config)
    setting = gated_output_norm_fusion(config)
    _zero_centered_override(config)
    fused = bool(setting)
    if fused_gated_norm is not None:
        check_bool("GatedDeltaNet spec params", "fused_gated_norm", fused_gated_norm)
        if setting is not None and fused_gated_norm != setting:
            raise ValueError(
                f"the GDN spec's param fused_gated_norm={fused_gated_norm} (from "
                f"core.models.use_fused_gdn(spec, gated_output_norm={fused_gated_norm})) "
                f"disagrees with {type(config).__name__}, which turns the fused output norm "
                f"{'on' if setting else 'off'} ({_switch_values(config)}): build from "
                f"use_fused_gdn(spec, gated_output_norm={setting}), or leave fused_gated_norm "
                "and gdn_gated_output_norm_fusion unset (None) so that the spec decides")
        fused = fused_gated_norm
    if not fused:
        return False
    activation = check_norm_and_gate(config.normalization, config.activation_func,
                                     "activation_func")
    # The kernels take eps as a normal fp32 number; checked again on every fused forward.
    check_positive_number(f"{type(config).__name__} with fused_gated_norm", "layernorm_epsilon",
                          config.layernorm_epsilon)
    if activation == "sigmoid" and not config.deterministic_mode:
        raise ValueError(
            "fused_gated_norm with a sigmoid gate requires deterministic_mode=True: megatron's "
            "GatedDeltaNet applies activation_func after its short convolution too, and outside "
            "deterministic mode that convolution (FLA's causal_conv1d) takes silu only"
        )
    return True


def gdn_out_norm_zero_centered(config) -> bool:
    """Whether the GDN output norm uses zero-centred gamma under ``config``: its
    ``gdn_out_norm_zero_centered_gamma`` when set, else ``layernorm_zero_centered_gamma``.
    Accepts a plain megatron TransformerConfig too (no override field: the global flag).
    TypeError when the flag it reads is not a bool (a string 'false' would read as True)."""
    value = _zero_centered_override(config)
    if value is None:
        return check_bool(type(config).__name__, "layernorm_zero_centered_gamma",
                          config.layernorm_zero_centered_gamma)
    return value
