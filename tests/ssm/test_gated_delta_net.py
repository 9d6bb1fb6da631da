"""core.ssm.GatedDeltaNet on the CPU (megatron's deterministic chunk rule, Triton interpreter):
flag on vs off parity per the numerics contract, unchanged megatron behaviour with the flag off,
zero-copy data flow, zero-centring override, every rejection of the fused path's checks (the
layer's own: gate activation, TP/CP head count, zero-centring; and validate_gated_norm's, which
the layer calls through core.fusions.fused_gated_norm)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import core.ssm.gated_delta_net as gdn_mod
from core.fusions import fused_gated_norm as fused_gated_norm_module
from core.testing.gdn import (
    build_gdn_layer,
    bytes_kept_for_backward,
    build_gdn_module,
    gdn_config,
    layer_inputs,
    randomize_norm_weights,
)
from core.transformer import RMSNorm
from tests.gated_norm_checks import assert_bitwise_or_within_ulps, assert_no_less_accurate
from tests.gated_norm_inputs import make_inputs

pytestmark = [pytest.mark.cpu_shims, pytest.mark.usefixtures("model_parallel_tp1")]

SEQ, BATCH, HIDDEN = 24, 2, 64
# The GDN gate activations the kernel implements (config.activation_func); gdn_config's
# deterministic_mode=True is what validate_gdn_config requires of a sigmoid gate.
ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


def _inputs(dtype, seed=0):
    return layer_inputs(SEQ, BATCH, HIDDEN, dtype, seed)


def _run(layer, x, dy):
    x = x.clone().requires_grad_(True)
    out = layer(x, attention_mask=None)[0]
    out.backward(dy)
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach(), grads


def _layers(dtype=torch.bfloat16, **cfg):
    """(unfused, fused) layers with identical weights (norm weights randomised)."""
    ref = build_gdn_layer(gdn_config(params_dtype=dtype, fused_gated_norm=False, **cfg))
    randomize_norm_weights(ref)
    fused = build_gdn_layer(gdn_config(params_dtype=dtype, fused_gated_norm=True, **cfg))
    fused.load_state_dict(ref.state_dict())
    return ref, fused


@pytest.fixture(scope="module", params=list(ACTIVATIONS))
def bf16_runs(request):
    """Runs of the unfused, fused and fp32 unfused layer (same weights), per gate activation."""
    act = dict(activation_func=ACTIVATIONS[request.param])
    ref, fused = _layers(torch.bfloat16, **act)
    assert fused.self_attention.gate_activation == request.param
    x, dy = _inputs(torch.bfloat16)
    f32 = build_gdn_layer(gdn_config(params_dtype=torch.float32, fused_gated_norm=False, **act))
    f32.load_state_dict({
        k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in ref.state_dict().items()})
    return _run(ref, x, dy), _run(fused, x, dy), _run(f32, x.float(), dy.float())


def test_bf16_output_matches_unfused_bitwise_or_one_ulp(bf16_runs):
    (out_ref, _, _), (out_fused, _, _), _ = bf16_runs
    assert out_fused.dtype == torch.bfloat16 and out_fused.shape == (SEQ, BATCH, HIDDEN)
    assert_bitwise_or_within_ulps(out_fused, out_ref)


def test_bf16_grads_no_less_accurate_than_unfused(bf16_runs):
    (_, dx_ref, g_ref), (_, dx_fused, g_fused), (_, dx_32, g_32) = bf16_runs
    assert g_ref.keys() == g_fused.keys()
    assert_no_less_accurate([dx_fused, *(g_fused[n] for n in g_ref)], [dx_ref, *g_ref.values()],
                            [dx_32, *(g_32[n] for n in g_ref)], names=["input", *g_ref])


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_fp32_flag_on_matches_off(activation):
    ref, fused = _layers(torch.float32, activation_func=ACTIVATIONS[activation])
    x, dy = _inputs(torch.float32, seed=1)
    (o_r, dx_r, g_r), (o_f, dx_f, g_f) = _run(ref, x, dy), _run(fused, x, dy)
    torch.testing.assert_close(o_f, o_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx_f, dx_r, rtol=1e-5, atol=1e-6)
    for n in g_r:
        torch.testing.assert_close(g_f[n], g_r[n], rtol=1e-4, atol=1e-5, msg=n)


def test_flag_off_is_megatron_unchanged():
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGDN
    from megatron.core.transformer.spec_utils import build_module

    from core.models import get_gdn_module_spec
    from core.testing.gdn import _pg_collection

    config = gdn_config(fused_gated_norm=False)
    ours = build_gdn_module(config)
    randomize_norm_weights(ours)
    spec = copy.copy(get_gdn_module_spec(use_te=False))
    spec.module = MegatronGDN
    theirs = build_module(spec, config=config, layer_number=1, pg_collection=_pg_collection())
    theirs.load_state_dict(ours.state_dict())
    assert type(theirs) is MegatronGDN
    x, dy = _inputs(torch.bfloat16, seed=2)
    a, b = _run(ours, x, dy), _run(theirs, x, dy)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for n in a[2]:
        assert torch.equal(a[2][n], b[2][n]), n


def _spy_fused_path(module, monkeypatch) -> dict:
    """Records the in_proj output, the gate and output of the fused norm, and the output of
    megatron's _gated_norm_and_a2a during the module's forwards."""
    seen = {}
    module.in_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("in_proj", o[0]))
    real_fused = gdn_mod.apply_validated_gated_norm

    def spy(x, gate, *args, **kwargs):
        seen["gate"] = gate
        out = real_fused(x, gate, *args, **kwargs)
        seen["norm"] = out
        return out

    monkeypatch.setattr(gdn_mod, "apply_validated_gated_norm", spy)
    real_a2a = module._gated_norm_and_a2a

    def a2a_spy(*args, **kwargs):
        out = real_a2a(*args, **kwargs)
        seen["a2a"] = out
        return out

    module._gated_norm_and_a2a = a2a_spy
    return seen


def _check_sbhd_output_is_final(seen):
    assert seen["norm"].transpose(0, 1).is_contiguous()
    # megatron's reshape/transpose/.contiguous() after the norm returned the very same buffer
    assert seen["a2a"].data_ptr() == seen["norm"].data_ptr()
    assert seen["a2a"].shape == (SEQ, BATCH, 4 * 16)


def test_fused_path_without_autograd_reads_gate_in_place_and_writes_sbhd(monkeypatch):
    module = build_gdn_module(gdn_config(fused_gated_norm=True))
    seen = _spy_fused_path(module, monkeypatch)
    x, _ = _inputs(torch.bfloat16, seed=3)
    with torch.no_grad():
        module(x, attention_mask=None)
    gate = seen["gate"]
    assert not gate.is_contiguous(), "without autograd the gate is the strided in_proj slice"
    assert gate.untyped_storage().data_ptr() == seen["in_proj"].untyped_storage().data_ptr()
    _check_sbhd_output_is_final(seen)


def test_fused_path_in_training_saves_a_compact_gate_and_writes_sbhd(monkeypatch):
    """With autograd the gate backward keeps is megatron's contiguous copy: a view would keep
    the whole in_proj output alive until backward."""
    module = build_gdn_module(gdn_config(fused_gated_norm=True))
    seen = _spy_fused_path(module, monkeypatch)
    x, dy = _inputs(torch.bfloat16, seed=3)
    _run(module, x, dy)
    gate = seen["gate"]
    assert gate.is_contiguous()
    assert gate.untyped_storage().data_ptr() != seen["in_proj"].untyped_storage().data_ptr()
    assert gate.untyped_storage().nbytes() == gate.numel() * gate.element_size()
    _check_sbhd_output_is_final(seen)


def _norm_recompute(recompute: bool) -> dict:
    """Config options of selective recompute of gdn_norm_out, or none."""
    return dict(recompute_granularity="selective", recompute_modules=["gdn_norm_out"]) \
        if recompute else {}


def _bytes_kept_for_backward(module, x) -> int:
    return bytes_kept_for_backward(
        lambda: module(x.clone().requires_grad_(True), attention_mask=None),
        exclude=module.parameters())[0]


@pytest.mark.parametrize("recompute", [False, True], ids=["no-recompute", "gdn_norm_out-recompute"])
def test_flag_keeps_no_more_activation_memory_in_deterministic_mode(recompute):
    """deterministic_mode's torch conv copies qkv, so the in_proj output would be freed: the
    fused path takes megatron's gate copy and keeps at most what flag off keeps; with
    gdn_norm_out recompute (the checkpoint keeps the norm's inputs on both paths) exactly that."""
    extra = _norm_recompute(recompute)
    x, _ = _inputs(torch.bfloat16, seed=5)
    kept = {fused: _bytes_kept_for_backward(
        build_gdn_module(gdn_config(fused_gated_norm=fused, **extra)), x)
        for fused in (False, True)}
    if recompute:
        assert kept[True] == kept[False]
    else:
        assert kept[True] <= kept[False]


def test_flag_keeps_what_megatrons_compiled_norm_keeps_in_deterministic_mode(monkeypatch):
    """Megatron runs its flag-off norm torch.compile'd (jit_fuser): inductor saves x, the gate
    and an fp32 rstd per row for backward, as the fused path does: the same bytes."""
    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    monkeypatch.setattr(_GDNBase, "_apply_gated_norm", torch.compile(_GDNBase._apply_gated_norm))
    x, _ = _inputs(torch.bfloat16, seed=5)
    kept = {fused: _bytes_kept_for_backward(build_gdn_module(gdn_config(fused_gated_norm=fused)), x)
            for fused in (False, True)}
    assert kept[True] == kept[False]


@pytest.mark.parametrize("recompute", [False, True], ids=["no-recompute", "gdn_norm_out-recompute"])
def test_flag_keeps_less_activation_memory_with_flas_conv(monkeypatch, recompute):
    """Outside deterministic_mode FLA's causal_conv1d (run here in the Triton interpreter) saves
    a strided view of the in_proj output, so the buffer lives until backward anyway and the gate
    read in place costs nothing: the fused path keeps the gate copy less than flag off (the
    chunk rule is the torch stand-in; FLA's does not run on the CPU)."""
    import megatron.core.ssm.gated_delta_net.gdn as megatron_gdn
    from fla.modules.convolution import causal_conv1d  # what megatron imports

    from core.testing.cpu import torch_chunk_gated_delta_rule

    # FLA's conv itself, in place of the CPU stand-in of the test run (tests/conftest.py)
    monkeypatch.setattr(megatron_gdn, "causal_conv1d", causal_conv1d)
    monkeypatch.setattr(megatron_gdn, "chunk_gated_delta_rule", torch_chunk_gated_delta_rule)
    extra = _norm_recompute(recompute)
    x, _ = _inputs(torch.bfloat16, seed=5)
    kept, modules = {}, {}
    for fused in (False, True):
        modules[fused] = build_gdn_module(
            gdn_config(fused_gated_norm=fused, deterministic_mode=False, **extra))
        assert modules[fused].gated_delta_rule is torch_chunk_gated_delta_rule
        kept[fused] = _bytes_kept_for_backward(modules[fused], x)
    gate_copy = SEQ * BATCH * 4 * 16 * 2  # [B, S, 4 value heads, 16] bf16
    assert kept[False] - kept[True] >= gate_copy
    assert modules[True]._reads_gate_in_place()


def test_fused_forward_checks_inputs_once(monkeypatch):
    """validate_gated_norm includes the kernel's input checks; the module must not repeat them."""
    import sys

    module = build_gdn_module(gdn_config(fused_gated_norm=True))
    calls = []
    real_check = fused_gated_norm_module.check_gated_norm_inputs

    def counting(*args, **kwargs):
        calls.append(args)
        return real_check(*args, **kwargs)

    owners = [m for name, m in list(sys.modules.items())  # wherever an entry would look it up
              if name.startswith("core.fusions") and hasattr(m, "check_gated_norm_inputs")]
    assert fused_gated_norm_module in owners
    for owner in owners:
        monkeypatch.setattr(owner, "check_gated_norm_inputs", counting)
    module._apply_gated_norm(*_xg())
    assert len(calls) == 1


def test_unfused_path_keeps_megatron_gate_copy(monkeypatch):
    module = build_gdn_module(gdn_config(fused_gated_norm=False))
    seen = {}
    real = type(module)._apply_gated_norm

    def spy(self, x, gate):
        seen["gate_contiguous"] = gate.is_contiguous()
        return real(self, x, gate)

    monkeypatch.setattr(type(module), "_apply_gated_norm", spy)
    _run(module, *_inputs(torch.bfloat16, seed=4))
    assert seen["gate_contiguous"]


def test_zero_centered_override_loads_unshifted_weights():
    """Qwen3-Next style: other norms zero-centred, GDN output norm not. The override with
    weight w equals the zero-centred norm with weight w - 1 (dyadic values: exact)."""
    w = 1.0 + torch.arange(16, dtype=torch.float32) / 64
    base = dict(layernorm_zero_centered_gamma=True, fused_gated_norm=True)
    plain = build_gdn_module(gdn_config(gdn_out_norm_zero_centered_gamma=False, **base))
    shifted = build_gdn_module(gdn_config(**base))
    assert plain.out_norm.zero_centered_gamma is False and plain.out_norm_zero_centered is False
    assert shifted.out_norm.zero_centered_gamma is True and shifted.out_norm_zero_centered is True
    shifted.load_state_dict({**plain.state_dict(), "out_norm.weight": (w - 1).to(torch.bfloat16)})
    plain.out_norm.weight.data.copy_(w)
    x, dy = _inputs(torch.bfloat16, seed=5)
    a, b = _run(plain, x, dy), _run(shifted, x, dy)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # the unfused path honours the override the same way
    unfused = build_gdn_module(gdn_config(gdn_out_norm_zero_centered_gamma=False,
                                          layernorm_zero_centered_gamma=True))
    unfused.load_state_dict(plain.state_dict())
    c = _run(unfused, x, dy)
    assert_bitwise_or_within_ulps(c[0], a[0])


def test_layer_spec_zero_centered_override_keeps_input_norm_zero_centered():
    layer = build_gdn_layer(gdn_config(layernorm_zero_centered_gamma=True,
                                       gdn_out_norm_zero_centered_gamma=False,
                                       fused_gated_norm=True))
    assert layer.input_layernorm.zero_centered_gamma is True
    assert layer.pre_mlp_layernorm.zero_centered_gamma is True
    assert layer.self_attention.out_norm.zero_centered_gamma is False


# ---------------------------------------------------------------------------------------------
# validate_gated_norm rejections, through the module (host-side checks before any launch)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fused_module():
    """A fresh module per test: the tests below replace its submodules (a shallow copy of an
    nn.Module would share them with every later test)."""
    return build_gdn_module(gdn_config(fused_gated_norm=True))


def _xg(dtype=torch.bfloat16, heads=4, dim=16):
    return make_inputs((2, 3, heads, dim), dtype)[:2]


def _with_config(module, **changes):
    clone = copy.copy(module)
    clone.config = copy.copy(module.config)
    for k, v in changes.items():
        setattr(clone.config, k, v)
    return clone


def _with_act_fn(module, act_fn):
    """The module with another gate activation, as megatron applies it (``module.act_fn``)."""
    clone = copy.copy(module)
    clone.act_fn = act_fn
    return clone


def _with_norm_weight(module, weight):
    """The module with out_norm's weight replaced (a fresh module per test: see fused_module)."""
    module.out_norm.weight = torch.nn.Parameter(weight)
    return module


def test_validation_accepts_good_inputs(fused_module):
    out = fused_module._apply_gated_norm(*_xg())
    assert out.shape == (2, 3, 4, 16)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda m: (_with_config(m, normalization="LayerNorm"), _xg()), ValueError,
         "requires normalization='RMSNorm'"),
        (lambda m: (_with_act_fn(m, F.gelu), _xg()), ValueError,
         r"requires the module's act_fn \(the GDN gate activation\)"),
        (lambda m: (_with_config(m, layernorm_epsilon=1e-3), _xg()), ValueError,
         r"out_norm eps \(1e-05\) to equal config.layernorm_epsilon"),
        (lambda m: (m, _xg(heads=3)), ValueError, r"core_attn_out of shape \[batch, seq, 4, 16\]"),
        (lambda m: (m, (_xg()[0], _xg(heads=2)[1])), ValueError,
         r"gate of shape \[batch, seq, 4, 16\]"),
        (lambda m: (m, (_xg(torch.float64))), TypeError,
         "fused_gated_norm: core_attn_out dtype must be bf16, fp16 or fp32"),
        (lambda m: (m, (_xg()[0], _xg(torch.float16)[1])), TypeError,
         "fused_gated_norm: gate dtype must be fp32 or core_attn_out's dtype"),
        (lambda m: (_with_norm_weight(m, torch.ones(16, dtype=torch.float16)), _xg()), TypeError,
         "fused_gated_norm: out_norm.weight dtype must be fp32 or core_attn_out's dtype"),
        (lambda m: (_with_norm_weight(m, torch.ones(32, dtype=torch.bfloat16)[::2]), _xg()),
         ValueError, "fused_gated_norm: out_norm.weight must be contiguous"),
        (lambda m: (m, (_xg()[0].to("meta"), _xg()[1].to("meta"))), ValueError,
         "fused_gated_norm: core_attn_out, gate and out_norm.weight must be on one device"),
    ],
    ids=["normalization", "activation", "eps", "x-heads", "gate-heads", "dtype", "gate-dtype",
         "weight-dtype", "weight-stride", "device"],
)
def test_validation_rejections(fused_module, make, error, match):
    module, (x, gate) = make(fused_module)
    with pytest.raises(error, match=match):
        module._apply_gated_norm(x, gate)


def test_validation_rejects_norm_with_bias(fused_module):
    module = fused_module
    module.out_norm.bias = torch.nn.Parameter(torch.zeros(16))
    with pytest.raises(ValueError, match="out_norm without a bias"):
        module._apply_gated_norm(*_xg())


def test_validation_rejects_norm_without_weight_or_wrong_shape(fused_module):
    module = fused_module
    module.out_norm = torch.nn.Identity()
    with pytest.raises(ValueError, match="out_norm to have a weight"):
        module._apply_gated_norm(*_xg())
    module.out_norm = RMSNorm(fused_module.config, hidden_size=8, eps=1e-5)
    with pytest.raises(ValueError, match=r"out_norm.weight of shape \(16,\)"):
        module._apply_gated_norm(*_xg())


def _as_tp_cp_rank(module, tp_size, cp_size):
    """The module with the head split of a rank at ``tp_size`` x ``cp_size`` (a shallow copy: the
    head count is all that changes)."""
    rank = copy.copy(module)
    rank.tp_size, rank.cp_size = tp_size, cp_size
    rank.num_v_heads_local_tp = module.config.linear_num_value_heads // tp_size
    rank.num_value_heads_local_tp_cp = rank.num_v_heads_local_tp // cp_size
    return rank


@pytest.mark.parametrize("tp_size, cp_size", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_layer_checks_the_local_head_count_of_its_tp_cp_rank(fused_module, tp_size, cp_size,
                                                             monkeypatch):
    """core_attn_out and gate carry the value heads left by TP and then CP's all-to-all; the
    layer refuses any other count before the validator runs, naming the split."""
    validated = []
    monkeypatch.setattr(fused_gated_norm_module, "validate_gated_norm",
                        lambda *args, **kwargs: validated.append(args))
    rank = _as_tp_cp_rank(fused_module, tp_size, cp_size)
    heads = 4 // tp_size // cp_size
    assert rank._apply_gated_norm(*_xg(heads=heads)).shape == (2, 3, heads, 16)
    assert len(validated) == 1
    split = (rf"\({heads} local value heads: linear_num_value_heads 4 split over tp_size "
             rf"{tp_size} and cp_size {cp_size}; linear_value_head_dim\)")
    for x, gate, name in ((_xg()[0], _xg(heads=heads)[1], "core_attn_out"),
                          (_xg(heads=heads)[0], _xg()[1], "gate")):
        rule = rf"{name} of shape \[batch, seq, {heads}, 16\] {split}"
        with pytest.raises(ValueError, match=rule):
            rank._apply_gated_norm(x, gate)
    with pytest.raises(ValueError, match=r"core_attn_out of shape .* got \(6, 4, 16\)"):
        rank._apply_gated_norm(_xg()[0].flatten(0, 1), _xg()[1])
    assert len(validated) == 1


def test_layer_checks_out_norm_zero_centring_against_the_kernels(fused_module):
    """out_norm centring its weight (zero_centered_gamma) where the kernel would not, or the other
    way round, is refused on the forward: the two would apply different weights."""
    fused_module._apply_gated_norm(*_xg())
    fused_module.out_norm.zero_centered_gamma = True
    with pytest.raises(ValueError, match=r"out_norm.zero_centered_gamma \(True\) to equal the "
                                         r"module's out_norm_zero_centered \(False\)"):
        fused_module._apply_gated_norm(*_xg())
    fused_module.out_norm_zero_centered = True  # now the kernel centres it too
    fused_module._apply_gated_norm(*_xg())
    del fused_module.out_norm.zero_centered_gamma  # a norm that does not say: nothing to compare
    fused_module._apply_gated_norm(*_xg())


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_layer_calls_the_validator_through_its_module(name, monkeypatch):
    """The layer looks validate_gated_norm up on core.fusions.fused_gated_norm at every call
    and names the gate activation it applies; a patched validator's refusal stops the fused
    forward before any launch (the recompute tests count its calls through recomputation)."""
    module = build_gdn_module(gdn_config(fused_gated_norm=True, activation_func=ACTIVATIONS[name]))
    x, gate = _xg()
    calls = []
    monkeypatch.setattr(fused_gated_norm_module, "validate_gated_norm",
                        lambda *args, **kwargs: calls.append((args, kwargs)))
    module._apply_gated_norm(x, gate)
    ((args, kwargs),) = calls
    assert args[0] is module and args[1] is x and args[2] is gate
    assert kwargs == {"gate_activation": name}
    launches = []
    monkeypatch.setattr(gdn_mod, "apply_validated_gated_norm", lambda *a, **k: launches.append(a))

    def refuse(*args, **kwargs):
        raise ValueError("refused by the patched validator")

    monkeypatch.setattr(fused_gated_norm_module, "validate_gated_norm", refuse)
    with pytest.raises(ValueError, match="refused by the patched validator"):
        module._apply_gated_norm(x, gate)
    assert launches == []


def test_zero_centered_mismatch_between_norm_and_config_raises():
    from megatron.core.transformer.spec_utils import ModuleSpec

    from core.models import get_gdn_module_spec
    from core.testing.gdn import _pg_collection
    from megatron.core.transformer.spec_utils import build_module

    spec = get_gdn_module_spec(use_te=False)
    always_zc = ModuleSpec(module=RMSNorm, params={"zero_centered_gamma": True})
    spec = copy.copy(spec)
    spec.submodules = copy.copy(spec.submodules)
    spec.submodules.out_norm = always_zc
    with pytest.raises(ValueError, match="out_norm.zero_centered_gamma=True disagrees"):
        build_module(spec, config=gdn_config(fused_gated_norm=True), layer_number=1,
                     pg_collection=_pg_collection())


def test_construction_checks_fields_set_on_any_config():
    """A config whose fields were set after its own checks ran (a Megatron-Bridge provider, or
    an attribute assigned later) is checked when the layer is built."""
    config = gdn_config()
    config.fused_gated_norm = "yes"
    with pytest.raises(TypeError, match=r"fused_gated_norm must be a bool \(True or False\)"):
        build_gdn_module(config)
    config.fused_gated_norm = True
    config.activation_func = F.gelu
    with pytest.raises(ValueError, match="fused_gated_norm requires activation_func"):
        build_gdn_module(config)
