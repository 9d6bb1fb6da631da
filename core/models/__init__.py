"""Module, layer and block specs for Gated DeltaNet models (with or without Transformer Engine)."""

from core.models.gdn_specs import (
    get_attention_layer_spec,
    get_gdn_hybrid_block_spec,
    get_gdn_layer_spec,
    get_gdn_module_spec,
)

__all__ = [
    "get_attention_layer_spec",
    "get_gdn_hybrid_block_spec",
    "get_gdn_layer_spec",
    "get_gdn_module_spec",
]
