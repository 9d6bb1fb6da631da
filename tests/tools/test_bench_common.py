"""tools/bench_common.py, the measurement scripts' shared helpers, on the CPU: shapes, byte
counts, rates, the benchmark's inputs, its same-bytes copy, and where megatron main's
fused_gated_norm comes from."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tools import bench_common
from tools.bench_common import (bytes_moved, gbps, make_inputs, parse_blocks,
                                parse_positive_ints, parse_shape, pct_of_ceiling, same_bytes_copy,
                                same_bytes_copy_us, shape_label)

def test_parse_shape():
    assert parse_shape("1x4096x32x128") == (1, 4096, 32, 128)
    for bad in ("1x4096x32", "1x0x32x128", "1x4096x32xD", "-1x2x3x4"):
        with pytest.raises(ValueError, match="BxSxHxD"):
            parse_shape(bad)


@pytest.mark.parametrize("text", ["4,8,16", "12"])
def test_parse_positive_ints(text):
    assert parse_positive_ints("--stages", text) == tuple(int(t) for t in text.split(","))


@pytest.mark.parametrize("text", ["", "4,,8", "0", "-1", "2.5", "three"])
def test_parse_positive_ints_rejects_anything_else(text):
    with pytest.raises(ValueError, match="--stages"):
        parse_positive_ints("--stages", text)


def test_parse_blocks():
    assert parse_blocks("8x1, 16X2") == ((8, 1), (16, 2))
    for bad in ("8x3", "8", "0x1", "8x1x2", "8x1,,4x1", "ax1"):
        with pytest.raises(ValueError, match="ROWSxWARPS pairs of powers of two"):
            parse_blocks(bad)


def test_shape_label():
    assert shape_label((2, 8192, 32, 128)) == "2x8192x32x128"
    assert shape_label((2, 8192, 32, 128), "sbhd") == "2x8192x32x128 sbhd"


def test_bytes_moved_and_rates():
    elements, rows = 1 * 4096 * 32 * 128, 1 * 4096 * 32
    moved = bytes_moved((1, 4096, 32, 128))
    assert moved == {"fwd": 6 * elements + 4 * rows, "bwd": 10 * elements + 4 * rows,
                     "infer": 6 * elements}
    assert gbps(4_000_000, 1000.0) == pytest.approx(4.0)  # 4 MB in 1 ms
    assert pct_of_ceiling(4_000_000, 1000.0, 8.0) == pytest.approx(50.0)


@pytest.mark.parametrize("new_outputs", [False, True])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.interpreter
def test_same_bytes_copy_moves_each_phase_s_bytes(backward, new_outputs):
    """The yardstick kernel reads two tensors and writes one (forward), or reads three and
    writes two (backward), over elements past one block; into the last two of its tensors, or
    into outputs of its own (new_outputs), which it returns either way."""
    n = 2048 + 5
    a, b, c = (torch.randn(n, dtype=torch.bfloat16) for _ in range(3))
    summed, copied = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    written = same_bytes_copy((a, b, c, summed, copied), backward, new_outputs=new_outputs)
    assert (written[0] is summed) != new_outputs
    torch.testing.assert_close(written[0], a + b)  # rounded (GPU) or truncated (interpreter)
    if backward:
        assert (written[1] is copied) != new_outputs and torch.equal(written[1], c)
    else:
        assert written[1] is None
    if new_outputs or not backward:  # buffers it was given and did not write stay as they were
        assert torch.equal(copied, torch.zeros_like(c))
    if new_outputs:
        assert torch.equal(summed, torch.zeros_like(a))


@pytest.mark.interpreter
def test_the_benchmarks_copy_writes_new_outputs_per_call(monkeypatch):
    """The benchmark times its yardstick as it times every implementation: each call writes
    outputs of its own (the calls of a captured graph then cycle through two sets)."""
    written = []

    def run_twice(fn):  # stands in for bench_graph: two calls, what each returned kept
        written.append((fn(), fn()))
        return 1.0

    monkeypatch.setattr(bench_common, "DEVICE", "cpu")
    monkeypatch.setattr(bench_common, "bench_graph", run_twice)
    assert same_bytes_copy_us((1, 4, 2, 300)) == {"fwd": 1.0, "bwd": 1.0}
    (fwd_first, fwd_second), (bwd_first, bwd_second) = written
    assert fwd_first[1] is None and fwd_first[0].numel() == 4 * 2 * 300
    assert fwd_first[0].data_ptr() != fwd_second[0].data_ptr()
    assert len({t.data_ptr() for t in (*bwd_first, *bwd_second)}) == 4


def test_strided_gate_is_a_slice_of_the_packed_projection():
    x, gate, weight, dy, leaves = make_inputs((2, 3, 4, 8), "strided_gate", device="cpu")
    packed = leaves[1]
    assert packed.shape == (2, 3, 64) and gate._base is packed
    assert gate.shape == x.shape == dy.shape and weight.shape == (8,)
    assert torch.equal(gate, packed[..., 32:].unflatten(-1, (4, 8)))
    assert all(t.requires_grad for t in leaves)
    again = make_inputs((2, 3, 4, 8), "strided_gate", device="cpu")
    assert torch.equal(again[0], x)  # seeded


STAND_IN = '''import torch


def fused_gated_norm(x, gate, weight, eps, zero_centered=False, gate_activation="silu"):
    xf = x.float()
    norm = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
            * (weight.float() + zero_centered)).to(x.dtype)
    return (norm.float() * torch.nn.functional.silu(gate.float())).to(x.dtype)
'''

LOADED_FILE_MODULE = bench_common._MEGATRON_MAIN_FILE_MODULE


@pytest.fixture(autouse=True)
def _forget_a_loaded_file():
    yield
    sys.modules.pop(LOADED_FILE_MODULE, None)


def test_megatron_main_from_a_file(tmp_path):
    path = tmp_path / "fused_gated_norm.py"
    path.write_text(STAND_IN)
    fn, source = bench_common.load_megatron_main_fused_gated_norm(str(path))
    assert source == f"file {path}"
    x, gate = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    out = fn(x, gate, torch.ones(8), 1e-6)
    assert out.shape == x.shape
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (8,), eps=1e-6)
                               * torch.nn.functional.silu(gate))


@pytest.mark.parametrize("case, body, why", [
    ("missing", None, "no such file"),
    ("not_python.txt", STAND_IN, "not a .py file"),
    ("no_function.py", "import torch\n", "fused_gated_norm is not defined there"),
    ("not_callable.py", "fused_gated_norm = 3\n", "fused_gated_norm is not callable there"),
    ("broken.py", "import no_such_module_here\n", "loading it raised ModuleNotFoundError"),
])
def test_megatron_main_file_errors_name_the_flag_and_the_rule(tmp_path, case, body, why):
    path = tmp_path / case
    if body is not None:
        path.write_text(body)
    with pytest.raises(ValueError, match=r"--megatron-fused-gated-norm .*" + why
                       + r".*must name an existing \.py file that defines a callable "
                         r"fused_gated_norm"):
        bench_common.load_megatron_main_fused_gated_norm(str(path))
    assert LOADED_FILE_MODULE not in sys.modules  # nothing half-loaded is left behind


def test_megatron_main_file_error_for_a_folder(tmp_path):
    folder = tmp_path / "megatron.py"
    folder.mkdir()
    with pytest.raises(ValueError, match="--megatron-fused-gated-norm .*a folder; the path"):
        bench_common.load_megatron_main_fused_gated_norm(str(folder))


def test_megatron_main_is_found_in_the_installed_megatron(monkeypatch):
    """Auto-detection: a megatron that has megatron.core.fusions.fused_gated_norm (Megatron-LM
    main; a stand-in module here) provides the peer."""
    def fused_gated_norm(x, gate, weight, eps, zero_centered=False, gate_activation="silu"):
        return x

    module = types.ModuleType(bench_common.MEGATRON_MAIN_MODULE)
    module.fused_gated_norm = fused_gated_norm
    monkeypatch.setitem(sys.modules, bench_common.MEGATRON_MAIN_MODULE, module)
    fn, source = bench_common.load_megatron_main_fused_gated_norm()
    assert fn is fused_gated_norm
    assert source.startswith("module megatron.core.fusions.fused_gated_norm (")


def test_megatron_main_absent_says_why(monkeypatch):
    # None in sys.modules: importing the module fails as for a megatron-core release without it
    monkeypatch.setitem(sys.modules, bench_common.MEGATRON_MAIN_MODULE, None)
    fn, why = bench_common.load_megatron_main_fused_gated_norm()
    assert fn is None
    assert why.endswith("has no megatron.core.fusions.fused_gated_norm; "
                        "--megatron-fused-gated-norm FILE.py times Megatron-LM main's file")
    monkeypatch.setitem(sys.modules, bench_common.MEGATRON_MAIN_MODULE,
                        types.ModuleType(bench_common.MEGATRON_MAIN_MODULE))
    fn, why = bench_common.load_megatron_main_fused_gated_norm()
    assert fn is None and why.endswith("defines no callable fused_gated_norm")
