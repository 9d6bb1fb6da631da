"""megatron's own Transformer Engine specs, built without Transformer Engine.

megatron-core's GDN specs name TE classes: the GPT block spec of the ``gated_delta_net``
attention variant (``get_transformer_block_with_experimental_attention_variant_spec``) and the
hybrid stack spec (``hybrid_stack_spec``). Without TE, megatron's TE spec builders stop at
``NameError: name 'TESpecProvider' is not defined``, and the TE names they put in a tree are
stand-ins that cannot be built. Two steps make such a tree buildable on any device:

    with megatron_te_spec_builders():
        spec = get_transformer_block_with_experimental_attention_variant_spec(config)
    model = GPTModel(config, transformer_layer_spec=te_to_local(spec), ...)

or in one call, ``megatron_gdn_block_spec(config)``. Pass the result through
``core.models.use_fused_gdn`` for our GatedDeltaNet. (``te_to_local(hybrid_stack_spec)`` swaps
the hybrid stack's TE classes too, but megatron's HybridModel still builds its final norm from
TENorm whatever the spec says: it needs Transformer Engine.)

``te_to_local`` swaps each TE class for megatron-core's own module of the same role
(:func:`te_to_local_map`) and keeps the structure of the tree. TE's linear layer with the input
norm fused in (``TELayerNormColumnParallelLinear``) becomes :class:`NormedColumnParallelLinear`,
the config's norm followed by megatron's ColumnParallelLinear: the model computes what the TE
model computes, though the norm's state-dict keys differ from TE's.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Optional

from megatron.core.tensor_parallel import ColumnParallelLinear

from core.models.gdn_specs import replace_modules
from core.transformer.rms_norm import LocalNorm

__all__ = [
    "NormedColumnParallelLinear",
    "megatron_gdn_block_spec",
    "megatron_te_spec_builders",
    "te_to_local",
    "te_to_local_map",
]

# megatron modules whose TE spec builders look up TESpecProvider as a module global (bound only
# when Transformer Engine imports).
SPEC_BUILDER_MODULES = (
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
)


@contextlib.contextmanager
def megatron_te_spec_builders():
    """Within the block, megatron's TE spec builders run without Transformer Engine: they only
    assemble spec objects (nothing is built). Their modules' ``TESpecProvider`` is restored on
    exit. A no-op where TE is installed."""
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    saved = []
    for name in SPEC_BUILDER_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "TESpecProvider", None) is None:
            saved.append((module, "TESpecProvider" in vars(module),
                          getattr(module, "TESpecProvider", None)))
            module.TESpecProvider = TESpecProvider
    try:
        yield
    finally:
        for module, existed, value in saved:
            if existed:
                module.TESpecProvider = value
            else:
                del module.TESpecProvider


class NormedColumnParallelLinear(ColumnParallelLinear):
    """TE's ``TELayerNormColumnParallelLinear`` from megatron-core modules: the config's norm
    (:class:`~core.transformer.rms_norm.LocalNorm`, ``norm``) over the input, then megatron's
    ColumnParallelLinear with the same arguments. Under sequence parallelism the norm runs on
    this rank's tokens before the linear layer gathers them, as TE's does."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.norm = LocalNorm(config, input_size, eps=config.layernorm_epsilon)

    def forward(self, input_, *args, **kwargs):
        return super().forward(self.norm(input_), *args, **kwargs)


def te_to_local_map() -> dict:
    """TE class (or its stand-in without TE) -> megatron-core's own module of the same role."""
    import megatron.core.extensions.transformer_engine as te
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return {
        te.TELayerNormColumnParallelLinear: NormedColumnParallelLinear,
        te.TEColumnParallelLinear: ColumnParallelLinear,
        te.TERowParallelLinear: RowParallelLinear,
        te.TEDotProductAttention: DotProductAttention,
        te.TENorm: LocalNorm,
    }


def te_to_local(spec):
    """``spec`` with every TE class of :func:`te_to_local_map` replaced: a copy, the input
    untouched (``core.models.replace_modules``; a spec function gives a spec function)."""
    return replace_modules(spec, te_to_local_map())


def megatron_gdn_block_spec(config, vp_stage: Optional[int] = None,
                            pp_rank: Optional[int] = None):
    """megatron's GPT block spec of the ``gated_delta_net`` attention variant,
    ``get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage,
    pp_rank)`` (megatron's layer and MoE patterns, pipeline slicing, final norm), with
    megatron-core's modules in TE's places: it builds with or without Transformer Engine. Its
    GDN layers are megatron's class: ``core.models.use_fused_gdn`` of it for ours.

    megatron's builder takes TE's configuration only: ``config.transformer_impl`` must be
    'transformer_engine' (megatron's default), though nothing of TE is built."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as variants

    impl = getattr(config, "transformer_impl", None)
    if impl != "transformer_engine":
        raise ValueError(
            "megatron_gdn_block_spec: megatron's GDN block builder requires "
            f"config.transformer_impl='transformer_engine', got {impl!r} (nothing of Transformer "
            "Engine is built); core.models.get_gdn_hybrid_block_spec(config, use_te=False) "
            "builds the same layer pattern from megatron's local layer specs")
    with megatron_te_spec_builders():
        spec = variants.get_transformer_block_with_experimental_attention_variant_spec(
            config, vp_stage=vp_stage, pp_rank=pp_rank)
    return te_to_local(spec)
