"""megatron's Transformer Engine specs on a machine without Transformer Engine (test-side only).

megatron-core's GDN specs name TE classes (the GPT block spec of the ``gated_delta_net``
attention variant, the hybrid stack spec). Without TE their builders stop at
``TESpecProvider`` (None), and the TE names are stand-ins that cannot be built. Two helpers let
the tests take those real spec trees as they are and build models from them on the CPU:

    with megatron_te_spec_builders():
        spec = get_transformer_block_with_experimental_attention_variant_spec(config)
    model = GPTModel(config, transformer_layer_spec=te_to_local(spec), ...)

``te_to_local`` swaps each TE class for megatron-core's own module with the same role
(:data:`TE_TO_LOCAL`); the structure of the tree is kept, so two trees that differ only in the
GDN class build models whose keys differ only if the GDN class changes them. A TE module that
fuses the input norm (``TELayerNormColumnParallelLinear``) becomes a plain linear layer: such a
model has no input norm, which is fine for structural comparisons and nothing else.
"""

from __future__ import annotations

import contextlib
import importlib

# megatron modules whose TE spec builders look up TESpecProvider as a module global.
SPEC_BUILDER_MODULES = (
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
)


@contextlib.contextmanager
def megatron_te_spec_builders():
    """Within the block, megatron's TE spec builders run without Transformer Engine (they only
    assemble spec objects; nothing is built). A no-op where TE is installed."""
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    saved = []
    for name in SPEC_BUILDER_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "TESpecProvider", None) is None:
            saved.append((module, "TESpecProvider" in vars(module), getattr(module, "TESpecProvider", None)))
            module.TESpecProvider = TESpecProvider
    try:
        yield
    finally:
        for module, existed, value in saved:
            if existed:
                module.TESpecProvider = value
            else:
                del module.TESpecProvider


def te_to_local_map() -> dict:
    """TE class (or its stand-in without TE) -> megatron-core's own module of the same role."""
    import megatron.core.extensions.transformer_engine as te
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from core.transformer.rms_norm import LocalNorm

    return {
        te.TELayerNormColumnParallelLinear: ColumnParallelLinear,
        te.TEColumnParallelLinear: ColumnParallelLinear,
        te.TERowParallelLinear: RowParallelLinear,
        te.TEDotProductAttention: DotProductAttention,
        te.TENorm: LocalNorm,
    }


def te_to_local(spec):
    """``spec`` with every TE class of :func:`te_to_local_map` replaced (a copy; see
    ``core.models.gdn_specs.replace_modules``)."""
    from core.models.gdn_specs import replace_modules

    return replace_modules(spec, te_to_local_map())
