"""Names of core.fusions: ``core.fusions.fused_gated_norm`` is the training module (importable,
patchable), ``core.fusions.fused_gdn_gated_rms_norm`` the inference function."""

from __future__ import annotations

import types
from unittest import mock

import torch

from tests.gated_norm_inputs import EPS, make_inputs


def test_fused_gated_norm_is_the_module():
    import core.fusions
    import core.fusions.fused_gated_norm as module

    assert isinstance(module, types.ModuleType)
    assert core.fusions.fused_gated_norm is module
    seeds = ("fused_gated_norm", "forward_impl", "backward_impl", "_FusedGatedNorm",
             "gated_norm_fwd", "gated_norm_bwd", "_row_offset", "validate_gated_norm")
    for name in seeds:
        assert hasattr(module, name), name
    assert set(seeds) <= set(module.__all__)
    assert callable(module.fused_gated_norm)
    assert not isinstance(module.fused_gated_norm, types.ModuleType)


def test_patching_the_module_takes_effect():
    """mock.patch resolves "core.fusions.fused_gated_norm" through the package attribute: it must
    be the module, or the patch lands on something the entry never calls."""
    from core.fusions.fused_gated_norm import forward_buffer, forward_impl, fused_gated_norm

    x, gate, weight = make_inputs((1, 2, 2, 64))
    with mock.patch("core.fusions.fused_gated_norm.forward_buffer", wraps=forward_buffer) as spy:
        out = fused_gated_norm(x, gate, weight, EPS)
    assert spy.call_count == 1
    assert torch.equal(out, forward_impl(x, gate, weight, EPS)[0])


def test_inference_entry_is_the_function():
    from core.fusions import fused_gdn_gated_rms_norm
    from core.fusions.gated_norm_inference import fused_gdn_gated_rms_norm as defined

    assert isinstance(fused_gdn_gated_rms_norm, types.FunctionType)
    assert fused_gdn_gated_rms_norm is defined
