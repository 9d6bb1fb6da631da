"""DirectLauncher: repeated launches skip JITFunction.run only when Triton would pick the same
compiled kernel.

The launch-key rules are tested with a stand-in for Triton's JITFunction/CompiledKernel pair and
its driver (the CPU has no compiled kernels); the real kernels are tested on whatever device
runs the suite: bit-identical results between the first (JITFunction.run) and the repeated
(direct) call, and the direct path actually taken on a GPU, never under the interpreter.
"""

from __future__ import annotations

import importlib

import pytest
import torch

direct_launch = importlib.import_module("core.fusions.direct_launch")
fgn = importlib.import_module("core.fusions.fused_gated_norm")
from core.fusions.direct_launch import DirectLauncher  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class FakeCompiled:
    """The attributes of Triton's CompiledKernel that the direct call uses."""

    function = "fn-handle"
    packed_metadata = "packed"

    def __init__(self, log):
        self.log = log

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream, args)

    def run(self, g0, g1, g2, stream, function, packed, metadata, enter, exit_, *args):
        self.log.append(("direct", (g0, g1, g2), stream, function, packed, args, metadata, enter, exit_))


class FakeParam:
    def __init__(self, num, do_not_specialize):
        self.num, self.do_not_specialize = num, do_not_specialize


class FakeJit:
    """kernel[grid](*args, num_warps=...) -> a compiled kernel (or None, as the interpreter).
    ``unspecialised``: positions of do_not_specialize parameters (JITFunction.params)."""

    def __init__(self, interpreted=False, unspecialised=()):
        self.log = []
        self.interpreted = interpreted
        self.params = [FakeParam(i, i in unspecialised) for i in range(8)]

    def __getitem__(self, grid):
        def run(*args, num_warps):
            self.log.append(("jit", grid, args, num_warps))
            return None if self.interpreted else FakeCompiled(self.log)
        return run


class FakeDriver:
    class active:
        device = 0

        @classmethod
        def get_current_device(cls):
            return cls.device

        @staticmethod
        def get_current_stream(device):
            return f"stream{device}"


@pytest.fixture
def fake_driver(monkeypatch):
    FakeDriver.active.device = 0
    monkeypatch.setattr(direct_launch, "driver", FakeDriver)
    return FakeDriver.active


def _kinds(log):
    return [entry[0] for entry in log]


def test_same_key_launches_the_compiled_kernel_with_the_same_arguments(fake_driver):
    jit = FakeJit()
    launch = DirectLauncher(jit)
    x = torch.zeros(64)
    scalars = (64, (0, 8, 1), True, "silu")
    launch(4, (x, None), scalars, 4)
    launch(4, (x, None), scalars, 4)
    assert _kinds(jit.log) == ["jit", "direct"]
    # Tensors go in as their addresses (None as a null pointer); no hook is registered, so
    # none is passed and no launch metadata is built.
    assert jit.log[1][1:] == ((4, 1, 1), "stream0", "fn-handle", "packed",
                              (x.data_ptr(), 0, *scalars), None, None, None)
    assert launch.direct_calls == 1


class HookChain:
    """Triton >= 3.7 keeps launch hooks in chains (possibly empty) and calls them per launch."""

    def __init__(self, calls):
        self.calls = calls

    def __call__(self, metadata):
        for call in self.calls:
            call(metadata)


def _profiler(metadata):
    pass


@pytest.mark.parametrize("hooks", ["empty chains", "chain", "plain hook"])
def test_launch_hooks_are_called_exactly_as_triton_would(fake_driver, monkeypatch, hooks):
    """A profiler's launch hook sees every direct launch with Triton's metadata; empty chains
    (Triton 3.7's default) are skipped, which calls nothing either way."""
    enter = {"empty chains": HookChain([]), "chain": HookChain([_profiler]),
             "plain hook": _profiler}[hooks]
    exit_ = HookChain([]) if hooks != "plain hook" else None
    monkeypatch.setattr(direct_launch.knobs.runtime, "launch_enter_hook", enter)
    monkeypatch.setattr(direct_launch.knobs.runtime, "launch_exit_hook", exit_)
    jit = FakeJit()
    launch = DirectLauncher(jit)
    x = torch.zeros(64)
    launch(4, (x,), (1,), 4)
    launch(4, (x,), (1,), 4)
    *_, metadata, passed_enter, passed_exit = jit.log[1]
    if hooks == "empty chains":
        assert (metadata, passed_enter, passed_exit) == (None, None, None)
    else:
        assert metadata == ("metadata", (4, 1, 1), "stream0", (x, 1))  # the tensors themselves
        assert (passed_enter, passed_exit) == (enter, exit_)


@pytest.mark.parametrize("change", ["scalar", "stride", "warps", "dtype", "alignment"])
def test_anything_triton_specialises_on_changes_the_key(fake_driver, change):
    jit = FakeJit()
    launch = DirectLauncher(jit)
    buf = torch.zeros(80)
    x, scalars, warps = buf[:64], (64, (0, 8, 1), "silu"), 4
    launch(4, (x,), scalars, warps)
    if change == "scalar":
        scalars = (32, (0, 8, 1), "silu")
    elif change == "stride":
        scalars = (64, (0, 16, 1), "silu")
    elif change == "warps":
        warps = 8
    elif change == "dtype":
        x = x.double()
    else:  # same dtype and shape, address 4 bytes past a 16-byte boundary
        x = buf[1:65]
    launch(4, (x,), scalars, warps)
    assert _kinds(jit.log) == ["jit", "jit"]
    launch(4, (x,), scalars, warps)  # and the new key is kept
    assert _kinds(jit.log) == ["jit", "jit", "direct"]


def test_a_new_token_count_keeps_the_direct_path(fake_driver):
    """Triton types a do_not_specialize integer by its width only: a new value within int32 is
    the same compiled kernel; past int32 it is another one (i64)."""
    jit = FakeJit(unspecialised=(1,))  # parameter 1 = the first scalar (the tensor is 0)
    launch = DirectLauncher(jit)
    x = torch.zeros(64)
    for rows in (64, 65, 2**31 - 1, 7):
        launch(4, (x,), (rows, 128), 4)
    assert _kinds(jit.log) == ["jit", "direct", "direct", "direct"]
    assert [entry[5][1] for entry in jit.log[1:]] == [65, 2**31 - 1, 7]  # the values still go in
    launch(4, (x,), (2**31, 128), 4)
    launch(4, (x,), (64, 256), 4)  # a specialised scalar still changes the key
    assert _kinds(jit.log)[4:] == ["jit", "jit"]


def test_other_device_and_grid(fake_driver):
    jit = FakeJit()
    launch = DirectLauncher(jit)
    x = torch.zeros(64)
    launch(4, (x,), (1,), 4)
    fake_driver.device = 1  # the compiled kernel was loaded on device 0
    launch(4, (x,), (1,), 4)
    assert _kinds(jit.log) == ["jit", "jit"]
    launch(4, (x,), (1,), 4)
    fake_driver.device = 0
    launch(9, (x,), (1,), 4)  # each device keeps its own; the grid is not part of the key
    assert _kinds(jit.log) == ["jit", "jit", "direct", "direct"]
    assert [entry[2] for entry in jit.log[2:]] == ["stream1", "stream0"]
    assert jit.log[-1][1] == (9, 1, 1)


def test_interpreted_kernels_are_never_kept(fake_driver):
    jit = FakeJit(interpreted=True)
    launch = DirectLauncher(jit)
    x = torch.zeros(64)
    for _ in range(3):
        launch(4, (x,), (1,), 4)
    assert _kinds(jit.log) == ["jit"] * 3 and launch.direct_calls == 0


def test_table_is_bounded(fake_driver, monkeypatch):
    monkeypatch.setattr(direct_launch, "MAX_KEYS", 3)
    launch = DirectLauncher(FakeJit())
    x = torch.zeros(64)
    for tokens in range(10):  # a new token count per step
        launch(4, (x,), (tokens,), 4)
        assert len(launch.compiled) <= 3


@pytest.mark.parametrize("gate_offset", [0, 1], ids=["aligned", "misaligned"])
def test_real_kernels_repeat_bit_identically(gate_offset, monkeypatch):
    """First call through JITFunction.run, the second direct on a GPU; the same bits either way,
    also for a gate whose address is not 16-byte aligned (another compiled kernel)."""
    gen = torch.Generator().manual_seed(0)
    packed = torch.randn(2, 5, 2 * 4 * 64 + 1, generator=gen).to(DEVICE, torch.bfloat16)
    start = 4 * 64 + gate_offset
    gate = packed[..., start:start + 4 * 64].view(2, 5, 4, 64)  # a packed projection's slice
    x = torch.randn(2, 5, 4, 64, generator=gen).to(DEVICE, torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(DEVICE, torch.bfloat16)
    dy = torch.randn(2, 5, 4, 64, generator=gen).to(DEVICE, torch.bfloat16)
    for launcher in (fgn.launch_forward, fgn.launch_backward):
        monkeypatch.setattr(launcher, "compiled", {})  # the first call below compiles or binds
    fwd0, bwd0 = fgn.launch_forward.direct_calls, fgn.launch_backward.direct_calls
    calls = []
    for _ in range(2):
        out, rstd = fgn.forward_impl(x, gate, weight, 1e-6)
        calls.append((out, rstd, *fgn.backward_impl(x, gate, weight, rstd, dy)))
    for a, b in zip(*calls):
        assert torch.equal(a, b)
    direct = 1 if DEVICE == "cuda" else 0  # the interpreter compiles nothing to keep
    assert fgn.launch_forward.direct_calls - fwd0 == direct
    assert fgn.launch_backward.direct_calls - bwd0 == direct
    reference = fgn.forward_impl(x, gate.contiguous(), weight, 1e-6)[0]  # an aligned copy
    assert torch.equal(calls[0][0], reference)
    # Another token count (one sequence of the two: the same flat-token layout): the same
    # compiled kernels, launched directly on a GPU.
    fwd0, bwd0 = fgn.launch_forward.direct_calls, fgn.launch_backward.direct_calls
    out, rstd = fgn.forward_impl(x[:1], gate[:1], weight, 1e-6)
    dx, _, _ = fgn.backward_impl(x[:1], gate[:1], weight, rstd, dy[:1])
    assert torch.equal(out, calls[0][0][:1]) and torch.equal(dx, calls[0][2][:1])
    assert fgn.launch_forward.direct_calls - fwd0 == direct
    assert fgn.launch_backward.direct_calls - bwd0 == direct
