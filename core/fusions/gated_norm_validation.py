"""The input rules of the fused gated norm: host metadata only (shapes, strides, dtypes,
devices, option values). No tensor is read, so no CUDA synchronisation.

Both entries use them: the training entry (``fused_gated_norm.fused_gated_norm`` through
``check_gated_norm_inputs``, ``validate_gated_norm`` for a Megatron module, and the impls on a
new launch signature) and the inference entry (``gated_norm_inference``), each after its own
shape rules. Exception types: TypeError for an argument of the wrong type (not a tensor, an
unsupported dtype, a non-bool flag, a non-number eps), ValueError for a value breaking a rule
(shape, stride, device, a limit, a range, an option).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from core.fusions.gated_norm_launch import (MAX_HEAD_DIM, MAX_ROWS,
                                            supports_programmatic_dependent_launch)

# Triton compiles for the GPU; on the CPU its interpreter runs the kernels (TRITON_INTERPRET=1,
# read when triton is imported). Each takes its own device's tensors only (a meta tensor has no
# memory for either).
INTERPRETED = bool(triton.knobs.runtime.interpret)
DEVICE_RULE = ("(compiled kernels take CUDA tensors; the Triton interpreter, TRITON_INTERPRET=1, "
               "takes CPU tensors)")

SUPPORTED_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED_ACTIVATIONS = ("silu", "sigmoid")


def current_device() -> Optional[int]:
    """The CUDA device the kernels launch on; None under the interpreter (CPU tensors)."""
    return None if INTERPRETED else torch.cuda.current_device()


# Checked signatures. A key holds everything a set of rules reads (each tensor's type, shape,
# strides, dtype, device, negative bit and layout, the current device, the options with their types
# where True == 1 would confuse a dict), so a key kept after the rules passed means they pass
# for exactly these values. Building one fails for an argument that is not a tensor or has no
# strides (sparse CSR), and where no CUDA device can be asked which one is current (no driver,
# a torch without CUDA): the rules then run and name what is wrong.
KEY_ERRORS = (AttributeError, TypeError, RuntimeError, AssertionError)


def tensor_signature(t: torch.Tensor) -> tuple:
    """What the rules read of one tensor, as part of a checked signature: its type, shape,
    strides, dtype, device, negative bit and layout (an mkldnn tensor reports a dense tensor's
    strides)."""
    return type(t), t.shape, t.stride(), t.dtype, t.device, t.is_neg(), t.layout


def keep_checked(table: dict, key: Optional[tuple], value, bound: int):
    """Keeps ``value`` under a checked signature ``key``; a full table starts over. Nothing is
    kept for no key, or for one no dict takes (symbolic sizes while tracing)."""
    if key is not None:
        if len(table) >= bound:
            table.clear()
        try:
            table[key] = value
        except TypeError:
            pass
    return value


def lookup_checked(table: dict, key: Optional[tuple]):
    """The value kept for ``key``, or None: also for a key that holds a value no dict takes (a
    list given as eps, symbolic sizes), which then goes through the rules."""
    try:
        return table.get(key)
    except TypeError:
        return None


FUSED_GATED_NORM = "fused_gated_norm"


class ArgNames(NamedTuple):
    """What the rules' messages call the inputs: the kernel's argument names, or those of the
    caller's own tensors."""
    x: str = "x"
    gate: str = "gate"
    weight: str = "weight"
    eps: str = "eps"


KERNEL_ARGS = ArgNames()
# validate_gated_norm: the tensors and the config value of a Megatron GatedDeltaNet.
GDN_MODULE_ARGS = ArgNames("core_attn_out", "gate", "out_norm.weight", "config.layernorm_epsilon")


MAX_CHECKED_INPUTS = 256
_checked_inputs: dict = {}


def check_gated_norm_inputs(x, gate, weight, eps, names: ArgNames = KERNEL_ARGS) -> None:
    """The tensor and eps rules of ``fused_gated_norm``; raises TypeError/ValueError naming the
    argument (as ``names`` spells it) and the rule; nothing is launched.

    Runs on every call. The rules read only host metadata, so inputs whose metadata equals that
    of inputs that passed (each tensor's type, shape, strides, dtype, device, negative bit and layout,
    the current device, eps and its type) pass again after one lookup instead of every rule
    (docs/design.md, Host cost). Anything else, and every call that torch.compile traces, goes
    through the rules."""
    key = None
    if not torch.compiler.is_compiling():
        try:
            key = (current_device(), tensor_signature(x), tensor_signature(gate),
                   tensor_signature(weight), type(eps), eps)
        except KEY_ERRORS:
            key = None
        if lookup_checked(_checked_inputs, key):
            return
    check_gated_norm_tensors(FUSED_GATED_NORM, x, gate, weight, names=names)
    check_positive_number(FUSED_GATED_NORM, names.eps, eps)
    keep_checked(_checked_inputs, key, True, MAX_CHECKED_INPUTS)


def check_gated_norm_tensors(entry: str, x, gate, weight, others: tuple = (),
                             names: ArgNames = KERNEL_ARGS) -> None:
    """The tensor rules of ``check_gated_norm_inputs`` for x, gate, the weight and ``others``
    (``(name, tensor)`` pairs of x's shape and dtype, such as forward_impl's out)."""
    check_tensors(entry, ((names.x, x), (names.gate, gate), (names.weight, weight), *others))
    shape = x.shape
    if len(shape) != 4:
        raise ValueError(f"{entry}: {names.x} must have rank 4 [batch, sequence, heads, dim], "
                         f"got shape {tuple(shape)}")
    operands = ((names.gate, gate), *others)
    for name, t in operands:
        if t.shape != shape:
            raise ValueError(f"{entry}: {name} must have {names.x}'s shape {tuple(shape)}, got "
                             f"{tuple(t.shape)}")
    batch, seq, heads, dim = shape
    rows = batch * seq * heads
    check_operands(entry, x, operands, weight, dim, names)
    check_head_dim(entry, f"the head dim ({names.x}'s last dim)", dim)
    check_rows(entry, "batch * sequence * heads", rows)
    if rows and dim:  # an empty view may have any strides
        check_last_dim_stride(entry, ((names.x, x), *operands))


def check_tensors(entry: str, named: tuple) -> None:
    """Each ``(name, value)`` is a dense (strided) torch.Tensor (TypeError): the kernels read
    memory through strides."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{entry}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{entry}: {name} must be a dense (strided) tensor, got layout "
                            f"{t.layout}")


def check_bool(entry: str, name: str, value, none_means: Optional[str] = None):
    """``value`` is a bool, or None where ``none_means`` says what None selects (TypeError): a
    flag selects a compiled kernel variant or a code path, and a string, 0, 1 or 0.5 would be
    taken as a truth value without complaint. Returns ``value``."""
    if type(value) is not bool and (none_means is None or value is not None):
        choices = (f"None ({none_means}), True or False" if none_means is not None
                   else "a bool (True or False)")
        raise TypeError(f"{entry}: {name} must be {choices}, got {value!r}")
    return value


# The kernels take eps and the dW scale as fp32: a value outside the normal fp32 range would
# become inf, 0 or a subnormal that the GPU's arithmetic flushes to 0.
FP32_MIN_NORMAL = 2.0**-126
FP32_MAX = 3.4028234663852886e38


def check_positive_number(entry: str, name: str, value) -> None:
    """A Python float or int (not a bool, not a tensor: reading one would sync the device),
    finite and > 0 as a normal fp32 number (the kernels' type): TypeError for the type,
    ValueError for the value."""
    if type(value) is not float and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise TypeError(f"{entry}: {name} must be a Python float or int, got {type(value).__name__}")
    if not FP32_MIN_NORMAL <= value <= FP32_MAX:  # the comparison also rejects NaN
        raise ValueError(f"{entry}: {name} must be finite and > 0, a normal fp32 number "
                         f"({FP32_MIN_NORMAL:.6g} to {FP32_MAX:.6g}), got {value!r}")


def check_option(entry: str, name: str, value, choices: tuple) -> None:
    """One of the strings ``choices``: TypeError for a non-string, ValueError for another
    string (the kernels select such an option by name and have no other)."""
    if not isinstance(value, str):
        raise TypeError(f"{entry}: {name} must be a str, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{entry}: {name} must be one of {choices}, got {value!r}")


def check_activation(entry: str, activation, names: tuple = SUPPORTED_ACTIVATIONS) -> None:
    """One of ``names``, the entry's spellings of the kernels' activations (check_option)."""
    check_option(entry, "activation", activation, names)


def check_operands(entry: str, x: torch.Tensor, operands: tuple, weight: torch.Tensor,
                   dim: int, names: ArgNames = KERNEL_ARGS) -> None:
    """The dtype (TypeError), device, weight shape and weight contiguity rules (ValueError) of
    x, its ``(name, tensor)`` operands (gate / z, out: x's dtype and device) and the weight;
    ``names`` spells x and the weight.

    The device rule comes before any rule that reads an address (the inference entry's overlap
    checks): the kernels take CUDA tensors when compiled, CPU tensors under the interpreter; a
    meta tensor has no memory at all."""
    x_name, weight_name = names.x, names.weight
    dtype = x.dtype
    if dtype not in SUPPORTED_ACTIVATION_DTYPES:
        raise TypeError(f"{entry}: {x_name} dtype must be bf16, fp16 or fp32, got {dtype}")
    for name, t in operands:
        if t.dtype != dtype:
            raise TypeError(f"{entry}: {name} dtype must equal {x_name}'s dtype {dtype}, got "
                            f"{t.dtype}")
    weight_dtype = weight.dtype
    if weight_dtype != dtype and weight_dtype != torch.float32:
        raise TypeError(f"{entry}: {weight_name} dtype must be fp32 or {x_name}'s dtype {dtype}, "
                        f"got {weight_dtype}")
    for name, t in ((x_name, x), *operands, (weight_name, weight)):
        check_not_negative_view(entry, name, t)
    device = x.device
    devices = [device] + [t.device for _, t in operands] + [weight.device]
    if devices.count(device) != len(devices):
        listed = ", ".join([x_name] + [name for name, _ in operands])
        raise ValueError(f"{entry}: {listed} and {weight_name} must be on one device, got "
                         f"{', '.join(str(d) for d in devices)}")
    kernel_device = "cpu" if INTERPRETED else "cuda"
    if device.type != kernel_device:
        raise ValueError(f"{entry}: {x_name} must be a {kernel_device.upper()} tensor "
                         f"{DEVICE_RULE}, got device {device}")
    if not INTERPRETED:
        check_current_device(entry, device, torch.cuda.current_device(), x_name)
    if weight.shape != (dim,):
        raise ValueError(f"{entry}: {weight_name} must have shape ({dim},) (one value per element "
                         f"of a head), got {tuple(weight.shape)}")
    if dim > 1 and weight.stride()[0] != 1:  # one element is read at offset 0, whatever its stride
        raise ValueError(f"{entry}: {weight_name} must be contiguous, got stride {weight.stride()}")


def check_not_negative_view(entry: str, name: str, t: torch.Tensor) -> None:
    """``t`` is not a negative view (ValueError): its memory holds the values negated (a real
    view of a complex conjugate, ``z.conj().imag``), and the kernels read memory. Not while
    torch.compile traces (Dynamo does not trace ``is_neg``): the custom ops' impls check the
    tensors they are given."""
    if not torch.compiler.is_compiling() and t.is_neg():
        raise ValueError(f"{entry}: {name} is a negative view (its memory holds the values "
                         f"negated); pass {name}.resolve_neg()")


def check_current_device(entry: str, device: torch.device, current: int,
                         x_name: str = "x") -> None:
    """x is on the current CUDA device (ValueError): a kernel launches there, on its stream, so
    another device's addresses would be read from the wrong GPU."""
    if device.index != current:
        raise ValueError(
            f"{entry}: {x_name} must be on the current CUDA device (cuda:{current}), where the "
            f"kernels launch, got {device}; make it current first (torch.cuda.set_device, or `with "
            f"torch.cuda.device({x_name}.device):`)"
        )


def check_head_dim(entry: str, dim_name: str, dim: int) -> None:
    """At most MAX_HEAD_DIM elements per row (ValueError): a row lives in registers."""
    if dim > MAX_HEAD_DIM:
        raise ValueError(f"{entry}: {dim_name} must be <= {MAX_HEAD_DIM}, got {dim}")


def check_rows(entry: str, rows_name: str, rows: int) -> None:
    """At most MAX_ROWS rows (ValueError): row indices are 32-bit in the kernels (element
    offsets are 64-bit)."""
    if rows > MAX_ROWS:
        raise ValueError(f"{entry}: {rows_name} must be <= {MAX_ROWS} (the row count; row "
                         f"indices are 32-bit), got {rows}")


def check_rstd(entry: str, x: torch.Tensor, rstd) -> None:
    """rstd as forward_impl returns it: a contiguous fp32 [batch, sequence, heads] tensor on x's
    device (TypeError for type and dtype, ValueError otherwise)."""
    check_tensors(entry, (("rstd", rstd),))
    if rstd.dtype != torch.float32:
        raise TypeError(f"{entry}: rstd dtype must be fp32, got {rstd.dtype}")
    check_not_negative_view(entry, "rstd", rstd)
    if rstd.shape != x.shape[:3] or rstd.device != x.device or not rstd.is_contiguous():
        raise ValueError(
            f"{entry}: rstd must be a contiguous tensor of shape {tuple(x.shape[:3])} on "
            f"{x.device} (forward_impl's), got shape {tuple(rstd.shape)}, strides "
            f"{rstd.stride()} on {rstd.device}"
        )


# The backward's persistent programs: its int32 block index (block + programs) stays below 2**31
# for rows <= MAX_ROWS.
MAX_PROGRAMS = 2**16
# The largest value of a count override: a program's rows (the backward's int32 loop bound takes
# blocks of up to 2**16 rows: MAX_ROWS), warps (a CUDA block holds at most 1024 threads; more
# would fail inside the driver) and the backward's programs.
MAX_OVERRIDE = {"bt": 2**16, "warps": 32, "programs": MAX_PROGRAMS}
POWER_OF_TWO_OVERRIDES = ("bt", "warps")  # a block and a warp count
# Elements of one Triton tile: a bigger block fails inside Triton's compiler.
MAX_TILE_ELEMENTS = tl.TRITON_MAX_TENSOR_NUMEL


def check_launch_overrides(entry: str, counts: tuple, switches: tuple) -> None:
    """Launch-parameter overrides of the ``*_impl`` wrappers: each ``(name, value)`` of
    ``counts`` None or a positive int, at most its MAX_OVERRIDE (``bt`` and ``warps`` also a
    power of two), each of ``switches`` None or a bool. What also depends on the head dim or
    the device is checked with the launch parameters (check_launch_tile,
    check_dependent_launch)."""
    for name, value in counts:
        if value is None:
            continue
        if type(value) is not int:
            raise TypeError(f"{entry}: {name} must be None or an int, got {type(value).__name__}")
        limit = MAX_OVERRIDE.get(name)
        if name in POWER_OF_TWO_OVERRIDES:
            broken = value < 1 or value & (value - 1) or value > limit
            rule = f"a power of two <= {limit}"
        elif limit is not None:
            broken, rule = not 1 <= value <= limit, f"between 1 and {limit}"
        else:
            broken, rule = value < 1, ">= 1"
        if broken:
            raise ValueError(f"{entry}: {name} must be {rule}, got {value}")
    for name, value in switches:
        if value is not None:
            check_bool(entry, name, value)


def check_launch_tile(entry: str, name: str, value: int, elements_each: int, what: str) -> None:
    """``value`` (a block override) times ``elements_each`` (``what``) elements fits one Triton
    tile (ValueError)."""
    if value * elements_each > MAX_TILE_ELEMENTS:
        raise ValueError(
            f"{entry}: {name} must be <= {MAX_TILE_ELEMENTS // elements_each} here: {name} x "
            f"{elements_each} ({what}) elements make one Triton tile, at most "
            f"{MAX_TILE_ELEMENTS}; got {value}")


def check_dependent_launch(entry: str, name: str, device: torch.device) -> None:
    """``name=True`` asks for programmatic dependent launch, which only NVIDIA GPUs of compute
    capability 9.0 or newer take (ValueError elsewhere, the interpreter included)."""
    if not supports_programmatic_dependent_launch(device):
        raise ValueError(
            f"{entry}: {name}=True needs programmatic dependent launch (an NVIDIA GPU of compute "
            f"capability 9.0 or newer), which {device} does not have")


def check_last_dim_stride(entry: str, named: tuple) -> list:
    """Each ``(name, tensor)`` has a unit last-dim stride (ValueError); returns their strides."""
    strides = []
    for name, t in named:
        stride = t.stride()
        if stride[-1] != 1 and t.shape[-1] != 1:  # a last dim of one element is read at offset 0
            raise ValueError(f"{entry}: {name} must have last-dim stride 1, got strides {stride}")
        strides.append(stride)
    return strides


def check_norm_and_gate(normalization, act_fn, act_fn_name: str) -> str:
    """The norm and gate rules of the fused GDN output norm, for a config (at construction) and
    a module (on every fused forward): RMSNorm, and a gate activation the kernels implement
    (ValueError naming ``act_fn_name``, where it comes from). Returns its kernel name."""
    if normalization != "RMSNorm":
        raise ValueError("fused_gated_norm requires normalization='RMSNorm' (the kernels "
                         f"implement RMSNorm only), got {normalization!r}")
    activation = gate_activation_name(act_fn)
    if activation is None:
        raise ValueError(
            f"fused_gated_norm requires {act_fn_name} (the GDN gate activation) to be one of the "
            f"kernels' {SUPPORTED_ACTIVATIONS} (torch.nn.functional.silu / torch.sigmoid), got "
            f"{getattr(act_fn, '__name__', act_fn)!r}"
        )
    return activation


def validate_gated_norm(module, x: torch.Tensor, gate: torch.Tensor) -> str:
    """Check that a Megatron GatedDeltaNet ``module`` can take the fused output norm for these
    inputs; runs on every fused forward, recomputation included. Host-side metadata only.
    Returns the kernel's name of the gate activation it checked ('silu' or 'sigmoid').

    ``module`` needs ``config`` (a TransformerConfig) and ``out_norm`` (the weight holder); the
    gate activation is its ``act_fn`` (what megatron's unfused path applies), else
    ``config.activation_func``. Where the module says whether the kernel centres the weight
    (``out_norm_zero_centered``, ours) and out_norm says whether it does
    (``zero_centered_gamma``), the two must agree. Messages name the module's tensors
    (``core_attn_out``, ``gate``, ``out_norm.weight``) and ``config.layernorm_epsilon``."""
    config = module.config
    if hasattr(module, "act_fn"):
        activation = check_norm_and_gate(config.normalization, module.act_fn, "the module's act_fn")
    else:
        activation = check_norm_and_gate(config.normalization, config.activation_func,
                                         "activation_func")
    norm = module.out_norm
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError("fused_gated_norm requires out_norm to have a weight")
    if getattr(norm, "bias", None) is not None:
        raise ValueError("fused_gated_norm requires out_norm without a bias (RMSNorm has none)")
    head_dim = config.linear_value_head_dim
    if tuple(weight.shape) != (head_dim,):
        raise ValueError(
            f"fused_gated_norm requires out_norm.weight of shape ({head_dim},) "
            f"(linear_value_head_dim), got {tuple(weight.shape)}"
        )
    zero_centered = getattr(module, "out_norm_zero_centered", None)  # what the kernel applies
    norm_zero_centered = getattr(norm, "zero_centered_gamma", None)
    if (zero_centered is not None and norm_zero_centered is not None
            and bool(norm_zero_centered) != zero_centered):
        raise ValueError(
            f"fused_gated_norm requires out_norm.zero_centered_gamma ({norm_zero_centered}) to "
            f"equal the module's out_norm_zero_centered ({zero_centered}), set from the config"
        )
    norm_eps = norm_epsilon(norm)
    if norm_eps is not None and norm_eps != config.layernorm_epsilon:
        raise ValueError(
            f"fused_gated_norm requires out_norm eps ({norm_eps}) to equal "
            f"config.layernorm_epsilon ({config.layernorm_epsilon})"
        )
    heads = getattr(module, "num_value_heads_local_tp_cp", None)
    if heads is None:  # a module without our attribute: value heads split by TP, then CP
        heads = (config.linear_num_value_heads // getattr(module, "tp_size", 1)
                 // getattr(module, "cp_size", 1))
    names = GDN_MODULE_ARGS
    check_tensors(FUSED_GATED_NORM, ((names.x, x), (names.gate, gate)))
    for name, t in ((names.x, x), (names.gate, gate)):
        if t.dim() != 4 or tuple(t.shape[-2:]) != (heads, head_dim):
            raise ValueError(
                f"fused_gated_norm requires {name} of shape [batch, seq, {heads}, {head_dim}] "
                f"(local value heads, linear_value_head_dim), got {tuple(t.shape)}"
            )
    check_gated_norm_inputs(x, gate, weight, config.layernorm_epsilon, names)
    return activation


def gate_activation_name(fn) -> Optional[str]:
    """'silu' or 'sigmoid' when ``fn`` is one the kernel implements, else None. Functions
    only: megatron calls ``activation_func(tensor)`` and reads its ``__name__``, so a module class
    such as ``torch.nn.SiLU`` is not an activation function there."""
    if fn is torch.nn.functional.silu:
        return "silu"
    if fn in (torch.sigmoid, torch.nn.functional.sigmoid):
        return "sigmoid"
    return None


def norm_epsilon(norm) -> Optional[float]:
    """The eps a norm module was built with (TE and torch modules spell it differently)."""
    for attr in ("eps", "epsilon", "variance_epsilon"):
        value = getattr(norm, attr, None)
        if isinstance(value, (float, int)):
            return float(value)
    return None


# Memory overlap: what an ``out`` argument may share with the inputs. These read addresses, so
# they run on every call that is given an ``out`` (and after the device rule: a meta tensor's
# address is 0).


def check_rows_apart(entry: str, name: str, t: torch.Tensor) -> None:
    """The rows of ``t`` (every index but the last dim's, unit last stride) do not share memory
    (ValueError): each is written by one program. Sufficient test: with the row dims sorted by
    stride, each stride spans everything inside it (a layout that interleaves rows otherwise is
    refused too)."""
    extent = t.shape[-1]
    for size, stride in sorted(zip(t.shape[:-1], t.stride()[:-1]), key=lambda p: p[1]):
        if size > 1:
            if stride < extent:
                raise ValueError(
                    f"{entry}: {name} rows must not overlap each other (each is written by one "
                    f"program): shape {tuple(t.shape)}, strides {t.stride()}"
                )
            extent = stride * (size - 1) + extent


def check_out_apart(entry: str, out: torch.Tensor, inputs: tuple, weight: torch.Tensor) -> None:
    """``out``'s rows are apart (check_rows_apart); ``out`` is each ``(name, tensor)`` of
    ``inputs`` itself (computed in place: a program reads its rows before it writes them) or
    does not overlap it; it never overlaps the weight, which every program reads (ValueError)."""
    check_rows_apart(entry, "out", out)
    if out.numel() == 0:
        return
    # Byte spans first (cheap); the exact test only where they meet.
    out_lo, out_hi = byte_span(out)
    for name, t in inputs:
        if t is out or t.numel() == 0:
            continue
        lo, hi = byte_span(t)
        if lo < out_hi and out_lo < hi and overlap(out, t) == "partial":
            raise ValueError(
                f"{entry}: out must either be {name} itself (same data_ptr, shape and strides) "
                f"or not overlap it; it partially overlaps {name}"
            )
    if weight.numel():
        lo, hi = byte_span(weight)
        if lo < out_hi and out_lo < hi and overlap(out, weight) != "none":
            raise ValueError(f"{entry}: out must not overlap weight (every program reads weight)")


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses of t's elements (t non-empty, non-negative strides)."""
    start = t.data_ptr()
    last = 1
    for n, s in zip(t.shape, t.stride()):
        last += (n - 1) * s
    return start, start + last * t.element_size()


def overlap(a: torch.Tensor, b: torch.Tensor) -> str:
    """'none', 'same' (identical view) or 'partial' (any other sharing, conservatively).

    torch's own overlap check (torch._C._overlaps) answers "too hard" for non-dense views such
    as a slice of a packed projection, so the spans are compared here from the metadata."""
    if a.numel() == 0 or b.numel() == 0:
        return "none"
    (a_lo, a_hi), (b_lo, b_hi) = byte_span(a), byte_span(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return "none"
    if a_lo == b_lo and a.shape == b.shape and a.dtype == b.dtype and all(
            sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1):
        return "same"  # the stride of a size-1 dim addresses nothing
    if _interleaved_rows_disjoint(_token_rows(a), _token_rows(b)):
        return "none"
    return "partial"


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """t as 2-D rows of its last two dims (a [B, S, H, D] view as [tokens, H * D]) where such a
    view exists, else t."""
    if t.dim() > 2:
        try:
            return t.view(-1, t.shape[-2] * t.shape[-1])
        except RuntimeError:
            pass
    return t


def _interleaved_rows_disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact test for two 2-D views with unit last stride and one common row pitch, such as two
    column slices of one packed buffer: their spans intersect, their elements need not.

    Row i of a covers [a_lo + i*p, a_lo + i*p + wa) and row j of b [b_lo + j*p, b_lo + j*p + wb)
    (bytes). With d = b_lo - a_lo and k = i - j, they meet iff (d - wa) / p < k < (d + wb) / p
    for some k in [-(rows_b - 1), rows_a - 1]."""
    if a.dim() != 2 or b.dim() != 2 or a.stride(1) != 1 or b.stride(1) != 1:
        return False
    size = a.element_size()
    pitch = a.stride(0) * size
    wa, wb = a.shape[1] * size, b.shape[1] * b.element_size()
    if b.stride(0) * b.element_size() != pitch or pitch < max(wa, wb):
        return False
    d = b.data_ptr() - a.data_ptr()
    k_lo = max((d - wa) // pitch + 1, -(b.shape[0] - 1))
    k_hi = min(-(-(d + wb) // pitch) - 1, a.shape[0] - 1)
    return k_lo > k_hi
