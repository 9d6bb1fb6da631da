"""out_norm's forward pre-hooks run before its weight is read, on every path of
GatedDeltaNet._apply_gated_norm: the fused one never calls out_norm, and the scaled unfused one
swaps its weight slot. Megatron's DDP with ``overlap_param_gather`` waits for a parameter's
all-gather in such a hook; skipping it would let the norm read a stale weight."""

from core.testing.cpu import cpu_tensor_types, init_cpu_model_parallel, install_cpu_shims

install_cpu_shims()

import pytest  # noqa: E402
import torch  # noqa: E402

from core.ssm.gated_delta_net import TP_AVG_TAG, run_forward_pre_hooks  # noqa: E402
from core.testing.gdn import build_gdn_module, gdn_config  # noqa: E402

PATHS = [(False, 1.0), (False, 2.0), (True, 1.0), (True, 2.0)]
PATH_IDS = ["unfused", "unfused-scaled", "fused", "fused-scaled"]


@pytest.fixture(scope="module", autouse=True)
def _model_parallel():
    init_cpu_model_parallel(tp_size=1)


def _inputs():
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(2, 3, 4, 16, generator=gen).bfloat16(),
            torch.randn(2, 3, 4, 16, generator=gen).bfloat16())


def _set_scale(module, scale):
    """As on a TP rank whose partial dW megatron leaves unreduced (scale 2) or TP 1 (scale 1)."""
    module.out_norm_weight_grad_scale = scale
    setattr(module.out_norm.weight, TP_AVG_TAG, scale != 1.0)


def test_hooks_run_in_order_with_the_arguments():
    module = torch.nn.Linear(2, 2)
    x = torch.randn(2)
    seen = []
    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, args: seen.append(("global", m, args))),
        module.register_forward_pre_hook(lambda m, args: seen.append(("plain", m, args))),
        module.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(("kwargs", m, args)) or (args, kwargs),
            with_kwargs=True),
        module.register_forward_pre_hook(lambda m, args: args),  # hands the same input back
    ]
    try:
        run_forward_pre_hooks(module, (x,))
    finally:
        for handle in handles:
            handle.remove()
    assert [name for name, _, _ in seen] == ["global", "plain", "kwargs"]
    assert all(m is module and args[0] is x for _, m, args in seen)


@pytest.mark.parametrize("with_kwargs", [False, True], ids=["plain", "with_kwargs"])
def test_a_hook_that_replaces_the_input_is_refused(with_kwargs):
    module = torch.nn.Linear(2, 2)
    if with_kwargs:
        module.register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 2,), kwargs),
                                         with_kwargs=True)
    else:
        module.register_forward_pre_hook(lambda m, args: args[0] * 2)
    with pytest.raises(RuntimeError, match="replaces the norm's input"):
        run_forward_pre_hooks(module, (torch.randn(2),))


@pytest.mark.parametrize("fused,scale", PATHS, ids=PATH_IDS)
def test_out_norm_hooks_see_the_weight_parameter(fused, scale):
    module = build_gdn_module(gdn_config(fused_gated_norm=fused))
    _set_scale(module, scale)
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
    _set_scale(ddp.module, scale)
    group = ddp.param_to_bucket_group[ddp.module.out_norm.weight]
    finished = []
    finish = group.finish_param_sync
    group.finish_param_sync = lambda *args, **kwargs: finished.append(1) or finish(*args, **kwargs)
    ddp.module._apply_gated_norm(*_inputs())
    assert finished, "out_norm.weight was read without waiting for its all-gather"
