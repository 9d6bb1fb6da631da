"""tools/pre_gdr_benchmark.py on the CPU: its byte floor, its inputs and region call against the
reference, its launch sweep's candidates, the kernel copies of --backward-parts, and its refusal
without a GPU (the timings and parity need one)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from core.fusions.pre_gated_delta_rule_reference import unfused_pre_gated_delta_rule
from tools import pre_gdr_benchmark as bench


def test_region_bytes_count_each_tensor_once():
    # B = 1, S = 2, 4 value heads (2 key heads) of 128: the in_proj output read is
    # q, k (2 x 2 x 128), v (4 x 128), beta and alpha (2 x 4) per token, bf16
    read = 2 * (2 * 2 * 128 + 4 * 128 + 2 * 4) * 2
    # q, k repeated to the value heads, v, beta in bf16; g in fp32
    written = 2 * (2 * 4 * 128 + 4 * 128 + 4) * 2 + 2 * 4 * 4
    assert bench.region_bytes(1, 2, 4) == {"forward": read + written,
                                           "forward_backward": 3 * read + 2 * written}


@pytest.mark.interpreter
def test_ours_is_the_fused_region_of_the_benchmark_inputs():
    qkvzba, weight, a_log, dt_bias = bench.region_inputs(1, 6, 2, device="cpu")
    assert qkvzba.transpose(0, 1).is_contiguous()  # the bshd view of an sbhd buffer
    ours = bench.ours(qkvzba, weight, a_log, dt_bias, 2)
    ref = unfused_pre_gated_delta_rule(qkvzba, weight, None, a_log, dt_bias, **bench.heads(2))
    for name, a, b in zip(("q", "k", "v", "gate", "beta"), ours[:4] + ours[5:],
                          ref[:4] + ref[5:]):
        assert torch.equal(a, b), name


def test_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--quick"])


def test_sweep_varies_one_kernel_at_a_time():
    default = bench.region.Launch(forward_tokens=32, forward_warps=4, backward_chunk=32,
                                  backward_rows=4, backward_warps=1)
    seen = {}
    for kernel, launch in bench.sweep_candidates(default):
        changed = {f for f in launch._fields if getattr(launch, f) != getattr(default, f)}
        assert changed <= set(bench.SWEEP[kernel]), (kernel, changed)
        seen.setdefault(kernel, set()).add(launch)
    for kernel, fields in bench.SWEEP.items():  # every combination, none twice
        assert len(seen[kernel]) == math.prod(len(v) for v in fields.values()), kernel
    assert {kernel for kernel, _ in bench.sweep_candidates(default, ("backward",))} == {
        "backward"}


@pytest.mark.interpreter
def test_backward_parts_leave_their_steps_out(monkeypatch):
    """Each step's line is in the kernel (the copies cannot go stale unnoticed), and the copy
    without dx's sum computes another d(qkvzba) from the same inputs."""
    (qkvzba, weight, a_log, dt_bias), shape, grads = bench.impl_inputs(1, 40, 2, device="cpu")

    def dx():
        out = bench.region.backward_impl(qkvzba, weight, None, a_log, dt_bias, shape, *grads)[0]
        return out[..., :shape.gate_slice.start].clone()  # the gate's slice is left unwritten

    full = dx()
    kernel_source = Path(bench.kernels.__file__).read_text()
    copy_source = Path(bench.kernels_without(tuple(bench.BACKWARD_STEPS)).__file__).read_text()
    for line, _ in bench.BACKWARD_STEPS.values():
        assert line in kernel_source and line not in copy_source
    monkeypatch.setattr(bench.region, "pre_gdr_bwd", bench.kernels_without(
        ("dx_sum",)).pre_gdr_bwd)
    assert not torch.equal(dx(), full)


def test_sweep_keeps_going_past_a_launch_that_fails(monkeypatch, tmp_path):
    """A launch that cannot run (compile error, out of resources) is recorded with its error;
    the other launches are still timed and the best is taken among them."""
    inputs = bench.impl_inputs(1, 40, 2, device="cpu")
    monkeypatch.setattr(bench, "impl_inputs", lambda *args: inputs)
    monkeypatch.setattr(bench, "environment", lambda: {})

    def fake_bench_graph(fn):  # a time from the launch launch_for returns now; nothing runs
        launch = bench.region.launch_for(None, 0)
        if launch.backward_stages == 3:
            raise RuntimeError("out of resource: shared memory")
        return launch.backward_chunk + launch.backward_rows

    monkeypatch.setattr(bench, "bench_graph", fake_bench_graph)
    results = bench.sweep(str(tmp_path), shapes=[(1, 40, 2)], swept=("backward",))
    failed = [r for r in results["rows"] if "error" in r]
    timed = [r for r in results["rows"] if "us" in r]
    assert failed and all(r["launch"]["backward_stages"] == 3 for r in failed)
    assert "RuntimeError: out of resource" in failed[0]["error"]
    assert len(failed) + len(timed) == math.prod(len(v) for v in bench.SWEEP["backward"].values())
    assert min(r["us"] for r in timed) == 16 + 2
    assert (tmp_path / "pre_gdr_launch_sweep.json").exists()
