"""Where the forward's rare differences from the unfused path come from, at 1M rows: the unfused
path recomputed with *our* rstd (the order of the fp32 sum of squares taken out) shows what is
left for the other operations (rsqrt, silu's exp, the products, the two roundings); rstd is
compared with torch's and with the correctly rounded value (float64 sum).

    python tools/parity_sources.py [--out DIR]      # -> DIR/parity_sources.json

tests/fusions/test_fused_gated_norm_gpu.py asserts the conclusion (no difference is left once the
rstd is shared); docs/numerics.md quotes the figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from core.fusions.gated_norm_reference import ulp_distance, unfused_gated_norm  # noqa: E402
from tools.bench_common import EPS, measure_and_write  # noqa: E402

import core.fusions.fused_gated_norm as fgn  # noqa: E402

SHAPE = (1, 32768, 32, 128)


def differing_share(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a != b).float().mean().item()


def parity_sources(shape=SHAPE, device="cuda") -> dict:
    gen = torch.Generator(device=device).manual_seed(7)
    x = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
    gate = (2 * torch.randn(shape, device=device, generator=gen)).to(torch.bfloat16)
    weight = (1 + 0.2 * torch.randn(shape[-1], device=device, generator=gen)).to(torch.bfloat16)
    out, rstd = fgn.forward_impl(x, gate, weight, EPS)
    rstd_torch = torch.rsqrt(x.float().pow(2).mean(-1) + EPS)
    rstd_exact = torch.rsqrt(x.double().pow(2).mean(-1) + EPS).float()
    ref = unfused_gated_norm(x, gate, weight, EPS)
    ref_our_rstd = unfused_gated_norm(x, gate, weight, EPS, rstd=rstd)
    rows_differ = (out != ref).any(-1)
    rstd_differs = rstd != rstd_torch
    return {
        "shape": list(shape), "elements": out.numel(), "rows": rstd.numel(),
        "out_vs_unfused": {"differ": differing_share(out, ref),
                           "max_ulp": ulp_distance(out, ref).max().item()},
        "rows_with_a_difference": rows_differ.sum().item(),
        "of_them_rstd_differs": (rows_differ & rstd_differs).sum().item(),
        "rstd_vs_torch": {"differ": rstd_differs.float().mean().item(),
                          "max_ulp": ulp_distance(rstd, rstd_torch).max().item()},
        "rstd_vs_correctly_rounded": {"ours_differ": differing_share(rstd, rstd_exact),
                                      "torch_differ": differing_share(rstd_torch, rstd_exact)},
        "out_vs_unfused_with_our_rstd": {"differ": differing_share(out, ref_our_rstd),
                                         "max_ulp": ulp_distance(out, ref_our_rstd).max().item()},
    }


def main(argv=None) -> None:
    measure_and_write(argv, __doc__, "parity_sources", parity_sources)


if __name__ == "__main__":
    main()
