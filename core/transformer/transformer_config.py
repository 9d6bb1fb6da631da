"""megatron-core's TransformerConfig with the switches of the fused GDN output gated norm.

No ``from __future__ import annotations`` here: megatron's ArgumentGroupFactory (which builds
megatron's command line from the config dataclass, see core.training.arguments) reads each
field's type object, and postponed annotations would turn them into strings.
"""

import argparse
from dataclasses import dataclass, field
from typing import Optional

from megatron.core.transformer.transformer_config import (
    TransformerConfig as _MegatronTransformerConfig,
)

from core.fusions.gated_norm_validation import (check_bool, check_norm_and_gate,
                                                 check_positive_number)


@dataclass
class TransformerConfig(_MegatronTransformerConfig):
    """megatron-core's TransformerConfig plus the fused GDN output-norm switches.

    Use it wherever megatron's config goes (GPTModel, the GDN specs of ``core.models``); every
    megatron field and check is unchanged.
    """

    fused_gated_norm: bool = False
    """Compute the Gated DeltaNet output norm and its gate, ``out_proj``'s input
    ``round(round(rms_norm(x) * w) * act(gate))``, in one Triton kernel per direction
    (``core.fusions.fused_gated_norm``) instead of megatron's norm + gate + transpose copy. Takes
    effect in every ``core.ssm.gated_delta_net.GatedDeltaNet`` and nowhere else: the spec
    functions of ``core.models.gdn_specs`` build it, ``core.models.use_fused_gdn(spec)`` puts it
    into any megatron spec (e.g. the hybrid stack spec, whose 'G' layers leave
    experimental_attention_variant at None), and ``core.models.assert_fused_gdn(model)`` names
    the layers of a built model that hold megatron's class instead. Requires
    normalization='RMSNorm' and activation_func (the GDN gate activation, which megatron also
    applies after the short convolution) F.silu, or torch.sigmoid with deterministic_mode (outside
    deterministic mode megatron's convolution kernel takes silu only). On megatron's command line
    (core.training.arguments): --fused-gated-norm with --normalization RMSNorm and --swiglu (silu)."""

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


def check_gdn_field_types(config) -> bool:
    """The types of the two GDN fields (TypeError naming the config's class: a string or an int
    is not a bool); returns whether the config asks for the fused norm."""
    fused = check_bool(type(config).__name__, "fused_gated_norm",
                       getattr(config, "fused_gated_norm", False))
    _zero_centered_override(config)
    return fused


def _zero_centered_override(config) -> Optional[bool]:
    """``gdn_out_norm_zero_centered_gamma`` checked (None: follow the global flag)."""
    return check_bool(type(config).__name__, "gdn_out_norm_zero_centered_gamma",
                      getattr(config, "gdn_out_norm_zero_centered_gamma", None),
                      "follow layernorm_zero_centered_gamma")


def validate_gdn_config(config, fused_gated_norm: Optional[bool] = None) -> bool:
    """The rules of the two GDN fields, on any megatron TransformerConfig (ours runs them in
    ``__post_init__``; ``core.ssm.GatedDeltaNet`` runs them again at construction, so a config of
    another class that carries the fields as plain attributes -- e.g. a Megatron-Bridge model
    provider -- is checked too). A config without the fields passes. TypeError for a field of
    the wrong type (a string or an int is not a bool), ValueError for a combination the fused
    norm does not implement. Returns whether the fused norm is on.

    ``fused_gated_norm``: the GDN spec's param of that name
    (``core.models.use_fused_gdn(spec, fused_gated_norm=True)``), which switches the fusion
    where the config has no such field: megatron's own TransformerConfig, as megatron's
    ``pretrain_gpt.py`` builds it from its command line. None leaves the choice to the config.
    A bool must agree with a config that has the field (ValueError): nothing decides between
    two settings silently."""
    fused = check_gdn_field_types(config)
    if fused_gated_norm is not None:
        check_bool("GatedDeltaNet spec params", "fused_gated_norm", fused_gated_norm)
        if hasattr(config, "fused_gated_norm") and fused_gated_norm != fused:
            raise ValueError(
                f"the GDN spec's param fused_gated_norm={fused_gated_norm} disagrees with "
                f"{type(config).__name__}.fused_gated_norm={fused}: set the config field and "
                "build from a spec without the param (use_fused_gdn(spec)), or use a config "
                "without the field (megatron's own TransformerConfig)")
        fused = fused_gated_norm
    if not fused:
        return False
    activation = check_norm_and_gate(config.normalization, config.activation_func, "activation_func")
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
