"""megatron-core's GatedDeltaNet with the fused output gated norm behind ``config.fused_gated_norm``.

Flag off: megatron's forward, unchanged (its norm module, its gate product, its transpose copy).
Flag on, per forward (and again when ``gdn_norm_out`` selective recompute re-runs it):

    _gated_norm_and_a2a (megatron's)             core_attn_out [B,S,H,D], gate [B,S,H,D] view
      -> _apply_gated_norm (this class)
           validate_gated_norm(self, x, gate)    host-side checks, every call
           apply_validated_gated_norm(..., "sbhd")   fused_gated_norm minus its checks
      -> reshape(B, S, H*D).transpose(0, 1).contiguous()   a no-op: the buffer is already sbhd
      -> CP all-to-all, out_proj

The gate is read in place as a strided slice of the in_proj output (megatron makes it
contiguous in ``_prepare_input_for_gated_delta_rule``; the fused path skips that copy).

Both paths (flag on and off) also get:
  * ``config.gdn_out_norm_zero_centered_gamma`` honoured by the output norm;
  * the tensor-parallel fix of the output-norm weight gradient (see :func:`mark_tp_partial_grad`
    and docs/integration.md): each TP rank's dW covers only its heads, and the stock
    ``finalize_model_grads`` now turns the partials into the full TP=1 gradient on every rank,
    with sequence parallelism on or off;
  * ``gdn_norm_out`` selective recompute without Transformer Engine (see
    :attr:`GatedDeltaNet.norm_out_checkpoint`).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from megatron.core.ssm.gated_delta_net import GatedDeltaNet as _MegatronGatedDeltaNet
from megatron.core.tensor_parallel import random as _tensor_parallel_random
from megatron.core.transformer.spec_utils import build_module

from core.fusions.fused_gated_norm import (
    apply_validated_gated_norm,
    gate_activation_name,
    validate_gated_norm,
)
from core.transformer.transformer_config import gdn_out_norm_zero_centered, validate_gdn_config

# Attribute holding the gradient hook of mark_tp_partial_grad on the parameter it scales.
TP_PARTIAL_GRAD_HOOK_ATTR = "_gdn_tp_partial_grad_hook"


class _ScaleGrad:
    """The gradient hook of :func:`mark_tp_partial_grad`: ``grad * scale``. A module-level class
    rather than a closure, so that a parameter carrying it can still be pickled (``torch.save``
    of a module, multiprocessing)."""

    def __init__(self, scale: int):
        self.scale = scale

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * float(self.scale)


def mark_tp_partial_grad(param: torch.nn.Parameter, tp_size: int) -> None:
    """Make the stock ``finalize_model_grads`` reduce ``param``'s per-TP-rank partial gradient
    into the full gradient, with sequence parallelism on or off.

    ``finalize_model_grads`` all-reduces over TP (i) with AVG, unconditionally, the grads of
    params tagged ``average_gradients_across_tp_domain``; (ii) with SUM, only when
    ``config.sequence_parallel``, params tagged ``sequence_parallel`` (never both: it is an
    if/elif). Only (i) runs with SP off, so the param is tagged for (i), its SP tag is cleared,
    and a gradient hook multiplies each incoming gradient by ``tp_size`` before it is
    accumulated: ``AVG(tp * partial_r) = SUM(partial_r)``, exact in fp32 for power-of-two TP.
    No collective per micro-batch; one reduction per step with the other non-TP grads; the
    hook runs before accumulation into ``.grad``, so DDP's ``main_grad`` (filled from ``.grad``)
    is covered too. Idempotent: a parameter whose hook is registered is left alone; one that
    carries the tags but lost the hook (``copy.copy``, a pickle round trip) gets it again."""
    attached = _attached_hook(param)
    if attached is not None and attached.scale != tp_size:
        raise ValueError(
            f"mark_tp_partial_grad: parameter already scaled for TP size {attached.scale}, "
            f"asked for {tp_size}"
        )
    setattr(param, "average_gradients_across_tp_domain", True)
    setattr(param, "sequence_parallel", False)  # one reduction path only
    if tp_size > 1 and attached is None:
        hook = _ScaleGrad(tp_size)
        param.register_hook(hook)
        setattr(param, TP_PARTIAL_GRAD_HOOK_ATTR, hook)


def _attached_hook(param: torch.nn.Parameter) -> Optional[_ScaleGrad]:
    """The parameter's _ScaleGrad hook when it is registered on this very tensor, else None."""
    hook = getattr(param, TP_PARTIAL_GRAD_HOOK_ATTR, None)
    hooks = getattr(param, "_backward_hooks", None) or {}
    return hook if hook is not None and any(h is hook for h in hooks.values()) else None


def has_tp_partial_grad(param: torch.nn.Parameter, tp_size: int) -> bool:
    """True when ``param``'s gradient is complete after ``finalize_model_grads``: always at
    TP = 1 (nothing to reduce), else when :func:`mark_tp_partial_grad` is in effect for
    ``tp_size`` (tagged, and its hook registered on this tensor)."""
    if tp_size <= 1:
        return True
    if not getattr(param, "average_gradients_across_tp_domain", False):
        return False
    hook = _attached_hook(param)
    return hook is not None and hook.scale == tp_size


class GatedDeltaNet(_MegatronGatedDeltaNet):
    """megatron-core's GatedDeltaNet; ``config.fused_gated_norm`` switches the output norm and
    gate to the fused kernel. Constructor arguments are megatron's."""

    def __init__(self, config, submodules, *args, **kwargs):
        validate_gdn_config(config)  # configs of other classes may carry the fields as attributes
        super().__init__(config, submodules, *args, **kwargs)
        self.fused_gated_norm = getattr(config, "fused_gated_norm", False)
        self.out_norm_zero_centered = gdn_out_norm_zero_centered(config)
        if self.out_norm_zero_centered != bool(config.layernorm_zero_centered_gamma):
            # The norm builders (TENorm, RMSNorm) read the global flag: give them a config copy.
            norm_config = copy.copy(config)
            norm_config.layernorm_zero_centered_gamma = self.out_norm_zero_centered
            self.out_norm = build_module(
                submodules.out_norm,
                config=norm_config,
                hidden_size=self.value_head_dim,
                eps=config.layernorm_epsilon,
            )
        norm_zc = getattr(self.out_norm, "zero_centered_gamma", None)
        if norm_zc is not None and bool(norm_zc) != self.out_norm_zero_centered:
            raise ValueError(
                f"GatedDeltaNet: out_norm.zero_centered_gamma={bool(norm_zc)} disagrees with the "
                f"configured GDN output-norm zero-centring ({self.out_norm_zero_centered}, from "
                "gdn_out_norm_zero_centered_gamma / layernorm_zero_centered_gamma)"
            )
        # Local value heads seen by the norm: TP splits heads, CP's all-to-all splits them again.
        self.num_value_heads_local_tp_cp = self.num_v_heads_local_tp // self.cp_size
        self.gate_activation = gate_activation_name(self.act_fn)
        weight = getattr(self.out_norm, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            mark_tp_partial_grad(weight, self.tp_size)

    @property
    def norm_out_checkpoint(self):
        """megatron's ``CheckpointWithoutOutput`` of the ``gdn_norm_out`` selective recompute
        (None until the first such forward), set by megatron's forward before each use; the
        setter turns its fp8 handling off when Transformer Engine is absent.

        megatron-core 0.19 creates it as ``CheckpointWithoutOutput()`` (fp8=False), whose
        ``__init__`` sets ``self.fp8 = fp8 is not None`` -- True -- and whose forward then asks
        TE's ``FP8GlobalStateManager`` whether fp8 is on: without TE that is a NameError, flag on
        or off, on any device. Without TE fp8 cannot be on, so False is the exact value. Only the
        checkpoint of this layer is touched (megatron's class and its other users are not); with
        TE, nothing changes."""
        try:
            return self.__dict__["_norm_out_checkpoint"]
        except KeyError:
            raise AttributeError("norm_out_checkpoint") from None

    @norm_out_checkpoint.setter
    def norm_out_checkpoint(self, checkpoint) -> None:
        if checkpoint is not None and not _tensor_parallel_random.HAVE_TE:
            checkpoint.fp8 = False
        self.__dict__["_norm_out_checkpoint"] = checkpoint

    def _check_tp_partial_grad(self) -> None:
        weight = getattr(self.out_norm, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and not has_tp_partial_grad(weight, self.tp_size):
            raise RuntimeError(
                "GatedDeltaNet: out_norm.weight lost its tensor-parallel gradient handling (the "
                "parameter was replaced or copied after construction), so its "
                "tensor-parallel gradient would be a partial sum (wrong at TP > 1). Call "
                "core.ssm.gated_delta_net.mark_tp_partial_grad(module.out_norm.weight, tp_size) "
                "on the new parameter."
            )

    def _prepare_input_for_gated_delta_rule(self, qkv, gate, batch, seq_len, *gate_feats):
        if not self.fused_gated_norm:
            return super()._prepare_input_for_gated_delta_rule(
                qkv, gate, batch, seq_len, *gate_feats
            )
        # The gate is only read by the fused norm, which addresses the strided slice of the
        # in_proj output in place: hand megatron an empty slice (its .contiguous() is a no-op)
        # and keep the view.
        query, key, value, _, *feats = super()._prepare_input_for_gated_delta_rule(
            qkv, gate[..., :0], batch, seq_len, *gate_feats
        )
        return (query, key, value, gate, *feats)

    def _apply_gated_norm(self, x, gate):
        self._check_tp_partial_grad()
        if not self.fused_gated_norm:
            return super()._apply_gated_norm(x, gate)
        validate_gated_norm(self, x, gate)  # includes fused_gated_norm's own input checks
        # A [B, S, H, D] view of an [S, B, H, D] buffer: megatron's reshape + transpose +
        # .contiguous() that follows in _gated_norm_and_a2a is then free.
        return apply_validated_gated_norm(
            x,
            gate,
            self.out_norm.weight,
            self.config.layernorm_epsilon,
            self.out_norm_zero_centered,
            "sbhd",
            self.gate_activation,
        )
