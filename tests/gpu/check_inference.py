"""GPU-only checks of the inference entry point (run by the device, not collected by pytest).

    python tests/gpu/check_inference.py

1. More than 2**31 elements per tensor, in place, z a slice of a packed projection: first and
   last rows equal the one-rounding reference (64-bit offsets).
2. CUDA-graph capture and replay give the same bits as an eager call.
3. Host cost per call (validation alone, the whole call) at one token, where the launch is
   host-bound.
4. Timing (do_bench, median) of the inference call vs the training forward at serving shapes.
The parity tests run on the GPU with `pytest tests/fusions/test_gated_norm_inference.py`.
"""

from __future__ import annotations

import json
import time

import torch
from triton.testing import do_bench

from core.fusions import fused_gdn_gated_rms_norm
from core.fusions.fused_gated_norm import fused_gated_norm
from core.fusions.gated_norm_reference import one_rounding_gated_norm

EPS = 1e-6
HEADS, DIM = 32, 128


def reference(x, z, weight):
    split = lambda t: t.unflatten(-1, (HEADS, DIM))  # noqa: E731
    return one_rounding_gated_norm(split(x), split(z), weight, EPS).flatten(-2)


def big_tensor_check() -> dict:
    tokens = 540_000
    width = HEADS * DIM
    assert tokens * width > 2**31
    gen = torch.Generator(device="cuda").manual_seed(0)
    proj = torch.randn(tokens, 2 * width, device="cuda", dtype=torch.bfloat16, generator=gen)
    x, z = proj[:, :width], proj[:, width:]  # x in place inside the packed buffer, z beside it
    weight = (1 + 0.1 * torch.randn(DIM, device="cuda", generator=gen)).to(torch.bfloat16)
    rows = {"head": slice(0, 1000), "tail": slice(tokens - 1000, tokens)}
    refs = {k: reference(x[s], z[s], weight) for k, s in rows.items()}
    fused_gdn_gated_rms_norm(x, z, weight, x, EPS, HEADS, DIM)
    torch.cuda.synchronize()
    result = {"numel": tokens * width}
    for k, s in rows.items():
        result[f"{k}_bitwise"] = (x[s] == refs[k]).float().mean().item()
    return result


def cuda_graph_check() -> dict:
    tokens = 4096
    x = torch.randn(tokens, HEADS * DIM, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(tokens, 3 * HEADS * DIM, device="cuda", dtype=torch.bfloat16)[:, HEADS * DIM:2 * HEADS * DIM]
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
    return {"graph_equals_eager": torch.equal(out, eager),
            "graph_bitwise_vs_reference": (out == reference(x, z, weight)).float().mean().item()}


def host_overhead() -> dict:
    import core.fusions.gated_norm_inference as mod

    x = torch.randn(1, HEADS * DIM, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(1, 2 * HEADS * DIM, device="cuda", dtype=torch.bfloat16)[:, HEADS * DIM:]
    weight = torch.rand(DIM, device="cuda", dtype=torch.bfloat16)
    calls = {
        "validation_us": lambda: mod._check_inputs(x, z, weight, x, EPS, HEADS, DIM, True, "swish"),
        "call_us": lambda: fused_gdn_gated_rms_norm(x, z, weight, x, EPS, HEADS, DIM),
    }
    result = {}
    with torch.inference_mode():
        for name, fn in calls.items():
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(1000):
                    fn()
                best = min(best, (time.perf_counter() - start) * 1e3)  # us per call
            torch.cuda.synchronize()
            result[name] = round(best, 2)
    return result


def timing() -> list[dict]:
    rows = []
    for tokens in (1, 64, 1024, 8192, 65536):
        width = HEADS * DIM
        x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
        z = torch.randn(tokens, 2 * width, device="cuda", dtype=torch.bfloat16)[:, width:]
        weight = torch.rand(DIM, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        infer = do_bench(lambda: fused_gdn_gated_rms_norm(x, z, weight, out, EPS, HEADS, DIM))
        split = lambda t: t.unflatten(-1, (HEADS, DIM)).unsqueeze(0)  # noqa: E731
        with torch.no_grad():
            train = do_bench(lambda: fused_gated_norm(split(x), split(z), weight, EPS))
        gbytes = 3 * x.numel() * x.element_size() / 1e9
        rows.append({"tokens": tokens, "inference_us": round(infer * 1e3, 2),
                     "inference_TBps": round(gbytes / infer, 2),  # GB / ms = TB / s
                     "training_fwd_us": round(train * 1e3, 2)})
    return rows


if __name__ == "__main__":
    print(json.dumps({"big_tensor": big_tensor_check()}), flush=True)
    torch.cuda.empty_cache()
    print(json.dumps({"cuda_graph": cuda_graph_check()}), flush=True)
    print(json.dumps({"host_overhead": host_overhead()}), flush=True)
    for row in timing():
        print(json.dumps(row), flush=True)
