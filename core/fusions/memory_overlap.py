"""Memory overlap of an ``out`` argument with the tensors a kernel reads: host metadata and
addresses only (no tensor is read). The checks read addresses, so they run on every call that is
given an ``out``, after the device rule (a meta tensor's address is 0).
"""

from __future__ import annotations

import torch


def check_rows_apart(entry: str, name: str, t: torch.Tensor) -> None:
    """No two elements of ``t`` share memory (ValueError): neither two rows (every index but the
    last dim's), each written by one program, nor two elements of a row. Sufficient test: with
    the dims sorted by stride, each stride spans everything inside it (a layout that
    interleaves elements otherwise is refused too). With a unit last stride this is the test of
    the row dims over rows of ``t.shape[-1]`` elements."""
    extent = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size > 1:
            if stride < extent:
                raise ValueError(
                    f"{entry}: {name} rows must not overlap each other or themselves (each "
                    f"element is written once): shape {tuple(t.shape)}, strides {t.stride()}"
                )
            extent = stride * (size - 1) + extent


def check_out_apart(entry: str, out: torch.Tensor, inputs: tuple, weight: torch.Tensor) -> None:
    """``out``'s elements are apart (check_rows_apart); ``out`` is each ``(name, tensor)`` of
    ``inputs`` itself (computed in place: a program reads its rows before it writes them) or
    does not overlap it; it never overlaps the weight, which every program reads (ValueError)."""
    check_rows_apart(entry, "out", out)
    if out.numel() == 0:
        return
    # Byte spans first (cheap); the exact test only where they meet.
    out_lo, out_hi = byte_span(out)
    for name, t in inputs:
        if t is out or t.numel() == 0:
            continue
        lo, hi = byte_span(t)
        if lo < out_hi and out_lo < hi and overlap(out, t) == "partial":
            raise ValueError(
                f"{entry}: out must either be {name} itself (same data_ptr, shape and strides) "
                f"or not overlap it; it partially overlaps {name}"
            )
    if weight.numel():
        lo, hi = byte_span(weight)
        if lo < out_hi and out_lo < hi and overlap(out, weight) != "none":
            raise ValueError(f"{entry}: out must not overlap weight (every program reads weight)")


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses of t's elements (t non-empty, non-negative strides)."""
    start = t.data_ptr()
    last = 1
    for n, s in zip(t.shape, t.stride()):
        last += (n - 1) * s
    return start, start + last * t.element_size()


def overlap(a: torch.Tensor, b: torch.Tensor) -> str:
    """'none', 'same' (identical view) or 'partial' (any other sharing, conservatively).

    torch's own overlap check (torch._C._overlaps) answers "too hard" for non-dense views such
    as a slice of a packed projection, so the spans are compared here from the metadata."""
    if a.numel() == 0 or b.numel() == 0:
        return "none"
    (a_lo, a_hi), (b_lo, b_hi) = byte_span(a), byte_span(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return "none"
    if a_lo == b_lo and a.shape == b.shape and a.dtype == b.dtype and all(
            sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1):
        return "same"  # the stride of a size-1 dim addresses nothing
    if _interleaved_rows_disjoint(_token_rows(a), _token_rows(b)):
        return "none"
    return "partial"


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """t as 2-D rows of its last two dims (a [B, S, H, D] view as [tokens, H * D]) where such a
    view exists, else t."""
    if t.dim() > 2:
        try:
            return t.view(-1, t.shape[-2] * t.shape[-1])
        except RuntimeError:
            pass
    return t


def _interleaved_rows_disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact test for two 2-D views with unit last stride and one common row pitch, such as two
    column slices of one packed buffer: their spans intersect, their elements need not.

    Row i of a covers [a_lo + i*p, a_lo + i*p + wa) and row j of b [b_lo + j*p, b_lo + j*p + wb)
    (bytes). With d = b_lo - a_lo and k = i - j, they meet iff (d - wa) / p < k < (d + wb) / p
    for some k in [-(rows_b - 1), rows_a - 1]."""
    if a.dim() != 2 or b.dim() != 2 or a.stride(1) != 1 or b.stride(1) != 1:
        return False
    size = a.element_size()
    pitch = a.stride(0) * size
    wa, wb = a.shape[1] * size, b.shape[1] * b.element_size()
    if b.stride(0) * b.element_size() != pitch or pitch < max(wa, wb):
        return False
    d = b.data_ptr() - a.data_ptr()
    k_lo = max((d - wa) // pitch + 1, -(b.shape[0] - 1))
    k_hi = min(-(-(d + wb) // pitch) - 1, a.shape[0] - 1)
    return k_lo > k_hi
