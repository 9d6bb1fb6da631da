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

from core.fusions.fused_gated_norm import SUPPORTED_ACTIVATIONS, gate_activation_name


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
    effect in every ``core.ssm.gated_delta_net.GatedDeltaNet`` (the spec functions of
    ``core.models.gdn_specs`` build it; a HybridModel's 'G' layers take it when their spec names
    this class, with experimental_attention_variant left at None). Requires
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
        if not isinstance(self.fused_gated_norm, bool):
            raise ValueError(
                f"fused_gated_norm must be True or False, got {self.fused_gated_norm!r}"
            )
        if not (self.gdn_out_norm_zero_centered_gamma is None
                or isinstance(self.gdn_out_norm_zero_centered_gamma, bool)):
            raise ValueError(
                "gdn_out_norm_zero_centered_gamma must be None (follow "
                "layernorm_zero_centered_gamma), True or False, got "
                f"{self.gdn_out_norm_zero_centered_gamma!r}"
            )
        if not self.fused_gated_norm:
            return
        if self.normalization != "RMSNorm":
            raise ValueError(
                "fused_gated_norm requires normalization='RMSNorm' (the kernel implements "
                f"RMSNorm only), got {self.normalization!r}"
            )
        activation = gate_activation_name(self.activation_func)
        if activation is None:
            name = getattr(self.activation_func, "__name__", repr(self.activation_func))
            raise ValueError(
                "fused_gated_norm requires activation_func (the GDN gate activation) to be one of "
                f"the kernel's {SUPPORTED_ACTIVATIONS} (torch.nn.functional.silu / torch.sigmoid), "
                f"got {name}"
            )
        if activation == "sigmoid" and not self.deterministic_mode:
            raise ValueError(
                "fused_gated_norm with a sigmoid gate requires deterministic_mode=True: megatron's "
                "GatedDeltaNet applies activation_func after its short convolution too, and outside "
                "deterministic mode that convolution (FLA's causal_conv1d) takes silu only"
            )


def gdn_out_norm_zero_centered(config) -> bool:
    """Whether the GDN output norm uses zero-centred gamma under ``config``: its
    ``gdn_out_norm_zero_centered_gamma`` when set, else ``layernorm_zero_centered_gamma``.
    Accepts a plain megatron TransformerConfig too (no override field: the global flag)."""
    value = getattr(config, "gdn_out_norm_zero_centered_gamma", None)
    if value is None:
        value = config.layernorm_zero_centered_gamma
    return bool(value)
