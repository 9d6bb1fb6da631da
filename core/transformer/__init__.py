"""Megatron transformer pieces of the project: the config with the fusion flags and the
Transformer-Engine-free RMSNorm."""

from core.transformer.rms_norm import LocalNorm, RMSNorm
from core.transformer.transformer_config import (
    TransformerConfig,
    gated_output_norm_fusion,
    gdn_out_norm_zero_centered,
    pre_gated_delta_rule_fusion_setting,
    validate_gdn_config,
    validate_pre_gated_delta_rule_config,
)

__all__ = [
    "LocalNorm",
    "RMSNorm",
    "TransformerConfig",
    "gated_output_norm_fusion",
    "gdn_out_norm_zero_centered",
    "pre_gated_delta_rule_fusion_setting",
    "validate_gdn_config",
    "validate_pre_gated_delta_rule_config",
]
