"""tools/forward_variants.py on the CPU: every variant writes what the shipped forward writes."""

from __future__ import annotations

import pytest
import torch

import core.fusions.fused_gated_norm as kernel_module
from tests.gated_norm_inputs import EPS, make_inputs
from tools.forward_variants import variant_launches


@pytest.mark.interpreter
@pytest.mark.interpreter_backward  # the grid-stride variants run the backward's kind of loop
@pytest.mark.parametrize("dim", [64, 128])
def test_every_variant_writes_the_shipped_forwards_bits(dim):
    x, gate, weight = make_inputs((1, 37, 4, dim), torch.bfloat16)  # a partial last block
    want, want_rstd = kernel_module.forward_impl(x, gate, weight, EPS)
    out, rstd = torch.empty_like(x), torch.empty(x.numel() // dim)
    launches = variant_launches(x, gate, weight, out, rstd, EPS, programs_cap=3)
    assert len(launches) == 3 * (8 + 1)  # per block: 2 x 2 x 2 choices, and the loop
    for name, launch in launches:
        out.fill_(float("nan"))
        rstd.fill_(float("nan"))
        launch()
        assert torch.equal(out, want), name
        assert torch.equal(rstd, want_rstd.flatten()), name
