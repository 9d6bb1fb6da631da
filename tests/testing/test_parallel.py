"""Helpers of core.testing.parallel, the layout harness (tests/ssm/test_gdn_layouts.py runs it)."""

import pytest
import torch

from core.testing.parallel import thd_cp_indices


def test_thd_cp_indices():
    """Each sequence's load-balanced context-parallel chunks: rank r takes chunks r and
    2 * cp - 1 - r of every sequence."""
    cu = torch.tensor([0, 8, 20])
    assert thd_cp_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 10, 17, 18, 19]
    assert thd_cp_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 11, 12, 13, 14, 15, 16]
    with pytest.raises(ValueError, match="not divisible by 2 x cp_size = 4"):
        thd_cp_indices(torch.tensor([0, 6]), 2, 0)
