"""Host (CPU) cost of one call of the fused gated norm, at a shape so small that the GPU is never
the bottleneck: validation, the launch, the autograd entry points, and references measured on
the same CPU in the same run (a tiny torch op, Triton's own launch path, the compiled kernel
called by hand). Compare rows of one run: a VM's CPU speed moves between moments.

    python tools/host_cost.py [--out DIR]   # -> DIR/host_cost.json (tools/benchmark.py runs it too)

Each timing entry is the mean over five rounds of 600 calls (``best_round_us``: the fastest
round, the least disturbed one, as timeit reports). ``own_work_units``, the figure of merit, from
15 interleaved rounds of 200 calls of each of its six parts: our own host
work for one eager forward + backward through autograd (forward with autograd + backward
through autograd - the backward of a trivial autograd Function) in units of a tiny torch op;
its timings are taken in interleaved rounds and the ratio is formed per round, so a drift of
the host's speed during the run falls on all of them alike (median and quartiles reported).
``same_signature_units`` is the same formula for a Function of our signature that launches one
tiny kernel each way and does nothing else, timed in the same rounds: the part of the figure
that autograd charges for the signature alone.
``backward_impl_in_autograd_us`` is the backward's own path (``autograd_backward``: its station
and launches, as the Function's backward runs it) timed inside the backward through autograd,
which the engine runs on its own thread for CUDA tensors, next to ``backward_impl_us`` called
directly in a loop and ``backward_impl_after_autograd_us`` called on this thread once after each
backward of a trivial Function: the last two tell the engine's round trip from its thread.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from core.fusions import fused_gdn_gated_rms_norm  # noqa: E402
from tools.bench_common import EPS, make_inputs, measure_and_write  # noqa: E402

import core.fusions.fused_gated_norm as fgn  # noqa: E402
import core.fusions.gated_norm_plans as plans  # noqa: E402
from core.fusions.gated_norm_kernels import ForwardArgs  # noqa: E402

ROUNDS, CALLS, WARMUP = 5, 600, 50
INTERLEAVED_ROUNDS, INTERLEAVED_CALLS = 15, 200
SHAPE = (1, 16, 8, 128)  # 128 rows
INFERENCE_HEADS, INFERENCE_DIM = 32, 128  # one token of a serving step


class HostTimer:
    """Collects ``name -> mean us per call`` and the fastest round per name."""

    def __init__(self, rounds: int = ROUNDS, calls: int = CALLS, warmup: int = WARMUP):
        self.rounds, self.calls, self.warmup = rounds, calls, warmup
        self.mean: dict[str, float] = {}
        self.best: dict[str, float] = {}
        self.extra: dict = {}

    def measure(self, name: str, fn) -> None:
        self.measure_interleaved({name: fn}, self.rounds, self.calls)

    def measure_interleaved(self, fns: dict, rounds: int, calls: int) -> dict[str, list[float]]:
        """``rounds`` rounds, each timing ``calls`` calls of every function in turn; records
        each and returns ``name -> us per call, per round``."""
        for fn in fns.values():
            for _ in range(self.warmup):
                fn()
        _synchronize()
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[name].append((time.perf_counter() - start) / calls * 1e6)
        _synchronize()
        for name, per_round in times.items():
            self.record(name, per_round)
        return times

    def record(self, name: str, times_us: list[float]) -> None:
        self.mean[name], self.best[name] = sum(times_us) / len(times_us), min(times_us)

    def add_sum(self, name: str, *parts: str) -> None:
        for table in (self.mean, self.best):
            table[name] = sum(table[p] for p in parts)

    def result(self) -> dict:
        return {**self.mean, "best_round_us": dict(self.best), **self.extra}


def measure_inside(timer: HostTimer, name: str, module, attribute: str, call) -> None:
    """Records ``name``: the us per call spent inside ``module.attribute`` (a function that
    ``call`` reaches through the module) while ``call`` runs, in the timer's rounds."""
    original = getattr(module, attribute)
    spent = [0.0]

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    setattr(module, attribute, timed)
    try:
        for _ in range(timer.warmup):
            call()
        per_round = []
        for _ in range(timer.rounds):
            spent[0] = 0.0
            for _ in range(timer.calls):
                call()
            per_round.append(spent[0] / timer.calls * 1e6)
    finally:
        setattr(module, attribute, original)
    _synchronize()
    timer.record(name, per_round)


def measure_after(timer: HostTimer, name: str, before, call) -> None:
    """Records ``name``: the us per call of ``call`` alone, each call right after one call of
    ``before`` (untimed), in the timer's rounds."""
    for _ in range(timer.warmup):
        before()
        call()
    per_round = []
    for _ in range(timer.rounds):
        spent = 0.0
        for _ in range(timer.calls):
            before()
            start = time.perf_counter()
            call()
            spent += time.perf_counter() - start
        per_round.append(spent / timer.calls * 1e6)
    _synchronize()
    timer.record(name, per_round)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


OWN_WORK_PARTS = ("forward_autograd_us", "backward_autograd_us",
                  "ref_autograd_function_backward_us", "ref_torch_add_us")


# A Function with our signature that does nothing but one tiny kernel each way, timed like ours
# (forward with autograd, backward through autograd).
SAME_SIGNATURE_PARTS = ("ref_same_signature_forward_us", "ref_same_signature_backward_us")


def own_work_units(times: dict[str, list[float]]) -> dict:
    """Per round: (forward with autograd + backward through autograd - a trivial Function's
    backward) / a tiny torch op, from interleaved rounds of the four (OWN_WORK_PARTS)."""
    return _units_per_round(times, *OWN_WORK_PARTS[:2])


def same_signature_units(times: dict[str, list[float]]) -> dict:
    """The same formula with ``_SameSignature`` in place of our Function: the part of the figure
    that autograd charges any Function of our signature."""
    return _units_per_round(times, *SAME_SIGNATURE_PARTS)


def _units_per_round(times: dict[str, list[float]], forward: str, backward: str) -> dict:
    trivial, tiny = (times[name] for name in OWN_WORK_PARTS[2:])
    per_round = [(f + b - t) / op for f, b, t, op in zip(times[forward], times[backward], trivial,
                                                          tiny)]
    # Quartiles, not the fastest round: a round in which the subtracted terms were disturbed
    # gives a low value, so the minimum of a difference is no "least disturbed" figure.
    if len(per_round) > 1:
        low, _, high = statistics.quantiles(per_round, n=4)
    else:
        low = high = per_round[0]
    return {"median": statistics.median(per_round), "quartiles": [low, high],
            "per_round": per_round}


class _RecordingKernel:
    """Stands in for gated_norm_fwd: ``kernel[grid](*args, num_warps=..., **options)`` records,
    runs nothing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, num_warps, **options: self.launches.append(
            (grid[0], args, num_warps, options))


def forward_launch_arguments(x, gate, weight):
    """(grid, tensors, scalars, warps, options) exactly as forward_impl's launcher hands them to
    ``kernel[grid]`` (scalars: the kernel's ``ForwardArgs``; options: its compile options, and
    launch_pdl where the GPU takes programmatic dependent launch)."""
    launcher, recorder = plans.launch_forward, _RecordingKernel()
    kernel, compiled = launcher.kernel, launcher.compiled
    launcher.kernel, launcher.compiled = recorder, {}  # every launch reaches the recorder
    try:
        fgn.forward_impl(x, gate, weight, EPS)
    finally:
        launcher.kernel, launcher.compiled = kernel, compiled
    grid, args, warps, options = recorder.launches[0]
    tensors = len(args) - len(ForwardArgs._fields)
    return grid, args[:tensors], ForwardArgs(*args[tensors:]), warps, options


class _Scale(torch.autograd.Function):
    """The autograd engine's own cost: one tiny kernel each way."""

    @staticmethod
    def forward(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _SameSignature(torch.autograd.Function):
    """_FusedGatedNorm's signature (three tensors that take gradients and a tuple of options)
    and no work but one tiny kernel each way: what autograd itself costs a Function of that shape,
    which the trivial one-input Function does not pay."""

    @staticmethod
    def forward(ctx, x, gate, weight, options):
        ctx.weight = weight  # returned as the weight's gradient: right shape, no kernel
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        dx = grad * 2
        return dx, dx, ctx.weight, None


def own_work_calls(x, g, w, dy, leaves, tiny: torch.Tensor) -> dict:
    """The calls of OWN_WORK_PARTS and SAME_SIGNATURE_PARTS for inputs from make_inputs; the tiny
    op adds 1 to ``tiny``."""
    out = fgn.fused_gated_norm(x, g, w, EPS)
    ref_out = _Scale.apply(x)
    options = (EPS, False, "bshd", "silu", 1.0, 0)  # as apply_validated_gated_norm passes them
    same_signature_out = _SameSignature.apply(x, g, w, options)
    return {"forward_autograd_us": lambda: fgn.fused_gated_norm(x, g, w, EPS),
            "backward_autograd_us": lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True),
            "ref_autograd_function_backward_us":
                lambda: torch.autograd.grad(ref_out, (x,), dy, retain_graph=True),
            "ref_torch_add_us": lambda: tiny.add(1),
            "ref_same_signature_forward_us": lambda: _SameSignature.apply(x, g, w, options),
            "ref_same_signature_backward_us":
                lambda: torch.autograd.grad(same_signature_out, leaves, dy, retain_graph=True)}


def training_host_cost(timer: HostTimer) -> None:
    x, g, w, dy, leaves = make_inputs(SHAPE)
    own_work = own_work_calls(x, g, w, dy, leaves, tiny=x.detach())
    times = timer.measure_interleaved(own_work, INTERLEAVED_ROUNDS, INTERLEAVED_CALLS)
    timer.extra["own_work_units"] = own_work_units(times)
    timer.extra["same_signature_units"] = same_signature_units(times)
    timer.measure("validation_us", lambda: fgn.check_gated_norm_inputs(x, g, w, EPS))
    with torch.no_grad():
        timer.measure("forward_no_grad_us", lambda: fgn.fused_gated_norm(x, g, w, EPS))
    xd, gd, wd = x.detach(), g.detach(), w.detach()
    timer.measure("forward_impl_us", lambda: fgn.forward_impl(xd, gd, wd, EPS))
    _, rstd = fgn.forward_impl(xd, gd, wd, EPS)
    timer.measure("backward_impl_us", lambda: fgn.backward_impl(xd, gd, wd, rstd, dy))
    # The same backward_impl as the autograd engine runs it (on its device thread for CUDA),
    # and on this thread, one call after each backward of the trivial Function: what the call
    # costs after an engine round trip, whichever thread runs it.
    measure_inside(timer, "backward_impl_in_autograd_us", fgn, "autograd_backward",
                   own_work["backward_autograd_us"])
    measure_after(timer, "backward_impl_after_autograd_us",
                  own_work["ref_autograd_function_backward_us"],
                  lambda: fgn.backward_impl(xd, gd, wd, rstd, dy))
    # References on this CPU: an allocation, Triton's own launch path (JITFunction.run) and the
    # project's launcher with forward_impl's own arguments.
    timer.measure("ref_torch_empty_us", lambda: xd.new_empty(xd.shape))
    grid, tensors, scalars, warps, options = forward_launch_arguments(xd, gd, wd)
    timer.measure("ref_triton_launch_us",
                  lambda: fgn.gated_norm_fwd[(grid,)](*tensors, *scalars, num_warps=warps,
                                                      **options))
    pdl = options.get("launch_pdl", False)  # the launcher adds its compile options itself
    timer.measure("direct_launcher_us",
                  lambda: plans.launch_forward(grid, tensors, scalars, warps, launch_pdl=pdl))
    prepared = plans.launch_forward.prepare(tuple(t.dtype for t in tensors), scalars, warps, pdl)
    timer.measure("direct_launcher_prepared_us",
                  lambda: plans.launch_forward.launch(grid, tensors, prepared))
    timer.add_sum("validation_plus_launch_us", "validation_us", "direct_launcher_us")
    # The compiled kernel called by hand (Triton-internal call convention): the floor of any
    # Python-side launch; with addresses, Triton's launcher skips its per-tensor driver query.
    compiled = fgn.gated_norm_fwd[(grid,)](*tensors, *scalars, num_warps=warps,
                                           **options)[(grid, 1, 1)]
    timer.measure("ref_compiled_kernel_launch_us", lambda: compiled(*tensors, *scalars))
    pointers = [t.data_ptr() for t in tensors]
    timer.measure("ref_compiled_kernel_int_pointers_us", lambda: compiled(*pointers, *scalars))


def inference_host_cost(timer: HostTimer) -> None:
    """The inference entry at one token, in place, z a slice of a packed projection."""
    inference = sys.modules[fused_gdn_gated_rms_norm.__module__]
    heads, dim = INFERENCE_HEADS, INFERENCE_DIM
    x = torch.randn(1, heads * dim, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(1, 2 * heads * dim, device="cuda", dtype=torch.bfloat16)[:, heads * dim:]
    weight = torch.rand(dim, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        timer.measure("inference_validation_us", lambda: inference._check_inputs(
            x, z, weight, x, EPS, heads, dim, True, "swish"))
        timer.measure("inference_call_us",
                      lambda: fused_gdn_gated_rms_norm(x, z, weight, x, EPS, heads, dim))


def host_cost() -> dict:
    timer = HostTimer()
    training_host_cost(timer)
    inference_host_cost(timer)
    return timer.result()


def main(argv=None) -> None:
    measure_and_write(argv, __doc__, "host_cost", host_cost)


if __name__ == "__main__":
    main()
