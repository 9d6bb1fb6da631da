"""Builders shared by the GDN integration tests and the GPU check script (test-side only).

    config = gdn_config(fused_gated_norm=True, params_dtype=torch.bfloat16)
    module = build_gdn_module(config)                # core.ssm.GatedDeltaNet, no TE by default
    layer = build_gdn_layer(config)                  # TransformerLayer: norm + GDN + MLP
    shard = shard_gdn_state_dict(module.state_dict(), config, tp_rank, tp_size)

Call ``core.testing.cpu.install_cpu_shims()`` and initialise parallel_state first on the CPU.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from core.transformer.transformer_config import TransformerConfig


def fla_gdn_backward_unavailable() -> str:
    """Why FLA's GDN kernels (megatron's GatedDeltaNet outside deterministic_mode) cannot run a
    backward on this machine, '' when they can: for a GPU test's skip reason."""
    try:
        import fla  # noqa: F401
        import triton
    except ImportError as e:
        return f"fla-core is not installed ({e})"
    if not torch.cuda.is_available():
        return ""  # the gpu marker skips the test already
    hopper = torch.cuda.get_device_capability()[0] == 9
    version = tuple(int(p) for p in triton.__version__.split(".")[:3] if p.isdigit())
    if hopper and version < (3, 7, 1):
        return ("FLA 0.6's GDN backward needs triton >= 3.7.1 on Hopper "
                f"(installed: {triton.__version__})")
    return ""


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """The gated delta rule token by token in torch, with no host-to-device copy, so that a
    CUDA graph can capture it (megatron's ``torch_chunk_gated_delta_rule``, the
    ``deterministic_mode`` path, builds its initial state on the host). For the CUDA-graph tests,
    where the rule itself is not under test. [B, T, H, D] inputs, fp32 state; per token:
    ``S = exp(g) S;  S += k (beta (v - k^T S))^T;  o = (q / sqrt(Dk))^T S``."""
    if (initial_state is not None or output_final_state or use_qk_l2norm_in_kernel
            or cu_seqlens is not None):
        raise NotImplementedError("recurrent_gated_delta_rule: megatron's training forward only")
    dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q = q * q.shape[-1] ** -0.5
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])  # [B, H, Dk, Dv]
    outputs = []
    for t in range(q.shape[1]):
        state = state * g[:, t, :, None, None].exp()
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state))
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outputs, dim=1).to(dtype), None


def unwrap_jit_gdn_methods() -> dict:
    """Make megatron's jit_fuser-decorated GDN methods (norm + gate, input preparation) run as
    written, eagerly. torch.compile drops the intermediate rounding of the norm output, so the
    eager code is the numerics reference of the fusion. Returns what to restore."""
    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    from core.testing.cpu import unwrap_compiled

    return unwrap_compiled(_GDNBase)


@contextlib.contextmanager
def counting_calls(owner, name: str):
    """While open, every call of ``owner.<name>`` (a module's function or a class's method)
    appends to the yielded list; the original is put back on exit."""
    calls = []
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(owner, name, counting)
    try:
        yield calls
    finally:
        setattr(owner, name, original)


def counting_fused_norm_calls():
    """``counting_calls`` of GatedDeltaNet's fused output norm (the kernel path of
    ``_apply_gated_norm``; the unfused paths never reach it): proof that a run or pass with the
    flag on used the fusion."""
    import core.ssm.gated_delta_net as gdn

    return counting_calls(gdn, "apply_validated_gated_norm")


@contextlib.contextmanager
def eager_megatron_gdn():
    """``unwrap_jit_gdn_methods`` for the duration of a ``with`` block."""
    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    saved = unwrap_jit_gdn_methods()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(_GDNBase, name, value)


def bytes_kept_for_backward(forward, exclude=()) -> tuple[int, object]:
    """Run ``forward()``; return (bytes of the distinct storages autograd holds for backward once
    it has returned, its result). Storages of ``exclude`` (the parameters) are left out, and
    storages released meanwhile (megatron's gdn_norm_out checkpoint frees its output) count 0:
    the activation memory a forward keeps, the same count on any device."""
    saved = []

    def pack(tensor):
        saved.append(tensor.untyped_storage())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = forward()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept = {s.data_ptr(): s.nbytes() for s in saved if s.nbytes() and s.data_ptr() not in skip}
    return sum(kept.values()), result


def gdn_config(
    hidden_size: int = 64,
    num_key_heads: int = 2,
    num_value_heads: int = 4,
    key_head_dim: int = 16,
    value_head_dim: int = 16,
    params_dtype: torch.dtype = torch.bfloat16,
    config_class: type = TransformerConfig,
    **overrides,
) -> TransformerConfig:
    """A GDN TransformerConfig (RMSNorm, silu, deterministic megatron chunk rule unless
    overridden). Tiny by default; pass Qwen3-Next sizes for the GPU. ``config_class``: ours, or
    megatron's own (no fusion fields), as megatron's pretrain scripts build it."""
    kwargs = dict(
        num_layers=1,
        hidden_size=hidden_size,
        num_attention_heads=4,
        ffn_hidden_size=2 * hidden_size,
        normalization="RMSNorm",
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=4,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=key_head_dim,
        linear_value_head_dim=value_head_dim,
        linear_num_key_heads=num_key_heads,
        linear_num_value_heads=num_value_heads,
        activation_func=F.silu,
        deterministic_mode=True,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return config_class(**kwargs)


def _pg_collection():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def _reseed(seed: Optional[int]) -> None:
    """Reseed torch and megatron's RNG tracker (None: leave them as they are)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if seed is not None:
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def build_gdn_module(config, use_te: Optional[bool] = False, seed: Optional[int] = 1234):
    """core.ssm.GatedDeltaNet from ``get_gdn_module_spec(use_te, config)``. ``seed`` reseeds
    megatron's RNG tracker first, so two builds with the same config get the same weights."""
    from megatron.core.transformer.spec_utils import build_module

    from core.models.gdn_specs import get_gdn_module_spec

    _reseed(seed)
    return build_module(
        get_gdn_module_spec(use_te, config), config=config, layer_number=1,
        pg_collection=_pg_collection()
    )


def build_gdn_layer(config, use_te: Optional[bool] = False, seed: Optional[int] = 1234):
    """TransformerLayer from ``get_gdn_layer_spec(use_te, config)`` (input norm, GDN, MLP)."""
    from megatron.core.transformer.spec_utils import build_module

    from core.models.gdn_specs import get_gdn_layer_spec

    _reseed(seed)
    return build_module(get_gdn_layer_spec(use_te, config), config=config, layer_number=1)


def randomize_norm_weights(module: torch.nn.Module, seed: int = 7) -> None:
    """Give every norm weight (initialised to 1 or 0) distinct values, so tests see them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                noise = torch.randn(p.shape, generator=gen) * 0.3
                p.copy_((p.float().cpu() + noise).to(p.dtype).to(p.device))


def layer_inputs(seq: int, batch: int, hidden: int, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, dy)``: a GDN layer's [S, B, hidden] input and output gradient, drawn in this order
    from a CPU generator seeded with ``seed`` (the same values on any device), in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, batch, hidden, generator=gen).to(device, dtype)
    dy = torch.randn(seq, batch, hidden, generator=gen).to(device, dtype)
    return x, dy


def set_out_norm_grad_scale(module: torch.nn.Module, scale: float) -> None:
    """As on a TP rank: scale 1 (TP 1, or megatron reduces the out_norm gradients) or the TP
    size (partial gradients that megatron leaves unreduced), for every out_norm parameter, with
    the parameter tag that goes with it."""
    from core.ssm.gated_delta_net import TP_AVG_TAG

    module.out_norm_grad_scales = {name: scale for name in module.out_norm._parameters}
    for param in module.out_norm._parameters.values():
        setattr(param, TP_AVG_TAG, scale != 1.0)


def shard_gdn_state_dict(full: dict, config, tp_rank: int, tp_size: int, prefix: str = "") -> dict:
    """The TP shard ``tp_rank`` of a TP=1 GatedDeltaNet state dict (keys under ``prefix``).

    in_proj rows are [q | k | v | z | beta | alpha] sections, each split over TP; conv1d rows
    [q | k | v]; A_log / dt_bias split; out_proj columns split; out_norm replicated."""
    qk = config.linear_key_head_dim * config.linear_num_key_heads
    v = config.linear_value_head_dim * config.linear_num_value_heads
    heads = config.linear_num_value_heads

    def sections(t, sizes, dim=0):
        parts = torch.split(t, sizes, dim=dim)
        return torch.cat([p.chunk(tp_size, dim=dim)[tp_rank] for p in parts], dim=dim)

    out = {}
    for key, t in full.items():
        name = key[len(prefix):] if key.startswith(prefix) else key
        if t is None or not isinstance(t, torch.Tensor):
            out[key] = t
        elif name == "in_proj.weight":
            out[key] = sections(t, [qk, qk, v, v, heads, heads])
        elif name.startswith("conv1d."):
            out[key] = sections(t, [qk, qk, v])
        elif name in ("A_log", "dt_bias"):
            out[key] = t.chunk(tp_size, dim=0)[tp_rank]
        elif name == "out_proj.weight":
            out[key] = t.chunk(tp_size, dim=1)[tp_rank]
        else:
            out[key] = t
        if isinstance(out[key], torch.Tensor):
            out[key] = out[key].clone()
    return out
