"""The input rules of the fused gated norm: host metadata only (shapes, strides, dtypes, devices,
option values). No tensor is read, so no CUDA synchronisation.

TypeError for an argument of the wrong type (not a tensor, an unsupported dtype, a non-bool
flag, a non-number eps), ValueError for a value that breaks a rule (shape, stride, device, a
limit, a range, an option). The training entries apply them through their checking stations
(gated_norm_checks), once per signature; the inference entry on every call, after its own shape
rules; the config (core.transformer) applies ``check_norm_and_gate`` and the flag and number
rules.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton.language as tl

from core.fusions.gated_norm_kernels import INTERPRETED
from core.fusions.gated_norm_launch import (MAX_HEAD_DIM, MAX_ROWS,
                                            supports_programmatic_dependent_launch)

# Each kernel build takes its own device's tensors only (a meta tensor has no memory for either).
DEVICE_RULE = ("(compiled kernels take CUDA tensors; the Triton interpreter, TRITON_INTERPRET=1, "
               "takes CPU tensors)")
SUPPORTED_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GATE_ACTIVATIONS = ("silu", "sigmoid")  # the kernels' names (their ACTIVATION)


def current_device() -> Optional[int]:
    """The CUDA device the kernels launch on; None under the interpreter (CPU tensors)."""
    return None if INTERPRETED else torch.cuda.current_device()


class ArgNames(NamedTuple):
    """What the messages call the inputs: the kernel's argument names, or the caller's."""
    x: str = "x"
    gate: str = "gate"
    weight: str = "weight"
    eps: str = "eps"


KERNEL_ARGS = ArgNames()
# validate_gated_norm: the tensors and the config value of a Megatron GatedDeltaNet.
GDN_MODULE_ARGS = ArgNames("core_attn_out", "gate", "out_norm.weight", "config.layernorm_epsilon")


def check_gated_norm_tensors(entry: str, x, gate, weight, others: tuple = (),
                             names: ArgNames = KERNEL_ARGS) -> None:
    """The tensor rules for x, gate, the weight and ``others`` (``(name, tensor)`` pairs of x's
    shape and dtype, such as forward_impl's out or backward_impl's dy). The gate is in x's dtype
    or fp32. Any strides: the kernels read all four of x, gate and dy (out's elements must not
    overlap: memory_overlap.check_out_apart)."""
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
    check_operands(entry, x, operands, weight, dim, names, fp32_operands=(names.gate,))
    check_head_dim(entry, f"the head dim ({names.x}'s last dim)", dim)
    check_rows(entry, "batch * sequence * heads", rows)


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
    if type(value) is not float and (not isinstance(value, (int, float))
                                     or isinstance(value, bool)):
        raise TypeError(f"{entry}: {name} must be a Python float or int, got "
                        f"{type(value).__name__}")
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


def check_operands(entry: str, x: torch.Tensor, operands: tuple, weight: torch.Tensor,
                   dim: int, names: ArgNames = KERNEL_ARGS, fp32_operands: tuple = ()) -> None:
    """The dtype (TypeError), device, weight shape and weight contiguity rules (ValueError) of
    x, its ``(name, tensor)`` operands (gate / z, out, dy: x's dtype, or also fp32 for those
    named in ``fp32_operands``, and x's device) and the weight.
    The device rule comes before any rule that reads an address (the overlap checks): the
    kernels take CUDA tensors when compiled, CPU tensors under the interpreter; a meta tensor
    has no memory at all."""
    x_name, weight_name = names.x, names.weight
    dtype = x.dtype
    if dtype not in SUPPORTED_ACTIVATION_DTYPES:
        raise TypeError(f"{entry}: {x_name} dtype must be bf16, fp16 or fp32, got {dtype}")
    for name, t in operands:
        if t.dtype == dtype:
            continue
        if name not in fp32_operands:
            raise TypeError(f"{entry}: {name} dtype must equal {x_name}'s dtype {dtype}, got "
                            f"{t.dtype}")
        if t.dtype != torch.float32:  # the kernels compute the gate in fp32 either way
            raise TypeError(f"{entry}: {name} dtype must be fp32 or {x_name}'s dtype {dtype}, "
                            f"got {t.dtype}")
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
        raise ValueError(f"{entry}: {weight_name} must have shape ({dim},) (one value per "
                         f"element of a head), got {tuple(weight.shape)}")
    if dim > 1 and weight.stride()[0] != 1:  # one element is read at offset 0, whatever its stride
        raise ValueError(f"{entry}: {weight_name} must be contiguous, got stride "
                         f"{weight.stride()}")


def check_not_negative_view(entry: str, name: str, t: torch.Tensor) -> None:
    """``t`` is not a negative view (ValueError): its memory holds the values negated (a real
    view of a complex conjugate, ``z.conj().imag``), and the kernels read memory. Not while
    torch.compile traces (Dynamo does not trace ``is_neg``): the custom ops check the tensors
    they are given."""
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
            f"kernels launch, got {device}; make it current first (torch.cuda.set_device, or "
            f"`with torch.cuda.device({x_name}.device):`)"
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


def check_last_dim_stride(entry: str, named: tuple) -> list:
    """Each ``(name, tensor)`` has a unit last-dim stride (ValueError): the inference entry's
    rule (vLLM's contract); returns their strides."""
    strides = []
    for name, t in named:
        stride = t.stride()
        if stride[-1] != 1 and t.shape[-1] != 1:  # a last dim of one element is read at offset 0
            raise ValueError(f"{entry}: {name} must have last-dim stride 1, got strides {stride}")
        strides.append(stride)
    return strides


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
    power of two), each of ``switches`` None or a bool."""
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


# ----------------------------------------------------------------------------------------------
# Config rules (core.transformer's TransformerConfig, at construction)
# ----------------------------------------------------------------------------------------------


def check_norm_and_gate(normalization, act_fn, act_fn_name: str) -> str:
    """RMSNorm, and a gate activation the kernels implement (ValueError naming
    ``act_fn_name``, where it comes from). Returns its kernel name."""
    check_normalization(normalization)
    activation = gate_activation_name(act_fn)
    if activation is None:
        raise ValueError(
            f"fused_gated_norm requires {act_fn_name} (the GDN gate activation) to be one of the "
            f"kernels' {GATE_ACTIVATIONS} (torch.nn.functional.silu / torch.sigmoid), got "
            f"{getattr(act_fn, '__name__', act_fn)!r}"
        )
    return activation


def check_normalization(normalization) -> None:
    if normalization != "RMSNorm":
        raise ValueError("fused_gated_norm requires normalization='RMSNorm' (the kernels "
                         f"implement RMSNorm only), got {normalization!r}")


def gate_activation_name(fn) -> Optional[str]:
    """'silu' or 'sigmoid' when ``fn`` is one the kernels implement, else None. Functions
    only: megatron calls ``activation_func(tensor)`` and reads its ``__name__``, so a module
    class such as ``torch.nn.SiLU`` is not an activation function there."""
    if fn is torch.nn.functional.silu:
        return "silu"
    if fn in (torch.sigmoid, torch.nn.functional.sigmoid):
        return "sigmoid"
    return None
