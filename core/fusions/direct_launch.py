"""Launch a Triton kernel without ``JITFunction.run`` on repeated calls.

``kernel[grid](...)`` binds every argument, derives Triton's specialisation key and looks the
compiled kernel up on every call: at the fused norm's small shapes that host time is more than
the kernel's GPU time, and the norm launches in every forward and backward of every GDN layer.
``DirectLauncher`` keeps the compiled kernel per *launch key* and calls it directly, with its
arguments prepared once per launch signature (docs/benchmarks.md, Host cost, has the measured
costs: ``python tools/host_cost.py``).

The launch key must determine Triton's specialisation of every argument. It is built from the
scalar arguments (every int, float, stride tuple, flag and constexpr by value, except the
kernel's ``do_not_specialize`` parameters, which Triton types by integer width alone: i32, i64 or
u64; a float is fp32 to Triton whatever its value, so a new value is a new launch key but never
a new compiled kernel),
the launch options, and per tensor its dtype and whether its address is 16-byte aligned: that
is all ``JITFunction.run`` specialises on, so equal keys mean the same compiled kernel. A new
token count (a ``do_not_specialize`` argument) keeps the key, so packed sequences of varying
length take the direct path in every step. A new key goes through ``JITFunction.run`` once, which
compiles only if Triton's own key is new. Under the Triton interpreter there is no compiled
kernel: every call takes the normal path. Triton settings that ``JITFunction.run`` reads on each
call (``knobs.runtime.debug``, ``knobs.compilation.instrumentation_mode``) are not in the key:
the kernel compiled at a key's first launch serves it from then on, so set them before the
first launch (``TRITON_DEBUG=1`` in the environment), or turn the direct path off (below).

The direct call is Triton's private launcher ABI (the call ``JITFunction.run`` ends with), as
written for the Triton versions in ``LAUNCHER_PARAMETERS`` (3.6 to 3.9). Each launcher
checks its first compiled kernel against it: the Triton version, and the parameters of the compiled
kernel's launcher and ``launch_metadata``. On a mismatch it launches through ``kernel[grid]``
from then on, and the process gets one warning. ``GDN_FUSED_NORM_DIRECT_LAUNCH=0`` in the
environment (read when a launcher is made, at import) turns the direct path off without one.
tests/fusions/test_direct_launch.py fails when the installed Triton's ABI moves.
"""

from __future__ import annotations

import inspect
import itertools
import os
import warnings
from typing import NamedTuple, Optional

import triton
from triton import knobs
from triton.runtime import driver

# Keys differ by layout, dtype, alignment and head shape, not by token count; the bound only
# guards against a caller that keeps producing new layouts.
MAX_KEYS = 1024

ENV_SWITCH = "GDN_FUSED_NORM_DIRECT_LAUNCH"
TRITON_VERSION = triton.__version__

# Parameters of a compiled kernel's launcher (``CompiledKernel.run``), by Triton major.minor.
# JITFunction.run calls it the same way in all: (grid x, y, z, stream, function, packed
# metadata, launch metadata, enter hook, exit hook, *kernel arguments); 3.6 passes everything
# after the function through *args, 3.7 names it, 3.8 and 3.9 keep 3.7's launcher (its C launch
# call too: integer pointers skip the driver query, None hooks are not called).
_NAMED_HOOKS = ("gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata",
                "launch_metadata", "launch_enter_hook", "launch_exit_hook", "*args")
LAUNCHER_PARAMETERS = {
    "3.6": ("gridX", "gridY", "gridZ", "stream", "function", "*args"),
    "3.7": _NAMED_HOOKS,
    "3.8": _NAMED_HOOKS,
    "3.9": _NAMED_HOOKS,
}
LAUNCH_METADATA_PARAMETERS = ("grid", "stream", "*args")

_warned = False  # one fallback warning per process


def direct_launch_switch() -> bool:
    """``GDN_FUSED_NORM_DIRECT_LAUNCH``: "1" (the default) or "0" (off); anything else is a
    ValueError rather than a guess."""
    value = os.environ.get(ENV_SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_SWITCH} must be 0 (direct launch off) or 1 (on, the default), "
                         f"got {value!r}")
    return value == "1"


def abi_mismatch(compiled) -> Optional[str]:
    """Why the direct call does not fit ``compiled`` (a compiled kernel of the running Triton),
    or None when it does."""
    version = ".".join(TRITON_VERSION.split(".")[:2])
    expected = LAUNCHER_PARAMETERS.get(version)
    if expected is None:
        return (f"Triton {TRITON_VERSION} is not a version its launcher ABI is known for "
                f"({', '.join(LAUNCHER_PARAMETERS)})")
    try:
        launcher = parameter_names(compiled.run)
        metadata = parameter_names(compiled.launch_metadata)
        compiled.function, compiled.packed_metadata  # noqa: B018 (read, as the direct call does)
    except (AttributeError, TypeError, ValueError) as e:
        return f"the compiled kernel lacks what the direct call uses ({type(e).__name__}: {e})"
    if launcher != expected:
        return f"the compiled kernel's launcher takes {launcher}, not {expected}"
    if metadata != LAUNCH_METADATA_PARAMETERS:
        return f"launch_metadata takes {metadata}, not {LAUNCH_METADATA_PARAMETERS}"
    return None


def parameter_names(fn) -> tuple[str, ...]:
    """``fn``'s parameter names in order, ``*name`` for a variadic one (``**`` for keywords)."""
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return tuple(stars.get(p.kind, "") + p.name for p in inspect.signature(fn).parameters.values())


def _warn_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"DirectLauncher: {reason}; launching through kernel[grid](...) instead (same "
            f"results, ~10-20 us more host time per launch). {ENV_SWITCH}=0 selects that path "
            "without this warning.",
            RuntimeWarning, stacklevel=3,
        )


class PreparedLaunch(NamedTuple):
    """A kernel's scalar arguments and launch options with ``signature``: the number its launcher
    gave to the part of the launch key they and the tensors' dtypes decide
    (``DirectLauncher.prepare``). A caller that launches one argument pattern repeatedly prepares
    it once."""
    scalars: tuple
    num_warps: int
    signature: int
    launch_pdl: bool = False  # programmatic dependent launch (Triton's compile option)


class DirectLauncher:
    """``launch(grid, tensors, scalars, num_warps)`` == ``kernel[(grid,)](*tensors, *scalars,
    num_warps=num_warps, **compile_options)`` for a kernel whose parameters are the tensors
    followed by the scalars, every parameter passed (defaults included: the compiled kernel takes
    them all); ``launch_pdl=True`` adds Triton's option of that name (the compiled kernel keeps
    it).
    The tensors are on the current CUDA device, as for ``kernel[grid]``; ``None`` is a null
    pointer. ``launch.launch(grid, tensors, launch.prepare(dtypes, scalars, num_warps))`` is the
    same launch with the key's argument part computed once."""

    def __init__(self, kernel, **compile_options):
        self.kernel = kernel
        # Triton compile options given on every launch (``enable_fp_fusion=True``): fixed per
        # launcher, so they take no part in the launch key.
        self.compile_options = compile_options
        # (device, signature, whether each pointer is 16-byte aligned) -> compiled kernel
        self.compiled = {}
        # (key scalars, warps, tensor dtypes) -> signature; numbers are never reused, so a
        # PreparedLaunch kept past a reset of this table still names only its own arguments.
        self.signatures = {}
        self._next_signature = itertools.count()
        # Parameter positions Triton does not specialise (do_not_specialize).
        self.unspecialised = tuple(p.num for p in getattr(kernel, "params", ())
                                   if getattr(p, "do_not_specialize", False))
        self.direct_calls = 0  # observable by tests: how many launches skipped JITFunction.run
        # None until the first compiled kernel is checked (abi_mismatch), then True or False.
        self.direct = None if direct_launch_switch() else False

    def __call__(self, grid: int, tensors: tuple, scalars: tuple, num_warps: int,
                 launch_pdl: bool = False) -> None:
        dtypes = tuple([None if t is None else t.dtype for t in tensors])
        self.launch(grid, tensors, self.prepare(dtypes, scalars, num_warps, launch_pdl))

    def prepare(self, dtypes: tuple, scalars: tuple, num_warps: int,
                launch_pdl: bool = False) -> PreparedLaunch:
        """``scalars`` and the launch options for tensors of ``dtypes`` (None for a null
        pointer)."""
        static = (self._key_scalars(len(dtypes), scalars), num_warps, launch_pdl, dtypes)
        signature = self.signatures.get(static)
        if signature is None:
            if len(self.signatures) >= MAX_KEYS:
                self.signatures.clear()
            signature = self.signatures[static] = next(self._next_signature)
        return PreparedLaunch(scalars, num_warps, signature, launch_pdl)

    def launch(self, grid: int, tensors: tuple, prepared: PreparedLaunch,
               device: Optional[int] = None) -> None:
        """Launch with ``prepared`` arguments; ``tensors`` have the dtypes it was prepared for.
        ``device``: the current CUDA device where the caller has read it, else asked here."""
        pointers = [0 if t is None else t.data_ptr() for t in tensors]
        if self.compiled:  # something compiled exists, so there is a driver to ask
            if device is None:  # the device JITFunction.run would use
                device = driver.active.get_current_device()
            compiled = self.compiled.get(_launch_key(device, prepared.signature, pointers))
            if compiled is not None:
                self._run(compiled, grid, device, tensors, pointers, prepared.scalars)
                return
        scalars = prepared.scalars
        options = self.compile_options
        if prepared.launch_pdl:
            options = {**options, "launch_pdl": True}
        compiled = self.kernel[(grid,)](*tensors, *scalars, num_warps=prepared.num_warps, **options)
        if compiled is None or self.direct is False:
            return  # the interpreter ran it (nothing compiled to keep), or direct launch is off
        if self.direct is None:
            reason = abi_mismatch(compiled)
            self.direct = reason is None
            if reason is not None:
                _warn_once(reason)
                return
        if len(self.compiled) >= MAX_KEYS:
            self.compiled.clear()
        device = driver.active.get_current_device()
        self.compiled[_launch_key(device, prepared.signature, pointers)] = compiled

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
          callers' validation requires CUDA tensors (gated_norm_validation.check_operands), and the
          first launch of every key went through JITFunction.run, which made the check itself;
        - with no launch hook registered (Triton 3.6-3.9 keep empty hook chains and call
          them on every launch), neither the hooks nor their metadata are built or called.
        ``self.compiled`` keeps the CompiledKernel itself, not its ``function`` handle: from
        Triton 3.8 on, a CompiledKernel unloads its module when it is freed (``__del__``).
        """
        stream = driver.active.get_current_stream(device)
        runtime = knobs.runtime
        enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
        if _has_hooks(enter) or _has_hooks(exit_):  # a profiler is listening: exactly as Triton
            metadata = compiled.launch_metadata((grid, 1, 1), stream, *tensors, *scalars)
        else:
            metadata = enter = exit_ = None
        compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, metadata,
                     enter, exit_, *pointers, *scalars)
        self.direct_calls += 1


def _has_hooks(hook) -> bool:
    """A launch hook (a plain callable) or a chain of them (``.calls``, Triton 3.6-3.9) that
    calls anything."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_key(device: int, signature: int, pointers: list) -> tuple:
    """Everything JITFunction.run specialises on (module docstring): the prepared arguments'
    signature and each pointer's 16-byte alignment, plus the device the compiled kernel is loaded
    on."""
    return (device, signature, *[p % 16 == 0 for p in pointers])
