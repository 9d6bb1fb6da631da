"""validate_gated_norm (core.fusions.fused_gated_norm): what it reads of a Megatron GatedDeltaNet
(its config, its activation's name, its out_norm: nothing else), each rule and its message, and
the checked signature it returns for the fused apply. The same rules through the layer, and the
layer's own (the TP/CP head count, out_norm's zero-centring): tests/ssm/test_gated_delta_net.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import core.fusions.gated_norm_checks as checks
import core.fusions.gated_norm_plans as plans
from core.fusions.fused_gated_norm import (apply_validated_gated_norm, fused_gated_norm,
                                           validate_gated_norm)
from tests.gated_norm_inputs import EPS, make_inputs


class _Module:
    """A GatedDeltaNet stand-in that lists the names of the attributes read of it."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs, read=[])

    def __getattribute__(self, name):
        if name not in ("__dict__", "read"):
            object.__getattribute__(self, "read").append(name)
        return object.__getattribute__(self, name)


def _gdn_stand_in(norm_eps: dict, activation="silu", **module_attrs):
    """A GatedDeltaNet-like module for ``validate_gated_norm``: megatron's config fields, the
    gate activation's name, and an out_norm whose eps attribute is spelled as in ``norm_eps``
    (torch: eps, TE: epsilon, HF: variance_epsilon)."""
    config = SimpleNamespace(normalization="RMSNorm", linear_value_head_dim=64,
                             linear_num_value_heads=8, layernorm_epsilon=EPS,
                             deterministic_mode=False)
    weight = make_inputs((1, 64), torch.bfloat16)[2]
    norm = SimpleNamespace(weight=weight, bias=None, **norm_eps)
    return _Module(config=config, activation=activation, cp_size=1, out_norm=norm,
                   **module_attrs)


def test_validation_reads_only_what_megatron_mains_validator_reads():
    """config, activation, cp_size and out_norm, nothing else: not the layer's TP/CP head
    counts, act_fn or zero-centring, which the layer checks itself. So no head count is
    imposed here (any split passes), and deterministic mode is taken."""
    x, gate, _ = make_inputs((1, 2, 3, 64), torch.bfloat16)
    module = _gdn_stand_in({"eps": EPS}, tp_size=2, num_value_heads_local_tp_cp=4,
                           act_fn=None, out_norm_zero_centered=True)
    module.config.deterministic_mode = True
    validate_gated_norm(module, x, gate)
    assert set(module.read) <= {"config", "activation", "cp_size", "out_norm"}
    assert {"config", "activation", "out_norm"} <= set(module.read)


@pytest.mark.parametrize("name, gate_activation", [("silu", "silu"), ("swish", "silu"),
                                                   ("sigmoid", "sigmoid")])
def test_validation_takes_the_modules_activation_by_any_of_its_names(name, gate_activation):
    """megatron's GatedDeltaNet keeps ``activation_func.__name__``: "silu" (or "swish", as
    megatron's own GDN kernels spell it) and "sigmoid" are the kernels' silu and sigmoid."""
    x, gate, _ = make_inputs((1, 2, 2, 64), torch.bfloat16)
    validate_gated_norm(_gdn_stand_in({}, name), x, gate, gate_activation)
    validate_gated_norm(_gdn_stand_in({}, name), x, gate, gate_activation=gate_activation)


@pytest.mark.parametrize("name, gate_activation, error, message", [
    ("gelu", "silu", ValueError, r"requires module.activation \(the GDN gate activation, "
                                 r"config.activation_func's name\) to be one of \('silu', "
                                 r"'swish', 'sigmoid'\), got 'gelu'"),
    (None, "silu", ValueError, "requires module.activation .* got None"),
    ("silu", "sigmoid", ValueError, r"requires gate_activation \('sigmoid'\) to be the module's "
                                    r"activation \('silu'\)"),
    ("sigmoid", "silu", ValueError, r"requires gate_activation \('silu'\) to be the module's "
                                    r"activation \('sigmoid'\)"),
    ("silu", "swish", ValueError, r"fused_gated_norm: gate_activation must be one of \('silu', "
                                  r"'sigmoid'\), got 'swish'"),
    ("silu", None, TypeError, "fused_gated_norm: gate_activation must be a str, got NoneType"),
], ids=["unsupported", "none", "silu-vs-sigmoid", "sigmoid-vs-silu", "swish-argument",
        "none-argument"])
def test_validation_refuses_another_activation(name, gate_activation, error, message):
    x, gate, _ = make_inputs((1, 2, 2, 64), torch.bfloat16)
    with pytest.raises(error, match=message):
        validate_gated_norm(_gdn_stand_in({}, name), x, gate, gate_activation)


@pytest.mark.parametrize("change, message", [
    (lambda m: setattr(m.config, "normalization", "LayerNorm"), "requires normalization='RMSNorm'"),
    (lambda m: setattr(m.out_norm, "weight", None), "requires out_norm to have a weight"),
    (lambda m: setattr(m.out_norm, "bias", torch.zeros(64)), "requires out_norm without a bias"),
    (lambda m: setattr(m.out_norm, "weight", torch.ones(32)),
     r"requires out_norm.weight of shape \(64,\) \(linear_value_head_dim\), got \(32,\)"),
], ids=["normalization", "no-weight", "bias", "weight-shape"])
def test_validation_refuses_another_norm(change, message):
    x, gate, _ = make_inputs((1, 2, 2, 64), torch.bfloat16)
    module = _gdn_stand_in({"eps": EPS})
    change(module)
    with pytest.raises(ValueError, match=message):
        validate_gated_norm(module, x, gate)


@pytest.mark.parametrize("attr", ["eps", "epsilon", "variance_epsilon"])
def test_validation_reads_every_spelling_of_the_norm_eps(attr):
    x, gate, _ = make_inputs((1, 2, 8, 64), torch.bfloat16)
    validate_gated_norm(_gdn_stand_in({attr: EPS}), x, gate)
    with pytest.raises(ValueError, match=r"out_norm eps \(0\.001\) to equal "
                                         r"config\.layernorm_epsilon"):
        validate_gated_norm(_gdn_stand_in({attr: 1e-3}), x, gate)
    with pytest.raises(ValueError, match=r"out_norm eps \(1\.0\) to equal "
                                         r"config\.layernorm_epsilon"):
        validate_gated_norm(_gdn_stand_in({attr: 1}), x, gate)  # an int eps is read too
    validate_gated_norm(_gdn_stand_in({}), x, gate)  # no eps to compare: accepted


@pytest.mark.parametrize("eps, error, rule", [
    ("1e-5", TypeError, "must be a Python float or int, got str"),
    (0.0, ValueError, "must be finite and > 0"),
], ids=["str", "zero"])
def test_validation_names_the_config_eps(eps, error, rule):
    """The kernel's eps rule, through a module: the message names where the value comes from
    (a norm without an eps attribute of its own leaves only the config's)."""
    x, gate, _ = make_inputs((1, 2, 8, 64), torch.bfloat16)
    module = _gdn_stand_in({})
    module.config.layernorm_epsilon = eps
    with pytest.raises(error, match=f"fused_gated_norm: config.layernorm_epsilon {rule}"):
        validate_gated_norm(module, x, gate)


@pytest.mark.parametrize("bad", ["x", ["gate"]], ids=["str", "list"])
def test_validate_gated_norm_names_a_non_tensor(bad):
    x, gate, _ = make_inputs((1, 2, 2, 64), torch.float32)
    with pytest.raises(TypeError, match="fused_gated_norm: core_attn_out must be a torch.Tensor"):
        validate_gated_norm(_gdn_stand_in({}), bad, gate)
    with pytest.raises(TypeError, match="fused_gated_norm: gate must be a torch.Tensor"):
        validate_gated_norm(_gdn_stand_in({}), x, bad)


def test_validation_names_the_modules_tensors():
    """x and gate take fused_gated_norm's rules, named as the module's tensors; their last dim
    is the config's head dim."""
    x, gate, _ = make_inputs((1, 2, 2, 64), torch.bfloat16)
    module = _gdn_stand_in({})
    with pytest.raises(ValueError, match=r"requires core_attn_out of shape \[batch, seq, heads, "
                                         r"64\] \(linear_value_head_dim\), got \(1, 2, 2, 32\)"):
        validate_gated_norm(module, x[..., :32], gate)
    with pytest.raises(ValueError, match=r"requires gate of shape \[batch, seq, heads, 64\]"):
        validate_gated_norm(module, x, gate[0])
    with pytest.raises(TypeError, match="fused_gated_norm: gate dtype must be fp32 or "
                                        "core_attn_out's dtype"):
        validate_gated_norm(module, x, gate.half())
    validate_gated_norm(module, x, gate.float())  # megatron main's validator takes it too
    module.out_norm.weight = module.out_norm.weight.half()
    with pytest.raises(TypeError, match="fused_gated_norm: out_norm.weight dtype must be fp32 or "
                                        "core_attn_out's dtype"):
        validate_gated_norm(module, x, gate)


def test_the_checked_signature_keys_the_fused_apply(monkeypatch):
    """validate_gated_norm returns the number of the checked signature (fused_gated_norm's, for
    the same tensors and eps); apply_validated_gated_norm launches under it, with
    fused_gated_norm's result, and runs no check of its own."""
    monkeypatch.setattr(plans, "_launch_plans", {})
    x, gate, weight = make_inputs((1, 2, 2, 64), torch.bfloat16)
    module = _gdn_stand_in({"eps": EPS})
    module.out_norm.weight = weight
    checked = validate_gated_norm(module, x, gate)
    assert checked is not None and checks.check_gated_norm_inputs(x, gate, weight, EPS) == checked
    rules = []
    monkeypatch.setattr(checks, "check_gated_norm_tensors", lambda *args: rules.append(args))
    out = apply_validated_gated_norm(x, gate, weight, EPS, False, "sbhd", "silu", 1.0, checked)
    assert rules == [] and {key[0] for key in plans._launch_plans} == {checked}
    assert torch.equal(out, fused_gated_norm(x, gate, weight, EPS))
