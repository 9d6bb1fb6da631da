"""The tensor-parallel handling of the GDN out_norm gradients, in one process: the scaling lives
in the autograd graph (scale_grad, parameters_read_as, the kernel's weight_grad_scale), the
parameters carry no hook and no Python object, megatron's own reduction rule is read by a dry
run, and a replaced weight without its tag is refused. The multi-rank checks (gloo, TP 2 and 4)
are in test_gdn_tensor_parallel.py."""

import importlib
from types import SimpleNamespace

import pytest
import torch

from core.ssm.gated_delta_net import (
    TP_AVG_TAG,
    megatron_tp_grad_reduction,
    parameters_read_as,
    scale_grad,
)
from core.testing.gdn import (build_gdn_module, gdn_config, randomize_norm_weights,
                              set_out_norm_grad_scale)
from core.testing.gdn_tp import megatron_summing_out_norm_grad
from core.transformer import RMSNorm

from tests.gated_norm_inputs import make_grad_inputs

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


def _norm_grads(module, scale, dtype=torch.bfloat16):
    """out, dx, dgate, dW of module._apply_gated_norm with the given weight-gradient scale."""
    set_out_norm_grad_scale(module, scale)
    x, gate, _, dy, _ = make_grad_inputs((2, 3, 4, 16), dtype=dtype, seed=5, device="cpu")
    out = module._apply_gated_norm(x, gate)
    out.backward(dy.reshape(out.shape))  # megatron's unfused norm returns [tokens * heads, D]
    weight = module.out_norm.weight
    dw, weight.grad = weight.grad.clone(), None
    return out.detach(), x.grad, gate.grad, dw


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_module_scales_only_the_weight_gradient(fused):
    """The scale (tp_size at a rank whose partial dW megatron leaves unreduced) multiplies dW
    and nothing else: output, dx and dgate keep their bits; dW is exactly scale x (a power of
    two), in the unfused path through parameters_read_as, in the fused one inside the kernel."""
    module = build_gdn_module(gdn_config(fused_gated_norm=fused))
    randomize_norm_weights(module)
    out1, dx1, dg1, dw1 = _norm_grads(module, 1.0)
    out4, dx4, dg4, dw4 = _norm_grads(module, 4.0)
    assert torch.equal(out4, out1) and torch.equal(dx4, dx1) and torch.equal(dg4, dg1)
    assert torch.equal(dw4, 4.0 * dw1) and dw1.abs().max() > 0
    assert module.out_norm._parameters["weight"] is module.out_norm.weight
    assert not module.out_norm.weight._backward_hooks


def test_module_scales_a_layernorm_bias_gradient_too():
    """Flag off with a LayerNorm output norm: its bias gradient is a per-rank partial sum as the
    weight's is, and is scaled the same way; the output and the input gradients keep their
    bits."""
    module = build_gdn_module(gdn_config(fused_gated_norm=False, normalization="LayerNorm"))
    norm = module.out_norm
    assert set(dict(norm.named_parameters())) == {"weight", "bias"}
    with torch.no_grad():
        norm.bias.copy_(torch.randn(norm.bias.shape))
    grads = {}
    for scale in (1.0, 4.0):
        set_out_norm_grad_scale(module, scale)
        assert module.out_norm_grad_scales == {"weight": scale, "bias": scale}
        x, gate, _, dy, _ = make_grad_inputs((2, 3, 4, 16), dtype=torch.float32, seed=5,
                                             device="cpu")
        out = module._apply_gated_norm(x, gate)
        out.backward(dy.reshape(out.shape))
        grads[scale] = (out.detach(), x.grad, gate.grad, norm.weight.grad, norm.bias.grad)
        norm.zero_grad(set_to_none=True)
    (out1, dx1, dg1, dw1, db1), (out4, dx4, dg4, dw4, db4) = grads[1.0], grads[4.0]
    assert torch.equal(out4, out1) and torch.equal(dx4, dx1) and torch.equal(dg4, dg1)
    assert torch.equal(dw4, 4.0 * dw1) and torch.equal(db4, 4.0 * db1)
    assert db1.abs().max() > 0
    assert norm._parameters["bias"] is norm.bias and not norm.bias._backward_hooks


def test_unfused_scaling_under_megatrons_torch_compile(monkeypatch):
    """megatron's jit_fuser compiles _apply_gated_norm with torch.compile on the GPU: traced with
    the weight slot holding scale_grad's output, it scales dW, and a second call reuses the
    graph (no recompilation)."""
    import torch._dynamo

    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    module = build_gdn_module(gdn_config(fused_gated_norm=False))
    randomize_norm_weights(module)
    eager = _norm_grads(module, 4.0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(_GDNBase, "_apply_gated_norm",
                        torch.compile(_GDNBase._apply_gated_norm, backend="aot_eager"))
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    for _ in range(2):
        compiled = _norm_grads(module, 4.0)
        for got, expected in zip(compiled, eager):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # it was compiled
    torch._dynamo.reset()


def test_tp1_module_leaves_the_weight_untouched():
    for fused in (False, True):
        module = build_gdn_module(gdn_config(fused_gated_norm=fused))
        weight = module.out_norm.weight
        assert module.out_norm_weight_grad_scale == 1.0
        assert not weight._backward_hooks
        assert vars(weight) == {"sequence_parallel": False}  # RMSNorm's own tag, nothing more


class _TPGroupOfTwo:
    """What megatron's TP step reads of the group before it communicates."""

    def size(self):
        return 2


def _norm_of(params: dict) -> torch.nn.Module:
    """A module holding ``params`` (name -> Parameter) as its own parameters."""
    norm = torch.nn.Module()
    for name, param in params.items():
        norm.register_parameter(name, param)
    return norm


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


@pytest.mark.parametrize("tags,sequence_parallel,scale", [
    ({"sequence_parallel": False}, False, 2.0),  # megatron leaves it: tagged here, scaled
    ({"sequence_parallel": True}, True, 1.0),  # megatron sums the partials itself
    ({"sequence_parallel": False, TP_AVG_TAG: True}, False, 2.0),  # arrives tagged: AVG
], ids=["unreduced", "summed", "averaged"])
@pytest.mark.parametrize("names", [("weight",), ("weight", "bias")], ids=["rmsnorm", "layernorm"])
def test_module_completes_each_reduction_to_the_sum(tags, sequence_parallel, scale, names):
    """The gradient scale a TP 2 rank applies to each out_norm parameter (an RMSNorm's weight; a
    LayerNorm's weight and bias), for each way megatron's finalize may treat it: the reduced
    gradient is the SUM of the per-rank partials every time."""
    from core.ssm.gated_delta_net import GatedDeltaNet

    norm = _norm_of({name: _weight(**tags) for name in names})
    config = gdn_config(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
    rank = SimpleNamespace(out_norm=norm, tp_size=2, config=config,
                           pg_collection=SimpleNamespace(tp=_TPGroupOfTwo()))
    scales, summed_by_sp_tag = GatedDeltaNet._complete_out_norm_tp_reduction(rank)
    assert scales == {name: scale for name in names}
    assert summed_by_sp_tag == (set(names) if sequence_parallel else set())
    for param in norm.parameters():
        assert getattr(param, TP_AVG_TAG, False) is (scale != 1.0)


def test_module_refuses_a_reduction_it_cannot_complete(monkeypatch):
    import core.ssm.gated_delta_net as gdn

    monkeypatch.setattr(gdn, "megatron_tp_grad_reduction", lambda *args: "reduce_scatter")
    rank = SimpleNamespace(out_norm=_norm_of({"weight": _weight()}), tp_size=2,
                           config=gdn_config(tensor_model_parallel_size=2),
                           pg_collection=SimpleNamespace(tp=_TPGroupOfTwo()))
    with pytest.raises(RuntimeError, match="reduces out_norm.weight's tensor-parallel gradient "
                                           "with 'reduce_scatter'"):
        gdn.GatedDeltaNet._complete_out_norm_tp_reduction(rank)


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
    with pytest.raises(RuntimeError, match="cannot tell how this megatron-core's finalize_model_grads"):
        megatron_tp_grad_reduction(_weight(), gdn_config(tensor_model_parallel_size=2),
                                   _TPGroupOfTwo())


def test_replaced_weight_without_tp_tag_raises():
    module = build_gdn_module(gdn_config(fused_gated_norm=True))
    x, gate = torch.randn(2, 3, 4, 16).bfloat16(), torch.randn(2, 3, 4, 16).bfloat16()
    module.out_norm_grad_scales = {"weight": 2.0}  # as on a TP 2 rank whose partial dW megatron leaves
    setattr(module.out_norm.weight, TP_AVG_TAG, True)
    module._apply_gated_norm(x, gate)
    module.out_norm = RMSNorm(module.config, hidden_size=16, eps=1e-5)  # untagged weight
    with pytest.raises(RuntimeError, match=f"out_norm.weight lost its {TP_AVG_TAG} tag"):
        module._apply_gated_norm(x, gate)
    setattr(module.out_norm.weight, TP_AVG_TAG, True)
    module._apply_gated_norm(x, gate)
    module.out_norm_grad_scales = {"weight": 1.0}  # TP 1 / megatron reduces: any weight is fine
    module.out_norm = RMSNorm(module.config, hidden_size=16, eps=1e-5)
    module._apply_gated_norm(x, gate)
    module.out_norm_grad_scales = {"weight": 2.0}
    module.out_norm = torch.nn.Identity()  # no weight at all: validation's own error
    with pytest.raises(ValueError, match="out_norm to have a weight"):
        module._apply_gated_norm(x, gate)


def test_replaced_parameter_runs_where_no_gradient_flows():
    """load_state_dict(..., assign=True) drops the tags; where no gradient can flow (grad mode
    off, or a frozen weight) the replaced parameter needs none, so inference runs."""
    module = build_gdn_module(gdn_config(fused_gated_norm=True))
    x, gate = torch.randn(2, 3, 4, 16).bfloat16(), torch.randn(2, 3, 4, 16).bfloat16()
    module.out_norm_grad_scales = {"weight": 2.0}  # as on a TP 2 rank whose partial dW megatron leaves
    module.out_norm = RMSNorm(module.config, hidden_size=16, eps=1e-5)  # untagged weight
    with torch.no_grad():
        module._apply_gated_norm(x, gate)
    module.out_norm.weight.requires_grad_(False)
    module._apply_gated_norm(x, gate)
    module.out_norm.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=f"out_norm.weight lost its {TP_AVG_TAG} tag"):
        module._apply_gated_norm(x, gate)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_replaced_weight_without_its_sequence_parallel_tag_raises(fused):
    """With sequence parallelism megatron sums the out_norm gradient over TP for the weight's
    sequence_parallel tag, and the module adds nothing: a replacement weight without that tag
    would leave the gradient partial, and the next forward names it."""
    module = build_gdn_module(gdn_config(fused_gated_norm=fused))
    x, gate = torch.randn(2, 3, 4, 16).bfloat16(), torch.randn(2, 3, 4, 16).bfloat16()
    module._out_norm_summed_by_sp_tag = {"weight"}  # as on a TP 2 rank with SP
    module.out_norm.weight.sequence_parallel = True
    module._apply_gated_norm(x, gate)
    module.out_norm = RMSNorm(module.config, hidden_size=16, eps=1e-5)  # sequence_parallel False
    with pytest.raises(RuntimeError, match="out_norm.weight lost its sequence_parallel tag"):
        module._apply_gated_norm(x, gate)
    module.out_norm.weight.sequence_parallel = True
    module._apply_gated_norm(x, gate)


def test_tp_tag_reaches_megatron_fsdp_distributed_param():
    """Megatron-FSDP (it needs CUDA: the GPU case is tests/ssm/test_gdn_layouts_gpu.py) runs the
    forward on the module's own parameter, marked ``_megatron_fsdp_model``, and hands finalize
    its distributed copy, which keeps only a fixed list of attributes. The forward carries the
    TP tag over to that copy, found through ``orig_param``; other parameters are left alone."""
    module = build_gdn_module(gdn_config(fused_gated_norm=True))
    x, gate = torch.randn(2, 3, 4, 16).bfloat16(), torch.randn(2, 3, 4, 16).bfloat16()
    weight = module.out_norm.weight
    module.out_norm_grad_scales = {"weight": 2.0}  # as on a TP 2 rank whose partial dW megatron leaves
    setattr(weight, TP_AVG_TAG, True)
    dist_weight, dist_other = torch.nn.Parameter(weight.detach()[:8]), torch.nn.Parameter(torch.ones(2))
    dist_weight.orig_param, dist_other.orig_param = weight, torch.nn.Parameter(torch.ones(2))
    buffer = type("Buffer", (), {"optimizer_named_parameters": [
        ("decoder.other", dist_other), ("decoder.out_norm.weight", dist_weight)]})()
    weight._megatron_fsdp_model = type("FSDP", (), {"param_and_grad_buffer": buffer})()
    module._apply_gated_norm(x, gate)
    assert getattr(dist_weight, TP_AVG_TAG, False) is True
    assert not hasattr(dist_other, TP_AVG_TAG)

    # The copy is checked on every forward: a rebuilt buffer, a new wrapper (which may reuse the
    # old one's address) or a copy that lost the tag gets it again.
    def fsdp_copy(at_index):
        copy = torch.nn.Parameter(weight.detach()[:8])
        copy.orig_param = weight
        named = [("decoder.other", dist_other)] * at_index + [("decoder.out_norm.weight", copy)]
        return copy, type("Buffer", (), {"optimizer_named_parameters": named})()

    wrapper = weight._megatron_fsdp_model
    copy, wrapper.param_and_grad_buffer = fsdp_copy(at_index=0)  # rebuilt, the same wrapper
    module._apply_gated_norm(x, gate)
    assert getattr(copy, TP_AVG_TAG, False) is True
    copy, buffer = fsdp_copy(at_index=2)
    weight._megatron_fsdp_model = type("FSDP", (), {"param_and_grad_buffer": buffer})()
    module._apply_gated_norm(x, gate)
    assert getattr(copy, TP_AVG_TAG, False) is True
    delattr(copy, TP_AVG_TAG)
    module._apply_gated_norm(x, gate)
    assert getattr(copy, TP_AVG_TAG, False) is True
    assert not hasattr(dist_other, TP_AVG_TAG)


def test_megatron_fsdp_still_drops_the_tp_tag():
    """The layout the carrying above relies on, read from megatron-core's source: MegatronFSDP's
    forward swaps the module's own parameters in (marking them ``_megatron_fsdp_model``), and its
    distributed parameters keep ``orig_param`` and a fixed attribute list without the TP tag.
    When a megatron-core changes this, the test says so."""
    import inspect

    fsdp = importlib.import_module(
        "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp")
    buffers = importlib.import_module(
        "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer")
    assert "_replace_param_with_raw_if_needed" in inspect.getsource(fsdp.MegatronFSDP.forward)
    assert "_megatron_fsdp_model = self" in inspect.getsource(
        fsdp.MegatronFSDP._replace_param_with_raw_if_needed)
    source = inspect.getsource(buffers.ParamAndGradBuffer._init_optimizer_named_parameters)
    assert '"orig_param", orig_param' in source
    assert TP_AVG_TAG not in source  # if megatron copies it one day, the carrying is redundant
