"""out_norm's forward pre-hooks run before its weight is read, on every path of
GatedDeltaNet._apply_gated_norm: the fused one never calls out_norm, and the scaled unfused one
swaps its weight slot. Megatron's DDP with ``overlap_param_gather`` waits for a parameter's
all-gather in such a hook; skipping it would let the norm read a stale weight. The same holds
for conv1d, whose weight megatron's forward reads without calling conv1d (flag on and off). The
hook runners themselves are tested in test_module_hooks.py."""

import pytest
import torch

from core.testing.cpu import cpu_tensor_types
from core.testing.gdn import build_gdn_module, gdn_config, set_out_norm_grad_scale
from tests.gated_norm_inputs import make_inputs

pytestmark = [pytest.mark.cpu_shims, pytest.mark.usefixtures("model_parallel_tp1")]

PATHS = [(False, 1.0), (False, 2.0), (True, 1.0), (True, 2.0)]
PATH_IDS = ["unfused", "unfused-scaled", "fused", "fused-scaled"]


def _inputs():
    return make_inputs((2, 3, 4, 16), seed=3)[:2]


@pytest.mark.parametrize("fused,scale", PATHS, ids=PATH_IDS)
def test_out_norm_hooks_run_once_with_megatrons_input(fused, scale):
    """As megatron's call ``out_norm(x.reshape(-1, D))`` runs them: each pre-hook and forward
    hook once per forward, on the [tokens * heads, D] input."""
    module = build_gdn_module(gdn_config(fused_gated_norm=fused))
    set_out_norm_grad_scale(module, scale)
    calls = []
    module.out_norm.register_forward_pre_hook(lambda m, args: calls.append(("pre", args[0].shape)))
    module.out_norm.register_forward_hook(
        lambda m, args, out: calls.append(("post", args[0].shape)))
    x, gate = _inputs()
    module._apply_gated_norm(x, gate)
    rows = (x.numel() // x.shape[-1], x.shape[-1])
    assert calls == [("pre", rows), ("post", rows)]


@pytest.mark.parametrize("fused,scale", PATHS, ids=PATH_IDS)
def test_a_hook_may_remove_itself_as_in_a_module_call(fused, scale):
    """A one-shot pre-hook (it removes its own handle) runs on the first forward only and the
    hooks after it still run, as torch's module call iterates a snapshot of the table."""
    module = build_gdn_module(gdn_config(fused_gated_norm=fused))
    set_out_norm_grad_scale(module, scale)
    calls = []

    def once(m, args):
        calls.append("once")
        handle.remove()

    handle = module.out_norm.register_forward_pre_hook(once)
    module.out_norm.register_forward_pre_hook(lambda m, args: calls.append("every"))
    x, gate = _inputs()
    module._apply_gated_norm(x, gate)
    module._apply_gated_norm(x, gate)
    assert calls == ["once", "every", "every"]


@pytest.mark.parametrize("fused,scale", PATHS, ids=PATH_IDS)
def test_module_compiled_whole_with_out_norm_hooks(fused, scale):
    """torch.compile of the whole GDN module, out_norm holding a pre-hook and a forward hook and
    conv1d a pre-hook (megatron's DDP with overlap_param_gather registers pre-hooks on every
    module): the hooks run once per call and the output and gradient equal the eager module's.
    The gated delta rule runs outside the graphs (a graph break between the conv1d and the
    norm): on the CPU it is megatron's torch chunk rule, whose 63-step Python loop would be most
    of the traced graph and of the test's time."""
    module = build_gdn_module(gdn_config(fused_gated_norm=fused, params_dtype=torch.float32))
    module.gated_delta_rule = torch.compiler.disable(module.gated_delta_rule)
    set_out_norm_grad_scale(module, scale)
    calls = []
    module.out_norm.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    module.out_norm.register_forward_hook(lambda m, args, out: calls.append("post"))
    module.conv1d.register_forward_pre_hook(lambda m, args: calls.append("conv1d"))
    x = torch.randn(8, 2, module.config.hidden_size, generator=torch.Generator().manual_seed(0))
    graph_inputs = []

    def backend(graph, example_inputs):  # aot_eager, recording what each graph reads
        graph_inputs.extend(n.name for n in graph.graph.nodes if n.op == "placeholder")
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

    results = []
    torch._dynamo.reset()  # a fresh cache: past its recompile limit dynamo would run eagerly
    for run in (module, torch.compile(module, backend=backend)):
        leaf = x.clone().requires_grad_()
        out, _ = run(leaf, None)
        out.sum().backward()
        results.append((out.detach(), leaf.grad))
    assert calls == ["conv1d", "pre", "post"] * 2
    # the norm ran compiled: a graph read out_norm's weight (as the module's or the norm's)
    assert any("norm_parameters_weight" in name for name in graph_inputs), graph_inputs
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 2.0], ids=["unfused", "unfused-scaled"])
def test_unfused_paths_apply_a_replaced_input_once(scale):
    """The hook shifts the input (a scale would cancel in the norm): the result is the norm of
    x + 1, not of x (hook dropped) or of x + 2 (applied twice)."""
    module = build_gdn_module(gdn_config(fused_gated_norm=False))
    set_out_norm_grad_scale(module, scale)
    x, gate = _inputs()
    results = {shift: module._apply_gated_norm(x + shift, gate) for shift in (0, 1, 2)}
    assert not torch.equal(results[1], results[0]) and not torch.equal(results[1], results[2])
    module.out_norm.register_forward_pre_hook(lambda m, args: (args[0] + 1,))
    assert torch.equal(module._apply_gated_norm(x, gate), results[1])


@pytest.mark.parametrize("scale", [1.0, 2.0], ids=["fused", "fused-scaled"])
def test_fused_path_refuses_hooks_it_cannot_honour(scale):
    module = build_gdn_module(gdn_config(fused_gated_norm=True))
    set_out_norm_grad_scale(module, scale)
    x, gate = _inputs()
    handle = module.out_norm.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    with pytest.raises(RuntimeError, match="replaces the norm's input"):
        module._apply_gated_norm(x, gate)
    handle.remove()
    handle = module.out_norm.register_forward_hook(lambda m, args, out: out.flatten())
    with pytest.raises(RuntimeError, match="in place of the fused output"):
        module._apply_gated_norm(x, gate)
    handle.remove()
    nn_module = torch.nn.modules.module
    for register in (module.out_norm.register_full_backward_hook,
                     module.out_norm.register_full_backward_pre_hook,
                     nn_module.register_module_full_backward_hook,  # global: every module's
                     nn_module.register_module_full_backward_pre_hook):
        handle = register(lambda *args: None)
        try:
            with pytest.raises(RuntimeError, match="has backward hooks"):
                module._apply_gated_norm(x, gate)
        finally:
            handle.remove()
    module._apply_gated_norm(x, gate)


@pytest.mark.parametrize("scale", [1.0, 2.0], ids=["fused", "fused-scaled"])
def test_fused_output_carries_a_forward_hooks_pre_backward_hook(scale):
    """Megatron-FSDP's fine-grained pre-backward unshard: a forward hook of out_norm hands back a
    view of the output with a gradient hook on it, which must fire before the norm's backward
    reads the weight."""
    module = build_gdn_module(gdn_config(fused_gated_norm=True))
    set_out_norm_grad_scale(module, scale)
    events = []

    def forward_hook(m, args, out):
        view = out.view_as(out)
        torch.autograd.graph.register_multi_grad_hook(
            [view], lambda grads: events.append("unshard"), mode="any")
        return view

    module.out_norm.register_forward_hook(forward_hook)
    weight = module.out_norm.weight
    weight.register_post_accumulate_grad_hook(lambda p: events.append("weight grad"))
    x, gate = (t.requires_grad_() for t in _inputs())
    module._apply_gated_norm(x, gate).float().sum().backward()
    assert events == ["unshard", "weight grad"]


@pytest.mark.parametrize("fused,scale", PATHS, ids=PATH_IDS)
def test_out_norm_hooks_see_the_weight_parameter(fused, scale):
    module = build_gdn_module(gdn_config(fused_gated_norm=fused))
    set_out_norm_grad_scale(module, scale)
    weight = module.out_norm.weight
    seen = []
    module.out_norm.register_forward_pre_hook(
        lambda m, args: seen.append(any(p is weight for p in m.parameters(recurse=False))))
    module._apply_gated_norm(*_inputs())
    assert any(seen), "no pre-hook of out_norm ran with its weight parameter in place"


@pytest.mark.parametrize("fused,scale", PATHS, ids=PATH_IDS)
def test_megatron_ddp_waits_for_the_out_norm_weight_all_gather(fused, scale):
    """megatron's DDP with the distributed optimizer and ``overlap_param_gather``: running the
    norm finishes the parameter sync of out_norm.weight's bucket group."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    module = build_gdn_module(gdn_config(fused_gated_norm=fused))
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               overlap_param_gather=True)
    with cpu_tensor_types():  # megatron checks param.type() against CUDA type names
        ddp = DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)
    set_out_norm_grad_scale(ddp.module, scale)
    group = ddp.param_to_bucket_group[ddp.module.out_norm.weight]
    finished = []
    finish = group.finish_param_sync
    group.finish_param_sync = lambda *args, **kwargs: finished.append(1) or finish(*args, **kwargs)
    ddp.module._apply_gated_norm(*_inputs())
    assert finished, "out_norm.weight was read without waiting for its all-gather"


# ----------------------------------------------------------------------------------------------
# conv1d: megatron's forward reads its weight without calling it
# ----------------------------------------------------------------------------------------------


def _layer_input(module, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 2, module.config.hidden_size, generator=gen).to(
        module.config.params_dtype)


def _record_convolutions(monkeypatch, deterministic: bool, events: list) -> None:
    """Append "convolution" to ``events`` whenever megatron's GDN forward convolves: F.conv1d in
    deterministic_mode, else FLA's causal_conv1d (on the CPU its stand-in)."""
    import megatron.core.ssm.gated_delta_net.gdn as gdn

    owner, name = (torch.nn.functional, "conv1d") if deterministic else (gdn, "causal_conv1d")
    convolve = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: events.append("convolution")
                        or convolve(*args, **kwargs))


@pytest.mark.parametrize("deterministic", [True, False], ids=["torch_conv", "fla_conv"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_conv1d_pre_hooks_run_after_in_proj_before_the_convolution(fused, deterministic,
                                                                   monkeypatch):
    """Each forward runs conv1d's pre-hooks once, given in_proj's output, between in_proj's
    return and the convolution (either of megatron's convolutions); the hook it adds to in_proj
    for that is gone afterwards."""
    module = build_gdn_module(gdn_config(fused_gated_norm=fused, deterministic_mode=deterministic))
    events = []
    _record_convolutions(monkeypatch, deterministic, events)
    module.in_proj.register_forward_hook(lambda m, args, out: events.append(("in_proj", out[0])))
    module.conv1d.register_forward_pre_hook(lambda m, args: events.append(("pre", args[0])))
    for _ in range(2):
        events.clear()
        module(_layer_input(module), None)
        assert [e if isinstance(e, str) else e[0] for e in events] == [
            "in_proj", "pre", "convolution"]
        assert events[1][1] is events[0][1]
    assert len(module.in_proj._forward_hooks) == 1  # only the test's own


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_conv1d_global_pre_hooks_run(fused):
    module = build_gdn_module(gdn_config(fused_gated_norm=fused))
    seen = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, args: seen.append(m))
    try:
        module(_layer_input(module), None)
    finally:
        handle.remove()
    assert sum(m is module.conv1d for m in seen) == 1


def test_conv1d_pre_hook_that_replaces_the_input_is_refused():
    module = build_gdn_module(gdn_config(fused_gated_norm=True))
    module.conv1d.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    with pytest.raises(RuntimeError, match="pre-hook of conv1d replaces its input"):
        module(_layer_input(module), None)
    assert not module.in_proj._forward_hooks


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_megatron_ddp_waits_for_the_conv1d_weight_all_gather(fused):
    """megatron's DDP with the distributed optimizer, ``overlap_param_gather`` and one bucket per
    parameter: the forward finishes conv1d.weight's parameter sync, which no module call of
    megatron's forward would, before the convolution reads the weight."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    module = build_gdn_module(gdn_config(fused_gated_norm=fused))
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               overlap_grad_reduce=True,
                                               overlap_param_gather=True, bucket_size=1)
    with cpu_tensor_types():
        ddp = DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)
    inner = ddp.module
    conv_group = ddp.param_to_bucket_group[inner.conv1d.weight]
    others = [p for n, p in inner.named_parameters() if not n.startswith("conv1d.")]
    assert all(ddp.param_to_bucket_group[p] is not conv_group for p in others)
    events = []
    finish = conv_group.finish_param_sync
    conv_group.finish_param_sync = (
        lambda *args, **kwargs: events.append("conv1d synced") or finish(*args, **kwargs))
    with pytest.MonkeyPatch.context() as patch:
        _record_convolutions(patch, inner.config.deterministic_mode, events)
        ddp(_layer_input(inner), None)
    assert events == ["conv1d synced", "convolution"]
