"""Module and layer specs that build Gated DeltaNet models with the fused output norm available.

    get_gdn_module_spec(use_te)           the GDN mixer (core.ssm.GatedDeltaNet)
    get_gdn_layer_spec(use_te)            a TransformerLayer: GDN mixer + dense MLP
    get_attention_layer_spec(use_te)      a standard softmax-attention TransformerLayer
    get_gdn_hybrid_block_spec(config)     a TransformerBlockSubmodules for GPTModel: GDN layers
                                          with an attention layer every linear_attention_freq

``use_te=None`` uses Transformer Engine when it is installed; ``False`` forces megatron-core's
own modules (ColumnParallelLinear / RowParallelLinear / DotProductAttention and
:class:`core.transformer.RMSNorm`), which work on any device; ``True`` without TE raises.
The fusion itself is switched by ``config.fused_gated_norm``, not by the spec.

Example::

    config = TransformerConfig(..., experimental_attention_variant="gated_delta_net",
                               linear_attention_freq=4, normalization="RMSNorm",
                               activation_func=F.silu, fused_gated_norm=True)
    model = GPTModel(config, transformer_layer_spec=get_gdn_hybrid_block_spec(config),
                     vocab_size=..., max_sequence_length=...)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_linear_attention_pattern,
    get_moe_layer_pattern,
)
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_mlp_module_spec_for_backend,
)
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from core.ssm.gated_delta_net import GatedDeltaNet
from core.transformer.rms_norm import LocalNorm

try:
    import transformer_engine  # noqa: F401  # pylint: disable=unused-import

    HAVE_TE = True
except ImportError:
    HAVE_TE = False


def _use_te(use_te: Optional[bool]) -> bool:
    if use_te is None:
        return HAVE_TE
    if use_te and not HAVE_TE:
        raise ImportError(
            "use_te=True but Transformer Engine is not installed; pass use_te=None (auto) or "
            "False to build with megatron-core's own modules"
        )
    return bool(use_te)


def _backend(te: bool):
    if te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    return LocalSpecProvider()


def _norm(te: bool):
    if te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return LocalNorm


def get_gdn_module_spec(use_te: Optional[bool] = None) -> ModuleSpec:
    """Spec of the GDN mixer: :class:`core.ssm.gated_delta_net.GatedDeltaNet`.

    TE: in_proj = TELayerNormColumnParallelLinear (the layer's input norm fused in, metainfo
    ``fuse_input_layernorm=True``), out_norm = TENorm, out_proj = TERowParallelLinear (as
    megatron's ``get_gated_delta_net_module_spec``). Without TE: ColumnParallelLinear, our
    RMSNorm (LocalNorm), RowParallelLinear; the input norm is then a separate layer module
    (``fuse_input_layernorm=False``)."""
    te = _use_te(use_te)
    if te:
        from megatron.core.extensions.transformer_engine import (
            TELayerNormColumnParallelLinear,
            TERowParallelLinear,
        )

        submodules = GatedDeltaNetSubmodules(
            in_proj=TELayerNormColumnParallelLinear,
            out_norm=_norm(True),
            out_proj=TERowParallelLinear,
        )
    else:
        submodules = GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=LocalNorm, out_proj=RowParallelLinear
        )
    return ModuleSpec(
        module=GatedDeltaNet, submodules=submodules, metainfo={"fuse_input_layernorm": te}
    )


def _attention_module_spec(te: bool, qk_layernorm: bool) -> ModuleSpec:
    if te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
        attention = spec.submodules.self_attention
        attention.metainfo["fuse_input_layernorm"] = True
        return attention
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    attention = spec.submodules.self_attention
    qk_norm = LocalNorm if qk_layernorm else IdentityOp
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(
            attention.submodules, q_layernorm=qk_norm, k_layernorm=qk_norm
        ),
        metainfo={**attention.metainfo, "fuse_input_layernorm": False},
    )
    return attention


def _mlp_spec(te: bool, config=None, moe: bool = False):
    """(mlp spec, whether its pre-norm is fused into fc1)."""
    backend = _backend(te)
    if moe:
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

        spec = get_moe_module_spec_for_backend(
            backend=backend,
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            use_te_activation_func=config.use_te_activation_func,
        )
        return spec, False
    return get_mlp_module_spec_for_backend(backend=backend, num_experts=None), te


def _layer_spec(te: bool, attention: ModuleSpec, mlp, fuse_pre_mlp_norm: bool) -> ModuleSpec:
    norm = _norm(te)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if attention.metainfo["fuse_input_layernorm"] else norm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp if fuse_pre_mlp_norm else norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def get_gdn_layer_spec(use_te: Optional[bool] = None) -> ModuleSpec:
    """A TransformerLayer whose self_attention is the GDN mixer, followed by a dense MLP.
    Without TE the input and pre-MLP norms are our RMSNorm (LocalNorm); with TE they are fused
    into in_proj / fc1."""
    te = _use_te(use_te)
    mlp, fused = _mlp_spec(te)
    return _layer_spec(te, get_gdn_module_spec(te), mlp, fused)


def get_attention_layer_spec(use_te: Optional[bool] = None, qk_layernorm: bool = False) -> ModuleSpec:
    """A standard causal self-attention TransformerLayer with a dense MLP: megatron's TE spec,
    or without TE megatron's local spec (``get_gpt_layer_local_spec``) with its norms replaced
    by LocalNorm (megatron's WrappedTorchNorm refuses sequence parallelism and zero-centred
    gamma)."""
    te = _use_te(use_te)
    mlp, fused = _mlp_spec(te)
    return _layer_spec(te, _attention_module_spec(te, qk_layernorm), mlp, fused)


def get_gdn_hybrid_block_spec(
    config,
    use_te: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """Per-layer specs of a GDN / attention hybrid, for ``GPTModel(transformer_layer_spec=...)``.

    Layer ``i`` (0-based) is softmax attention when ``(i + 1) % linear_attention_freq == 0``,
    else GDN (megatron's convention, ``get_linear_attention_pattern``; a list
    ``linear_attention_freq`` is used as the pattern, 1 = GDN). MLPs are dense, or MoE where
    ``config.num_moe_experts``/``moe_layer_freq`` say so. Only this pipeline stage's layers are
    returned; the final norm is included."""
    te = _use_te(use_te)
    if config.experimental_attention_variant != "gated_delta_net":
        raise ValueError(
            "get_gdn_hybrid_block_spec requires experimental_attention_variant='gated_delta_net', "
            f"got {config.experimental_attention_variant!r}"
        )
    attention_pattern = get_linear_attention_pattern(config)
    moe_pattern = (
        get_moe_layer_pattern(config) if config.num_moe_experts is not None
        else [0] * config.num_layers
    )
    gdn = get_gdn_module_spec(te)
    attention = _attention_module_spec(te, bool(config.qk_layernorm))
    dense_mlp, dense_fused = _mlp_spec(te)
    moe_mlp = _mlp_spec(te, config, moe=True) if 1 in moe_pattern else None

    layer_specs = []
    for i in range(config.num_layers):
        mixer = gdn if attention_pattern[i] == 1 else attention
        mlp, fused = moe_mlp if moe_pattern[i] == 1 else (dense_mlp, dense_fused)
        layer_specs.append(_layer_spec(te, mixer, mlp, fused))

    if config.pipeline_model_parallel_layout is not None:
        from megatron.core.transformer.enums import LayerType

        local_ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
        )
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_ids = range(offset, offset + count)
    return TransformerBlockSubmodules(
        layer_specs=[layer_specs[i] for i in local_ids], layer_norm=_norm(te)
    )
