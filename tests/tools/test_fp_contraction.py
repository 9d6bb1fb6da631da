"""tools/fp_contraction.py on the CPU: both settings reach the kernels' launches, the shipped
option comes back, and the accuracy it reports is the tests' measure."""

from __future__ import annotations

import pytest
import torch

import core.fusions.gated_norm_plans as plans
from tools import fp_contraction


class _OptionSpy:
    """Wraps a kernel: records the ``enable_fp_fusion`` each launch asks for, then launches."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.seen.append(kwargs.get("enable_fp_fusion"))
            return launch(*args, **kwargs)
        return run


@pytest.mark.interpreter
@pytest.mark.interpreter_backward
def test_both_settings_reach_every_launch_and_the_shipped_one_returns(monkeypatch):
    seen = []
    for launcher in fp_contraction.LAUNCHERS:
        monkeypatch.setattr(launcher, "kernel", _OptionSpy(launcher.kernel, seen))
    rows = fp_contraction.measure_shape((1, 8, 2, 64), timed=False, device="cpu")
    assert [r["fp_contraction"] for r in rows] == [True, False]
    # each setting: the forward twice (fused and inside autograd) and the backward's two kernels
    assert seen == [True] * 4 + [False] * 4
    assert all(launcher.compile_options == plans.COMPILE_OPTIONS
               for launcher in fp_contraction.LAUNCHERS)
    for row in rows:  # the interpreter ignores the option: both rows are the shipped numerics
        assert row["bitwise_share"] >= 0.99 and row["max_ulps"] <= 2
        for name in fp_contraction.GRADIENTS:
            assert row["grad_rel_err"][name] <= 1.01 * row["unfused_grad_rel_err"][name] + 1e-6
    assert "on   bitwise" in fp_contraction.describe(rows[0])


def test_the_command_needs_a_gpu_and_checks_its_shapes(monkeypatch):
    with pytest.raises(ValueError, match="expected BxSxHxD"):
        fp_contraction.main(["--shapes", "1x2x3"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fp_contraction.main(["--shapes", "1x8x2x64"])
