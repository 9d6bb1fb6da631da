"""What an ``out`` may share with the tensors a kernel reads (core.fusions.memory_overlap): the
overlap of two views from their metadata and addresses, and rows written by one program each
(their elements apart too, whatever the last-dim stride)."""

from __future__ import annotations

import pytest
import torch

import core.fusions.memory_overlap as memory_overlap


def test_overlap_of_views():
    """Column slices of one packed buffer: their spans intersect, their elements do not; the
    exact test also takes [tokens, heads, dim] views of them. Anything else that shares bytes is
    a partial overlap (conservatively), an identical view the same."""
    buf = torch.zeros(4, 40, dtype=torch.bfloat16)
    a, b = buf[:, :16], buf[:, 16:32]
    assert memory_overlap.overlap(a, b) == "none" and memory_overlap.overlap(b, a) == "none"
    assert memory_overlap.overlap(a, buf[:, 15:31]) == "partial"
    apart = buf[1:, 32:40].unflatten(1, (1, 8))
    assert memory_overlap.overlap(a.unflatten(1, (2, 8)), apart) == "none"
    assert memory_overlap.overlap(a, buf[1:, 8:24].unflatten(1, (2, 8))) == "partial"
    assert memory_overlap.overlap(a, buf.t()[:16].t()) == "same"
    rows = torch.zeros(3, 1, 16)  # the same memory whatever the stride of the size-1 dim
    assert memory_overlap.overlap(rows, rows.as_strided((3, 1, 16), (16, 48, 1))) == "same"
    assert memory_overlap.overlap(a, buf[:0]) == "none"
    sbhd = torch.zeros(8, 2, 16).transpose(0, 1)  # no [tokens, 16] view: conservative
    assert memory_overlap.overlap(sbhd, torch.zeros(8, 2, 16)[:, :, 8:].transpose(0, 1)) == "none"
    assert memory_overlap.overlap(sbhd[:, :, :8], sbhd[:, :, 8:]) == "partial"


def test_overlap_at_the_edges_of_two_spans():
    s = torch.zeros(64)
    # out's first element is x's last one: they share memory
    assert memory_overlap.overlap(s[:32].view(1, 2, 2, 8), s[31:63].view(1, 2, 2, 8)) == "partial"
    assert memory_overlap.overlap(s[:8], s[8:16]) == "none"  # adjacent, not overlapping


@pytest.mark.parametrize("view, apart", [
    (lambda t: t, True),
    (lambda t: t[:, :, :1].expand(2, 3, 4, 16), False),  # four heads on one row
    (lambda t: t.transpose(0, 1), True),  # an sbhd view
    (lambda t: torch.zeros(2, 3, 64).as_strided((2, 3, 4, 16), (192, 64, 8, 1)), False),
    (lambda t: t[:, :1].expand(2, 1, 4, 16), True),  # a size-1 dim takes any stride
    # the boundary: heads exactly one row apart, or one element closer
    (lambda t: torch.zeros(96).as_strided((1, 1, 4, 16), (64, 64, 16, 1)), True),
    (lambda t: torch.zeros(96).as_strided((1, 1, 4, 16), (64, 64, 15, 1)), False),
    (lambda t: torch.zeros(200).as_strided((1, 3, 4, 16), (192, 64, 16, 1)), True),
    (lambda t: torch.zeros(200).as_strided((1, 3, 4, 16), (192, 63, 16, 1)), False),
    # any last-dim stride: every second element, heads interleaved with elements, a row that
    # reaches into the next one, one element for the whole row
    (lambda t: torch.zeros(2, 3, 4, 32)[..., ::2], True),
    (lambda t: torch.zeros(64).as_strided((1, 1, 2, 16), (64, 64, 1, 2)), True),
    (lambda t: torch.zeros(64).as_strided((1, 1, 2, 16), (64, 64, 16, 2)), False),
    (lambda t: t[..., :1].expand(2, 3, 4, 16), False),
])
def test_rows_apart(view, apart):
    t = view(torch.zeros(2, 3, 4, 16))
    if apart:
        memory_overlap.check_rows_apart("entry", "out", t)
    else:
        with pytest.raises(ValueError, match="entry: out rows must not overlap each other"):
            memory_overlap.check_rows_apart("entry", "out", t)
