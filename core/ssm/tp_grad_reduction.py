"""Completing the tensor-parallel reduction of a replicated parameter's gradient.

Each TP rank's gradient of the GDN output norm's parameters covers only that rank's heads: the
whole gradient is the SUM of the per-rank partials. :func:`megatron_tp_grad_reduction` reads
how megatron-core's ``finalize_model_grads`` reduces a parameter over TP (by a dry run of its TP
step). Where it AVG-reduces the parameter, or leaves it unreduced (the parameter is then tagged
``TP_AVG_TAG`` for the AVG), :func:`scale_grad` multiplies the partial by the TP size inside the
autograd graph, so that the AVG is the SUM; :func:`parameters_read_as` has a module read its
parameters through that scaling. docs/design.md ("The Megatron module") has the whole
scheme."""

import contextlib
import importlib
from typing import Iterator, Optional

import torch

from core.ssm.private_names import PrivateName

# The tag megatron's finalize_model_grads AVG-reduces over TP, sequence parallelism on or off.
TP_AVG_TAG = "average_gradients_across_tp_domain"

# What this module reads outside torch's and megatron-core's public API (checked by
# tests/ssm/test_tp_grad_reduction.py).
PRIVATE_NAMES = (
    PrivateName("torch", "torch.nn.Module", "_parameters"),
    PrivateName("megatron-core", "megatron.core.distributed.finalize_model_grads",
                "_allreduce_non_tensor_model_parallel_grads"),
)


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


def registered_parameter(module: torch.nn.Module, name: str) -> Optional[torch.nn.Parameter]:
    """What ``module``'s parameter slot ``name`` holds (None: no such slot, or an empty one):
    what ``module.parameters()`` yields, whatever else the attribute ``name`` may resolve to."""
    return module._parameters.get(name)


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
            raise AttributeError(
                "finalize_model_grads has no _allreduce_non_tensor_model_parallel_grads")
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
