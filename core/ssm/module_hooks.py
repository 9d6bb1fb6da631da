"""Running a module's hooks as a call of the module would, for a caller that reads the module's
parameters without calling it.

torch runs forward pre-hooks and forward hooks only inside ``module(*args)``. GatedDeltaNet
reads conv1d's weight without calling conv1d, and its fused output norm never calls out_norm;
the functions here run their hooks at the point of the read, in torch's order (global hooks
first, then the module's own, in registration order), over torch's private hook tables."""

import collections

import torch

from core.ssm.private_names import PrivateName

_hook_tables = torch.nn.modules.module

# What this module reads of torch outside its public API (checked by tests/ssm/test_module_hooks).
PRIVATE_NAMES = (
    *(PrivateName("torch", "torch.nn.modules.module", table) for table in (
        "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_with_kwargs",
        "_global_backward_hooks", "_global_backward_pre_hooks")),
    *(PrivateName("torch", "torch.nn.Module", table) for table in (
        "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
        "_forward_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")),
)


def run_forward_pre_hooks(module: torch.nn.Module, args: tuple, *,
                          global_hooks: bool = True) -> tuple:
    """Run the forward pre-hooks that ``module(*args)`` would run (with ``global_hooks``, the
    global ones first, then the module's own, in registration order) and return the arguments
    they leave, as ``module(*args)`` would pass them on, for a caller that reads ``module``'s
    parameters itself. Megatron's DistributedDataParallel with ``overlap_param_gather``
    registers one on every module: it waits for the all-gather of the module's parameters
    (found through ``module.parameters(recurse=False)``) before they are read."""
    hooks = module._forward_pre_hooks
    if global_hooks and _hook_tables._global_forward_pre_hooks:
        hooks = {**_hook_tables._global_forward_pre_hooks, **hooks}
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


def run_forward_pre_hooks_on(module: torch.nn.Module, tensor: torch.Tensor,
                             refusal: str) -> tuple:
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
    hooks = {**_hook_tables._global_forward_hooks, **module._forward_hooks}
    with_kwargs = (module._forward_hooks_with_kwargs,
                   _hook_tables._global_forward_hooks_with_kwargs)
    for hook_id, hook in tuple(hooks.items()):
        if hook_id in with_kwargs[0] or hook_id in with_kwargs[1]:
            result = hook(module, args, {}, output)
        else:
            result = hook(module, args, output)
        if result is not None:
            output = result
    return output


def own_forward_pre_hooks(module: torch.nn.Module) -> dict:
    """``module``'s own table of forward pre-hooks (not the global ones), by hook id."""
    return module._forward_pre_hooks


# Swapping a module's hook table is no graph operation: where the module is compiled whole,
# torch.compile runs these two eagerly (a graph break) instead of tracing the dict mutations.
@torch.compiler.disable
def set_aside_forward_pre_hooks(owner: torch.nn.Module, module: torch.nn.Module) -> None:
    """An empty table in place of ``module``'s forward pre-hooks, so that a call of ``module``
    runs none of its own (the caller has run them); one table per ``owner`` (for one module at
    a time), so that a compiled caller sees the same (empty) hooks every call.
    :func:`restore_forward_pre_hooks` undoes it."""
    module._forward_pre_hooks = owner.__dict__.setdefault("_forward_pre_hooks_set_aside",
                                                          collections.OrderedDict())


@torch.compiler.disable
def restore_forward_pre_hooks(module: torch.nn.Module, own_hooks: dict) -> None:
    """``module``'s own table (``own_hooks``, as :func:`own_forward_pre_hooks` read it before
    :func:`set_aside_forward_pre_hooks`) back, with any pre-hook registered in the meantime."""
    own_hooks.update(module._forward_pre_hooks)
    module._forward_pre_hooks.clear()
    module._forward_pre_hooks = own_hooks


def has_backward_hooks(module: torch.nn.Module) -> bool:
    """Whether a call of ``module`` would run backward hooks or backward pre-hooks (its own or
    global ones)."""
    return bool(module._backward_hooks or module._backward_pre_hooks
                or _hook_tables._global_backward_hooks
                or _hook_tables._global_backward_pre_hooks)


def has_forward_pre_hooks(module: torch.nn.Module) -> bool:
    """Whether a call of ``module`` would run forward pre-hooks (its own or global ones)."""
    return bool(module._forward_pre_hooks or _hook_tables._global_forward_pre_hooks)


def has_forward_hooks(module: torch.nn.Module) -> bool:
    """Whether a call of ``module`` would run forward pre-hooks or forward hooks (its own or
    global ones)."""
    return (has_forward_pre_hooks(module)
            or bool(module._forward_hooks or _hook_tables._global_forward_hooks))
