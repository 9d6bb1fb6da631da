"""core.transformer.RMSNorm: the TE-free output norm (fp32 math, one rounding to
promote_types(x, weight)), zero-centred gamma, params_dtype, SP tagging; LocalNorm dispatch."""

import pytest
import torch

from core.testing.gdn import gdn_config
from core.transformer import LocalNorm, RMSNorm


def _reference(x, w, eps, zero_centered):
    xd = x.double()
    wd = w.double() + (1.0 if zero_centered else 0.0)
    y = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps) * wd
    return y


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.float32),
                                              (torch.float16, torch.float16)])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.cpu_shims
def test_numerics_one_rounding(x_dtype, w_dtype, zero_centered):
    config = gdn_config(params_dtype=w_dtype, bf16=False, fp16=False)
    norm = RMSNorm(config, hidden_size=48, eps=1e-5, zero_centered_gamma=zero_centered)
    assert norm.weight.dtype == w_dtype and norm.zero_centered_gamma is zero_centered
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48) * 0.2 + (0.0 if zero_centered else 1.0))
    x = torch.randn(5, 3, 48).to(x_dtype)
    y = norm(x)
    out_dtype = torch.promote_types(x_dtype, w_dtype)
    assert y.dtype == out_dtype
    # fp32 math then one rounding: equal to the float64 value rounded, up to fp32 error.
    ref = _reference(x, norm.weight, 1e-5, zero_centered)
    fp32 = (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-5)
            * (norm.weight.float() + (1.0 if zero_centered else 0.0)))
    torch.testing.assert_close(y, fp32.to(out_dtype), rtol=0, atol=0)
    torch.testing.assert_close(y.double(), ref.to(out_dtype).double(),
                               rtol=1e-2 if out_dtype != torch.float32 else 1e-5, atol=1e-5)


@pytest.mark.cpu_shims
def test_init_zero_centered_from_config_and_sp_tag():
    config = gdn_config(layernorm_zero_centered_gamma=True)
    norm = RMSNorm(config, hidden_size=8, eps=1e-6)
    assert norm.zero_centered_gamma
    assert torch.equal(norm.weight, torch.zeros(8, dtype=torch.bfloat16))
    assert norm.weight.sequence_parallel is False
    assert norm.eps == 1e-6 and getattr(norm, "bias", None) is None
    plain = RMSNorm(gdn_config(), hidden_size=8)
    assert torch.equal(plain.weight, torch.ones(8, dtype=torch.bfloat16))


def test_default_eps_and_weight_device(monkeypatch):
    """eps defaults to megatron's 1e-5; without use_cpu_initialization the weight is made on
    the current CUDA device (a stand-in device here)."""
    assert RMSNorm(gdn_config(), hidden_size=8).eps == 1e-5
    config = gdn_config()
    config.use_cpu_initialization = False
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "meta")
    assert RMSNorm(config, hidden_size=8).weight.device.type == "meta"


def test_local_norm_takes_the_builders_zero_centring():
    for zero_centered in (True, False):
        norm = LocalNorm(config=gdn_config(layernorm_zero_centered_gamma=not zero_centered),
                         hidden_size=8, eps=1e-5, zero_centered_gamma=zero_centered)
        assert norm.zero_centered_gamma is zero_centered


def test_local_norm_dispatch():
    assert isinstance(LocalNorm(config=gdn_config(), hidden_size=8, eps=1e-5), RMSNorm)
    ln = LocalNorm(config=gdn_config(normalization="LayerNorm"), hidden_size=8, eps=1e-5)
    assert isinstance(ln, torch.nn.LayerNorm)


@pytest.mark.parametrize("kwargs,error,message", [
    ({"zero_centered_gamma": "False"}, TypeError, "RMSNorm: zero_centered_gamma must be a bool"),
    ({"zero_centered_gamma": 0}, TypeError, "RMSNorm: zero_centered_gamma must be a bool"),
    ({"eps": "1e-5"}, TypeError, "RMSNorm: eps must be a Python float or int"),
    ({"eps": 0.0}, ValueError, "RMSNorm: eps must be finite and > 0"),
], ids=["string-flag", "int-flag", "string-eps", "zero-eps"])
def test_arguments_are_not_coerced(kwargs, error, message):
    with pytest.raises(error, match=message):
        RMSNorm(gdn_config(), hidden_size=8, **kwargs)


def test_config_flag_is_not_coerced():
    config = gdn_config()
    config.layernorm_zero_centered_gamma = "false"  # would read as True
    with pytest.raises(TypeError, match="config.layernorm_zero_centered_gamma must be a bool"):
        RMSNorm(config, hidden_size=8)
