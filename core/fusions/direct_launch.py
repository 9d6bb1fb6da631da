"""Launch a Triton kernel without ``JITFunction.run`` on repeated calls.

``kernel[grid](...)`` binds every argument, derives Triton's specialisation key and looks the
compiled kernel up on every call: 24-33 us of host time per launch on the lent H200 VM. The
fused norm launches in every forward and backward of every GDN layer, so ``DirectLauncher``
keeps the compiled kernel per *launch key* and calls it directly: 13-16 us, against 10-15 us
for a bare call of the compiled kernel (docs/benchmarks.md, host cost).

The launch key must determine Triton's specialisation of every argument. It is built from the
scalar arguments themselves (every int, stride tuple, flag and constexpr, by value), the
launch options, and per tensor its dtype and whether its address is 16-byte aligned: that is all
``JITFunction.run`` specialises on, so equal keys mean the same compiled kernel. A new key (a new
token count, say) goes through ``JITFunction.run`` once, which compiles only if Triton's own key
is new. Under the Triton interpreter there is no compiled kernel: every call takes the normal
path.
"""

from __future__ import annotations

from triton import knobs
from triton.runtime import driver

# Distinct keys differ mostly by token count; a bounded table keeps a long run with packed
# sequences of varying length from growing it without limit.
MAX_KEYS = 1024


class DirectLauncher:
    """``launch(grid, tensors, scalars, num_warps)`` == ``kernel[(grid,)](*tensors, *scalars,
    num_warps=num_warps)`` for a kernel whose parameters are the tensors followed by the
    scalars, every parameter passed (defaults included: the compiled kernel takes them all)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled = {}  # launch key (current device first) -> compiled kernel
        self.direct_calls = 0  # observable by tests: how many launches skipped JITFunction.run

    def __call__(self, grid: int, tensors: tuple, scalars: tuple, num_warps: int) -> None:
        compiled = None
        if self.compiled:  # something compiled exists, so there is a driver to ask
            device = driver.active.get_current_device()  # the device JITFunction.run would use
            compiled = self.compiled.get(_launch_key(device, tensors, scalars, num_warps))
        if compiled is not None:
            stream = driver.active.get_current_stream(device)
            # The call JITFunction.run makes once it has found the kernel (launch hooks
            # included, for profilers).
            metadata = compiled.launch_metadata((grid, 1, 1), stream, *tensors, *scalars)
            compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata,
                         metadata, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook,
                         *tensors, *scalars)
            self.direct_calls += 1
            return
        compiled = self.kernel[(grid,)](*tensors, *scalars, num_warps=num_warps)
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            return  # the interpreter ran it: nothing compiled to keep
        if len(self.compiled) >= MAX_KEYS:
            self.compiled.clear()
        device = driver.active.get_current_device()
        self.compiled[_launch_key(device, tensors, scalars, num_warps)] = compiled


def _launch_key(device: int, tensors: tuple, scalars: tuple, num_warps: int) -> tuple:
    """Everything JITFunction.run specialises on (module docstring), plus the device the compiled
    kernel is loaded on."""
    return (device, scalars, num_warps,
            *[None if t is None else (t.dtype, t.data_ptr() % 16 == 0) for t in tensors])
