"""The input rules (core.fusions.gated_norm_validation) taken one by one: the current-device
rule, the gate activation's spellings, the launch-override limits and the row limit. The rules
as each entry applies them (every bad argument, before any launch): test_fused_gated_norm.py,
test_validate_gated_norm.py and test_gated_norm_inference.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton.language as tl

import core.fusions.gated_norm_validation as validation


def test_kernels_take_tensors_of_the_current_cuda_device_only():
    """Checked on the GPU before every launch (check_operands), here with the device numbers."""
    validation.check_current_device("fused_gated_norm", torch.device("cuda", 1), 1)
    with pytest.raises(ValueError, match=r"x must be on the current CUDA device \(cuda:0\), where "
                                         r"the kernels launch, got cuda:1"):
        validation.check_current_device("fused_gated_norm", torch.device("cuda", 1), 0)


@pytest.mark.parametrize("fn, name", [(F.silu, "silu"), (torch.sigmoid, "sigmoid"),
                                      (F.sigmoid, "sigmoid"), (F.gelu, None),
                                      (torch.nn.SiLU, None)],
                         ids=["F.silu", "torch.sigmoid", "F.sigmoid", "F.gelu", "nn.SiLU"])
def test_gate_activation_name_knows_every_spelling_of_the_kernels_functions(fn, name):
    """megatron's activation_func may be either sigmoid function (they are distinct objects);
    a module class is not an activation function there."""
    assert validation.gate_activation_name(fn) == name


def test_launch_overrides_up_to_their_maxima():
    validation.check_launch_overrides("entry", (("bt", 2**16), ("warps", 32), ("programs", 2**16)),
                                      ())
    for name, value in (("bt", 2**17), ("warps", 64), ("programs", 2**16 + 1)):
        with pytest.raises(ValueError, match=f"entry: {name}"):
            validation.check_launch_overrides("entry", ((name, value),), ())


def test_launch_tile_up_to_tritons_limit():
    limit = tl.TRITON_MAX_TENSOR_NUMEL
    validation.check_launch_tile("entry", "bt", limit // 128, 128, "a row")
    with pytest.raises(ValueError, match=f"entry: bt must be <= {limit // 128} here"):
        validation.check_launch_tile("entry", "bt", limit // 128 + 1, 128, "a row")


def test_dependent_launch_needs_hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    validation.check_dependent_launch("entry", "pdl", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 9))
    with pytest.raises(ValueError, match="entry: pdl=True needs programmatic dependent launch"):
        validation.check_dependent_launch("entry", "pdl", torch.device("cuda", 0))


def test_row_count_limit_is_exact():
    validation.check_rows("entry", "rows", validation.MAX_ROWS)
    with pytest.raises(ValueError, match=f"entry: rows must be <= {validation.MAX_ROWS}"):
        validation.check_rows("entry", "rows", validation.MAX_ROWS + 1)
