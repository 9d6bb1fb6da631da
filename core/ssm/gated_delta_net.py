"""megatron-core's GatedDeltaNet with the fused output gated norm behind ``config.fused_gated_norm``.

Flag off: megatron's forward, unchanged (its norm module, its gate product, its transpose copy).
Flag on, per forward (and again when ``gdn_norm_out`` selective recompute re-runs it):

    _gated_norm_and_a2a (megatron's)             core_attn_out [B,S,H,D], gate [B,S,H,D] view
      -> _apply_gated_norm (this class)
           validate_gated_norm(self, x, gate)    host-side checks, every call
           apply_validated_gated_norm(..., "sbhd", weight_grad_scale=...)
                                                 fused_gated_norm minus its checks
      -> reshape(B, S, H*D).transpose(0, 1).contiguous()   a no-op: the buffer is already sbhd
      -> CP all-to-all, out_proj

The gate is read in place as a strided slice of the in_proj output, skipping megatron's copy in
``_prepare_input_for_gated_delta_rule``, wherever that keeps no more memory for backward (see
``GatedDeltaNet._reads_gate_in_place``); in ``deterministic_mode`` training it takes the copy.

Both paths (flag on and off) also get:
  * ``config.gdn_out_norm_zero_centered_gamma`` honoured by the output norm;
  * the tensor-parallel gradients of the output norm's parameters (its weight, and the bias of
    a LayerNorm on the unfused path) made whole (docs/tensor_parallel.md): each TP
    rank's gradient covers only its heads. Where megatron's stock ``finalize_model_grads`` would
    leave that partial unreduced (sequence parallelism off), the backward multiplies the
    parameter's gradient by ``tp_size`` inside the autograd graph and the parameter is tagged
    ``average_gradients_across_tp_domain``: finalize's AVG over TP then gives the SUM of the
    partials; a parameter that arrives tagged gets the same factor. Where megatron already sums
    it (sequence parallelism on: SUM of ``sequence_parallel`` params), nothing is added. See
    :func:`megatron_tp_grad_reduction`;
  * ``gdn_norm_out`` selective recompute without Transformer Engine (see
    :attr:`GatedDeltaNet.norm_out_checkpoint`);
  * out_norm's hooks run as a call of out_norm would run them, each once per forward, its
    forward pre-hooks with its weight in place before that weight is read (megatron's DDP with
    ``overlap_param_gather`` waits there for the weight's all-gather). On the fused path, which
    never calls out_norm, its forward hooks get the fused output; backward hooks, or a
    pre-hook that replaces the input, are refused there (RuntimeError);
  * conv1d's forward pre-hooks run before megatron's forward reads conv1d's weight, which it
    does without calling conv1d (see :meth:`GatedDeltaNet.forward`).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import importlib
import weakref
from typing import Iterator, Optional

import torch

from megatron.core.tensor_parallel import random as _tensor_parallel_random
from megatron.core.transformer.spec_utils import build_module

from core.fusions.fused_gated_norm import apply_validated_gated_norm, validate_gated_norm
from core.fusions.gated_norm_validation import gate_activation_name
from core.ssm.megatron_gdn_import import import_megatron_gdn
from core.transformer.transformer_config import gdn_out_norm_zero_centered, validate_gdn_config

_MegatronGatedDeltaNet = import_megatron_gdn().GatedDeltaNet

# The tag megatron's finalize_model_grads AVG-reduces over TP, sequence parallelism on or off.
TP_AVG_TAG = "average_gradients_across_tp_domain"


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the incoming gradient by ``scale``. Applied to
    the out_norm weight inside the forward, so the scaling is one node of the autograd graph
    (recorded once, replayed once by CUDA graphs) and nothing is attached to the parameter."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_grad(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """``tensor`` in the forward; its gradient times ``scale`` in the backward (``tensor`` itself
    when ``scale == 1``)."""
    return tensor if scale == 1.0 else _ScaleGrad.apply(tensor, scale)


@contextlib.contextmanager
def parameters_read_as(module: torch.nn.Module, tensors: dict) -> Iterator[None]:
    """While the block runs, each of ``module``'s parameter slots named in ``tensors`` holds the
    tensor given for it (a function of the parameter, such as :func:`scale_grad`'s output); the
    parameters are put back afterwards.

    The slots themselves are swapped (``module._parameters[name]``, as
    torch.func.functional_call does), so every way a norm reads its parameters sees the tensors:
    attribute access (``self.weight``: our RMSNorm, torch's norms, Transformer Engine 1.x) and
    ``module.parameters()`` (Transformer Engine 2.x's op fuser passes the op's parameters to its
    autograd Function as inputs and returns their gradients through it). The gradient reaching
    a tensor flows on to its parameter through whatever produced the tensor."""
    slots = module._parameters
    params = {name: slots[name] for name in tensors}
    slots.update(tensors)
    try:
        yield
    finally:
        slots.update(params)


_module_hooks = torch.nn.modules.module


def run_forward_pre_hooks(module: torch.nn.Module, args: tuple, *,
                          global_hooks: bool = True) -> tuple:
    """Run the forward pre-hooks that ``module(*args)`` would run (with ``global_hooks``, the
    global ones first, then the module's own, in registration order) and return the arguments
    they leave, as ``module(*args)`` would pass them on, for a caller that reads ``module``'s
    parameters itself. Megatron's DistributedDataParallel with ``overlap_param_gather``
    registers one on every module: it waits for the all-gather of the module's parameters
    (found through ``module.parameters(recurse=False)``) before they are read."""
    hooks = module._forward_pre_hooks
    if global_hooks and _module_hooks._global_forward_pre_hooks:
        hooks = {**_module_hooks._global_forward_pre_hooks, **hooks}
    with_kwargs = module._forward_pre_hooks_with_kwargs
    for hook_id, hook in tuple(hooks.items()):  # a hook may remove itself, as in module(*args)
        if hook_id in with_kwargs:
            result = hook(module, args, {})
            if result is not None:
                args = result[0]
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args


def run_forward_pre_hooks_on(module: torch.nn.Module, tensor: torch.Tensor, refusal: str) -> tuple:
    """:func:`run_forward_pre_hooks` with ``(tensor,)``, for a caller that never calls
    ``module`` and so has nowhere to pass a replaced input: a hook that replaces it raises
    RuntimeError(``refusal``). Returns ``(tensor,)``."""
    args = (tensor,)
    after = run_forward_pre_hooks(module, args)
    if len(after) != 1 or after[0] is not tensor:
        raise RuntimeError(refusal)
    return args


def run_forward_hooks(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Run the forward hooks that ``module(*args)`` would run after its forward (the global ones,
    then the module's own) on ``output``; return the output they leave (a hook may return a
    replacement, e.g. Megatron-FSDP's view that carries its pre-backward unshard hook)."""
    hooks = {**_module_hooks._global_forward_hooks, **module._forward_hooks}
    with_kwargs = (module._forward_hooks_with_kwargs,
                   _module_hooks._global_forward_hooks_with_kwargs)
    for hook_id, hook in tuple(hooks.items()):
        if hook_id in with_kwargs[0] or hook_id in with_kwargs[1]:
            result = hook(module, args, {}, output)
        else:
            result = hook(module, args, output)
        if result is not None:
            output = result
    return output


# Swapping a module's hook table is no graph operation: where the module is compiled whole,
# torch.compile runs these two eagerly (a graph break) instead of tracing the dict mutations.
@torch.compiler.disable
def _set_aside_pre_hooks(owner: torch.nn.Module, module: torch.nn.Module) -> None:
    """An empty table in place of ``module``'s forward pre-hooks, one per ``owner``, so that a
    compiled megatron ``_apply_gated_norm`` sees the same (empty) hooks every call."""
    module._forward_pre_hooks = owner.__dict__.setdefault("_out_norm_hooks_set_aside",
                                                          collections.OrderedDict())


@torch.compiler.disable
def _restore_pre_hooks(module: torch.nn.Module, own_hooks) -> None:
    """``module``'s own table back, with any pre-hook registered in the meantime."""
    own_hooks.update(module._forward_pre_hooks)
    module._forward_pre_hooks.clear()
    module._forward_pre_hooks = own_hooks


def _has_backward_hooks(module: torch.nn.Module) -> bool:
    return bool(module._backward_hooks or module._backward_pre_hooks
                or _module_hooks._global_backward_hooks
                or _module_hooks._global_backward_pre_hooks)


def _has_forward_pre_hooks(module: torch.nn.Module) -> bool:
    return bool(module._forward_pre_hooks or _module_hooks._global_forward_pre_hooks)


def _has_forward_hooks(module: torch.nn.Module) -> bool:
    return (_has_forward_pre_hooks(module)
            or bool(module._forward_hooks or _module_hooks._global_forward_hooks))


class _ReductionProbe(torch.Tensor):
    """A gradient stand-in that records the ``torch.distributed`` collectives it is handed and
    skips them (``all_reduce`` and friends dispatch ``__torch_function__`` on their tensors)."""

    collectives: list

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", "").startswith("torch.distributed"):
            op = kwargs.get("op", args[1] if len(args) > 1 else None)
            cls.collectives.append((func.__name__, op))
            return None
        return super().__torch_function__(func, types, args, kwargs)


def megatron_tp_grad_reduction(param: torch.nn.Parameter, config, tp_group,
                               name: str = "out_norm.weight") -> Optional[str]:
    """How megatron-core's ``finalize_model_grads`` reduces ``param``'s gradient over the
    tensor-parallel group: ``"sum"``, ``"avg"``, another collective's name, or None (not
    reduced, e.g. the GDN out_norm weight in megatron-core 0.19 with sequence parallelism off,
    upstream issue #7452).

    Found by running megatron's own TP step of ``finalize_model_grads``
    (``_allreduce_non_tensor_model_parallel_grads``) on a stand-in: a parameter named ``name``
    with ``param``'s attributes (its tags, as megatron and the norm module set them), ``config``
    and ``tp_group``, whose gradient records the collectives megatron issues on it instead of
    running them. No communication, nothing of ``param`` is modified. A megatron whose finalize
    reduces the out_norm weight by a tag or by its name is seen as such.

    Raises RuntimeError when that function is missing or fails on the stand-in (a megatron-core
    this was not written for): whether the gradient would be reduced once, twice or never is
    then unknown."""
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    reduce_tp = getattr(finalize, "_allreduce_non_tensor_model_parallel_grads", None)
    stand_in = torch.nn.Parameter(torch.zeros(1), requires_grad=param.requires_grad)
    for attr, value in vars(param).items():
        setattr(stand_in, attr, value)
    stand_in.main_grad = torch.zeros(1).as_subclass(_ReductionProbe)
    _ReductionProbe.collectives = []

    class _Chunk(torch.nn.Module):  # a DDP-wrapped model chunk, as finalize sees one
        ddp_config = type("DDPConfig", (), {"use_megatron_fsdp": False})()

        def named_parameters(self, *args, **kwargs):
            yield name, stand_in

    try:
        if reduce_tp is None:
            raise AttributeError("finalize_model_grads has no _allreduce_non_tensor_model_parallel_grads")
        reduce_tp([_Chunk()], config, tp_group)
    except Exception as exc:
        raise RuntimeError(
            "GatedDeltaNet: cannot tell how this megatron-core's finalize_model_grads reduces the "
            f"out_norm weight gradient over tensor parallelism ({type(exc).__name__}: {exc}); "
            "this package supports megatron-core 0.19"
        ) from exc
    finally:
        collectives, _ReductionProbe.collectives = _ReductionProbe.collectives, []
    if not collectives:
        return None
    func, op = collectives[0]
    if func == "all_reduce" and op in (torch.distributed.ReduceOp.SUM, None):
        return "sum"
    if func == "all_reduce" and op == torch.distributed.ReduceOp.AVG:
        return "avg"
    return func


def carry_tag_to_megatron_fsdp_param(param: torch.nn.Parameter, tag: str) -> Optional[int]:
    """Set ``tag`` on Megatron-FSDP's distributed copy of ``param`` when ``param`` carries it.

    Megatron-FSDP runs the forward on the module's own parameters but puts its distributed
    parameters on the module before ``finalize_model_grads``; those copy a fixed list of
    attributes (``set_param_attribute_closure`` in megatron_fsdp/param_and_grad_buffer.py,
    megatron-core 0.19) without ``average_gradients_across_tp_domain``, so finalize would skip
    the TP reduction. MegatronFSDP.forward marks each parameter with ``_megatron_fsdp_model``
    before it runs the module; its ``param_and_grad_buffer.optimizer_named_parameters`` hold the
    distributed parameters, each with ``orig_param``. Returns the index there of the copy it
    tagged (None: no wrapper, an untagged ``param`` or no copy), for ``fsdp_copy_tagged``."""
    fsdp = getattr(param, "_megatron_fsdp_model", None)
    if fsdp is None or not getattr(param, tag, False):
        return None
    found = None
    for index, (_, dist_param) in enumerate(fsdp.param_and_grad_buffer.optimizer_named_parameters):
        if getattr(dist_param, "orig_param", None) is param:
            setattr(dist_param, tag, True)
            found = index if found is None else found
    return found


def fsdp_copy_tagged(param: torch.nn.Parameter, tag: str, index: Optional[int]) -> bool:
    """Whether Megatron-FSDP's distributed copy at ``index`` (as carry_tag_to_megatron_fsdp_param
    returned it) is still ``param``'s and carries ``tag``: one lookup, so the search runs again
    only when the wrapper, its buffer or the copy changed."""
    if index is None:
        return False
    try:
        _, dist_param = (param._megatron_fsdp_model.param_and_grad_buffer
                         .optimizer_named_parameters[index])
    except (AttributeError, IndexError, TypeError, ValueError):
        return False
    return getattr(dist_param, "orig_param", None) is param and getattr(dist_param, tag, False) is True


def torch_fsdp2_param(module: torch.nn.Module, name: str):
    """torch FSDP2's record (``FSDPParam``) of ``module.<name>`` when what is registered there
    now is FSDP2's unsharded parameter, else None. Its ``sharded_param`` is what FSDP2 registers
    outside the forward and what finalize_model_grads reduces.

    With ``fully_shard`` (megatron's ``TorchFullyShardedDataParallel``, ``--use-torch-fsdp2``)
    the forward runs on an unsharded parameter that FSDP2 made without the original's attributes;
    megatron's wrapper copies those (the TP tag among them) onto the sharded one. FSDP2 keeps no
    link from one to the other, so its states are searched (torch's private
    ``_module_state_mapping`` and ``FSDPParam``, read from torch 2.4 to 2.13; the FSDP2 tests pass
    with torch 2.13 to 2.15: a torch without them gives None)."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:
        return None
    current = module._parameters.get(name)
    for state in list(_module_state_mapping.values()):
        state = state() if isinstance(state, weakref.ref) else state
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                info = getattr(fsdp_param, "_module_info", None)
                if info is None or getattr(fsdp_param, "_unsharded_param", None) is not current:
                    continue
                owners = zip([info.module, *getattr(info, "shared_modules", ())],
                             [info.param_name, *getattr(info, "shared_param_names", ())])
                if any(owner is module and owner_name == name for owner, owner_name in owners):
                    return fsdp_param
    return None


class GatedDeltaNet(_MegatronGatedDeltaNet):
    """megatron-core's GatedDeltaNet; ``config.fused_gated_norm`` switches the output norm and
    gate to the fused kernel. Constructor arguments are megatron's, and ``fused_gated_norm``: a
    spec param (``core.models.use_fused_gdn(spec, fused_gated_norm=True)``) that switches it
    where the config has no such field, such as megatron's own TransformerConfig; None (no
    param) leaves it to the config (``validate_gdn_config``).

    ``out_norm_grad_scales``: per parameter of out_norm (``"weight"``, and ``"bias"`` where the
    norm has one), the factor the backward applies to its gradient: ``tp_size`` where this class
    completes the TP reduction, else 1.0. ``out_norm_weight_grad_scale`` is the weight's."""

    def __init__(self, config, submodules, *args, fused_gated_norm: Optional[bool] = None,
                 **kwargs):
        # configs of other classes may carry the fields as attributes, or have none
        fused = validate_gdn_config(config, fused_gated_norm)
        super().__init__(config, submodules, *args, **kwargs)
        self.fused_gated_norm = fused
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

    def forward(self, *args, **kwargs):
        """megatron's forward. It reads conv1d's parameters without calling conv1d, so conv1d's
        forward pre-hooks would never run: megatron's DDP with ``overlap_param_gather`` waits
        there for their all-gather, which the hook of in_proj's bucket has started, and without
        the wait the convolution may read a stale weight wherever a DDP bucket ends between
        in_proj's weight and conv1d's. While this forward runs, conv1d's pre-hooks run as
        in_proj returns, just before the read (and nothing is added where conv1d has none)."""
        if not _has_forward_pre_hooks(self.conv1d):
            return super().forward(*args, **kwargs)
        handle = self.in_proj.register_forward_hook(self._run_conv1d_pre_hooks)
        try:
            return super().forward(*args, **kwargs)
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

    @property
    def out_norm_weight_grad_scale(self) -> float:
        """The factor the backward applies to the out_norm weight's gradient (the kernel's
        ``weight_grad_scale`` on the fused path)."""
        return self.out_norm_grad_scales.get("weight", 1.0)

    @property
    def gate_activation(self) -> Optional[str]:
        """The kernel's name of the gate activation ('silu', 'sigmoid'; None for another)."""
        return gate_activation_name(self.act_fn)

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
        params = self.out_norm._parameters
        for name, scale in self.out_norm_grad_scales.items():
            param = params.get(name)  # none: the norm's own checks refuse it
            if not isinstance(param, torch.nn.Parameter) or not param.requires_grad:
                continue
            if scale != 1.0:
                self._carry_tag_to_megatron_fsdp_copy(name, param, TP_AVG_TAG)
                self._check_tp_tag(name, param, TP_AVG_TAG)
            elif name in self._out_norm_summed_by_sp_tag:
                self._check_tp_tag(name, param, "sequence_parallel")

    def _carry_tag_to_megatron_fsdp_copy(self, name: str, param, tag: str) -> None:
        """Megatron-FSDP's distributed copy of ``param`` carries ``tag`` as ``param`` does
        (carry_tag_to_megatron_fsdp_param); a search only when the copy changed."""
        if getattr(param, "_megatron_fsdp_model", None) is None:
            return
        fsdp_indices = self.__dict__.setdefault("_fsdp_tag_index", {})
        if not fsdp_copy_tagged(param, tag, fsdp_indices.get(name)):
            fsdp_indices[name] = carry_tag_to_megatron_fsdp_param(param, tag)

    def _check_tp_tag(self, name: str, param, tag: str) -> None:
        """out_norm's parameter ``name`` (``param``) still carries ``tag`` where
        finalize_model_grads reads it (RuntimeError otherwise)."""
        if getattr(param, tag, False):
            return
        # torch FSDP2: the tag is on the sharded parameter behind FSDP2's unsharded one. Its
        # record is searched once (FSDP2 keeps both from step to step); the sharded parameter
        # is read on every forward, as it may be replaced (load_state_dict).
        fsdp2_params = self.__dict__.setdefault("_fsdp2_param", {})
        known = fsdp2_params.get(name)
        fsdp_param = known() if known is not None else None
        if fsdp_param is None or getattr(fsdp_param, "_unsharded_param", None) is not param:
            fsdp_param = torch_fsdp2_param(self.out_norm, name)
            fsdp2_params[name] = None if fsdp_param is None else weakref.ref(fsdp_param)
        if fsdp_param is not None and getattr(fsdp_param.sharded_param, tag, False):
            return
        raise RuntimeError(
            f"GatedDeltaNet: out_norm.{name} lost its {tag} tag (the parameter was "
            "replaced after construction), so finalize_model_grads would leave its "
            f"tensor-parallel gradient partial. Set module.out_norm.{name}.{tag} = True "
            "on the new parameter."
        )

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
        activation = validate_gated_norm(self, x, gate)  # and fused_gated_norm's input checks
        norm = self.out_norm
        if _has_backward_hooks(norm):
            raise RuntimeError(
                "GatedDeltaNet: out_norm (or every module) has backward hooks; the fused output "
                "norm computes out_norm's gradient inside one kernel and cannot run them. Turn "
                "fused_gated_norm off for this model."
            )
        hooked = _has_forward_hooks(norm)
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
        )
        return self._run_out_norm_forward_hooks(args, out) if hooked else out

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
        if result is not out and not (isinstance(result, torch.Tensor) and result.shape == out.shape
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
        own_hooks = norm._forward_pre_hooks
        if own_hooks:
            (x_rows,) = run_forward_pre_hooks(norm, (x.reshape(-1, x.shape[-1]),),
                                              global_hooks=False)
            x = x_rows.reshape(x.shape)  # megatron's _apply_gated_norm reshapes it back
            _set_aside_pre_hooks(self, norm)
        try:
            scaled = {name: scale_grad(param, scale) for name, scale in scales.items()
                      if (param := norm._parameters.get(name)) is not None}
            with parameters_read_as(norm, scaled):
                return super()._apply_gated_norm(x, gate)
        finally:
            if own_hooks:
                _restore_pre_hooks(norm, own_hooks)
