"""The tensor-parallel handling of the GDN out_norm gradients by the layer, in one process: the
scaling lives in the autograd graph (the unfused norm reads its parameters through scale_grad,
the fused kernel takes weight_grad_scale), the parameters carry no hook and no Python object,
each reduction megatron may apply is completed to the sum, a replaced weight without its tag is
refused, and the tag reaches Megatron-FSDP's distributed copy. The pieces themselves are tested
in test_tp_grad_reduction.py and test_fsdp_tags.py; the multi-rank checks (gloo, TP 2 and 4) are
in test_gdn_tensor_parallel.py."""

from types import SimpleNamespace

import pytest
import torch

from core.ssm.tp_grad_reduction import TP_AVG_TAG
from core.testing.gdn import (build_gdn_module, gdn_config, randomize_norm_weights,
                              set_out_norm_grad_scale)
from core.transformer import RMSNorm

from tests.gated_norm_inputs import make_grad_inputs

pytestmark = [pytest.mark.cpu_shims, pytest.mark.usefixtures("model_parallel_tp1")]


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


def test_replaced_weight_without_tp_tag_raises():
    module = build_gdn_module(gdn_config(fused_gated_norm=True))
    x, gate = torch.randn(2, 3, 4, 16).bfloat16(), torch.randn(2, 3, 4, 16).bfloat16()
    module.out_norm_grad_scales = {"weight": 2.0}  # a TP 2 rank whose partial dW megatron leaves
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
    module.out_norm_grad_scales = {"weight": 2.0}  # a TP 2 rank whose partial dW megatron leaves
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
    module.out_norm_grad_scales = {"weight": 2.0}  # a TP 2 rank whose partial dW megatron leaves
    setattr(weight, TP_AVG_TAG, True)
    dist_weight = torch.nn.Parameter(weight.detach()[:8])
    dist_other = torch.nn.Parameter(torch.ones(2))
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
