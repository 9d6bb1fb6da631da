"""GatedDeltaNet.forward with the fused pre-recurrence region (gdn_pre_gated_delta_rule_fusion).

megatron-core writes the region inline in ``GatedDeltaNet.forward``, so the layer needs a forward
of its own. :func:`forward` is megatron-core 0.19.2's, step for step (packed-sequence checks,
in_proj, the CP all-to-all and its permutations, the recurrence call, the output norm with its
``gdn_norm_out`` recompute, out_proj), with one change: the span from the bshd transpose of the
in_proj output to ``_compute_g_and_beta`` is one call of ``fused_pre_gated_delta_rule``.
``MEGATRON_FORWARD_SHA256`` names the megatron forwards it mirrors; tests/ssm fails on another.

Validation on every forward (``check_layer``): the convolution's activation is SiLU, its
stride / dilation / padding / groups are megatron's, and the tensor rules of the kernels.
"""

from __future__ import annotations

import hashlib
import inspect
from functools import partial

import torch

from megatron.core import tensor_parallel
from megatron.core.utils import deprecate_inference_params, nvtx_range_pop, nvtx_range_push

from core.fusions.fused_pre_gated_delta_rule import GateGradientSink, fused_pre_gated_delta_rule
from core.ssm.megatron_gdn_import import import_megatron_gdn
from core.ssm.private_names import PrivateName

_gdn = import_megatron_gdn().gdn

PRIVATE_NAMES = (
    PrivateName("megatron-core", "megatron.core.ssm.gated_delta_net.gdn",
                "_build_head_perm_for_split_sections"),
    PrivateName("megatron-core", "megatron.core.ssm.gated_delta_net.gdn",
                "_build_thd_cp_a2a_perm"),
)

# sha256 of inspect.getsource(megatron's GatedDeltaNet.forward) for each release mirrored here.
MEGATRON_FORWARD_SHA256 = {
    "0.19.2": "6b5b300d75dd47a0212efe4e31bfd768a237a3e515c92afc6b6da1f02527ac0c",
}


def megatron_forward_digest(gdn_class) -> str:
    return hashlib.sha256(inspect.getsource(gdn_class.forward).encode()).hexdigest()


def check_layer(layer) -> str:
    """The layer settings the fused region implements (ValueError naming the rule); returns the
    conv rounding ("twice" in deterministic_mode: torch's conv1d then SiLU, else "once": FLA's
    causal_conv1d)."""
    if layer.activation not in ("silu", "swish"):
        raise ValueError(
            "gdn_pre_gated_delta_rule_fusion requires the convolution's activation "
            "(config.activation_func) to be silu, as FLA's causal_conv1d requires; got "
            f"{layer.activation!r}")
    conv = layer.conv1d
    width = layer.conv_kernel_dim
    expected = dict(stride=(1,), dilation=(1,), padding=(width - 1,),
                    groups=layer.conv_dim_local_tp)
    for name, value in expected.items():
        if getattr(conv, name) != value:
            raise ValueError(
                f"gdn_pre_gated_delta_rule_fusion requires conv1d.{name} == {value} (megatron's "
                f"causal depthwise convolution), got {getattr(conv, name)}")
    return "twice" if layer.config.deterministic_mode else "once"


def forward(layer, hidden_states, attention_mask, inference_context=None,
            packed_seq_params=None, sequence_len_offset=None, *, inference_params=None,
            **kwargs):
    """megatron-core 0.19.2's GatedDeltaNet.forward, the pre-recurrence region fused."""
    inference_context = deprecate_inference_params(inference_context, inference_params)
    seq_len, batch, _ = hidden_states.shape
    seq_len = seq_len * layer.sp_size * layer.cp_size
    if inference_context is not None:
        assert inference_context.is_static_batching(), (
            "GDN does not currently support dynamic inference batching.")
        assert not layer.config.sequence_parallel
        raise NotImplementedError("GDN does not support inference for now.")
    conv_rounding = check_layer(layer)
    thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
    if thd:
        assert batch == 1, "Packed sequence expects batch dimension to be 1"
        assert not layer.config.deterministic_mode, (
            "Packed sequence does not support deterministic mode.")
        cu_seqlens_q = layer._resolve_cu_seqlens(
            packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_q, seq_len,
            "cu_seqlens_q", cp_size=layer.cp_size)
        cu_seqlens_kv = layer._resolve_cu_seqlens(
            packed_seq_params.cu_seqlens_kv_padded, packed_seq_params.cu_seqlens_kv, seq_len,
            "cu_seqlens_kv", cp_size=layer.cp_size)
        assert torch.equal(cu_seqlens_q, cu_seqlens_kv), (
            "Currently only support cu_seqlens_q equals to cu_seqlens_kv, "
            f"but got {cu_seqlens_q=} and {cu_seqlens_kv=}")
        assert cu_seqlens_q.shape[0] - 1 > 0, (
            f"Number of packed sequences must be greater than 0, but got {cu_seqlens_q=}")
    else:
        cu_seqlens_q = None

    nvtx_range_push(suffix="in_proj")
    qkvzba, _ = layer.in_proj(hidden_states)
    nvtx_range_pop(suffix="in_proj")

    cp_group = layer.pg_collection.cp
    if layer.cp_size > 1:
        head_perm = _gdn._build_head_perm_for_split_sections(
            layer.in_proj_split_sections, cp_group.size(), qkvzba.device)
        qkvzba = qkvzba.index_select(-1, head_perm)
    thd_cp_a2a_inv = None
    if thd:
        qkvzba = _gdn.tensor_a2a_cp2hp(qkvzba, seq_dim=0, head_dim=-1, cp_group=cp_group,
                                       undo_attention_load_balancing=False)
        if layer.cp_size > 1:
            thd_cp_a2a_idx, thd_cp_a2a_inv = _gdn._build_thd_cp_a2a_perm(
                cu_seqlens_q, layer.cp_size, seq_len)
            qkvzba = qkvzba.index_select(0, thd_cp_a2a_idx)
    else:
        qkvzba = _gdn.tensor_a2a_cp2hp(qkvzba, seq_dim=0, head_dim=-1, cp_group=cp_group)

    sections = [layer.qk_dim_local_tp, layer.qk_dim_local_tp, layer.v_dim_local_tp]
    conv_weight = _gdn.get_parameter_local_cp(layer.conv1d.weight, dim=0, cp_group=cp_group,
                                              split_sections=sections)
    conv_bias = (_gdn.get_parameter_local_cp(layer.conv1d.bias, dim=0, cp_group=cp_group,
                                             split_sections=sections)
                 if layer.conv_bias else None)
    a_log = _gdn.get_parameter_local_cp(layer.A_log, dim=0, cp_group=cp_group)
    dt_bias = _gdn.get_parameter_local_cp(layer.dt_bias, dim=0, cp_group=cp_group)

    # With the fused output norm computed in this call (not recomputed later), its backward
    # writes the gate's gradient straight into the region's gradient buffer.
    sink = (GateGradientSink() if layer.fused_gated_norm and not layer.recompute_norm_out
            else None)
    nvtx_range_push(suffix="pre_gated_delta_rule")
    query, key, value, gate, g, beta = fused_pre_gated_delta_rule(
        qkvzba.transpose(0, 1), conv_weight, conv_bias, a_log, dt_bias,
        num_key_heads=layer.num_k_heads_local_tp // layer.cp_size,
        key_head_dim=layer.key_head_dim,
        num_value_heads=layer.num_v_heads_local_tp // layer.cp_size,
        value_head_dim=layer.value_head_dim, cu_seqlens=cu_seqlens_q,
        use_qk_l2norm=layer.use_qk_l2norm, conv_rounding=conv_rounding, dgate_sink=sink)
    nvtx_range_pop(suffix="pre_gated_delta_rule")
    seq_len = query.shape[1]

    nvtx_range_push(suffix="gated_delta_rule")
    core_attn_out, _ = layer.gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens_q)
    nvtx_range_pop(suffix="gated_delta_rule")

    if layer.recompute_norm_out:
        layer.norm_out_checkpoint = tensor_parallel.CheckpointWithoutOutput()
        norm_func = partial(layer._gated_norm_and_a2a, thd_cp_a2a_inv=thd_cp_a2a_inv,
                            batch=batch, seq_len=seq_len, packed_seq_params=packed_seq_params)
        norm_out = layer.norm_out_checkpoint.checkpoint(norm_func, core_attn_out, gate)
    else:
        layer.dgate_sink = sink  # read by the fused output norm of this call only
        try:
            norm_out = layer._gated_norm_and_a2a(core_attn_out, gate, thd_cp_a2a_inv, batch,
                                                 seq_len, packed_seq_params)
        finally:
            layer.dgate_sink = None

    nvtx_range_push(suffix="out_proj")
    out, out_bias = layer.out_proj(norm_out)
    nvtx_range_pop(suffix="out_proj")
    if layer.recompute_norm_out:
        layer.norm_out_checkpoint.discard_output_and_register_recompute(out)
    return out, out_bias
