"""core.ssm.GatedDeltaNet with gdn_pre_gated_delta_rule_fusion on the CPU (Triton interpreter,
megatron's chunk rule): its forward against megatron's flag-off forward, alone and with the
fused output norm, deterministic_mode (torch conv, two roundings) and FLA's conv path (the CPU
stand-in of core.testing), packed sequences, recompute, the layer's rules, and the megatron
forward it mirrors."""

import pytest
import torch
import torch.nn.functional as F

from core.ssm import pre_gated_delta_rule_forward as forward_module
from core.ssm.megatron_gdn_import import import_megatron_gdn
from core.testing.gdn import (build_gdn_layer, counting_calls, gdn_config, layer_inputs,
                              randomize_norm_weights)
from tests.gated_norm_checks import assert_bitwise_or_within_ulps, assert_no_less_accurate

pytestmark = [pytest.mark.cpu_shims, pytest.mark.usefixtures("model_parallel_tp1")]

SEQ, BATCH, HIDDEN = 16, 2, 64


def _run(layer, x, dy, **kwargs):
    x = x.clone().requires_grad_(True)
    out = layer(x, attention_mask=None, **kwargs)[0]
    out.backward(dy)
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach(), grads


def _assert_fp32_runs_close(fused, reference):
    """Two fp32 ``_run`` results: output and input gradient within 1e-5, every parameter's
    gradient within 1e-4 (relative)."""
    (o_f, dx_f, g_f), (o_r, dx_r, g_r) = fused, reference
    torch.testing.assert_close(o_f, o_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx_f, dx_r, rtol=1e-5, atol=1e-6)
    for name in g_r:
        torch.testing.assert_close(g_f[name], g_r[name], rtol=1e-4, atol=1e-5, msg=name)


def _layers(dtype=torch.bfloat16, fused_gated_norm=False, **cfg):
    """(megatron's path, the fused region) with identical weights, conv bias and A_log varied."""
    ref = build_gdn_layer(gdn_config(params_dtype=dtype, fused_gated_norm=False, **cfg))
    randomize_norm_weights(ref)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        gdn = ref.self_attention
        gdn.dt_bias.copy_(torch.randn(gdn.dt_bias.shape, generator=gen).to(dtype))
    fused = build_gdn_layer(gdn_config(params_dtype=dtype, fused_gated_norm=fused_gated_norm,
                                       gdn_pre_gated_delta_rule_fusion=True, **cfg))
    fused.load_state_dict(ref.state_dict())
    assert fused.self_attention.pre_gated_delta_rule_fusion is True
    return ref, fused


@pytest.mark.parametrize("fused_gated_norm", [False, True])
def test_fp32_fused_region_matches_megatron(fused_gated_norm):
    ref, fused = _layers(torch.float32, fused_gated_norm)
    x, dy = layer_inputs(SEQ, BATCH, HIDDEN, torch.float32, seed=1)
    with counting_calls(forward_module, "fused_pre_gated_delta_rule") as calls:
        fused_run = _run(fused, x, dy)
    assert len(calls) == 1
    ref_run = _run(ref, x, dy)
    assert fused_run[2].keys() == ref_run[2].keys()
    _assert_fp32_runs_close(fused_run, ref_run)


@pytest.mark.parametrize("fused_gated_norm", [False, True])
def test_bf16_fused_region_matches_megatron(fused_gated_norm):
    ref, fused = _layers(torch.bfloat16, fused_gated_norm)
    x, dy = layer_inputs(SEQ, BATCH, HIDDEN, torch.bfloat16, seed=2)
    out_f, dx_f, g_f = _run(fused, x, dy)
    out_r, dx_r, g_r = _run(ref, x, dy)
    # the recurrence and out_proj amplify a rare flipped rounding of q, k, v (fp32 sum order)
    assert_bitwise_or_within_ulps(out_f, out_r, max_ulps=None, min_bitwise=0.95)
    f32 = build_gdn_layer(gdn_config(params_dtype=torch.float32, fused_gated_norm=False))
    f32.load_state_dict({k: (v.float() if v.is_floating_point() else v)
                         for k, v in ref.state_dict().items() if isinstance(v, torch.Tensor)},
                        strict=False)
    _, dx_32, g_32 = _run(f32, x.float(), dy.float())
    names = sorted(g_r)
    assert_no_less_accurate([dx_f, *(g_f[n] for n in names)], [dx_r, *(g_r[n] for n in names)],
                            [dx_32, *(g_32[n] for n in names)], names=["input", *names])


def test_flas_conv_path_outside_deterministic_mode(monkeypatch):
    """deterministic_mode off: megatron runs FLA's causal_conv1d (the CPU stand-in rounds like
    torch's conv; the fused region rounds once, as FLA's kernel does), so fp32 is compared."""
    ref, fused = _layers(torch.float32, deterministic_mode=False)
    x, dy = layer_inputs(SEQ, BATCH, HIDDEN, torch.float32, seed=4)
    _assert_fp32_runs_close(_run(fused, x, dy), _run(ref, x, dy))


def test_packed_sequences_match_megatron():
    from megatron.core.packed_seq_params import PackedSeqParams

    ref, fused = _layers(torch.float32, deterministic_mode=False)
    x, dy = layer_inputs(SEQ, 1, HIDDEN, torch.float32, seed=5)
    cu = torch.tensor([0, 4, 10, 16], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=6, max_seqlen_kv=6)
    _assert_fp32_runs_close(_run(fused, x, dy, packed_seq_params=packed),
                            _run(ref, x, dy, packed_seq_params=packed))


def test_gdn_norm_out_recompute_gives_the_same_gradients():
    """megatron's gdn_norm_out recompute re-runs the output norm only, not the region."""
    _, plain = _layers(torch.float32, fused_gated_norm=True)
    _, again = _layers(torch.float32, fused_gated_norm=True, recompute_granularity="selective",
                       recompute_modules=["gdn_norm_out"])
    x, dy = layer_inputs(SEQ, BATCH, HIDDEN, torch.float32, seed=6)
    o_p, dx_p, g_p = _run(plain, x, dy)
    with counting_calls(forward_module, "fused_pre_gated_delta_rule") as calls:
        o_r, dx_r, g_r = _run(again, x, dy)
    assert len(calls) == 1
    assert torch.equal(o_p, o_r) and torch.equal(dx_p, dx_r)
    for name in g_p:
        assert torch.equal(g_p[name], g_r[name]), name


def test_full_layer_recompute_gives_the_same_gradients():
    """megatron's full recompute: the layer's forward runs again in backward (the region with
    it) and gives the same gradients, bit for bit."""
    from megatron.core import tensor_parallel

    _, layer = _layers(torch.float32, fused_gated_norm=True)
    x, dy = layer_inputs(SEQ, BATCH, HIDDEN, torch.float32, seed=6)
    o_p, dx_p, g_p = _run(layer, x, dy)
    layer.zero_grad(set_to_none=True)
    x2 = x.clone().requires_grad_(True)
    with counting_calls(forward_module, "fused_pre_gated_delta_rule") as calls:
        out = tensor_parallel.checkpoint(lambda h: layer(h, attention_mask=None)[0], False, x2)
        out.backward(dy)
    assert len(calls) == 2
    assert torch.equal(out.detach(), o_p) and torch.equal(x2.grad, dx_p)
    for name, p in layer.named_parameters():
        if p.grad is not None:
            assert torch.equal(p.grad, g_p[name]), name


def test_layer_refuses_another_conv_activation():
    _, fused = _layers(torch.float32)
    gdn = fused.self_attention
    gdn.activation = "gelu"
    x, _ = layer_inputs(SEQ, BATCH, HIDDEN, torch.float32)
    with pytest.raises(ValueError, match=r"gdn_pre_gated_delta_rule_fusion requires the "
                                         r"convolution's activation .* silu.*'gelu'"):
        fused(x, attention_mask=None)


def test_layer_refuses_a_changed_convolution():
    _, fused = _layers(torch.float32)
    fused.self_attention.conv1d.dilation = (2,)
    x, _ = layer_inputs(SEQ, BATCH, HIDDEN, torch.float32)
    with pytest.raises(ValueError, match=r"requires conv1d.dilation == \(1,\)"):
        fused(x, attention_mask=None)


def test_mirrors_this_megatron_forward():
    """The fused forward copies megatron's; a megatron release whose forward differs fails here
    until the copy is brought in step and its digest added."""
    megatron_gdn = import_megatron_gdn().GatedDeltaNet
    digest = forward_module.megatron_forward_digest(megatron_gdn)
    assert digest in forward_module.MEGATRON_FORWARD_SHA256.values(), (
        "megatron-core's GatedDeltaNet.forward changed: bring "
        "core/ssm/pre_gated_delta_rule_forward.py in step and record its digest", digest)


def test_flag_off_runs_megatrons_forward():
    ref, _ = _layers(torch.float32)
    assert ref.self_attention.pre_gated_delta_rule_fusion is False
    x, _ = layer_inputs(SEQ, BATCH, HIDDEN, torch.float32)
    with counting_calls(forward_module, "fused_pre_gated_delta_rule") as calls:
        ref(x, attention_mask=None)
    assert calls == []


def test_fused_layer_uses_silu_conv_config():
    with pytest.raises(ValueError, match="silu"):
        build_gdn_layer(gdn_config(params_dtype=torch.float32, activation_func=F.gelu,
                                   gdn_pre_gated_delta_rule_fusion=True))


@pytest.mark.parametrize("batch", [1, BATCH])
def test_both_flags_write_the_gate_gradient_in_place(monkeypatch, batch):
    """With both fusions on, the output norm's backward writes dgate into the region's gradient
    buffer: the region's backward copies nothing into it (batch 1 included, where the buffer's
    batch stride is any)."""
    from core.fusions import fused_pre_gated_delta_rule as region

    _, fused = _layers(torch.float32, fused_gated_norm=True)
    x, dy = layer_inputs(SEQ, batch, HIDDEN, torch.float32, seed=7)
    views = []
    original = region._is_view_of
    monkeypatch.setattr(region, "_is_view_of",
                        lambda grad, slot: views.append(original(grad, slot)) or views[-1])
    _run(fused, x, dy)
    assert views == [True]
    assert fused.self_attention.dgate_sink is None


@pytest.mark.parametrize("deterministic_mode", [True, False])
def test_region_keeps_no_more_activation_memory(deterministic_mode):
    """What the forward keeps for backward: the fused region saves the in_proj output (kept by
    the output norm and the conv anyway) and the small parameters, not megatron's conv output,
    normalised q / k or the g / beta inputs."""
    from core.testing.gdn import bytes_kept_for_backward

    _, both = _layers(torch.bfloat16, fused_gated_norm=True,
                      deterministic_mode=deterministic_mode)
    norm_only = build_gdn_layer(gdn_config(params_dtype=torch.bfloat16, fused_gated_norm=True,
                                           deterministic_mode=deterministic_mode))
    norm_only.load_state_dict(both.state_dict())
    x, _ = layer_inputs(SEQ, BATCH, HIDDEN, torch.bfloat16, seed=8)
    kept = {}
    for name, layer in (("norm", norm_only), ("both", both)):
        inp = x.clone().requires_grad_(True)
        kept[name], _ = bytes_kept_for_backward(lambda: layer(inp, attention_mask=None),
                                                exclude=list(layer.parameters()))
    assert kept["both"] < kept["norm"], kept
