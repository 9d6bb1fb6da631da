"""tools/launch_sweep.py on the CPU: the candidate blocks, the ranking, the parts of each kernel
timed in turn, and its command line."""

from __future__ import annotations

import pytest
import torch

from tools import launch_sweep
from tools.bench_common import make_inputs
from tools.launch_sweep import ALTERNATIONS, ELEMENTS_PER_THREAD, best_lines, candidate_blocks

@pytest.mark.parametrize("dim", [64, 128, 256, 1000])
def test_sweep_candidates_keep_the_elements_per_thread_in_range(dim):
    blocks = candidate_blocks(dim)
    assert blocks
    width = 1 << (dim - 1).bit_length()
    low, high = ELEMENTS_PER_THREAD
    assert all(low <= bt * width // (32 * warps) <= high for bt, warps in blocks)
    if dim == 128:
        # the shipped forward and backward blocks, and the backward rule's 2-warp block
        assert {(16, 8), (4, 1), (4, 2)} <= set(blocks)


def test_sweep_best_lines_rank_by_time():
    results = [{"kernel": "fwd", "shape": (1, 8, 2, 128), "bt": bt, "warps": 4, "us": us,
                "pct": 1.0} for bt, us in ((8, 3.0), (16, 2.0))]
    results.append({"kernel": "fwd", "shape": (1, 8, 2, 128), "bt": 4, "warps": 2, "pdl": True,
                    "us": 2.5, "pct": 1.0, "shipped": True})
    fwd_line = best_lines(results)[0]
    assert fwd_line.startswith("fwd (1, 8, 2, 128): shipped bt4 w2 pdl 2.5 us")
    assert fwd_line.index("bt16") < fwd_line.index("bt8")


@pytest.mark.interpreter
def test_sweep_times_the_forwards_parts_in_turn(monkeypatch):
    """forward_parts runs each part once per alternation, every part before the next
    alternation, and reports the median of each; the launch into the output allocated once
    writes what the shipped forward returns; the copy writes one buffer in every call, or a new
    one per call."""
    order, results = [], []

    def one_run(fn):  # stands in for bench_graph: runs the part, "times" it by its position
        results.append(fn())
        order.append(fn)
        return float(len(order))

    monkeypatch.setattr(launch_sweep, "bench_graph", one_run)
    x, g, w, _, _ = make_inputs((1, 8, 2, 64), device="cpu")
    medians = launch_sweep.forward_parts(x.detach(), g.detach(), w.detach())
    names = ("forward_us", "forward_one_output_us", "same_bytes_copy_us",
             "same_bytes_copy_new_outputs_us")
    assert tuple(medians) == names
    assert len(order) == ALTERNATIONS * len(names)
    middle = ALTERNATIONS // 2
    assert medians == {name: float(middle * len(names) + i + 1) for i, name in enumerate(names)}
    by_part = {name: results[i::len(names)] for i, name in enumerate(names)}
    forwards = [out for name in names[:2] for out, _ in by_part[name]]
    assert all(torch.equal(out, forwards[0]) for out in forwards)
    for name, distinct in (("same_bytes_copy_us", 1),
                           ("same_bytes_copy_new_outputs_us", ALTERNATIONS)):
        written = by_part[name]
        assert all(copied is None and summed.numel() == x.numel() for summed, copied in written)
        assert len({id(summed) for summed, _ in written}) == distinct


@pytest.mark.interpreter
def test_sweep_times_the_backwards_parts_in_turn(monkeypatch):
    """backward_parts runs each part (the interpreter runs the kernels) once per alternation,
    every part before the next alternation, and reports the median of each; the row kernel's
    partials, summed by the dW sum, give backward_impl's dW."""
    import core.fusions.fused_gated_norm as fgn
    import core.fusions.gated_norm_plans as plans

    order = []

    def one_run(fn):  # stands in for bench_graph: runs the part, "times" it by its position
        fn()
        order.append(fn)
        return float(len(order))

    monkeypatch.setattr(launch_sweep, "bench_graph", one_run)
    x, g, w, dy, _ = make_inputs((1, 8, 2, 64), device="cpu")
    x, g, w = x.detach(), g.detach(), w.detach()
    _, rstd = fgn.forward_impl(x, g, w, 1e-6)
    sums = []
    summing = plans.launch_dw_sum.launch
    monkeypatch.setattr(plans.launch_dw_sum, "launch",
                        lambda grid, tensors, prepared, device=None: (
                            summing(grid, tensors, prepared, device),
                            sums.append(tensors[1].clone())))
    medians = launch_sweep.backward_parts(x, g, w, rstd, dy)
    names = ("row_kernel_us", "row_kernel_then_empty_us", "row_kernel_then_dw_sum_us",
             "dw_sum_us", "torch_dw_sum_us", "same_bytes_copy_us",
             "same_bytes_copy_new_outputs_us")
    assert tuple(medians) == names
    assert len(order) == ALTERNATIONS * len(names)
    middle = ALTERNATIONS // 2  # the median alternation: part i ran at position middle * 7 + i + 1
    assert medians == {name: float(middle * len(names) + i + 1) for i, name in enumerate(names)}
    summed = list(sums)  # backward_impl below sums through the same wrapped launch
    assert len(summed) == 2 * ALTERNATIONS  # after the row kernel, and alone
    dweight = fgn.backward_impl(x, g, w, rstd, dy)[2]
    assert all(torch.equal(s, dweight) for s in summed)


def test_sweep_blocks_replace_the_candidates(monkeypatch):
    """--blocks: exactly the given (rows, warps) pairs are swept, for both kernels, beside the
    shipped launches (which pass no block)."""
    launches = []

    def launch(kernel):  # stands in for the impls: records the block a launch asks for
        def impl(x, *args, **kwargs):
            launches.append((kernel, kwargs.get("bt"), kwargs.get("warps")))
            return x, None
        return impl

    monkeypatch.setattr(launch_sweep, "make_inputs", lambda shape: make_inputs(shape, device="cpu"))
    monkeypatch.setattr(launch_sweep, "bench_graph", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(launch_sweep, "forward_parts", lambda *args: {})
    monkeypatch.setattr(launch_sweep, "backward_parts", lambda *args: {})
    monkeypatch.setattr(launch_sweep.fgn, "forward_impl", launch("fwd"))
    monkeypatch.setattr(launch_sweep.fgn, "backward_impl", launch("bwd"))
    launch_sweep.sweep_shape((1, 8, 2, 64), 1.0, sms=1, programs_per_sm=(8,), stages_swept=(3,),
                             blocks=((8, 1), (16, 2)))
    for kernel in ("fwd", "bwd"):
        assert {(bt, warps) for k, bt, warps in launches if k == kernel} == {
            (None, None), (8, 1), (16, 2)}


@pytest.mark.parametrize("argv, message", [
    (["--stages", "0"], "--stages '0': expected comma-separated positive integers"),
    (["--programs-per-sm", "8,x"],
     "--programs-per-sm '8,x': expected comma-separated positive integers"),
    (["--shapes", "1x2"], "shape '1x2': expected BxSxHxD with four positive integers"),
    (["--blocks", "8x3"],
     "--blocks '8x3': expected comma-separated ROWSxWARPS pairs of powers of two"),
    (["--blocks", "8"], "--blocks '8': expected comma-separated ROWSxWARPS pairs of powers of two"),
])
def test_launch_sweep_arguments_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        launch_sweep.main(argv)
    assert message in capsys.readouterr().err
