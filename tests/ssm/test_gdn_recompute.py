"""Recompute with the fused norm. Selective recompute 'gdn_norm_out': bitwise-equal output,
input grad and every parameter grad with and without recompute; the norm output's storage is
freed after the forward and rebuilt in backward; validate_gated_norm runs again during the
recomputation. Megatron's full layer recompute of a GDN hybrid GPT: the same, bit for bit."""

import pytest
import torch

from core.fusions import fused_gated_norm as fused_gated_norm_module
from core.testing.gdn import (build_gdn_layer, gdn_config, layer_inputs,
                              randomize_norm_weights, set_out_norm_grad_scale)

pytestmark = [pytest.mark.cpu_shims, pytest.mark.usefixtures("model_parallel_tp1")]

SEQ, BATCH, HIDDEN = 24, 2, 64
RECOMPUTE = dict(recompute_granularity="selective", recompute_modules=["gdn_norm_out"])


@pytest.fixture
def validate_calls(monkeypatch):
    """Grad mode at each call of the validator, patched where the layer looks it up at every
    call: on the module core.fusions.fused_gated_norm (the seed contract)."""
    calls = []
    real = fused_gated_norm_module.validate_gated_norm

    def counting(module, x, gate, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return real(module, x, gate, *args, **kwargs)

    monkeypatch.setattr(fused_gated_norm_module, "validate_gated_norm", counting)
    return calls


def _pair(fused: bool):
    plain = build_gdn_layer(gdn_config(fused_gated_norm=fused))
    randomize_norm_weights(plain)
    recompute = build_gdn_layer(gdn_config(fused_gated_norm=fused, **RECOMPUTE))
    recompute.load_state_dict(plain.state_dict())
    assert recompute.self_attention.recompute_norm_out
    assert not plain.self_attention.recompute_norm_out
    return plain, recompute


def _inputs():
    return layer_inputs(SEQ, BATCH, HIDDEN, seed=11)


def _forward(layer, x):
    x = x.clone().requires_grad_(True)
    return x, layer(x, attention_mask=None)[0]


def _grads(layer):
    return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_recompute_is_bitwise_equal(fused, validate_calls):
    plain, recompute = _pair(fused)
    x, dy = _inputs()

    xa, out_a = _forward(plain, x)
    out_a.backward(dy)
    calls_plain = len(validate_calls)

    xb, out_b = _forward(recompute, x)
    checkpoint = recompute.self_attention.norm_out_checkpoint
    stored = checkpoint.outputs[0]
    assert stored.untyped_storage().nbytes() == 0, "norm output must be freed after the forward"
    calls_after_forward = len(validate_calls)
    out_b.backward(dy)
    assert stored.untyped_storage().nbytes() == stored.numel() * stored.element_size(), \
        "norm output must be rebuilt during backward"

    assert torch.equal(out_a, out_b)
    assert torch.equal(xa.grad, xb.grad)
    ga, gb = _grads(plain), _grads(recompute)
    assert ga.keys() == gb.keys() and len(ga) == len(list(plain.parameters()))
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name

    if fused:
        # one validation per forward; the recomputation in backward validates again, with grad on
        assert calls_plain == 1
        assert calls_after_forward - calls_plain == 1
        assert len(validate_calls) - calls_after_forward == 1
        assert validate_calls[-1] is True and validate_calls[-2] is False
    else:
        assert validate_calls == []


def test_recompute_validation_failure_surfaces_in_backward(validate_calls):
    """A module changed between forward and backward is caught by the recomputed validation."""
    _, recompute = _pair(True)
    x, dy = _inputs()
    _, out = _forward(recompute, x)
    recompute.self_attention.config.normalization = "LayerNorm"
    try:
        with pytest.raises(ValueError, match="requires normalization='RMSNorm'"):
            out.backward(dy)
    finally:
        recompute.self_attention.config.normalization = "RMSNorm"


def test_recompute_checkpoint_fp8_off_without_te_only_in_our_layer():
    """megatron's CheckpointWithoutOutput() takes TE's fp8 path (fp8 = True) and raises a
    NameError without TE. Our layer turns that off for its own checkpoint when TE is absent (the
    recompute test above runs through it: the CPU shims do not touch the class); megatron's class
    and every other checkpoint keep megatron's behaviour."""
    from megatron.core.tensor_parallel import CheckpointWithoutOutput
    from megatron.core.tensor_parallel import random as tensor_parallel_random

    _, recompute = _pair(True)
    x, dy = _inputs()
    _, out = _forward(recompute, x)
    assert recompute.self_attention.norm_out_checkpoint.fp8 is tensor_parallel_random.HAVE_TE
    out.backward(dy)
    assert CheckpointWithoutOutput().fp8 is True  # megatron's class: unchanged
    assert CheckpointWithoutOutput.__init__.__module__ == tensor_parallel_random.__name__


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_recompute_scales_the_out_norm_grad_once(fused):
    """At a TP rank whose out_norm dW the module completes (scale = tp), the recomputation in
    backward builds the scaled graph again: dW is scale x the unscaled one, with and without
    recompute, and every other gradient keeps its bits."""
    x, dy = _inputs()
    grads = {}
    for scale in (1.0, 2.0):
        for name, layer in zip(("plain", "recompute"), _pair(fused)):
            set_out_norm_grad_scale(layer.self_attention, scale)
            _, out = _forward(layer, x)
            out.backward(dy)
            grads[name, scale] = _grads(layer)
    key = "self_attention.out_norm.weight"
    for name in ("plain", "recompute"):
        assert torch.equal(grads[name, 2.0][key], 2.0 * grads[name, 1.0][key])
        for param in grads[name, 1.0]:
            if param != key:
                assert torch.equal(grads[name, 2.0][param], grads[name, 1.0][param]), param
    assert torch.equal(grads["plain", 2.0][key], grads["recompute", 2.0][key])


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_full_layer_recompute_is_bitwise_equal(method, validate_calls):
    """megatron's full recompute (``recompute_granularity='full'``) of a GDN hybrid GPT with the
    flag on: the same loss and every parameter's gradient, bit for bit."""
    from megatron.core.models.gpt import GPTModel

    from core.models import get_gdn_hybrid_block_spec

    def build(**recompute):
        config = gdn_config(num_layers=2, linear_attention_freq=2, params_dtype=torch.float32,
                            fused_gated_norm=True, **recompute)
        return GPTModel(config, transformer_layer_spec=get_gdn_hybrid_block_spec(config),
                        vocab_size=64, max_sequence_length=16)

    plain = build()
    full = build(recompute_granularity="full", recompute_method=method, recompute_num_layers=1)
    full.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    validate_calls.clear()
    mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
    results = []
    for model in (plain, full):
        loss = model(ids, torch.arange(16).expand(2, 16), attention_mask=mask, labels=ids)
        loss.mean().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    # the plain model's one fused forward; the recomputed model's forward without autograd,
    # then again in its backward
    assert validate_calls == [True, False, True]
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
