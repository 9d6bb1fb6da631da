"""megatron-core's TransformerConfig with the switches of the fused GDN output gated norm."""

from __future__ import annotations

from dataclasses import dataclass
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
    effect in ``core.ssm.gated_delta_net.GatedDeltaNet`` (the spec functions of
    ``core.models.gdn_specs`` build it). Requires experimental_attention_variant='gated_delta_net',
    normalization='RMSNorm' and a silu or sigmoid activation_func (the GDN gate activation)."""

    gdn_out_norm_zero_centered_gamma: Optional[bool] = None
    """Zero-centred gamma (``w_eff = 1 + w``) for the GDN output norm only. None follows
    layernorm_zero_centered_gamma. Qwen3-Next's GDN output norm is NOT zero-centred while its
    other norms are: set layernorm_zero_centered_gamma=True and this to False to load such
    checkpoints without shifting the output-norm weight by 1. Honoured by the fused and the
    unfused path alike."""

    def __post_init__(self):
        super().__post_init__()
        if self.gdn_out_norm_zero_centered_gamma not in (None, True, False):
            raise ValueError(
                "gdn_out_norm_zero_centered_gamma must be None (follow "
                "layernorm_zero_centered_gamma), True or False, got "
                f"{self.gdn_out_norm_zero_centered_gamma!r}"
            )
        if not self.fused_gated_norm:
            return
        if self.experimental_attention_variant != "gated_delta_net":
            raise ValueError(
                "fused_gated_norm requires experimental_attention_variant='gated_delta_net' "
                "(it fuses the Gated DeltaNet output norm), got "
                f"{self.experimental_attention_variant!r}"
            )
        if self.normalization != "RMSNorm":
            raise ValueError(
                "fused_gated_norm requires normalization='RMSNorm' (the kernel implements "
                f"RMSNorm only), got {self.normalization!r}"
            )
        if gate_activation_name(self.activation_func) is None:
            name = getattr(self.activation_func, "__name__", repr(self.activation_func))
            raise ValueError(
                "fused_gated_norm requires activation_func (the GDN gate activation) to be one of "
                f"the kernel's {SUPPORTED_ACTIVATIONS} (torch.nn.functional.silu / torch.sigmoid), "
                f"got {name}"
            )


def gdn_out_norm_zero_centered(config) -> bool:
    """Whether the GDN output norm uses zero-centred gamma under ``config``: its
    ``gdn_out_norm_zero_centered_gamma`` when set, else ``layernorm_zero_centered_gamma``.
    Accepts a plain megatron TransformerConfig too (no override field: the global flag)."""
    value = getattr(config, "gdn_out_norm_zero_centered_gamma", None)
    if value is None:
        value = config.layernorm_zero_centered_gamma
    return bool(value)
