"""The input rules (core.fusions.gated_norm_validation): validate_gated_norm's module rules, the
current-device rule, the gate activation's spellings, and the table of checked input metadata
behind fused_gated_norm's per-call rules. The rules as each entry applies them (every bad
argument, before any launch): test_fused_gated_norm.py and test_gated_norm_inference.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import triton.language as tl

import core.fusions.gated_norm_validation as validation
from tests.gated_norm_inputs import EPS, make_inputs, packed_projection_gate, sbhd_view


def _gdn_stand_in(norm_eps: dict, value_heads=8, **module_attrs):
    """A GatedDeltaNet-like module for ``validate_gated_norm``: a config and an out_norm whose eps
    attribute is spelled as in ``norm_eps`` (torch: eps, TE: epsilon, HF: variance_epsilon)."""
    config = SimpleNamespace(normalization="RMSNorm", activation_func=F.silu, linear_value_head_dim=64,
                             linear_num_value_heads=value_heads, layernorm_epsilon=EPS)
    weight = make_inputs((1, 64), torch.bfloat16)[2]
    return SimpleNamespace(config=config, out_norm=SimpleNamespace(weight=weight, bias=None, **norm_eps),
                           **module_attrs)


def test_kernels_take_tensors_of_the_current_cuda_device_only():
    """Checked on the GPU before every launch (check_operands), here with the device numbers."""
    validation.check_current_device("fused_gated_norm", torch.device("cuda", 1), 1)
    with pytest.raises(ValueError, match=r"x must be on the current CUDA device \(cuda:0\), where "
                                         r"the kernels launch, got cuda:1"):
        validation.check_current_device("fused_gated_norm", torch.device("cuda", 1), 0)


@pytest.mark.parametrize("norm_zero_centered", [None, False, True])
@pytest.mark.parametrize("module_zero_centered", [None, False, True])
def test_validation_compares_the_norms_zero_centring_with_the_module(norm_zero_centered,
                                                                     module_zero_centered):
    """out_norm replaced after construction by a norm that centres otherwise is refused: the
    kernel applies the module's choice. Either side unknown (megatron's class, a norm without
    the attribute): nothing to compare."""
    x, gate, _ = make_inputs((1, 2, 8, 64), torch.bfloat16)
    norm = {} if norm_zero_centered is None else {"zero_centered_gamma": norm_zero_centered}
    attrs = {} if module_zero_centered is None else {"out_norm_zero_centered": module_zero_centered}
    module = _gdn_stand_in({"eps": EPS, **norm}, **attrs)
    if None in (norm_zero_centered, module_zero_centered) or norm_zero_centered == module_zero_centered:
        validation.validate_gated_norm(module, x, gate)
    else:
        with pytest.raises(ValueError, match="requires out_norm.zero_centered_gamma .* to equal the "
                                             "module's out_norm_zero_centered"):
            validation.validate_gated_norm(module, x, gate)


@pytest.mark.parametrize("attr", ["eps", "epsilon", "variance_epsilon"])
def test_validation_reads_every_spelling_of_the_norm_eps(attr):
    x, gate, _ = make_inputs((1, 2, 8, 64), torch.bfloat16)
    validation.validate_gated_norm(_gdn_stand_in({attr: EPS}), x, gate)
    with pytest.raises(ValueError, match=r"out_norm eps \(0\.001\) to equal config\.layernorm_epsilon"):
        validation.validate_gated_norm(_gdn_stand_in({attr: 1e-3}), x, gate)
    with pytest.raises(ValueError, match=r"out_norm eps \(1\.0\) to equal config\.layernorm_epsilon"):
        validation.validate_gated_norm(_gdn_stand_in({attr: 1}), x, gate)  # an int eps is read too
    validation.validate_gated_norm(_gdn_stand_in({}), x, gate)  # no eps to compare: accepted


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
        validation.validate_gated_norm(module, x, gate)


@pytest.mark.parametrize("module_attrs, heads", [
    ({}, 8),  # no split known: all value heads
    ({"tp_size": 2}, 4),
    ({"tp_size": 2, "cp_size": 2}, 2),
    ({"cp_size": 4}, 2),
    ({"tp_size": 2, "cp_size": 2, "num_value_heads_local_tp_cp": 1}, 1),  # ours wins
], ids=["none", "tp", "tp_cp", "cp", "own_attribute"])
def test_validation_heads_of_a_module_without_the_local_head_count(module_attrs, heads):
    """A module without ``num_value_heads_local_tp_cp`` (megatron's own class) expects the value
    heads split over TP and then CP: exactly that head count passes, any other is refused."""
    module = _gdn_stand_in({"eps": EPS}, **module_attrs)
    for h in (1, 2, 4, 8):
        x, gate, _ = make_inputs((1, 2, h, 64), torch.bfloat16)
        if h == heads:
            validation.validate_gated_norm(module, x, gate)
        else:
            with pytest.raises(ValueError, match=rf"core_attn_out of shape \[batch, seq, {heads}, 64\]"):
                validation.validate_gated_norm(module, x, gate)


@pytest.mark.parametrize("fn, name", [(F.silu, "silu"), (torch.sigmoid, "sigmoid"),
                                      (F.sigmoid, "sigmoid"), (F.gelu, None), (torch.nn.SiLU, None)],
                         ids=["F.silu", "torch.sigmoid", "F.sigmoid", "F.gelu", "nn.SiLU"])
def test_gate_activation_name_knows_every_spelling_of_the_kernels_functions(fn, name):
    """megatron's activation_func may be either sigmoid function (they are distinct objects);
    a module class is not an activation function there."""
    assert validation.gate_activation_name(fn) == name


def test_input_rules_run_again_for_any_other_metadata(monkeypatch):
    """fused_gated_norm's input rules pass inputs whose metadata equals that of inputs that
    passed without evaluating the rules again; anything else (strides, a dtype, a device, the
    current device, eps or only eps's type) goes through them."""
    monkeypatch.setattr(validation, "_checked_inputs", {})
    evaluated = []
    rules = validation.check_gated_norm_tensors
    monkeypatch.setattr(validation, "check_gated_norm_tensors",
                        lambda *args, **kwargs: (evaluated.append(args[1:]), rules(*args, **kwargs)))
    current = [None]
    monkeypatch.setattr(validation, "current_device", lambda: current[0])
    x, gate, weight = make_inputs((2, 3, 2, 64), torch.bfloat16)
    check = validation.check_gated_norm_inputs
    check(x, gate, weight, EPS)
    check(x.clone(), gate.clone(), weight.clone(), EPS)  # other tensors, the same metadata
    assert len(evaluated) == 1
    others = [(sbhd_view(x), gate, weight, EPS),
              (x, packed_projection_gate(x.shape, x.dtype), weight, EPS),
              (x, gate, weight.float(), EPS),
              (x, gate, torch.nn.Parameter(weight), EPS),
              (x, gate, weight, 1),
              (x, gate, weight, 1.0)]
    for args in others:
        check(*args)
    assert len(evaluated) == 1 + len(others)
    current[0] = 1  # as on a GPU after torch.cuda.set_device
    check(x, gate, weight, EPS)
    assert len(evaluated) == 2 + len(others)
    with pytest.raises(TypeError, match="eps must be a Python float or int, got bool"):
        check(x, gate, weight, True)  # True == 1, which passed
    with pytest.raises(ValueError, match="must be on one device"):
        check(x, gate.to("meta"), weight, EPS)


def test_input_rule_table_is_bounded(monkeypatch):
    monkeypatch.setattr(validation, "_checked_inputs", {})
    monkeypatch.setattr(validation, "MAX_CHECKED_INPUTS", 3)
    x, gate, weight = make_inputs((1, 6, 2, 32), torch.float32)
    for tokens in range(1, 7):
        validation.check_gated_norm_inputs(x[:, :tokens], gate[:, :tokens], weight, EPS)
        assert len(validation._checked_inputs) <= 3


def test_metadata_no_dict_takes_goes_through_the_rules(monkeypatch):
    """Symbolic sizes (make_fx's symbolic tracing) make a key no dict takes: the rules run and
    pass, and nothing is kept."""
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(validation, "_checked_inputs", {})
    x, gate, weight = make_inputs((2, 3, 2, 64), torch.float32)

    def check(x, gate, weight):
        validation.check_gated_norm_inputs(x, gate, weight, EPS)
        return x

    make_fx(check, tracing_mode="symbolic")(x, gate, weight)
    assert validation._checked_inputs == {}


def test_overlap_of_views():
    """Column slices of one packed buffer: their spans intersect, their elements do not; the
    exact test also takes [tokens, heads, dim] views of them. Anything else that shares bytes is
    a partial overlap (conservatively), an identical view the same."""
    buf = torch.zeros(4, 40, dtype=torch.bfloat16)
    a, b = buf[:, :16], buf[:, 16:32]
    assert validation.overlap(a, b) == "none" and validation.overlap(b, a) == "none"
    assert validation.overlap(a, buf[:, 15:31]) == "partial"
    assert validation.overlap(a.unflatten(1, (2, 8)), buf[1:, 32:40].unflatten(1, (1, 8))) == "none"
    assert validation.overlap(a, buf[1:, 8:24].unflatten(1, (2, 8))) == "partial"
    assert validation.overlap(a, buf.t()[:16].t()) == "same"
    rows = torch.zeros(3, 1, 16)  # the same memory whatever the stride of the size-1 dim
    assert validation.overlap(rows, rows.as_strided((3, 1, 16), (16, 48, 1))) == "same"
    assert validation.overlap(a, buf[:0]) == "none"
    sbhd = torch.zeros(8, 2, 16).transpose(0, 1)  # no [tokens, 16] view: conservative
    assert validation.overlap(sbhd, torch.zeros(8, 2, 16)[:, :, 8:].transpose(0, 1)) == "none"
    assert validation.overlap(sbhd[:, :, :8], sbhd[:, :, 8:]) == "partial"


@pytest.mark.parametrize("view, apart", [
    (lambda t: t, True),
    (lambda t: t[:, :, :1].expand(2, 3, 4, 16), False),  # four heads on one row
    (lambda t: t.transpose(0, 1), True),  # an sbhd view
    (lambda t: torch.zeros(2, 3, 64).as_strided((2, 3, 4, 16), (192, 64, 8, 1)), False),
    (lambda t: t[:, :1].expand(2, 1, 4, 16), True),  # a size-1 dim takes any stride
    # the boundary: heads exactly one row apart, or one element closer
    (lambda t: torch.zeros(96).as_strided((1, 1, 4, 16), (64, 64, 16, 1)), True),
    (lambda t: torch.zeros(96).as_strided((1, 1, 4, 16), (64, 64, 15, 1)), False),
    (lambda t: torch.zeros(200).as_strided((1, 3, 4, 16), (192, 64, 16, 1)), True),
    (lambda t: torch.zeros(200).as_strided((1, 3, 4, 16), (192, 63, 16, 1)), False),
])
def test_rows_apart(view, apart):
    t = view(torch.zeros(2, 3, 4, 16))
    if apart:
        validation.check_rows_apart("entry", "out", t)
    else:
        with pytest.raises(ValueError, match="entry: out rows must not overlap each other"):
            validation.check_rows_apart("entry", "out", t)



def test_a_call_that_breaks_a_rule_is_not_kept_as_checked(monkeypatch):
    """The checked-metadata table keeps a signature only after its rules passed: the same bad
    call is refused every time."""
    monkeypatch.setattr(validation, "_checked_inputs", {})
    x, gate, weight = make_inputs((1, 2, 2, 16), torch.bfloat16)
    for _ in range(2):
        with pytest.raises(ValueError, match="weight must have shape"):
            validation.check_gated_norm_inputs(x, gate, weight[:8], EPS)
    validation.check_gated_norm_inputs(x, gate, weight, EPS)
    assert len(validation._checked_inputs) == 1


def test_overlap_at_the_edges_of_two_spans():
    s = torch.zeros(64)
    # out's first element is x's last one: they share memory
    assert validation.overlap(s[:32].view(1, 2, 2, 8), s[31:63].view(1, 2, 2, 8)) == "partial"
    assert validation.overlap(s[:8], s[8:16]) == "none"  # adjacent, not overlapping


def test_launch_overrides_up_to_their_maxima():
    validation.check_launch_overrides("entry", (("bt", 2**16), ("warps", 32), ("programs", 2**16)),
                                      ())
    for name, value in (("bt", 2**17), ("warps", 64), ("programs", 2**16 + 1)):
        with pytest.raises(ValueError, match=f"entry: {name}"):
            validation.check_launch_overrides("entry", ((name, value),), ())


def test_launch_tile_up_to_tritons_limit():
    limit = tl.TRITON_MAX_TENSOR_NUMEL
    validation.check_launch_tile("entry", "bt", limit // 128, 128, "a row")
    with pytest.raises(ValueError, match=f"entry: bt must be <= {limit // 128} here"):
        validation.check_launch_tile("entry", "bt", limit // 128 + 1, 128, "a row")


def test_dependent_launch_needs_hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    validation.check_dependent_launch("entry", "pdl", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 9))
    with pytest.raises(ValueError, match="entry: pdl=True needs programmatic dependent launch"):
        validation.check_dependent_launch("entry", "pdl", torch.device("cuda", 0))


def test_row_count_limit_is_exact():
    validation.check_rows("entry", "rows", validation.MAX_ROWS)
    with pytest.raises(ValueError, match=f"entry: rows must be <= {validation.MAX_ROWS}"):
        validation.check_rows("entry", "rows", validation.MAX_ROWS + 1)


@pytest.mark.parametrize("bad", ["x", ["gate"]], ids=["str", "list"])
def test_validate_gated_norm_names_a_non_tensor(bad):
    x, gate, _ = make_inputs((1, 2, 2, 16), torch.float32)
    with pytest.raises(TypeError, match="fused_gated_norm: core_attn_out must be a torch.Tensor"):
        validation.validate_gated_norm(_gdn_stand_in({}), bad, gate)
    with pytest.raises(TypeError, match="fused_gated_norm: gate must be a torch.Tensor"):
        validation.validate_gated_norm(_gdn_stand_in({}), x, bad)


@pytest.mark.interpreter
def test_a_tensor_with_dense_strides_but_another_layout_is_refused_after_a_dense_one():
    """An mkldnn tensor (CPU only) reports a dense tensor's strides: its layout is part of the
    checked signature under the interpreter, so a passed dense weight does not let it through."""
    x, gate, weight = make_inputs((1, 2, 2, 16), torch.float32)
    validation.check_gated_norm_inputs(x, gate, weight, EPS)  # a dense weight passes, and is kept
    with pytest.raises(TypeError, match="weight must be a dense \\(strided\\) tensor, got layout torch._mkldnn"):
        validation.check_gated_norm_inputs(x, gate, weight.to_mkldnn(), EPS)
