"""core.ssm.tp_grad_reduction: scale_grad is one autograd node that scales a gradient,
parameters_read_as has a module read its parameters through such nodes (every way a norm reads
them), megatron_tp_grad_reduction reads megatron's own reduction rule by a dry run of its TP step
and refuses a finalize_model_grads it cannot read (its private names: test_private_names.py)."""

import importlib

import pytest
import torch

from core.ssm.tp_grad_reduction import (
    TP_AVG_TAG,
    megatron_tp_grad_reduction,
    parameters_read_as,
    registered_parameter,
    scale_grad,
)
from core.testing.gdn import gdn_config
from core.testing.gdn_tp import megatron_summing_out_norm_grad
from core.transformer import RMSNorm

pytestmark = [pytest.mark.cpu_shims, pytest.mark.usefixtures("model_parallel_tp1")]



def test_scale_grad_is_identity_forward_and_scales_the_backward():
    weight = torch.nn.Parameter(torch.randn(8))
    assert scale_grad(weight, 1.0) is weight  # TP 1: nothing is added to the graph
    scaled = scale_grad(weight, 4.0)
    assert torch.equal(scaled, weight) and scaled.data_ptr() == weight.data_ptr()
    upstream = torch.randn(8)
    scaled.backward(upstream)
    assert torch.equal(weight.grad, 4.0 * upstream)
    assert not weight._backward_hooks and not vars(weight)


class _WeightThroughFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return dy * weight, (dy * x).sum(0)


class _FuserStyleNorm(torch.nn.Module):
    """Hands ``self.parameters()`` to its own autograd Function and returns the weight's
    gradient through it, as Transformer Engine 2.x's op fuser does for te.pytorch.RMSNorm
    (megatron's TENorm)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return _WeightThroughFunction.apply(x, *self.parameters())


def _rms_norm(dim):
    norm = RMSNorm(gdn_config(params_dtype=torch.float32), hidden_size=dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    return norm


def _layer_norm(dim):
    norm = torch.nn.LayerNorm(dim)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
        norm.bias.copy_(torch.randn(dim))
    return norm


@pytest.mark.parametrize("make_norm", [_rms_norm, _FuserStyleNorm, _layer_norm],
                         ids=["attribute", "parameters", "weight-and-bias"])
def test_parameters_read_as_scales_each_gradient_once(make_norm):
    norm = make_norm(16)
    params = dict(norm.named_parameters())
    x = torch.randn(6, 16, requires_grad=True)
    dy = torch.randn(6, 16)
    y_ref = norm(x)
    y_ref.backward(dy)
    ref = {name: p.grad.clone() for name, p in params.items()}
    dx_ref = x.grad.clone()
    norm.zero_grad(set_to_none=True)
    x.grad = None
    scales = {name: 2.0 ** (i + 1) for i, name in enumerate(params)}  # weight 2, bias 4
    with parameters_read_as(norm, {n: scale_grad(p, scales[n]) for n, p in params.items()}):
        y = norm(x)
    assert dict(norm.named_parameters()) == params  # the parameters are back
    y.backward(dy)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, dx_ref)
    for name, param in params.items():
        assert torch.equal(param.grad, scales[name] * ref[name]), name
    with pytest.raises(RuntimeError, match="inside"), parameters_read_as(
            norm, {n: scale_grad(p, 2.0) for n, p in params.items()}):
        raise RuntimeError("inside")
    assert all(norm._parameters[name] is param for name, param in params.items())


def test_registered_parameter_reads_the_slot():
    norm = _layer_norm(4)
    assert registered_parameter(norm, "weight") is norm.weight
    assert registered_parameter(norm, "no_such_parameter") is None
    norm.bias = None  # an empty slot
    assert registered_parameter(norm, "bias") is None


class _TPGroupOfTwo:
    """What megatron's TP step reads of the group before it communicates."""

    def size(self):
        return 2


def _weight(**tags):
    weight = torch.nn.Parameter(torch.ones(4))
    for name, value in tags.items():
        setattr(weight, name, value)
    return weight


def test_megatron_tp_grad_reduction_reads_megatrons_rule():
    sp_off = gdn_config(tensor_model_parallel_size=2)
    sp_on = gdn_config(tensor_model_parallel_size=2, sequence_parallel=True)
    group = _TPGroupOfTwo()
    # megatron-core 0.19: the norm's sequence_parallel tag is summed only with SP on.
    assert megatron_tp_grad_reduction(_weight(sequence_parallel=False), sp_off, group) is None
    assert megatron_tp_grad_reduction(_weight(sequence_parallel=True), sp_on, group) == "sum"
    assert megatron_tp_grad_reduction(_weight(**{TP_AVG_TAG: True}), sp_off, group) == "avg"
    weight = _weight(sequence_parallel=True)
    megatron_tp_grad_reduction(weight, sp_on, group)
    assert vars(weight) == {"sequence_parallel": True}  # dry run: nothing added or changed
    assert torch.equal(weight, torch.ones(4)) and weight.grad is None
    with megatron_summing_out_norm_grad():
        assert megatron_tp_grad_reduction(_weight(sequence_parallel=False), sp_off, group) == "sum"
        assert megatron_tp_grad_reduction(_weight(), sp_off, group, name="linear.weight") is None


def _finalize_without_the_tp_step(finalize, monkeypatch):
    monkeypatch.delattr(finalize, "_allreduce_non_tensor_model_parallel_grads")


def _finalize_whose_tp_step_takes_other_arguments(finalize, monkeypatch):
    monkeypatch.setattr(finalize, "_allreduce_non_tensor_model_parallel_grads",
                        lambda model, config, tp_group, dp_group: None)


@pytest.mark.parametrize("change", [_finalize_without_the_tp_step,
                                    _finalize_whose_tp_step_takes_other_arguments],
                         ids=["missing", "other-signature"])
def test_megatron_tp_grad_reduction_refuses_an_unknown_finalize(change, monkeypatch):
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    change(finalize, monkeypatch)
    with pytest.raises(RuntimeError,
                       match="cannot tell how this megatron-core's finalize_model_grads"):
        megatron_tp_grad_reduction(_weight(), gdn_config(tensor_model_parallel_size=2),
                                   _TPGroupOfTwo())
