"""The check that tests/ssm applies to every private name a module of core.ssm declares: it finds
the names where torch and megatron-core keep them (a module attribute, an instance attribute a
class annotates or sets) and names the release and the relying module for one that moved."""

import importlib.metadata

import pytest

from core.ssm import module_hooks
from core.ssm.private_names import PrivateName

from tests.ssm.private_name_checks import private_name_problem

TORCH = f"torch {importlib.metadata.version('torch')}"
MEGATRON = f"megatron-core {importlib.metadata.version('megatron-core')}"
FSDP_BUFFER = ("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer."
               "ParamAndGradBuffer")


@pytest.mark.parametrize("private", [
    PrivateName("torch", "torch.nn.modules.module", "_global_forward_hooks"),  # module attribute
    PrivateName("torch", "torch.nn.Module", "_forward_hooks"),  # annotated for instances
    PrivateName("megatron-core", FSDP_BUFFER, "optimizer_named_parameters"),  # self.x = ...
    PrivateName("megatron-core", FSDP_BUFFER, "orig_param"),  # setattr(param, "orig_param", ...)
], ids=str)
def test_a_name_still_there_passes(private):
    assert private_name_problem(private, module_hooks) is None


@pytest.mark.parametrize("private, message", [
    (PrivateName("torch", "torch.nn.modules.module", "_global_forward_hooks_gone"),
     f"{TORCH} no longer has torch.nn.modules.module._global_forward_hooks_gone; "
     "core/ssm/module_hooks.py relies on it"),
    (PrivateName("torch", "torch.nn.Module", "_forward_hooks_gone"),
     f"{TORCH} no longer has torch.nn.Module._forward_hooks_gone; "
     "core/ssm/module_hooks.py relies on it"),
    (PrivateName("megatron-core", FSDP_BUFFER, "orig_param_gone"),
     f"{MEGATRON} no longer has {FSDP_BUFFER}.orig_param_gone; "
     "core/ssm/module_hooks.py relies on it"),
    (PrivateName("torch", "torch.distributed._gone_module", "_module_state_mapping"),
     f"{TORCH} no longer has torch.distributed._gone_module (for _module_state_mapping); "
     "core/ssm/module_hooks.py relies on it"),
    (PrivateName("torch", "torch.nn.GoneClass", "_parameters"),
     f"{TORCH} no longer has torch.nn.GoneClass (for _parameters); "
     "core/ssm/module_hooks.py relies on it"),
], ids=["module-attribute", "instance-attribute", "set-in-source", "module", "class"])
def test_a_moved_name_is_reported_with_the_release_and_the_module(private, message):
    assert private_name_problem(private, module_hooks) == message
