"""Module and layer specs for Gated DeltaNet models (with or without Transformer Engine), and the
spec rewrite / model check that make the fused output norm take effect in megatron's own specs."""

from core.models.gdn_specs import (
    assert_fused_gdn,
    get_attention_layer_spec,
    get_gdn_hybrid_block_spec,
    get_gdn_layer_spec,
    get_gdn_module_spec,
    replace_modules,
    use_fused_gdn,
)

__all__ = [
    "assert_fused_gdn",
    "get_attention_layer_spec",
    "get_gdn_hybrid_block_spec",
    "get_gdn_layer_spec",
    "get_gdn_module_spec",
    "replace_modules",
    "use_fused_gdn",
]
