"""DirectLauncher: repeated launches skip JITFunction.run only when Triton would pick the same
compiled kernel.

The launch-key rules are tested with a stand-in for Triton's JITFunction/CompiledKernel pair and
its driver (the CPU has no compiled kernels); the real kernels are tested on whatever device
runs the suite: bit-identical results between the first (JITFunction.run) and the repeated
(direct) call, and the direct path actually taken on a GPU, never under the interpreter.
The direct call's fallback (an unknown Triton, a launcher of another shape, the environment
switch) and the installed Triton's launcher ABI are tested too.
"""

from __future__ import annotations

import inspect
import pathlib
import re
import warnings

import pytest
import torch
import triton
from triton.backends.nvidia.compiler import CUDABackend
from triton.backends.nvidia.driver import CudaLauncher
from triton.compiler.compiler import CompiledKernel
from triton.runtime.jit import JITFunction, native_specialize_impl

import core.fusions.direct_launch as direct_launch
import core.fusions.fused_gated_norm as fgn
import core.fusions.gated_norm_kernels as kernels
import core.fusions.gated_norm_plans as plans
from core.fusions.direct_launch import DirectLauncher, parameter_names
from tests.gated_norm_inputs import DEVICE, EPS, make_inputs, packed_projection_gate


class FakeCompiled:
    """The attributes of Triton's CompiledKernel that the direct call uses; ``run`` has the
    parameters of Triton 3.7's launcher (the fake_driver fixture says 3.7)."""

    function = "fn-handle"
    packed_metadata = "packed"

    def __init__(self, log):
        self.log = log

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream, args)

    def run(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
            launch_enter_hook, launch_exit_hook, *args):
        self.log.append(("direct", (gridX, gridY, gridZ), stream, function, kernel_metadata, args,
                         launch_metadata, launch_enter_hook, launch_exit_hook))


class FakeCompiled36(FakeCompiled):
    """Triton 3.6's launcher: everything after the function through ``*args``; logs the call as
    FakeCompiled does."""

    def run(self, gridX, gridY, gridZ, stream, function, *args):
        kernel_metadata, launch_metadata, enter, exit_, *args = args
        self.log.append(("direct", (gridX, gridY, gridZ), stream, function, kernel_metadata,
                         tuple(args), launch_metadata, enter, exit_))


# A fake compiled kernel with each known launcher's parameters (direct_launch.LAUNCHER_PARAMETERS).
FAKE_LAUNCHERS = {"3.6": FakeCompiled36, "3.7": FakeCompiled, "3.8": FakeCompiled,
                  "3.9": FakeCompiled}


class FakeParam:
    def __init__(self, num, do_not_specialize):
        self.num, self.do_not_specialize = num, do_not_specialize


class FakeJit:
    """kernel[grid](*args, num_warps=...) -> a compiled kernel (or None, as the interpreter).
    ``unspecialised``: positions of do_not_specialize parameters (JITFunction.params)."""

    def __init__(self, interpreted=False, unspecialised=(), compiled=FakeCompiled):
        self.log = []
        self.interpreted = interpreted
        self.compiled = compiled
        self.params = [FakeParam(i, i in unspecialised) for i in range(8)]

    def __getitem__(self, grid):
        def run(*args, num_warps, **options):
            self.log.append(("jit", grid, args, num_warps, *options.items()))
            if self.interpreted:
                return None
            self.returned = self.compiled(self.log)
            return self.returned
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
    monkeypatch.setattr(direct_launch, "TRITON_VERSION", "3.7.1")  # FakeCompiled's launcher
    monkeypatch.setattr(direct_launch, "_warned", False)  # this test's own warning, if any
    return FakeDriver.active


def _kinds(log):
    return [entry[0] for entry in log]


def test_programmatic_dependent_launch_is_a_launch_option_and_part_of_the_key(fake_driver):
    jit = FakeJit()
    launch = DirectLauncher(jit)
    x = torch.zeros(64)
    scalars = (64, (0, 8, 1), True, "silu")
    launch(4, (x, None), scalars, 4, launch_pdl=True)
    launch(4, (x, None), scalars, 4)  # another compiled kernel: launch_pdl is a compile option
    launch(4, (x, None), scalars, 4, launch_pdl=True)
    assert _kinds(jit.log) == ["jit", "jit", "direct"]
    assert jit.log[0][-1] == ("launch_pdl", True)
    assert jit.log[1][-1] == 4  # num_warps alone: the option is passed only when set


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
    # The CompiledKernel itself is kept, not its function handle: Triton >= 3.8 unloads the
    # module of a CompiledKernel that is freed.
    assert list(launch.compiled.values()) == [jit.returned]


@pytest.mark.parametrize("version", sorted(direct_launch.LAUNCHER_PARAMETERS))
def test_every_known_triton_takes_the_direct_path(fake_driver, monkeypatch, version):
    """Each Triton of LAUNCHER_PARAMETERS, with a launcher of its parameters, launches directly
    with the arguments JITFunction.run would pass, without a warning."""
    assert set(FAKE_LAUNCHERS) == set(direct_launch.LAUNCHER_PARAMETERS)
    compiled = FAKE_LAUNCHERS[version]
    assert parameter_names(compiled.run) == ("self", *direct_launch.LAUNCHER_PARAMETERS[version])
    monkeypatch.setattr(direct_launch, "TRITON_VERSION", f"{version}.0")
    jit = FakeJit(compiled=compiled)
    launch = DirectLauncher(jit)
    x = torch.zeros(64)
    scalars = (64, (0, 8, 1), True, "silu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            launch(4, (x, None), scalars, 4)
    assert _kinds(jit.log) == ["jit", "direct", "direct"] and launch.direct is True
    assert jit.log[2][1:] == ((4, 1, 1), "stream0", "fn-handle", "packed",
                              (x.data_ptr(), 0, *scalars), None, None, None)


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


@pytest.mark.parametrize("change", ["scalar", "stride", "warps", "dtype", "alignment",
                                    "alignment_8_bytes"])
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
    elif change == "alignment":  # same dtype and shape, address 4 bytes past a 16-byte boundary
        x = buf[1:65]
    else:  # 8 bytes past: aligned to 8, not to the 16 Triton specialises on
        x = buf[2:66]
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


@pytest.mark.parametrize("first, second", [
    (2**31 - 1, 2**31),  # i32 -> i64
    (2**63 - 1, 2**63),  # i64 -> u64
    (-2**31, -2**31 - 1),  # i32 -> i64, below
    (1, True),  # a bool is Triton's i1, not an int
], ids=["i32-i64", "i64-u64", "negative-i32-i64", "int-bool"])
def test_an_unspecialised_integer_keys_by_tritons_width_class(fake_driver, first, second):
    """Each side of a width boundary of Triton's do_not_specialize integers is another
    compiled kernel, and so another key; within a class the kernel is reused."""
    jit = FakeJit(unspecialised=(1,))
    launch = DirectLauncher(jit)
    x = torch.zeros(64)
    launch(4, (x,), (first, 128), 4)
    launch(4, (x,), (first, 128), 4)
    launch(4, (x,), (second, 128), 4)
    assert _kinds(jit.log) == ["jit", "direct", "jit"]


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
        assert len(launch.compiled) <= 3 and len(launch.signatures) <= 3


@pytest.mark.parametrize("gate_offset", [0, 1], ids=["aligned", "misaligned"])
def test_real_kernels_repeat_bit_identically(gate_offset, monkeypatch):
    """First call through JITFunction.run, the second direct on a GPU; the same bits either way,
    also for a gate whose address is not 16-byte aligned (another compiled kernel)."""
    gate = packed_projection_gate((2, 5, 4, 64), torch.bfloat16, misalign=gate_offset)
    assert (gate.data_ptr() % 16 == 0) == (gate_offset == 0)
    x, _, weight = make_inputs((2, 5, 4, 64), torch.bfloat16)
    dy = make_inputs((2, 5, 4, 64), torch.bfloat16, seed=1)[0]
    for launcher in (plans.launch_forward, plans.launch_backward):
        monkeypatch.setattr(launcher, "compiled", {})  # the first call below compiles or binds
    fwd0, bwd0 = plans.launch_forward.direct_calls, plans.launch_backward.direct_calls
    calls = []
    for _ in range(2):
        out, rstd = fgn.forward_impl(x, gate, weight, EPS)
        calls.append((out, rstd, *fgn.backward_impl(x, gate, weight, rstd, dy)))
    for a, b in zip(*calls):
        assert torch.equal(a, b)
    direct = 1 if DEVICE == "cuda" else 0  # the interpreter compiles nothing to keep
    assert plans.launch_forward.direct_calls - fwd0 == direct
    assert plans.launch_backward.direct_calls - bwd0 == direct
    reference = fgn.forward_impl(x, gate.contiguous(), weight, EPS)[0]  # an aligned copy
    assert torch.equal(calls[0][0], reference)
    # Another token count (one sequence of the two: the same flat-token layout): the same
    # compiled kernels, launched directly on a GPU.
    fwd0, bwd0 = plans.launch_forward.direct_calls, plans.launch_backward.direct_calls
    out, rstd = fgn.forward_impl(x[:1], gate[:1], weight, EPS)
    dx, _, _ = fgn.backward_impl(x[:1], gate[:1], weight, rstd, dy[:1])
    assert torch.equal(out, calls[0][0][:1]) and torch.equal(dx, calls[0][2][:1])
    assert plans.launch_forward.direct_calls - fwd0 == direct
    assert plans.launch_backward.direct_calls - bwd0 == direct


def test_a_last_dim_stride_other_than_1_is_a_launch_key_of_its_own():
    """The launch key holds the last-dim stride by value: unit-stride launches share one key
    (one compiled kernel, the one Triton specialises on the constant 1), while a stride of 2 is
    another key, so its first launch goes through JITFunction.run and Triton compiles the
    variant that reads the stride (tests/fusions/test_gated_norm_compile.py checks Triton's
    side). That a token count keeps the key: test_a_new_token_count_keeps_the_direct_path."""
    weight = make_inputs((1, 64))[2]
    wide = make_inputs((2, 5, 4, 128), seed=1)[0]
    views = {"unit": make_inputs((2, 5, 4, 64))[0], "unit_again": make_inputs((2, 5, 4, 64))[0],
             "stride_2": wide[..., ::2]}
    signatures = {}
    for name, x in views.items():
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        plan = plans.forward_plan(x, make_inputs(x.shape)[1], weight, out, EPS, False, "silu",
                                  True)
        signatures[name] = plan.launch.signature
    assert signatures["unit"] == signatures["unit_again"] != signatures["stride_2"]


# ------------------------------------------------------------------------------------------------
# Fallback to kernel[grid] and the installed Triton's ABI
# ------------------------------------------------------------------------------------------------


def test_environment_switch_turns_the_direct_path_off(fake_driver, monkeypatch):
    monkeypatch.setenv(direct_launch.ENV_SWITCH, "0")
    launch = DirectLauncher(FakeJit())
    x = torch.zeros(64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit choice: no warning
        for _ in range(3):
            launch(4, (x,), (1,), 4)
    assert _kinds(launch.kernel.log) == ["jit"] * 3
    assert launch.direct is False and launch.direct_calls == 0 and launch.compiled == {}


def test_environment_switch_takes_0_or_1_only(monkeypatch):
    monkeypatch.setenv(direct_launch.ENV_SWITCH, "1")
    assert DirectLauncher(FakeJit()).direct is None  # on: decided at the first compiled kernel
    monkeypatch.setenv(direct_launch.ENV_SWITCH, "off")
    with pytest.raises(ValueError, match="GDN_FUSED_NORM_DIRECT_LAUNCH must be 0 .* or 1"):
        DirectLauncher(FakeJit())


class LauncherOfAnotherShape(FakeCompiled):
    def run(self, grid, stream, function, *args):  # not the launcher the direct call knows
        raise AssertionError("the direct call must not use this launcher")


class NoPackedMetadata(FakeCompiled):
    packed_metadata = property(lambda self: self.missing)


class OtherLaunchMetadata(FakeCompiled):
    def launch_metadata(self, grid, stream, args):
        return None


@pytest.mark.parametrize("triton_version, compiled, reason", [
    ("3.10.0", FakeCompiled, "Triton 3.10.0 is not a version its launcher ABI is known for"),
    ("2.3.1", FakeCompiled, "Triton 2.3.1 is not a version"),
    ("3.6.0", FakeCompiled, "launcher takes .*'kernel_metadata'.*, not"),  # 3.7's under 3.6
    ("3.8.0", FakeCompiled36, r"launcher takes \('gridX', 'gridY', 'gridZ', 'stream', "
                              r"'function', '\*args'\), not"),  # 3.6's under 3.8
    ("3.8.0", LauncherOfAnotherShape, r"launcher takes \('grid', 'stream', 'function', '\*args'\)"),
    ("3.7.1", LauncherOfAnotherShape, r"launcher takes \('grid', 'stream', 'function', '\*args'\)"),
    ("3.7.1", NoPackedMetadata, "lacks what the direct call uses"),
    ("3.7.1", OtherLaunchMetadata, "launch_metadata takes"),
])
def test_a_mismatched_triton_falls_back_with_one_warning(fake_driver, monkeypatch, triton_version,
                                                         compiled, reason):
    """Every launch then goes through kernel[grid](...) with the same arguments (the results
    are Triton's own), and the process is warned once, however many launchers fall back."""
    monkeypatch.setattr(direct_launch, "TRITON_VERSION", triton_version)
    launchers = [DirectLauncher(FakeJit(compiled=compiled)) for _ in range(2)]
    x = torch.zeros(64)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for launch in launchers:
            for rows in (5, 6, 7):
                launch(4, (x, None), (rows, 2.0), 4)
    messages = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert re.search(reason, messages[0]), messages[0]
    assert "kernel[grid](...)" in messages[0] and direct_launch.ENV_SWITCH in messages[0]
    for launch in launchers:
        assert launch.direct is False and launch.direct_calls == 0 and launch.compiled == {}
        assert [entry[:3] for entry in launch.kernel.log] == [
            ("jit", (4,), (x, None, rows, 2.0)) for rows in (5, 6, 7)]


def test_real_kernels_under_an_unknown_triton(monkeypatch):
    """The fused norm's own launchers fall back to kernel[grid]: the same bits as before. On a
    GPU the first compiled kernel brings the one warning; the interpreter compiles nothing, so
    there the direct path is never considered."""
    monkeypatch.setattr(direct_launch, "TRITON_VERSION", "9.9.0")
    monkeypatch.setattr(direct_launch, "_warned", False)
    x, gate, weight = make_inputs((2, 5, 4, 64))
    dy = make_inputs(x.shape, seed=1)[0]
    expected = fgn.forward_impl(x, gate, weight, EPS)
    expected = (*expected, *fgn.backward_impl(x, gate, weight, expected[1], dy))
    for launcher in (plans.launch_forward, plans.launch_backward, plans.launch_dw_sum):
        monkeypatch.setattr(launcher, "compiled", {})
        monkeypatch.setattr(launcher, "direct", None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            out, rstd = fgn.forward_impl(x, gate, weight, EPS)
            got = (out, rstd, *fgn.backward_impl(x, gate, weight, rstd, dy))
            for a, b in zip(got, expected):
                assert torch.equal(a, b)
    fallbacks = [w for w in record if "launching through kernel[grid]" in str(w.message)]
    assert len(fallbacks) == (1 if DEVICE == "cuda" else 0)
    for launcher in (plans.launch_forward, plans.launch_backward, plans.launch_dw_sum):
        assert launcher.compiled == {}
        assert launcher.direct is (False if DEVICE == "cuda" else None)


def test_installed_triton_has_the_launch_abi_the_direct_call_uses():
    """Fails when the installed Triton moves any part of the private ABI DirectLauncher relies
    on: then direct_launch.py needs a look (and LAUNCHER_PARAMETERS an entry) before it is used."""
    version = ".".join(triton.__version__.split(".")[:2])
    assert version in direct_launch.LAUNCHER_PARAMETERS, f"untested Triton {triton.__version__}"
    # The compiled kernel's launcher, and how JITFunction.run ends: the call the direct path makes.
    launcher = direct_launch.LAUNCHER_PARAMETERS[version]
    assert parameter_names(CudaLauncher.__call__) == ("self", *launcher)
    metadata = direct_launch.LAUNCH_METADATA_PARAMETERS
    assert parameter_names(CompiledKernel.launch_metadata) == ("self", *metadata)
    assert isinstance(inspect.getattr_static(CompiledKernel, "run"), property)
    compiled_init = inspect.getsource(CompiledKernel.__init__)
    assert "self.packed_metadata =" in compiled_init and "self.function =" in compiled_init
    run = " ".join(inspect.getsource(JITFunction.run).split())
    assert "device = driver.active.get_current_device()" in run
    assert "stream = driver.active.get_current_stream(device)" in run
    assert "launch_metadata = kernel.launch_metadata(grid, stream, *bound_args.values())" in run
    assert ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, "
            "launch_metadata, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, "
            "*bound_args.values())") in run
    # The launcher's C side takes what the direct call passes in place of Triton's: an integer
    # as the address itself (before any data_ptr() or driver query), None as no hook.
    source = _c_launcher_source()
    assert re.search(r"if\(PyLong_Check\(obj\)\)\{[\w.*]*dev_ptr=PyLong_AsUnsignedLongLong\(obj\);"
                     r"return\w*;\}.{0,200}?PyObject_CallMethodNoArgs\(obj,data_ptr_str\)", source)
    hooks = ("launch_enter_hook", "launch_exit_hook")
    assert (all(f"if({hook}!=Py_None){{PyObject*ret=PyObject_CallOneArg({hook},launch_metadata);"
                in source for hook in hooks)  # 3.6: generated per kernel in driver.py
            or ("if(hook!=Py_None){PyObject*ret=PyObject_CallOneArg(hook,metadata);" in source
                and all(f"launchHook({hook},launch_metadata)" in source for hook in hooks)))

    # What the launch key stands for (direct_launch.py's docstring): an unspecialised int is
    # typed by its width, a float is fp32 whatever its value, a pointer specialises on 16-byte
    # alignment only.
    def specialization(value, specialize=True):
        return native_specialize_impl(CUDABackend, value, False, specialize, True)

    widths = [specialization(v, specialize=False)[0] for v in (7, -7, 2**31 - 1, 2**31, 2**63)]
    assert widths == ["i32", "i32", "i32", "i64", "u64"]
    assert specialization(1.0) == specialization(2.5) == ("fp32", None)
    buf = torch.zeros(64, dtype=torch.bfloat16)
    assert buf.data_ptr() % 16 == 0
    assert [specialization(buf[i:i + 32])[1] for i in (0, 8, 4, 1)] == ["D", "D", "", ""]
    # The parameters the launcher reads when it is made (of the compiled build's JITFunction:
    # the interpreter's stand-in has none), and the launch hooks it looks at.
    kernel = JITFunction(kernels.gated_norm_fwd.fn, do_not_specialize=kernels.PER_STEP_ARGS)
    params = kernel.params
    assert [p.num for p in params] == list(range(len(kernel.arg_names)))
    assert sorted(p.name for p in params if p.do_not_specialize) == ["ROWS", "SEQUENCE"]
    assert hasattr(triton.knobs.runtime, "launch_enter_hook")
    assert hasattr(triton.knobs.runtime, "launch_exit_hook")


def _c_launcher_source() -> str:
    """The C source of the installed Triton's CUDA launcher, whitespace removed: generated from a
    template in driver.py (3.6) or driver.c beside it (3.7 on)."""
    module = inspect.getmodule(CudaLauncher)
    parts = [inspect.getsource(module)]
    c_file = pathlib.Path(module.__file__).with_name("driver.c")
    if c_file.exists():
        parts.append(c_file.read_text())
    source = "".join(parts).replace("{{", "{").replace("}}", "}")  # the template's braces
    return re.sub(r"\s+", "", source)
