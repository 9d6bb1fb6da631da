"""Launch a Triton kernel without ``JITFunction.run`` on repeated calls.

``kernel[grid](...)`` binds every argument, derives Triton's specialisation key and looks the
compiled kernel up on every call: 21-38 us of host time per launch on the lent H200 VM. The
fused norm launches in every forward and backward of every GDN layer, so ``DirectLauncher``
keeps the compiled kernel per *launch key* and calls it directly: 10-16 us, within 0.2-2.9 us of a
bare call of the compiled kernel (docs/benchmarks.md, host cost).

The launch key must determine Triton's specialisation of every argument. It is built from the
scalar arguments (every int, stride tuple, flag and constexpr by value, except the kernel's
``do_not_specialize`` parameters, which Triton types by integer width alone: i32, i64 or u64),
the launch options, and per tensor its dtype and whether its address is 16-byte aligned: that
is all ``JITFunction.run`` specialises on, so equal keys mean the same compiled kernel. A new
token count (a ``do_not_specialize`` argument) keeps the key, so packed sequences of varying
length take the direct path in every step. A new key goes through ``JITFunction.run`` once, which
compiles only if Triton's own key is new. Under the Triton interpreter there is no compiled
kernel: every call takes the normal path.
"""

from __future__ import annotations

from triton import knobs
from triton.runtime import driver

# Keys differ by layout, dtype, alignment and head shape, not by token count; the bound only
# guards against a caller that keeps producing new layouts.
MAX_KEYS = 1024


class DirectLauncher:
    """``launch(grid, tensors, scalars, num_warps)`` == ``kernel[(grid,)](*tensors, *scalars,
    num_warps=num_warps)`` for a kernel whose parameters are the tensors followed by the
    scalars, every parameter passed (defaults included: the compiled kernel takes them all).
    The tensors are on the current CUDA device, as for ``kernel[grid]``; ``None`` is a null
    pointer."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled = {}  # launch key (current device first) -> compiled kernel
        # Parameter positions Triton does not specialise (do_not_specialize).
        self.unspecialised = tuple(p.num for p in getattr(kernel, "params", ())
                                   if getattr(p, "do_not_specialize", False))
        self.direct_calls = 0  # observable by tests: how many launches skipped JITFunction.run

    def __call__(self, grid: int, tensors: tuple, scalars: tuple, num_warps: int) -> None:
        pointers = [0 if t is None else t.data_ptr() for t in tensors]
        key_scalars = self._key_scalars(len(tensors), scalars)
        if self.compiled:  # something compiled exists, so there is a driver to ask
            device = driver.active.get_current_device()  # the device JITFunction.run would use
            compiled = self.compiled.get(_launch_key(device, tensors, pointers, key_scalars, num_warps))
            if compiled is not None:
                self._run(compiled, grid, device, tensors, pointers, scalars)
                return
        compiled = self.kernel[(grid,)](*tensors, *scalars, num_warps=num_warps)
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            return  # the interpreter ran it: nothing compiled to keep
        if len(self.compiled) >= MAX_KEYS:
            self.compiled.clear()
        device = driver.active.get_current_device()
        self.compiled[_launch_key(device, tensors, pointers, key_scalars, num_warps)] = compiled

    def _key_scalars(self, n_tensors: int, scalars: tuple) -> tuple:
        """``scalars`` with each unspecialised integer replaced by the type Triton gives it."""
        if not self.unspecialised:
            return scalars
        key = list(scalars)
        for num in self.unspecialised:
            value = key[num - n_tensors]
            if type(value) is int:
                key[num - n_tensors] = ("i32" if -2**31 <= value < 2**31 else
                                        "u64" if value >= 2**63 else "i64")
        return tuple(key)

    def _run(self, compiled, grid, device, tensors, pointers, scalars) -> None:
        """The call JITFunction.run makes once it has found the kernel, with two savings:
        - pointers go in as integers: the launcher then skips its per-tensor driver query
          (cuPointerGetAttribute), which only checks that the address is device memory; the
          callers' validation requires CUDA tensors (check_gated_norm_inputs), and the first
          launch of every key went through JITFunction.run, which made the check itself;
        - with no launch hook registered (Triton >= 3.7 keeps empty hook chains and calls them
          on every launch), neither the hooks nor their metadata are built or called.
        """
        stream = driver.active.get_current_stream(device)
        enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _has_hooks(enter) or _has_hooks(exit_):  # a profiler is listening: exactly as Triton
            metadata = compiled.launch_metadata((grid, 1, 1), stream, *tensors, *scalars)
        else:
            metadata = enter = exit_ = None
        compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, metadata,
                     enter, exit_, *pointers, *scalars)
        self.direct_calls += 1


def _has_hooks(hook) -> bool:
    """A launch hook (Triton <= 3.6) or a chain of them (>= 3.7: ``.calls``) that calls anything."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_key(device: int, tensors: tuple, pointers: list, scalars: tuple, num_warps: int) -> tuple:
    """Everything JITFunction.run specialises on (module docstring), plus the device the compiled
    kernel is loaded on."""
    return (device, scalars, num_warps,
            *[None if t is None else (t.dtype, p % 16 == 0) for t, p in zip(tensors, pointers)])
