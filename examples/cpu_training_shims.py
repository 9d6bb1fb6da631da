"""No-GPU shims for the *training* side of megatron-core 0.19 (optimizer, DDP, grad clipping),
used by examples/pretrain_gdn.py on a machine without CUDA. Never imported on a GPU, never
imported by the library.

``core.testing.cpu.install_cpu_shims`` covers what a GatedDeltaNet layer needs (RNG tracker,
``torch.cuda.current_device``, jit, recompute). A full training step also goes through code
that hard-codes ``device='cuda'`` (``found_inf`` / loss-scale tensors of the mixed-precision
optimizer, ``clip_grads``' norm buffers, the NCCL warm-up of the grad buffer, the default
causal mask of megatron's local attention) and checks
``param.type() == 'torch.cuda.FloatTensor'`` (``Float16OptimizerWithFloat16Params``). Here:

* :func:`install_cpu_training_shims`: in those megatron modules only, the global name ``torch``
  is replaced by a proxy whose tensor factories map ``device='cuda'`` to the CPU and whose
  ``torch.cuda`` has no-op streams (the grad buffer waits on ``torch.cuda.current_stream()``);
  everything else is the real torch.
* :func:`cpu_tensor_types`: a context manager (held while the optimizer is built and while it
  steps: ``clip_grads`` asserts ``grad.type() == 'torch.cuda.FloatTensor'``) in which
  ``Tensor.type()`` of a CPU tensor reports the CUDA type name, so megatron's dtype dispatch
  picks the same branch as on a GPU.

And one for speed: the query/key L2 norm of megatron's GatedDeltaNet calls FLA's Triton
``l2norm``, which in the interpreter runs one Python-emulated program per 8 rows (~25 s per
training step at the default CPU size); :func:`install_cpu_training_shims` points megatron at
the same formula in torch (fp32 math, then the input dtype). It is the same in the flag-on and
flag-off runs; the kernel under test (the fused gated norm) still runs in the interpreter, with
the interpreter's launch parameters from ``core.fusions.gated_norm_launch``.
"""

from __future__ import annotations

import contextlib
import importlib
import types

import torch

# megatron modules with `device='cuda'` literals on the training path.
_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.utils",  # get_default_causal_mask of the local attention
    "megatron.core.utils",  # local_multi_tensor_l2_norm (grad norm without apex)
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "ones_like",
              "empty_like", "full_like", "arange")


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


class _NullStream:
    """A CUDA stream stand-in: the CPU runs everything in order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` with streams, synchronisation and the cache made no-ops."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.Stream = _NullStream
        self.current_stream = lambda *a, **k: _NullStream()
        self.default_stream = lambda *a, **k: _NullStream()
        self.stream = lambda *a, **k: contextlib.nullcontext()
        self.synchronize = lambda *a, **k: None
        self.empty_cache = lambda *a, **k: None
        self.current_device = lambda: "cpu"

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """``torch`` with ``device='cuda'`` mapped to the CPU in the tensor factories and the stream
    API of ``torch.cuda`` made no-ops."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in _FACTORIES:
            def factory(*args, _f=value, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return _f(*args, **kwargs)

            return factory
        return value


def _torch_l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype=None) -> torch.Tensor:
    """FLA's ``l2norm`` (``x / sqrt(sum(x^2) + eps)`` over the last dim, fp32 math) in torch."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


_INSTALLED = False


def install_cpu_training_shims() -> None:
    """Idempotent. Call after ``core.testing.cpu.install_cpu_shims()``, before training."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    proxy = _CpuTorch()
    for name in _MODULES:
        mod = importlib.import_module(name)
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy
    gdn_common = importlib.import_module("megatron.core.ssm.gated_delta_net.common")
    gdn_common.l2norm = _torch_l2norm
    _INSTALLED = True


@contextlib.contextmanager
def cpu_tensor_types():
    """``Tensor.type()`` (no arguments) of a CPU float tensor returns the CUDA type name."""
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(name, str) and name.startswith("torch.") \
                and not name.startswith("torch.cuda.") and self.device.type == "cpu":
            return "torch.cuda." + name[len("torch."):]
        return name

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original
