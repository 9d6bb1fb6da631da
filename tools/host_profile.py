"""Host (Python) cost of one eager forward + backward of the fused gated norm, on the CPU, with
every kernel launch stubbed: what the GPU host pays around its launches, without a GPU.

    python tools/host_profile.py [--rounds N] [--calls N] [--profile]

The Triton interpreter (set here before triton loads) makes the package take CPU tensors; each
launcher's compiled kernel is replaced by a no-op, so the launcher's own path (launch key,
lookup, argument packing) still runs and only the final call into the driver is skipped.
Reported in units of a tiny torch op of the same run (``x.add(1)`` on 16 elements), rounds of
all measurements interleaved, each timing the median over the rounds: a shared CPU's speed moves
between moments, ratios within one run do not. ``own_units`` = (forward with autograd +
backward through autograd - backward through autograd of a trivial Function) / tiny op, formed
per round as tools/host_cost.py forms it (median, and quartiles ``own_units_q1`` / ``_q3``), the
quantity it measures on a GPU host (there a tiny op includes a CUDA launch, so
the CPU's units are larger numbers for the same work); ``same_signature_units``, the same for a
Function of our signature that only launches one tiny op each way. ``--profile`` adds a
cProfile listing.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import core.fusions.direct_launch as direct_launch  # noqa: E402
import core.fusions.fused_gated_norm as fgn  # noqa: E402
import core.fusions.gated_norm_plans as plans  # noqa: E402
from tools.bench_common import EPS, make_inputs  # noqa: E402
from tools.host_cost import (SHAPE, HostTimer, own_work_calls, own_work_units,  # noqa: E402
                             same_signature_units)


class _StubCompiled:
    """A compiled kernel whose launch does nothing (the attributes the direct call reads)."""

    function = packed_metadata = None

    def run(self, *args):
        return None


class _StubKernel:
    """``kernel[grid](...)`` returning a _StubCompiled: the first launch of every key."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _StubCompiled()


class _StubDriver:
    """driver.active with CUDA's query functions' shapes: a Python function around a builtin
    (torch.cuda.current_device) and a builtin (torch._C._cuda_getCurrentRawStream)."""

    class active:  # noqa: N801 (read as driver.active)
        @staticmethod
        def get_current_device():
            return abs(0)

        get_current_stream = abs


def stub_launches() -> None:
    """Every launcher takes its direct path with a no-op compiled kernel."""
    direct_launch.driver = _StubDriver
    for launcher in (plans.launch_forward, plans.launch_backward, plans.launch_dw_sum):
        launcher.kernel, launcher.direct = _StubKernel(), True
        launcher.compiled.clear()


def measurements() -> dict:
    """name -> a call to time: tools/host_cost.py's four (the tiny op on 16 elements: no work
    but the op's host path) and the validation."""
    x, g, w, dy, leaves = make_inputs(SHAPE, device="cpu")
    return {**own_work_calls(x, g, w, dy, leaves, tiny=torch.zeros(16)),
            "validation_us": lambda: fgn.check_gated_norm_inputs(x, g, w, EPS)}


def measure(rounds: int, calls: int) -> dict:
    """Median us of each measurement over the rounds, and the units as tools/host_cost.py forms
    them (per round, then the median and quartiles)."""
    # The warm-up also fills the launchers' tables (first launches).
    times = HostTimer().measure_interleaved(measurements(), rounds, calls)
    own, signature = own_work_units(times), same_signature_units(times)
    return {**{name: statistics.median(per_round) for name, per_round in times.items()},
            "own_units": own["median"], "own_units_q1": own["quartiles"][0],
            "own_units_q3": own["quartiles"][1], "same_signature_units": signature["median"]}


def profile(calls: int) -> None:
    fns = measurements()
    forward, backward = fns["forward_autograd_us"], fns["backward_autograd_us"]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        forward()
        backward()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15,
                        help="interleaved rounds; each times every measurement in turn, and the "
                             "median over the rounds is reported (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=500,
                        help="calls of each measurement per round (default: %(default)s)")
    parser.add_argument("--profile", action="store_true",
                        help="also print a cProfile listing (top 25 by own time) of CALLS eager "
                             "forward + backward calls")
    args = parser.parse_args(argv)
    for name in ("rounds", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    stub_launches()
    result = measure(args.rounds, args.calls)
    for name, value in result.items():
        print(f"{name:32s} {value:8.2f}")
    if args.profile:
        profile(args.calls)
    return result


if __name__ == "__main__":
    main()
