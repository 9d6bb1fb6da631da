"""The checking stations and their one memo (core.fusions.gated_norm_checks): inputs whose
metadata passed pass again after one lookup, anything else goes through the rules; a call that
breaks a rule is never kept; the memo is bounded and takes no traced sizes; each call runs its
rules at one station, and no launch plan stands in for a check."""

from __future__ import annotations

import pytest
import torch

import core.fusions.gated_norm_checks as checks
import core.fusions.gated_norm_plans as plans
from core.fusions.fused_gated_norm import backward_impl, forward_impl, fused_gated_norm
from tests.gated_norm_inputs import EPS, make_inputs, packed_projection_gate, sbhd_view


def test_input_rules_run_again_for_any_other_metadata(monkeypatch):
    """fused_gated_norm's station passes inputs whose metadata equals that of inputs that passed
    without evaluating the rules again, under the same number; anything else (strides, a dtype,
    a device, the current device, eps or only eps's type) goes through them."""
    monkeypatch.setattr(checks, "_checked_signatures", {})
    evaluated = []
    rules = checks.check_gated_norm_tensors
    monkeypatch.setattr(checks, "check_gated_norm_tensors",
                        lambda *args, **kwargs: (evaluated.append(args[1:]),
                                                 rules(*args, **kwargs)))
    current = [None]
    monkeypatch.setattr(checks, "current_device", lambda: current[0])
    x, gate, weight = make_inputs((2, 3, 2, 64), torch.bfloat16)
    check = checks.check_gated_norm_inputs
    number = check(x, gate, weight, EPS)
    assert check(x.clone(), gate.clone(), weight.clone(), EPS) == number  # the same metadata
    assert len(evaluated) == 1
    others = [(sbhd_view(x), gate, weight, EPS),
              (x, packed_projection_gate(x.shape, x.dtype), weight, EPS),
              (x, gate, weight.float(), EPS),
              (x, gate, torch.nn.Parameter(weight), EPS),
              (x, gate, weight, 1),
              (x, gate, weight, 1.0)]
    numbers = {check(*args) for args in others}
    assert len(evaluated) == 1 + len(others) and len(numbers | {number}) == 1 + len(others)
    current[0] = 1  # as on a GPU after torch.cuda.set_device
    check(x, gate, weight, EPS)
    assert len(evaluated) == 2 + len(others)
    with pytest.raises(TypeError, match="eps must be a Python float or int, got bool"):
        check(x, gate, weight, True)  # True == 1, which passed
    with pytest.raises(ValueError, match="must be on one device"):
        check(x, gate.to("meta"), weight, EPS)


def test_input_rule_table_is_bounded(monkeypatch):
    monkeypatch.setattr(checks, "_checked_signatures", {})
    monkeypatch.setattr(checks, "MAX_CHECKED_SIGNATURES", 3)
    x, gate, weight = make_inputs((1, 6, 2, 32), torch.float32)
    for tokens in range(1, 7):
        checks.check_gated_norm_inputs(x[:, :tokens], gate[:, :tokens], weight, EPS)
        assert len(checks._checked_signatures) <= 3


def test_metadata_no_dict_takes_goes_through_the_rules(monkeypatch):
    """Symbolic sizes (make_fx's symbolic tracing) make a key no dict takes: the rules run and
    pass, and nothing is kept."""
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(checks, "_checked_signatures", {})
    x, gate, weight = make_inputs((2, 3, 2, 64), torch.float32)

    def check(x, gate, weight):
        checks.check_gated_norm_inputs(x, gate, weight, EPS)
        return x

    make_fx(check, tracing_mode="symbolic")(x, gate, weight)
    assert checks._checked_signatures == {}


def test_a_call_that_breaks_a_rule_is_not_kept_as_checked(monkeypatch):
    """The memo keeps a signature only after its rules passed: the same bad call is refused
    every time."""
    monkeypatch.setattr(checks, "_checked_signatures", {})
    x, gate, weight = make_inputs((1, 2, 2, 16), torch.bfloat16)
    for _ in range(2):
        with pytest.raises(ValueError, match="weight must have shape"):
            checks.check_gated_norm_inputs(x, gate, weight[:8], EPS)
    checks.check_gated_norm_inputs(x, gate, weight, EPS)
    assert len(checks._checked_signatures) == 1


@pytest.mark.interpreter
def test_a_tensor_with_dense_strides_but_another_layout_is_refused_after_a_dense_one():
    """An mkldnn tensor (CPU only) reports a dense tensor's strides: its layout is part of the
    checked signature under the interpreter, so a passed dense weight does not let it through."""
    x, gate, weight = make_inputs((1, 2, 2, 16), torch.float32)
    checks.check_gated_norm_inputs(x, gate, weight, EPS)  # a dense weight passes, and is kept
    with pytest.raises(TypeError, match="weight must be a dense \\(strided\\) tensor, got layout "
                                        "torch._mkldnn"):
        checks.check_gated_norm_inputs(x, gate, weight.to_mkldnn(), EPS)


def _count_rules(monkeypatch) -> list:
    """The entries (their names) whose tensor rules run from now on."""
    entries, rules = [], checks.check_gated_norm_tensors
    monkeypatch.setattr(checks, "check_gated_norm_tensors",
                        lambda entry, *args, **kwargs: (entries.append(entry),
                                                        rules(entry, *args, **kwargs)))
    return entries


def test_a_fused_call_runs_its_rules_once_and_a_repeated_one_not_at_all(monkeypatch):
    """A forward and backward through fused_gated_norm runs the tensor rules at two stations,
    its own and the backward's (whose dy is new), and nowhere else; the same call again runs
    none."""
    monkeypatch.setattr(checks, "_checked_signatures", {})
    entries = _count_rules(monkeypatch)
    x, gate, weight = make_inputs((2, 3, 2, 64), torch.bfloat16)
    dy = make_inputs(x.shape, torch.bfloat16, seed=1)[0]
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in (x, gate, weight)]
        torch.autograd.grad(fused_gated_norm(*leaves, EPS, out_layout="sbhd"), leaves, dy)
    assert entries == ["fused_gated_norm", "backward_impl"]


def test_no_launch_plan_stands_in_for_a_check(monkeypatch):
    """With their plans kept and the memo emptied, the same calls go through the rules again:
    the plan table is not a record of checks."""
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    _, rstd = forward_impl(x, gate, weight, EPS)
    backward_impl(x, gate, weight, rstd, x)
    assert plans._launch_plans
    monkeypatch.setattr(checks, "_checked_signatures", {})
    entries = _count_rules(monkeypatch)
    forward_impl(x, gate, weight, EPS)
    backward_impl(x, gate, weight, rstd, x)
    fused_gated_norm(x, gate, weight, EPS)  # forward_impl's signature, kept again just now
    assert entries == ["forward_impl", "backward_impl"]


def test_another_current_device_is_another_signature_with_its_own_plan(monkeypatch):
    """The same tensors with another current device (torch.cuda.set_device on a GPU) go through
    the rules again and get a plan of their own: the kernels launch on the current device."""
    monkeypatch.setattr(checks, "_checked_signatures", {})
    monkeypatch.setattr(plans, "_launch_plans", {})
    entries = _count_rules(monkeypatch)
    current = [None]
    monkeypatch.setattr(checks, "current_device", lambda: current[0])
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.float32)
    for device in (None, None, 1, 1, None):
        current[0] = device
        forward_impl(x, gate, weight, EPS)
    assert len(entries) == 2 and len(plans._launch_plans) == 2
