"""Specs for megatron's ``--spec MODULE NAME`` option that turn the GDN fusions on by themselves,
for megatron's own ``pretrain_gpt.py`` and ``pretrain_hybrid.py``, unmodified:

    pretrain_gpt.py    ... --experimental-attention-variant gated_delta_net \\
                           --spec core.models.fused_gdn_specs gpt_block_spec
    pretrain_hybrid.py ... --hybrid-layer-pattern "GGG*GGG*" \\
                           --spec core.models.fused_gdn_specs hybrid_stack_spec

Those scripts build megatron's own TransformerConfig, which has no fusion field. These specs
carry the switches: their GDN layers are ``core.ssm.GatedDeltaNet`` with the spec param
``fused_gated_norm=True`` (``core.models.use_fused_gdn(spec)``): the fused output norm. The
``*_both_fusions`` specs (``gpt_block_spec_both_fusions``, ``hybrid_stack_spec_both_fusions``)
also set ``pre_gated_delta_rule_fusion=True`` (``use_fused_gdn(spec,
pre_gated_delta_rule=True)``): the fusion before the gated delta rule as well. The layer checks
at construction what the config's flags would check (RMSNorm, a silu or sigmoid gate, eps; a
silu activation_func for the fusion before the gated delta rule). A config that turns a
fusion off explicitly (``fused_gated_norm=False`` or ``gdn_gated_output_norm_fusion=False``;
``gdn_pre_gated_delta_rule_fusion=False`` for the ``*_both_fusions`` specs), or the fusion
before the gated delta rule on for the others, fails the build, saying how to fix it.

Any other name asked of this module raises an AttributeError that lists :data:`SPEC_NAMES`.
megatron's ``--spec`` reads ``vars(module)[name]``, which bypasses that and raises a bare
KeyError; this package's launchers check the name first (examples/pretrain_gdn_megatron.py).
"""

from __future__ import annotations

from typing import Optional

from megatron.core.models.hybrid.hybrid_layer_specs import (
    hybrid_stack_spec as _megatron_hybrid_stack_spec,
)

from core.models.gdn_specs import get_gdn_hybrid_block_spec, use_fused_gdn

# What megatron's --spec may name in this module.
SPEC_NAMES = ("gpt_block_spec", "hybrid_stack_spec", "gpt_block_spec_both_fusions",
              "hybrid_stack_spec_both_fusions")
__all__ = [*SPEC_NAMES, "SPEC_NAMES"]


def gpt_block_spec(config, vp_stage: Optional[int] = None):
    """The layer specs of a GPTModel of the ``gated_delta_net`` attention variant
    (:func:`core.models.get_gdn_hybrid_block_spec`: megatron's block with Transformer Engine,
    the same block from megatron-core's modules with ``--transformer-impl local``), every GDN
    layer fused. ``config``: megatron.training's ``GPTModelConfig`` (what its ``--spec``
    calls a spec function with) or a TransformerConfig; ``vp_stage``: the virtual pipeline
    stage megatron builds."""
    return _gpt_block_spec(config, vp_stage, pre_gated_delta_rule=False)


def gpt_block_spec_both_fusions(config, vp_stage: Optional[int] = None):
    """:func:`gpt_block_spec` with the fusion before the gated delta rule on too."""
    return _gpt_block_spec(config, vp_stage, pre_gated_delta_rule=True)


def _gpt_block_spec(config, vp_stage: Optional[int], pre_gated_delta_rule: bool):
    transformer_config = getattr(config, "transformer", config)
    return use_fused_gdn(get_gdn_hybrid_block_spec(transformer_config, vp_stage=vp_stage),
                         pre_gated_delta_rule=pre_gated_delta_rule)


# megatron's hybrid stack (Transformer Engine modules), its 'G' layers fused, in the decoder and
# in multi-token prediction depths. A spec object, as megatron's --spec takes for HybridModel.
hybrid_stack_spec = use_fused_gdn(_megatron_hybrid_stack_spec)
# The same with the fusion before the gated delta rule on too.
hybrid_stack_spec_both_fusions = use_fused_gdn(_megatron_hybrid_stack_spec,
                                               pre_gated_delta_rule=True)


def __getattr__(name: str):
    """Module attributes not defined above: a mistyped spec name is told the valid ones."""
    if name.startswith("__"):  # import machinery and tools probe for dunder names
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise AttributeError(f"module {__name__!r} has no spec {name!r}; its specs are: "
                         f"{', '.join(SPEC_NAMES)}")
