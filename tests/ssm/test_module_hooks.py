"""core.ssm.module_hooks: a module's hooks run as a call of the module would run them (order,
arguments, replaced inputs and outputs), its pre-hooks set aside and restored, the hook-presence
tests (its private names: test_private_names.py). The layer's use of them is in
test_gdn_out_norm_hooks.py."""

import pytest
import torch

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

nn_module = torch.nn.modules.module



def test_hooks_run_in_order_with_the_arguments():
    module = torch.nn.Linear(2, 2)
    x = torch.randn(2)
    seen = []
    handles = [
        nn_module.register_module_forward_pre_hook(
            lambda m, args: seen.append(("global", m, args))),
        module.register_forward_pre_hook(lambda m, args: seen.append(("plain", m, args))),
        module.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(("kwargs", m, args)) or (args, kwargs),
            with_kwargs=True),
        module.register_forward_pre_hook(lambda m, args: args),  # hands the same input back
    ]
    try:
        run_forward_pre_hooks(module, (x,))
        seen_without_global = len(seen)
        run_forward_pre_hooks(module, (x,), global_hooks=False)
    finally:
        for handle in handles:
            handle.remove()
    assert [name for name, _, _ in seen[:seen_without_global]] == ["global", "plain", "kwargs"]
    assert [name for name, _, _ in seen[seen_without_global:]] == ["plain", "kwargs"]
    assert all(m is module and args[0] is x for _, m, args in seen)


@pytest.mark.parametrize("with_kwargs", [False, True], ids=["plain", "with_kwargs"])
def test_a_hook_may_replace_the_input(with_kwargs):
    module = torch.nn.Linear(2, 2)
    if with_kwargs:
        module.register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 2,), kwargs),
                                         with_kwargs=True)
    else:
        module.register_forward_pre_hook(lambda m, args: args[0] * 2)
    x = torch.randn(2)
    (replaced,) = run_forward_pre_hooks(module, (x,))
    assert torch.equal(replaced, x * 2)
    with pytest.raises(RuntimeError, match="nowhere to pass it"):
        run_forward_pre_hooks_on(module, x, "nowhere to pass it")


def test_forward_hooks_run_in_order_and_may_replace_the_output():
    module = torch.nn.Linear(2, 2)
    x, out = torch.randn(2), torch.randn(2)
    seen = []
    handles = [
        nn_module.register_module_forward_hook(
            lambda m, args, output: seen.append(("global", output))),
        nn_module.register_module_forward_hook(
            lambda m, args, kwargs, output: seen.append(("global_kwargs", output)),
            with_kwargs=True),
        module.register_forward_hook(lambda m, args, output: seen.append(("plain", output))),
        module.register_forward_hook(lambda m, args, kwargs, output: output * 3, with_kwargs=True),
        module.register_forward_hook(lambda m, args, output: seen.append(("last", output))),
    ]
    try:
        result = run_forward_hooks(module, (x,), out)
    finally:
        for handle in handles:
            handle.remove()
    assert [name for name, _ in seen] == ["global", "global_kwargs", "plain", "last"]
    assert seen[0][1] is out and torch.equal(seen[3][1], out * 3) and seen[3][1] is result


def test_pre_hooks_set_aside_run_none_and_come_back_with_later_ones():
    """While set aside, a call of the module runs none of its own pre-hooks; restored, the
    table holds them and any registered meanwhile, in order."""
    owner, module = torch.nn.Module(), torch.nn.Linear(2, 2)
    calls = []
    module.register_forward_pre_hook(lambda m, args: calls.append("own"))
    own_hooks = own_forward_pre_hooks(module)
    set_aside_forward_pre_hooks(owner, module)
    module(torch.randn(2))
    assert calls == []
    module.register_forward_pre_hook(lambda m, args: calls.append("meanwhile"))
    restore_forward_pre_hooks(module, own_hooks)
    assert own_forward_pre_hooks(module) is own_hooks
    module(torch.randn(2))
    assert calls == ["own", "meanwhile"]


def test_hook_presence_counts_own_and_global_hooks():
    module = torch.nn.Linear(2, 2)
    assert not (has_forward_pre_hooks(module) or has_forward_hooks(module)
                or has_backward_hooks(module))
    for register, has in ((module.register_forward_pre_hook, has_forward_pre_hooks),
                          (nn_module.register_module_forward_pre_hook, has_forward_pre_hooks),
                          (module.register_forward_hook, has_forward_hooks),
                          (nn_module.register_module_forward_hook, has_forward_hooks),
                          (module.register_full_backward_hook, has_backward_hooks),
                          (module.register_full_backward_pre_hook, has_backward_hooks),
                          (nn_module.register_module_full_backward_hook, has_backward_hooks),
                          (nn_module.register_module_full_backward_pre_hook, has_backward_hooks)):
        handle = register(lambda *args: None)
        try:
            assert has(module), register
            if has is has_forward_pre_hooks:
                assert has_forward_hooks(module)  # a pre-hook is a forward hook to skip too
        finally:
            handle.remove()
        assert not has(module)
