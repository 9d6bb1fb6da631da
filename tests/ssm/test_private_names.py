"""Every private name a module of core.ssm declares in its ``PRIVATE_NAMES`` is still where the
installed torch and megatron-core keep it; and the check finds such names (a module attribute,
an instance attribute a class annotates or sets) and names the release and the relying module
for one that moved."""

import importlib
import importlib.metadata
import pkgutil

import pytest

import core.ssm
from core.ssm import module_hooks
from core.ssm.private_names import PrivateName

from tests.ssm.private_name_checks import private_name_problem

TORCH = f"torch {importlib.metadata.version('torch')}"
MEGATRON = f"megatron-core {importlib.metadata.version('megatron-core')}"
FSDP_BUFFER = ("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer."
               "ParamAndGradBuffer")


def declared_private_names() -> list:
    """(module, name) for every name each module of core.ssm lists in its PRIVATE_NAMES."""
    modules = [importlib.import_module(f"core.ssm.{info.name}")
               for info in pkgutil.iter_modules(core.ssm.__path__)]
    return [(module, private) for module in modules
            for private in getattr(module, "PRIVATE_NAMES", ())]


DECLARED = declared_private_names()


def test_the_plumbing_modules_declare_their_private_names():
    declaring = {module.__name__ for module, _ in DECLARED}
    assert {"core.ssm.module_hooks", "core.ssm.tp_grad_reduction",
            "core.ssm.fsdp_tags"} <= declaring


@pytest.mark.parametrize("module, private", DECLARED,
                         ids=[f"{m.__name__.rpartition('.')[2]}:{p}" for m, p in DECLARED])
def test_torch_and_megatron_still_have_each_declared_private_name(module, private):
    problem = private_name_problem(private, module)
    assert problem is None, problem


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
