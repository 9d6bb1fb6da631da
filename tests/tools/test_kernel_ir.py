"""tools/kernel_ir.py compiles the kernels for sm_90 without a GPU (even when the pytest process
runs the interpreter) and reports the row reduction's layout, which decides a row's bits.
Checks the claims of docs/design.md (Launch choices: a row's bits follow its layout) on Triton's
real compiler output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def kernel_ir(*args: str) -> list[dict]:
    """The tool's command line, as a user runs it."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # the tool must compile anyway
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_ir.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


# The configurations the tests below read, as (kernel, dim, dtype, bt, warps, unaligned, dW sum
# launched as usual), described by the tool's ``describe`` in one process (``reports``): one
# Python start and import instead of one per command line.
CONFIGS = [
    *[("fwd", 128, "bf16", bt, warps, True, False) for bt, warps in ((16, 8), (8, 2))],
    ("bwd", 256, "fp32", 4, 4, False, False),
    *[("fwd", 256, "fp32", bt, 4, unaligned, False)
      for bt in (8, 4) for unaligned in (False, True)],
    *[("bwd", 128, dtype, 4, warps, unaligned, False)
      for dtype, unaligned in (("bf16", False), ("bf16", True), ("fp32", False))
      for warps in (2, 1)],
    *[("bwd", 256, dtype, 2, warps, False, False)
      for dtype in ("bf16", "fp32") for warps in (2, 1)],
    ("fwd", 128, "bf16", 16, 8, False, False),
    *[(kernel, 128, "bf16", 4, 1, False, usual)
      for kernel in ("bwd", "dw_sum") for usual in (False, True)],
    ("fwd", 128, "bf16", 4, 2, False, False),
]

DESCRIBE_ALL = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from tools.kernel_ir import describe
print(json.dumps([describe(kernel, dim, dtype, bt, warps, unaligned,
                           dw_sum_pdl=False if usual else None)
                  for kernel, dim, dtype, bt, warps, unaligned, usual in json.loads(sys.argv[2])]))
"""


@pytest.fixture(scope="module")
def reports() -> dict:
    """``CONFIGS`` -> the tool's report of each, compiled in one process that does not interpret
    (as the tool's command line runs)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", DESCRIBE_ALL, str(ROOT), json.dumps(CONFIGS)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(zip(CONFIGS, json.loads(done.stdout)))


def described(reports, kernel, dim, dtype, blocks, unaligned=False, usual=False) -> list[dict]:
    """The reports of ``blocks`` ((bt, warps) pairs) for one kernel, dim and dtype."""
    return [reports[(kernel, dim, dtype, bt, warps, unaligned, usual)] for bt, warps in blocks]


def layouts(reports):
    return [tuple(r["row_layout"][0].values()) for r in reports]


def test_aligned_rows_keep_their_layout_with_fewer_warps():
    # D = 128, bf16: the regular block (16 rows, 8 warps) and the small-grid block (8 rows,
    # 2 warps) both give a row 8 elements x 16 lanes of one warp. Through the command line.
    reports = kernel_ir("--dim", "128", "--bt", "16", "--warps", "8", "--bt", "8", "--warps", "2")
    assert [(r["kernel"], r["bt"], r["warps"]) for r in reports] == [("fwd", 16, 8), ("fwd", 8, 2)]
    assert layouts(reports) == [(8, 16, 1), (8, 16, 1)]
    assert all(r["sass_instructions"] > 100 for r in reports)


def test_unaligned_rows_spread_over_the_blocks_warps(reports):
    # One element per thread: the row spans 4 of the regular block's 8 warps, 2 of the small
    # block's 2, so the two blocks sum a row in different orders.
    found = described(reports, "fwd", 128, "bf16", ((16, 8), (8, 2)), unaligned=True)
    assert layouts(found) == [(1, 32, 4), (1, 32, 2)]


def test_backward_row_layout_at_d256_fp32(reports):
    (report,) = described(reports, "bwd", 256, "fp32", ((4, 4),))
    assert report["kernel"] == "bwd"
    assert layouts([report]) == [(4, 32, 2)]  # 16-byte fp32 vectors, 64 lanes: two warps per row


def test_d256_forward_blocks_lay_rows_out_alike(reports):
    # gated_norm_launch's swept D = 256 block (4 rows x 4 warps) and the rule's (8 x 4): the same
    # row layout aligned or not, so switching between them changes no bit.
    blocks = ((8, 4), (4, 4))
    assert layouts(described(reports, "fwd", 256, "fp32", blocks)) == [(4, 32, 2)] * 2
    assert layouts(described(reports, "fwd", 256, "fp32", blocks,
                             unaligned=True)) == [(1, 32, 4)] * 2


def test_d128_backward_blocks_lay_rows_out_alike(reports):
    # gated_norm_launch's swept D = 128 backward block (4 rows x 1 warp, 16 elements per thread)
    # and the rule's (4 x 2, 8 per thread): a row takes 16-byte vectors over 16 (2-byte dtypes)
    # or 32 lanes (fp32) of one warp in both, aligned or not, so dx and dgate keep their bits.
    blocks = ((4, 2), (4, 1))
    assert layouts(described(reports, "bwd", 128, "bf16", blocks)) == [(8, 16, 1)] * 2
    assert layouts(described(reports, "bwd", 128, "bf16", blocks,
                             unaligned=True)) == [(8, 16, 1)] * 2
    assert layouts(described(reports, "bwd", 128, "fp32", blocks)) == [(4, 32, 1)] * 2


def test_d256_backward_blocks_lay_two_byte_rows_out_alike(reports):
    # gated_norm_launch's swept D = 256 backward block (2 rows x 1 warp, 16 elements per thread)
    # and the rule's (2 x 2): the same layout along a bf16 row, so dx and dgate keep their bits;
    # an fp32 row spans two warps in the rule's block and one in the swept one (another order).
    blocks = ((2, 2), (2, 1))
    assert layouts(described(reports, "bwd", 256, "bf16", blocks)) == [(8, 32, 1)] * 2
    assert layouts(described(reports, "bwd", 256, "fp32", blocks)) == [(4, 32, 2), (4, 32, 1)]


def test_kernels_launched_early_wait_for_the_previous_kernel_before_loading(reports):
    # Under the H200's rules the forward is launched with programmatic dependent launch, so it
    # must wait for the previous kernel's writes before its first global load, and it lets the
    # next kernel launch early. The backward kernel is launched as usual (stream order orders
    # it) and lets its dW sum launch as its programs start, before any load; the dW sum,
    # launched early, waits for the partials before its first load, then lets the next kernel
    # launch early.
    (fwd,) = described(reports, "fwd", 128, "bf16", ((16, 8),))
    assert fwd["launch_pdl"] and fwd["waits_before_loading"] and fwd["launches_dependents"], fwd
    (bwd,) = described(reports, "bwd", 128, "bf16", ((4, 1),))
    assert not bwd["launch_pdl"] and not bwd["waits_before_loading"], bwd
    assert bwd["launches_dependents_before_loading"], bwd
    (dw_sum,) = described(reports, "dw_sum", 128, "bf16", ((4, 1),))
    assert dw_sum["launch_pdl"] and dw_sum["waits_before_loading"], dw_sum
    assert dw_sum["launches_dependents"], dw_sum
    # The dW sum launched as usual instead (DW_SUM_PDL off, backward_impl(dw_sum_pdl=False)):
    # the backward lets nothing launch early and the dW sum waits for nothing (stream order does
    # it), but still lets the next kernel launch early.
    (bwd,) = described(reports, "bwd", 128, "bf16", ((4, 1),), usual=True)
    assert not bwd["launch_pdl"] and not bwd["launches_dependents"], bwd
    (dw_sum,) = described(reports, "dw_sum", 128, "bf16", ((4, 1),), usual=True)
    assert not dw_sum["launch_pdl"] and not dw_sum["waits_before_loading"], dw_sum
    assert dw_sum["launches_dependents"], dw_sum


def test_gate_exponential_is_one_flush_to_zero_ex2(reports):
    # _exp_neg: exp(-g) as ex2.approx.ftz of g * -log2(e), the bits of tl.exp(-g) without its
    # negation and subnormal fix-up (docs/numerics.md, The gate activation's exp).
    for kernel in ("fwd", "bwd"):
        (report,) = described(reports, kernel, 128, "bf16", ((4, 2),))
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


@pytest.mark.parametrize("value_heads", [32, 4])
def test_region_backward_holds_the_programs_its_launch_rule_counts(value_heads):
    # launch_for sizes the backward's chunks by RESIDENT_PER_SM one-warp programs per SM: what
    # the compiled kernel's registers allow (its default launch, at TP 1 and TP 8 head counts).
    # Loads kept 2 steps ahead (--stages 3) take shared memory (2 steps' x rows alone: 2 x 4
    # tokens x 128 channels x 2 bytes), no more registers.
    from core.fusions.fused_pre_gated_delta_rule import RESIDENT_PER_SM

    default, staged = kernel_ir("--kernel", "pre_gdr_bwd", "--value-heads", str(value_heads),
                                "--bt", "4", "--warps", "1", "--bt", "4", "--warps", "1",
                                "--stages", "1", "--stages", "3")
    assert default["programs_per_sm"] == RESIDENT_PER_SM, default
    assert default["stack_bytes"] == 0 and default["sass_instructions"] > 1000, default
    key_loop, value_loop = default["loop_instructions"][:2]  # the token loops, q/k head's first
    assert key_loop > value_loop > 300, default  # the L2 norm's backward is the q/k head's
    assert staged["registers"] <= default["registers"], staged
    assert staged["shared_bytes"] >= default["shared_bytes"] + 2 * 4 * 128 * 2, staged


@pytest.mark.parametrize("registers, warps, shared, programs", [
    (128, 1, 512, 16), (72, 2, 1024, 14), (80, 2, 3080, 12), (32, 1, 0, 32),
    (64, 4, 6144, 8), (40, 1, 60 * 1024, 3)])
def test_programs_per_sm(registers, warps, shared, programs):
    from tools.kernel_ir import programs_per_sm

    assert programs_per_sm(registers, warps, shared) == programs
