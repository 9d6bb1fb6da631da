"""The inference entry point on a CUDA GPU: 64-bit offsets past 2**31 elements (in place, z a
slice of a packed projection) and CUDA-graph replay. Parity at small sizes runs on the CPU in
tests/fusions/test_gated_norm_inference.py."""

from __future__ import annotations

import pytest
import torch

from core.fusions import fused_gdn_gated_rms_norm
from core.fusions.gated_norm_reference import inference_gated_norm
from tests.gated_norm_checks import assert_bitwise_or_within_ulps
from tests.gated_norm_inputs import EPS

pytestmark = pytest.mark.gpu

HEADS, DIM = 32, 128


def test_more_than_2_31_elements_in_place():
    tokens, width = 540_000, HEADS * DIM
    assert tokens * width > 2**31
    gen = torch.Generator(device="cuda").manual_seed(0)
    proj = torch.randn(tokens, 2 * width, device="cuda", dtype=torch.bfloat16, generator=gen)
    x, z = proj[:, :width], proj[:, width:]  # x in place inside the packed buffer, z beside it
    weight = (1 + 0.1 * torch.randn(DIM, device="cuda", generator=gen)).to(torch.bfloat16)
    rows = (slice(0, 1000), slice(tokens - 1000, tokens))
    refs = [inference_gated_norm(x[r], z[r], weight, EPS, DIM) for r in rows]
    fused_gdn_gated_rms_norm(x, z, weight, x, EPS, HEADS, DIM)
    for r, ref in zip(rows, refs):
        assert_bitwise_or_within_ulps(x[r], ref)


def test_cuda_graph_replay_matches_eager():
    tokens = 4096
    x = torch.randn(tokens, HEADS * DIM, device="cuda", dtype=torch.bfloat16)
    packed = torch.randn(tokens, 3 * HEADS * DIM, device="cuda", dtype=torch.bfloat16)
    z = packed[:, HEADS * DIM:2 * HEADS * DIM]
    weight = torch.rand(DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    fused_gdn_gated_rms_norm(x, z, weight, out, EPS, HEADS, DIM)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_gdn_gated_rms_norm(x, z, weight, out, EPS, HEADS, DIM)
    x.copy_(torch.randn_like(x))
    graph.replay()
    eager = torch.empty_like(out)
    fused_gdn_gated_rms_norm(x, z, weight, eager, EPS, HEADS, DIM)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert_bitwise_or_within_ulps(out, inference_gated_norm(x, z, weight, EPS, DIM))
