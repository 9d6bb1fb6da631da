"""Keeping a parameter's tag where megatron's ``finalize_model_grads`` reads it under FSDP.

finalize reads a parameter's tags (``average_gradients_across_tp_domain``,
``sequence_parallel``) to choose its tensor-parallel reduction. Under Megatron-FSDP and torch
FSDP2 the parameter it reads is not the one the module's forward sees, and carries only what
the wrapper copied: Megatron-FSDP's distributed copy a fixed list of attributes, FSDP2's
sharded parameter what megatron's wrapper copied at wrapping. The functions here find that
other parameter from the forward's (through the wrappers' private records) and carry a tag over
or read it there."""

import weakref
from typing import Optional

import torch

from core.ssm.private_names import PrivateName

_MEGATRON_FSDP = "megatron.core.distributed.fsdp.src.megatron_fsdp"
_TORCH_FSDP2 = "torch.distributed.fsdp._fully_shard"

# What this module reads outside torch's and megatron-core's public API (checked by
# tests/ssm/test_fsdp_tags.py). Megatron-FSDP: the wrapper that MegatronFSDP's forward marks each
# raw parameter with, its buffer's distributed parameters and their link to the original.
# torch FSDP2: its per-module states, their parameter groups and records (FSDPParam), and what a
# record keeps of the parameter's owner (older torch releases hold one _fsdp_param_group, which
# is read as well).
PRIVATE_NAMES = (
    PrivateName("torch", "torch.nn.Module", "_parameters"),
    PrivateName("megatron-core", f"{_MEGATRON_FSDP}.megatron_fsdp.MegatronFSDP",
                "_megatron_fsdp_model"),
    PrivateName("megatron-core", f"{_MEGATRON_FSDP}.megatron_fsdp.MegatronFSDP",
                "param_and_grad_buffer"),
    PrivateName("megatron-core", f"{_MEGATRON_FSDP}.param_and_grad_buffer.ParamAndGradBuffer",
                "optimizer_named_parameters"),
    PrivateName("megatron-core", f"{_MEGATRON_FSDP}.param_and_grad_buffer.ParamAndGradBuffer",
                "orig_param"),
    PrivateName("torch", "torch.distributed._composable_state", "_module_state_mapping"),
    PrivateName("torch", f"{_TORCH_FSDP2}._fsdp_state.FSDPState", "_fsdp_param_groups"),
    PrivateName("torch", f"{_TORCH_FSDP2}._fsdp_param_group.FSDPParamGroup", "fsdp_params"),
    *(PrivateName("torch", f"{_TORCH_FSDP2}._fsdp_param.FSDPParam", attribute)
      for attribute in ("_module_info", "_unsharded_param", "sharded_param")),
    *(PrivateName("torch", f"{_TORCH_FSDP2}._fsdp_param.ParamModuleInfo", attribute)
      for attribute in ("module", "param_name", "shared_modules", "shared_param_names")),
)


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
    return (getattr(dist_param, "orig_param", None) is param
            and getattr(dist_param, tag, False) is True)


def keep_tag_on_megatron_fsdp_copy(param: torch.nn.Parameter, tag: str, name: str,
                                   known_indices: dict) -> None:
    """Megatron-FSDP's distributed copy of ``param`` carries ``tag`` as ``param`` does (nothing
    to do without Megatron-FSDP). ``known_indices`` (the caller's, kept from call to call, by
    ``name``) holds where the copy was found last time: a search only when the copy changed."""
    if getattr(param, "_megatron_fsdp_model", None) is None:
        return
    if not fsdp_copy_tagged(param, tag, known_indices.get(name)):
        known_indices[name] = carry_tag_to_megatron_fsdp_param(param, tag)


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


def torch_fsdp2_sharded_param_tagged(module: torch.nn.Module, name: str,
                                     param: torch.nn.Parameter, tag: str,
                                     known_records: dict) -> bool:
    """Whether ``param``, registered as ``module.<name>`` during the forward, is torch FSDP2's
    unsharded parameter and the sharded one behind it carries ``tag``. ``known_records`` (the
    caller's, kept from call to call, by ``name``) holds FSDP2's record found last time: it is
    searched again only when it no longer holds ``param`` (FSDP2 keeps both from step to step);
    the sharded parameter is read every call, as it may be replaced (load_state_dict)."""
    known = known_records.get(name)
    fsdp_param = known() if known is not None else None
    if fsdp_param is None or getattr(fsdp_param, "_unsharded_param", None) is not param:
        fsdp_param = torch_fsdp2_param(module, name)
        known_records[name] = None if fsdp_param is None else weakref.ref(fsdp_param)
    return fsdp_param is not None and bool(getattr(fsdp_param.sharded_param, tag, False))
