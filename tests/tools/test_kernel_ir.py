"""tools/kernel_ir.py compiles the kernels for sm_90 without a GPU (even when the pytest process
runs the interpreter) and reports the row reduction's layout, which decides a row's bits.
Checks the claims of docs/design.md (Launch choices: a row's bits follow its layout) on Triton's real
compiler output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def kernel_ir(*args: str) -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # the tool must compile anyway
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_ir.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def layouts(reports):
    return [tuple(r["row_layout"][0].values()) for r in reports]


def test_aligned_rows_keep_their_layout_with_fewer_warps():
    # D = 128, bf16: the regular block (16 rows, 8 warps) and the small-grid block (8 rows,
    # 2 warps) both give a row 8 elements x 16 lanes of one warp.
    reports = kernel_ir("--dim", "128", "--bt", "16", "--warps", "8", "--bt", "8", "--warps", "2")
    assert layouts(reports) == [(8, 16, 1), (8, 16, 1)]
    assert all(r["sass_instructions"] > 100 for r in reports)


def test_unaligned_rows_spread_over_the_blocks_warps():
    # One element per thread: the row spans 4 of the regular block's 8 warps, 2 of the small
    # block's 2, so the two blocks sum a row in different orders.
    reports = kernel_ir("--dim", "128", "--bt", "16", "--warps", "8", "--bt", "8", "--warps", "2",
                        "--unaligned")
    assert layouts(reports) == [(1, 32, 4), (1, 32, 2)]


def test_backward_row_layout_at_d256_fp32():
    (report,) = kernel_ir("--kernel", "bwd", "--dim", "256", "--dtype", "fp32", "--bt", "4",
                          "--warps", "4")
    assert report["kernel"] == "bwd"
    assert layouts([report]) == [(4, 32, 2)]  # 16-byte fp32 vectors, 64 lanes: two warps per row


def test_d256_forward_blocks_lay_rows_out_alike():
    # gated_norm_launch's swept D = 256 block (4 rows x 4 warps) and the rule's (8 x 4): the same
    # row layout aligned or not, so switching between them changes no bit.
    blocks = ("--dim", "256", "--dtype", "fp32", "--bt", "8", "--warps", "4", "--bt", "4", "--warps", "4")
    assert layouts(kernel_ir(*blocks)) == [(4, 32, 2)] * 2
    assert layouts(kernel_ir(*blocks, "--unaligned")) == [(1, 32, 4)] * 2


def test_d128_backward_blocks_lay_rows_out_alike():
    # gated_norm_launch's swept D = 128 backward block (4 rows x 1 warp, 16 elements per thread)
    # and the rule's (4 x 2, 8 per thread): a row takes 16-byte vectors over 16 (2-byte dtypes)
    # or 32 lanes (fp32) of one warp in both, aligned or not, so dx and dgate keep their bits.
    blocks = ("--kernel", "bwd", "--dim", "128", "--bt", "4", "--warps", "2", "--bt", "4", "--warps", "1")
    assert layouts(kernel_ir(*blocks)) == [(8, 16, 1)] * 2
    assert layouts(kernel_ir(*blocks, "--unaligned")) == [(8, 16, 1)] * 2
    assert layouts(kernel_ir(*blocks, "--dtype", "fp32")) == [(4, 32, 1)] * 2


def test_d256_backward_blocks_lay_two_byte_rows_out_alike():
    # gated_norm_launch's swept D = 256 backward block (2 rows x 1 warp, 16 elements per thread)
    # and the rule's (2 x 2): the same layout along a bf16 row, so dx and dgate keep their bits;
    # an fp32 row spans two warps in the rule's block and one in the swept one (another order).
    blocks = ("--kernel", "bwd", "--dim", "256", "--bt", "2", "--warps", "2", "--bt", "2", "--warps", "1")
    assert layouts(kernel_ir(*blocks)) == [(8, 32, 1)] * 2
    assert layouts(kernel_ir(*blocks, "--dtype", "fp32")) == [(4, 32, 2), (4, 32, 1)]


def test_kernels_launched_early_wait_for_the_previous_kernel_before_loading():
    # Under the H200's rules the forward is launched with programmatic dependent launch, so it
    # must wait for the previous kernel's writes before its first global load, and it lets the
    # next kernel launch early. The backward kernel is launched as usual (stream order orders
    # it) and lets its dW sum launch as its programs start, before any load; the dW sum,
    # launched early, waits for the partials before its first load, then lets the next kernel
    # launch early.
    (fwd,) = kernel_ir("--kernel", "fwd", "--dim", "128", "--bt", "16", "--warps", "8")
    assert fwd["launch_pdl"] and fwd["waits_before_loading"] and fwd["launches_dependents"], fwd
    (bwd,) = kernel_ir("--kernel", "bwd", "--dim", "128", "--bt", "4", "--warps", "1")
    assert not bwd["launch_pdl"] and not bwd["waits_before_loading"], bwd
    assert bwd["launches_dependents_before_loading"], bwd
    (dw_sum,) = kernel_ir("--kernel", "dw_sum", "--dim", "128", "--bt", "4", "--warps", "1")
    assert dw_sum["launch_pdl"] and dw_sum["waits_before_loading"], dw_sum
    assert dw_sum["launches_dependents"], dw_sum
    # The dW sum launched as usual instead (DW_SUM_PDL off, backward_impl(dw_sum_pdl=False)):
    # the backward lets nothing launch early and the dW sum waits for nothing (stream order does
    # it), but still lets the next kernel launch early.
    usual = ("--dim", "128", "--bt", "4", "--warps", "1", "--dw-sum-as-usual")
    (bwd,) = kernel_ir("--kernel", "bwd", *usual)
    assert not bwd["launch_pdl"] and not bwd["launches_dependents"], bwd
    (dw_sum,) = kernel_ir("--kernel", "dw_sum", *usual)
    assert not dw_sum["launch_pdl"] and not dw_sum["waits_before_loading"], dw_sum
    assert dw_sum["launches_dependents"], dw_sum


def test_gate_exponential_is_one_flush_to_zero_ex2():
    # _exp_neg: exp(-g) as ex2.approx.ftz of g * -log2(e), the bits of tl.exp(-g) without its
    # negation and subnormal fix-up (docs/numerics.md, The gate activation's exp).
    for kernel in ("fwd", "bwd"):
        (report,) = kernel_ir("--kernel", kernel, "--dim", "128", "--bt", "4", "--warps", "2")
        assert report["exp2_instructions"] == ["ex2.approx.ftz.f32"], report


@pytest.mark.parametrize("argv, message", [
    (["--bt", "4", "--warps", "1", "--dim", "0"], "--dim must be in [1, 8192], got 0"),
    (["--bt", "3", "--warps", "1"], "--bt must be powers of two, got [3]"),
    (["--bt", "4", "--warps", "0"], "--warps must be powers of two, got [0]"),
])
def test_bad_arguments_are_usage_errors(capsys, argv, message):
    from tools import kernel_ir as tool

    with pytest.raises(SystemExit):
        tool.main(argv)
    assert message in capsys.readouterr().err
