"""megatron-core's GatedDeltaNet, the fused output gated norm behind ``config.fused_gated_norm``.

Flag off: megatron's forward, unchanged (its norm module, its gate product, its transpose copy).
Flag on, per forward (and again when ``gdn_norm_out`` selective recompute re-runs it):

    _gated_norm_and_a2a (megatron's)             core_attn_out [B,S,H,D], gate [B,S,H,D] view
      -> _apply_gated_norm (this class)
           _check_fused_norm_inputs              the TP/CP head count, out_norm's zero-centring
           fused_gated_norm.validate_gated_norm  host-side checks, every call
           apply_validated_gated_norm(..., "sbhd", weight_grad_scale=..., checked=...)
                                                 fused_gated_norm minus its checks
      -> reshape(B, S, H*D).transpose(0, 1).contiguous()   a no-op: the buffer is already sbhd
      -> CP all-to-all, out_proj

The gate is read in place as a strided slice of the in_proj output, skipping megatron's copy in
``_prepare_input_for_gated_delta_rule``, wherever that keeps no more memory for backward (see
``GatedDeltaNet._reads_gate_in_place``); in ``deterministic_mode`` training it takes the copy.

Both paths (flag on and off) also get:
  * ``config.gdn_out_norm_zero_centered_gamma`` honoured by the output norm;
  * the tensor-parallel gradients of the output norm's parameters (its weight, and the bias of
    a LayerNorm on the unfused path) made whole (docs/design.md, "The Megatron module"): each
    TP rank's gradient covers only its heads. Where megatron's stock ``finalize_model_grads``
    would leave that partial unreduced (sequence parallelism off), the backward multiplies the
    parameter's gradient by ``tp_size`` inside the autograd graph and the parameter is tagged
    ``average_gradients_across_tp_domain``: finalize's AVG over TP then gives the SUM of the
    partials; a parameter that arrives tagged gets the same factor. Where megatron already sums
    it (sequence parallelism on: SUM of ``sequence_parallel`` params), nothing is added
    (core.ssm.tp_grad_reduction; the tags reach FSDP's parameters through core.ssm.fsdp_tags);
  * ``gdn_norm_out`` selective recompute without Transformer Engine (see
    :attr:`GatedDeltaNet.norm_out_checkpoint`);
  * out_norm's hooks run as a call of out_norm would run them, each once per forward, its
    forward pre-hooks with its weight in place before that weight is read (megatron's DDP with
    ``overlap_param_gather`` waits there for the weight's all-gather). On the fused path, which
    never calls out_norm, its forward hooks get the fused output; backward hooks, or a
    pre-hook that replaces the input, are refused there (RuntimeError);
  * conv1d's forward pre-hooks run before megatron's forward reads conv1d's weight, which it
    does without calling conv1d (see :meth:`GatedDeltaNet.forward`).
The hooks run through core.ssm.module_hooks.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Optional

import torch

from megatron.core.tensor_parallel import random as _tensor_parallel_random
from megatron.core.transformer.spec_utils import build_module

from core.fusions import fused_gated_norm as fused_gated_norm_module
from core.fusions.fused_gated_norm import apply_validated_gated_norm
from core.fusions.gated_norm_validation import gate_activation_name
from core.ssm import pre_gated_delta_rule_forward
from core.ssm.fsdp_tags import keep_tag_on_megatron_fsdp_copy, torch_fsdp2_sharded_param_tagged
from core.ssm.megatron_gdn_import import import_megatron_gdn
from core.ssm.module_hooks import (
    has_backward_hooks,
    has_forward_hooks,
    has_forward_pre_hooks,
    own_forward_pre_hooks,
    restore_forward_pre_hooks,
    run_forward_hooks,
    run_forward_pre_hooks,
    run_forward_pre_hooks_on,
    set_aside_forward_pre_hooks,
)
from core.ssm.tp_grad_reduction import (
    TP_AVG_TAG,
    megatron_tp_grad_reduction,
    parameters_read_as,
    registered_parameter,
    scale_grad,
)
from core.transformer.transformer_config import (
    gdn_out_norm_zero_centered,
    validate_gdn_config,
    validate_pre_gated_delta_rule_config,
)

_MegatronGatedDeltaNet = import_megatron_gdn().GatedDeltaNet


class GatedDeltaNet(_MegatronGatedDeltaNet):
    """megatron-core's GatedDeltaNet; ``config.fused_gated_norm`` switches the output norm and
    gate to the fused kernel. Constructor arguments are megatron's, and ``fused_gated_norm``: a
    spec param (set by ``core.models.use_fused_gdn(spec)``) that switches it on where the config
    has no such field, such as megatron's own TransformerConfig, or leaves it unset; None (no
    param) leaves it to the config (``validate_gdn_config``). ``pre_gated_delta_rule_fusion``:
    the spec param of the fusion before the gated delta rule, the same way
    (``config.gdn_pre_gated_delta_rule_fusion``; ``use_fused_gdn(spec,
    pre_gated_delta_rule=True)``; ``validate_pre_gated_delta_rule_config``). The attributes
    ``fused_gated_norm`` and ``pre_gated_delta_rule_fusion`` hold the resolved bools.

    ``out_norm_grad_scales``: per parameter of out_norm (``"weight"``, and ``"bias"`` where the
    norm has one), the factor the backward applies to its gradient: ``tp_size`` where this class
    completes the TP reduction, else 1.0. ``out_norm_weight_grad_scale`` is the weight's."""

    # The fused pre-recurrence region's gradient buffer, set for the span of one forward's
    # output-norm call (core.ssm.pre_gated_delta_rule_forward): the fused output norm's backward
    # writes the gate's gradient into it.
    dgate_sink = None

    def __init__(self, config, submodules, *args, fused_gated_norm: Optional[bool] = None,
                 pre_gated_delta_rule_fusion: Optional[bool] = None, **kwargs):
        # configs of other classes may carry the fields as attributes, or have none
        fused = validate_gdn_config(config, fused_gated_norm)
        pre_fused = validate_pre_gated_delta_rule_config(config, pre_gated_delta_rule_fusion)
        super().__init__(config, submodules, *args, **kwargs)
        self.fused_gated_norm = fused
        self.pre_gated_delta_rule_fusion = pre_fused
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
        self.out_norm_grad_scales, self._out_norm_summed_by_sp_tag = (
            self._complete_out_norm_tp_reduction())
        # Where the FSDP wrappers' counterparts of out_norm's parameters were found last, by
        # name: Megatron-FSDP's distributed copy (its index), torch FSDP2's record (a weakref).
        self._megatron_fsdp_copy_index, self._torch_fsdp2_record = {}, {}

    def forward(self, *args, **kwargs):
        """megatron's forward. It reads conv1d's parameters without calling conv1d, so conv1d's
        forward pre-hooks would never run: megatron's DDP with ``overlap_param_gather`` waits
        there for their all-gather, which the hook of in_proj's bucket has started, and without
        the wait the convolution may read a stale weight wherever a DDP bucket ends between
        in_proj's weight and conv1d's. While this forward runs, conv1d's pre-hooks run as
        in_proj returns, just before the read (and nothing is added where conv1d has none)."""
        run = (partial(pre_gated_delta_rule_forward.forward, self)
               if self.pre_gated_delta_rule_fusion else super().forward)
        if not has_forward_pre_hooks(self.conv1d):
            return run(*args, **kwargs)
        handle = self.in_proj.register_forward_hook(self._run_conv1d_pre_hooks)
        try:
            return run(*args, **kwargs)
        finally:
            handle.remove()

    def _run_conv1d_pre_hooks(self, in_proj, args, output) -> None:
        """in_proj's forward hook: conv1d's forward pre-hooks, given in_proj's output (from
        which megatron's forward takes the convolution's input). A hook that replaces that
        input has nothing to act on: RuntimeError."""
        run_forward_pre_hooks_on(
            self.conv1d, output[0] if isinstance(output, tuple) else output,
            "GatedDeltaNet: a forward pre-hook of conv1d replaces its input; megatron's forward "
            "reads conv1d's parameters without calling conv1d and cannot apply it")

    # ------------------------------------------------------------------------------------------
    # What the flag changes: the gate read in place, the fused output norm
    # ------------------------------------------------------------------------------------------

    def _reads_gate_in_place(self) -> bool:
        """The gate is a slice of the in_proj output. Read in place, it saves megatron's copy;
        saved for backward, it keeps that whole buffer alive. That is free where the buffer is
        kept anyway -- FLA's ``causal_conv1d`` (megatron's path outside ``deterministic_mode``)
        saves its strided qkv input, a view of the same buffer -- and when nothing is saved (no
        autograd). ``deterministic_mode``'s torch conv copies qkv, so there the copy keeps less."""
        return not self.config.deterministic_mode or not torch.is_grad_enabled()

    def _prepare_input_for_gated_delta_rule(self, qkv, gate, batch, seq_len, *gate_feats):
        if not (self.fused_gated_norm and self._reads_gate_in_place()):
            return super()._prepare_input_for_gated_delta_rule(
                qkv, gate, batch, seq_len, *gate_feats
            )
        # Megatron gets an empty slice (its .contiguous() is then a no-op); the kernel reads the
        # strided view.
        query, key, value, _, *feats = super()._prepare_input_for_gated_delta_rule(
            qkv, gate[..., :0], batch, seq_len, *gate_feats
        )
        return (query, key, value, gate, *feats)

    def _apply_gated_norm(self, x, gate):
        self._keep_out_norm_tp_tags()
        if not self.fused_gated_norm:
            scales = {name: scale for name, scale in self.out_norm_grad_scales.items()
                      if scale != 1.0}
            if not scales:
                return super()._apply_gated_norm(x, gate)
            return self._apply_unfused_gated_norm_scaled(x, gate, scales)
        scale = self.out_norm_weight_grad_scale
        activation = self._check_fused_norm_inputs(x, gate)
        # Looked up on the module at every call, so that a patched validator applies everywhere
        # (recomputation included); it includes fused_gated_norm's input checks, whose result
        # (``checked``) the kernel's entry takes instead of checking again.
        checked = fused_gated_norm_module.validate_gated_norm(self, x, gate,
                                                              gate_activation=activation)
        norm = self.out_norm
        if has_backward_hooks(norm):
            raise RuntimeError(
                "GatedDeltaNet: out_norm (or every module) has backward hooks; the fused output "
                "norm computes out_norm's gradient inside one kernel and cannot run them. Turn "
                "fused_gated_norm off for this model."
            )
        hooked = has_forward_hooks(norm)
        args = self._run_out_norm_pre_hooks(x) if hooked else None
        # A [B, S, H, D] view of an [S, B, H, D] buffer: megatron's reshape + transpose +
        # .contiguous() that follows in _gated_norm_and_a2a is then free. The kernel multiplies
        # dW by the scale before its single rounding.
        out = apply_validated_gated_norm(
            x,
            gate,
            norm.weight,
            self.config.layernorm_epsilon,
            self.out_norm_zero_centered,
            "sbhd",
            activation,
            weight_grad_scale=scale,
            checked=checked,
            dgate_sink=self.dgate_sink,
        )
        return self._run_out_norm_forward_hooks(args, out) if hooked else out

    def _check_fused_norm_inputs(self, x, gate) -> str:
        """What only this layer knows, checked before the validator (ValueError): the gate
        activation its ``act_fn`` applies is one the kernels implement (returned, by the
        kernels' name); ``core_attn_out`` and ``gate`` are [batch, seq,
        num_value_heads_local_tp_cp, linear_value_head_dim], the value heads split by TP and
        again by CP's all-to-all; out_norm, where it says whether it centres its weight
        (``zero_centered_gamma``), agrees with the kernel's ``out_norm_zero_centered``. A
        non-tensor is left to the validator's type checks."""
        activation = self.gate_activation
        if activation is None:
            raise ValueError(
                "fused_gated_norm requires the module's act_fn (the GDN gate activation) to be "
                "one the kernels implement, 'silu' or 'sigmoid' (torch.nn.functional.silu / "
                f"torch.sigmoid), got {getattr(self.act_fn, '__name__', self.act_fn)!r}"
            )
        heads, head_dim = self.num_value_heads_local_tp_cp, self.config.linear_value_head_dim
        for name, t in (("core_attn_out", x), ("gate", gate)):
            if isinstance(t, torch.Tensor) and (t.dim() != 4 or t.shape[2:] != (heads, head_dim)):
                raise ValueError(
                    f"fused_gated_norm requires {name} of shape [batch, seq, {heads}, "
                    f"{head_dim}] ({heads} local value heads: linear_num_value_heads "
                    f"{self.config.linear_num_value_heads} split over tp_size {self.tp_size} and "
                    f"cp_size {self.cp_size}; linear_value_head_dim), got {tuple(t.shape)}"
                )
        norm_zero_centered = getattr(self.out_norm, "zero_centered_gamma", None)
        zero_centered = self.out_norm_zero_centered  # what the kernel applies
        if norm_zero_centered is not None and bool(norm_zero_centered) != zero_centered:
            raise ValueError(
                f"fused_gated_norm requires out_norm.zero_centered_gamma ({norm_zero_centered}) "
                f"to equal the module's out_norm_zero_centered ({zero_centered}), set from the "
                "config"
            )
        return activation

    @property
    def gate_activation(self) -> Optional[str]:
        """The kernel's name of the gate activation ('silu', 'sigmoid'; None for another)."""
        return gate_activation_name(self.act_fn)

    # ------------------------------------------------------------------------------------------
    # out_norm's hooks around the fused kernel, and the scaled unfused path
    # ------------------------------------------------------------------------------------------

    def _run_out_norm_pre_hooks(self, x) -> tuple:
        """out_norm is never called on the fused path, so its hooks run here, around the kernel:
        its forward pre-hooks before its weight is read, with the input megatron's call would
        give it (megatron's DDP with ``overlap_param_gather`` waits there for the weight's
        all-gather). A hook that replaces that input has nothing to act on inside the one
        kernel: RuntimeError."""
        return run_forward_pre_hooks_on(
            self.out_norm, x.reshape(-1, x.shape[-1]),
            "GatedDeltaNet: a forward pre-hook of out_norm replaces the norm's input; the fused "
            "output norm computes norm and gate in one kernel and cannot apply it. Turn "
            "fused_gated_norm off for this model.")

    def _run_out_norm_forward_hooks(self, args, out):
        """out_norm's forward hooks, given the fused output (the gated norm, [B, S, H, D]: the
        one output this path computes). A hook may return a replacement of the same shape,
        dtype and device, such as Megatron-FSDP's view that carries its pre-backward unshard."""
        result = run_forward_hooks(self.out_norm, args, out)
        if result is not out and not (isinstance(result, torch.Tensor)
                                      and result.shape == out.shape
                                      and result.dtype == out.dtype
                                      and result.device == out.device):
            raise RuntimeError(
                "GatedDeltaNet: a forward hook of out_norm returned "
                f"{type(result).__name__} {getattr(result, 'shape', '')} in place of the fused "
                f"output {tuple(out.shape)} {out.dtype}; the fused output norm can only pass on "
                "an output of the same shape, dtype and device. Turn fused_gated_norm off for "
                "this model."
            )
        return result

    def _apply_unfused_gated_norm_scaled(self, x, gate, scales: dict):
        """megatron's norm + gate, its norm reading each parameter named in ``scales`` through
        ``scale_grad`` with that factor. out_norm's own forward pre-hooks run first, with the
        parameters in place (megatron's DDP waits there for their all-gather, and acts on
        Parameters only); inside megatron's call of out_norm, where the slots hold the scaled
        tensors, they are set aside so that none runs twice. A hook's replacement input is what
        megatron's call gets, as in ``out_norm(x)``. Global hooks and forward hooks run inside
        megatron's call as usual, so here the global pre-hooks run after out_norm's own, where a
        module call runs them first."""
        norm = self.out_norm
        own_hooks = own_forward_pre_hooks(norm)
        if own_hooks:
            (x_rows,) = run_forward_pre_hooks(norm, (x.reshape(-1, x.shape[-1]),),
                                              global_hooks=False)
            x = x_rows.reshape(x.shape)  # megatron's _apply_gated_norm reshapes it back
            set_aside_forward_pre_hooks(self, norm)
        try:
            scaled = {name: scale_grad(param, scale) for name, scale in scales.items()
                      if (param := registered_parameter(norm, name)) is not None}
            with parameters_read_as(norm, scaled):
                return super()._apply_gated_norm(x, gate)
        finally:
            if own_hooks:
                restore_forward_pre_hooks(norm, own_hooks)

    # ------------------------------------------------------------------------------------------
    # The tensor-parallel gradient of out_norm's parameters
    # ------------------------------------------------------------------------------------------

    @property
    def out_norm_weight_grad_scale(self) -> float:
        """The factor the backward applies to the out_norm weight's gradient (the kernel's
        ``weight_grad_scale`` on the fused path)."""
        return self.out_norm_grad_scales.get("weight", 1.0)

    def _complete_out_norm_tp_reduction(self) -> tuple[dict, set]:
        """Each TP rank's gradient of an out_norm parameter (weight; bias, for a LayerNorm) is a
        partial sum over its heads. Per parameter: when megatron's finalize_model_grads leaves
        it unreduced, tag it for finalize's AVG over TP; its factor is then ``tp_size``, applied
        by the backward, so that AVG = SUM of the partials. 1.0 (nothing done) at TP 1 and where
        megatron reduces it itself. Returns ``{name: factor}`` for out_norm's own parameters, and
        the names of those megatron sums for their ``sequence_parallel`` tag (which must stay)."""
        params = dict(self.out_norm.named_parameters(recurse=False))
        if self.tp_size == 1:
            return {name: 1.0 for name in params}, set()
        scales, summed_by_sp_tag = {}, set()
        for name, param in params.items():
            reduction = megatron_tp_grad_reduction(param, self.config, self.pg_collection.tp,
                                                   f"out_norm.{name}")
            if reduction == "sum":  # megatron adds the partials itself (sequence parallelism on)
                scales[name] = 1.0
                if self.config.sequence_parallel and getattr(param, "sequence_parallel", False):
                    summed_by_sp_tag.add(name)
                continue
            if reduction is None:
                setattr(param, TP_AVG_TAG, True)
            elif reduction != "avg":  # "avg": it came tagged; AVG of scaled partials = SUM
                raise RuntimeError(
                    f"GatedDeltaNet: megatron's finalize_model_grads reduces out_norm.{name}'s "
                    f"tensor-parallel gradient with {reduction!r}; only a SUM, an AVG or no "
                    "reduction can be completed to the sum of the per-rank partials"
                )
            scales[name] = float(self.tp_size)
        return scales, summed_by_sp_tag

    def _keep_out_norm_tp_tags(self) -> None:
        """Each out_norm parameter a gradient can reach keeps what has its TP gradient made
        whole: where the backward scales it, the tag of finalize's AVG, carried first to
        Megatron-FSDP's distributed copy of the parameter; where megatron sums it for its
        ``sequence_parallel`` tag, that tag (RuntimeError naming a lost tag). Only where a
        gradient can flow (grad mode on, the parameter requiring grad): a parameter replaced
        for inference (``load_state_dict(..., assign=True)`` drops the tags) still runs under
        ``torch.no_grad()``."""
        if not torch.is_grad_enabled():
            return
        norm = self.out_norm
        for name, scale in self.out_norm_grad_scales.items():
            param = registered_parameter(norm, name)  # none: the norm's own checks refuse it
            if not isinstance(param, torch.nn.Parameter) or not param.requires_grad:
                continue
            if scale != 1.0:
                keep_tag_on_megatron_fsdp_copy(param, TP_AVG_TAG, name,
                                               self._megatron_fsdp_copy_index)
                self._check_tp_tag(name, param, TP_AVG_TAG)
            elif name in self._out_norm_summed_by_sp_tag:
                self._check_tp_tag(name, param, "sequence_parallel")

    def _check_tp_tag(self, name: str, param, tag: str) -> None:
        """out_norm's parameter ``name`` (``param``) still carries ``tag`` where
        finalize_model_grads reads it (under torch FSDP2: on the sharded parameter behind the
        forward's); RuntimeError otherwise."""
        if getattr(param, tag, False) or torch_fsdp2_sharded_param_tagged(
                self.out_norm, name, param, tag, self._torch_fsdp2_record):
            return
        raise RuntimeError(
            f"GatedDeltaNet: out_norm.{name} lost its {tag} tag (the parameter was "
            "replaced after construction), so finalize_model_grads would leave its "
            f"tensor-parallel gradient partial. Set module.out_norm.{name}.{tag} = True "
            "on the new parameter."
        )

    # ------------------------------------------------------------------------------------------
    # gdn_norm_out selective recompute
    # ------------------------------------------------------------------------------------------

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
