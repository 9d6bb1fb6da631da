"""Module and layer specs for Gated DeltaNet models (with or without Transformer Engine), and the
spec rewrite / model check that make the fused output norm take effect in megatron's own specs.
``core.models.te_free_specs`` builds megatron's own TE specs without Transformer Engine
(``megatron_gdn_block_spec``, ``megatron_te_spec_builders``, ``te_to_local``).
``core.models.fused_gdn_specs`` (not imported here: it builds megatron's hybrid stack spec) holds
the specs for megatron's ``--spec`` option that switch the fusion on by themselves."""

from core.models.gdn_specs import (
    assert_fused_gdn,
    get_attention_layer_spec,
    get_gdn_hybrid_block_spec,
    get_gdn_layer_spec,
    get_gdn_module_spec,
    replace_modules,
    use_fused_gdn,
)
from core.models.te_free_specs import (
    megatron_gdn_block_spec,
    megatron_te_spec_builders,
    te_to_local,
)

__all__ = [
    "assert_fused_gdn",
    "get_attention_layer_spec",
    "get_gdn_hybrid_block_spec",
    "get_gdn_layer_spec",
    "get_gdn_module_spec",
    "megatron_gdn_block_spec",
    "megatron_te_spec_builders",
    "replace_modules",
    "te_to_local",
    "use_fused_gdn",
]
