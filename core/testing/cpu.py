"""THE no-GPU shims of this project: everything that lets megatron-core 0.19 build, run and
train a GatedDeltaNet model on a machine without CUDA lives in this one module.

Test-side only: the library (``core.*`` outside ``core.testing``) never imports this module
(``grep -rn "core.testing" core/ --include=*.py | grep -v "^core/testing"`` finds nothing).
Used by the tests and by the CPU runs of the examples (examples/pretrain_gdn.py, and
examples/pretrain_gdn_megatron.py, megatron's own training loop). Everything
here patches megatron-core, torch or triton in-process; nothing is written to disk except a
file-based rendezvous.

    from core.testing.cpu import install_cpu_shims, init_cpu_model_parallel
    install_cpu_shims()                       # layer level: before importing megatron's GDN
    install_cpu_shims(training=True)          # + DDP / optimizer / grad clipping / attention
    install_cpu_shims(training_loop=True)     # + megatron.training.pretrain (implies training)
    init_cpu_model_parallel(tp_size=1)        # gloo group + parallel_state + RNG tracker

    with cpu_tensor_types():                  # while building and stepping megatron's optimizer
        optimizer.step()

Layer level (``install_cpu_shims()``), all idempotent:
  * ``TRITON_INTERPRET=1`` when there is no CUDA (Triton kernels run in the interpreter).
  * ``torch.cuda.current_device`` -> ``"cpu"``: megatron allocates with
    ``device=torch.cuda.current_device()``.
  * ``megatron.core.jit.disable_jit_fuser()``; methods that were already wrapped by
    ``torch.compile`` (module imported earlier) are unwrapped.
  * The "CUDA" RNG state of ``megatron.core.tensor_parallel.random`` is mapped to the CPU
    generator (get/set state, ``CudaRNGStatesTracker.add``); the tracker's "CPU RNG state
    changed" warning, always true in that mapping, is filtered.
  * ``CheckpointWithoutOutput``'s zero-copy share-storage helper compiles a C++ extension
    (~20 s); replaced by a storage copy with the same observable result.
  * Triton's autotuner benchmarks through the GPU driver; on the CPU every config gets the
    same time, so the first config is picked.
  * Without Transformer Engine, megatron's ``HybridStack`` builds its final norm from
    ``TENorm`` whatever its spec says, and ``SelfAttention`` its q/k norms where the spec
    leaves them unset (:data:`TE_NORM_FALLBACK_MODULES`): that name becomes
    :class:`~core.transformer.rms_norm.LocalNorm`, the config's norm from megatron-core
    modules, so a HybridModel built from :func:`core.models.te_to_local`'s spec trains.
  * ``torch.cpu.device(index)``, a null context: fla-core 0.4 (what a ``megatron-core[dev]``
    install picks) enters it on a host without CUDA, and torch has no such function (fla-core
    0.6 uses a null context there itself).

A process's first ``install_cpu_shims`` call runs with Python's cyclic collector paused, then
freezes what is alive, and again at exit (``gc.freeze``): the collector then no longer walks
torch's and megatron's millions of import-time objects, about 4 s per CPU process.

(``gdn_norm_out`` selective recompute without Transformer Engine needs no shim: the library's
``core.ssm.GatedDeltaNet`` turns its checkpoint's fp8 handling off itself.)

Training level (``install_cpu_shims(training=True)``, or :func:`install_cpu_training_shims`
after the layer-level shims). A full training step goes through megatron code that hard-codes
``device='cuda'`` (``found_inf`` / loss-scale tensors of the mixed-precision optimizer,
``clip_grads``' norm buffers, the grad buffer's NCCL warm-up, the default causal mask of
megatron's local attention), waits on CUDA streams (as does the ``torch_dist`` checkpoint
writer of ``megatron.core.dist_checkpointing``), and checks
``param.type() == 'torch.cuda.FloatTensor'`` (``Float16OptimizerWithFloat16Params``,
``clip_grads``):

  * in those megatron modules only (:data:`TRAINING_MODULES`), the global name ``torch`` is
    replaced by a proxy whose tensor factories map ``device='cuda'`` to the CPU and whose
    ``torch.cuda`` has no-op streams and synchronisation; everything else is the real torch.
  * ``TorchFullyShardedDataParallel`` (megatron's torch FSDP2 wrapper) builds its device mesh
    for "cuda": built for the CPU instead.
  * megatron's MoE all-to-all token dispatcher (in :data:`TRAINING_MODULES`) copies its token
    splits to the host on a side stream (a no-op stream here) with ``maybe_move_tensor_to_cpu``,
    which leaves a CPU tensor as it is, so the splits would stay a tensor where
    ``all_to_all_single`` takes numbers: :func:`host_copy_on_the_cpu` makes the NumPy copy.
  * ``LanguageModule.setup_embeddings_and_output_layer`` moves the embedding copy of a later
    pipeline stage (the MTP stage's, or a tied output layer's) with ``weight.data.cuda()``
    before its all-reduce: run with ``Tensor.cuda()`` returning the tensor itself.
  * :func:`cpu_tensor_types`: a context manager (held while the optimizer is built and while it
    steps) in which ``Tensor.type()`` of a CPU tensor reports the CUDA type name, so megatron's
    dtype dispatch picks the same branch as on a GPU.

Training-loop level (``install_cpu_shims(training_loop=True)``): megatron.training's
``pretrain`` (initialize, model and optimizer setup, data, ``train_step``, logging, checkpoint
save and load) on gloo. Where megatron-core 0.19.2's loop asks for CUDA (line numbers of the
wheel), and what stands in:

  * ``training/initialize.py`` ``initialize_megatron`` l.66 ``assert torch.cuda.is_available()``
    (``pretrain`` does not pass ``allow_no_cuda``): ``megatron.training.training`` calls it with
    ``allow_no_cuda=True``, megatron's own switch for CPU use.
  * ``_initialize_distributed`` l.270/358 and ``_set_random_seed`` l.447 set up model
    parallelism and the RNG tracker only if ``torch.cuda.device_count() > 0``: the proxy's
    ``torch.cuda`` reports one device (the CPU) and ``set_device`` does nothing.
  * ``set_jit_fusion_options`` -> ``_warmup_jit_function`` l.508 (``torch.rand(device="cuda")``)
    warms up torch.compile'd fusions: skipped (the jit fuser is off), and module-level functions
    compiled before the fuser was turned off go back to eager.
  * ``training/arguments.py`` ``validate_args`` l.1414 reads the GPU architecture at TP > 1
    (``torch.cuda.get_device_properties``): answered 9 (Hopper, the H200).
  * ``core/timers.py`` ``Timer.start`` l.152 (``torch.cuda.synchronize``),
    ``training/training.py`` ``pretrain`` l.1131/1137 (``device='cuda'`` start-time tensors),
    ``training/models/dist_utils.py`` ``_ddp_wrap`` l.303 (``torch.cuda.Stream``),
    ``core/rerun_state_machine.py`` ``_save_state`` l.979 and ``training/checkpointing.py``
    ``get_rng_state`` l.417 (``torch.cuda.get_rng_state``, the CPU generator here): the
    ``torch`` proxy of the training level in those modules (:data:`TRAINING_LOOP_MODULES`; the
    ``torch_dist`` writer's synchronisation is already in the training level's).
  * ``core/optimizer/clip_grads.py`` ``clip_grad_by_total_norm_fp32`` l.174
    (``param.grad.type() == 'torch.cuda.FloatTensor'``): megatron's optimizer is built and
    stepped under :func:`cpu_tensor_types`.
  * ``dist_utils.unimodal_build_distributed_models`` l.174 moves the model with
    ``module.cuda()`` unless ``--use-cpu-initialization``: the CPU runs pass that flag.

One speed stand-in, CPU only, not a correctness shim: megatron's GatedDeltaNet normalises
query/key with FLA's Triton ``l2norm``, which in the interpreter costs ~25 s per training step
at the example's default CPU size (one Python-emulated program per 8 rows).
``install_cpu_shims(training=True)`` points megatron at :func:`torch_l2norm`, the same formula
in torch (fp32 math, then the input dtype). It is not bitwise FLA's kernel, but it is the same
function in the flag-on and flag-off runs, and the kernel under test (the fused gated norm)
still runs in the interpreter. Never installed when CUDA is available (FLA's kernel runs).

FLA's chunk gated-delta-rule and causal-conv kernels, which megatron's GatedDeltaNet calls
without ``deterministic_mode`` (the only mode that takes packed THD sequences), do not run in
the Triton interpreter. :func:`install_cpu_fla_stand_ins` (explicit, not part of
``install_cpu_shims``) points megatron at torch equivalents that honour ``cu_seqlens``:
megatron's own torch chunk rule (its ``deterministic_mode`` path) and a depthwise
``F.conv1d``, each applied to one packed sequence at a time. The same functions serve the
reference and the parallel runs they are compared with.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import gc
import importlib
import logging
import os
import sys
import tempfile
import types
from typing import Optional

import torch

_INSTALLED = False
_TRAINING_INSTALLED = False
_TRAINING_LOOP_INSTALLED = False
_COLLECTOR_FROZEN = False


class _DropCpuRngWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _cpu_rng_state(*args, **kwargs):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, *args, **kwargs):
    torch.set_rng_state(new_state)


def _tracker_add_cpu(self, name, seed):
    """CudaRNGStatesTracker.add with CPU generator states."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


def _share_storage_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Stand-in for megatron's C++ share_storage: give ``dst``'s (freed) storage the bytes of
    ``src``'s storage. Views of dst see the data, as with the zero-copy original."""
    nbytes = src.untyped_storage().nbytes()
    dst.untyped_storage().resize_(nbytes)
    dst.untyped_storage().copy_(src.untyped_storage())


def unwrap_compiled(namespace) -> dict:
    """Put back the function each torch.compile'd attribute of ``namespace`` (a class or a
    module: megatron's ``jit_fuser`` decorates at import) wraps; returns ``{name: compiled}``,
    what to restore."""
    saved = {}
    for name, value in list(vars(namespace).items()):
        orig = getattr(value, "_torchdynamo_orig_callable", None)
        if orig is not None:
            saved[name] = value
            setattr(namespace, name, orig)
    return saved


# megatron modules that build a TENorm whatever the spec says (HybridStack's final norm) or
# where the spec leaves a norm unset (SelfAttention's q/k norms with qk_layernorm).
TE_NORM_FALLBACK_MODULES = ("megatron.core.models.hybrid.hybrid_block",
                            "megatron.core.transformer.attention")


def install_cpu_shims(share_storage_copy: bool = True, training: bool = False,
                      training_loop: bool = False) -> None:
    """Install the layer-level shims listed in the module docstring (and, with
    ``training=True``, the training-level ones too). Idempotent; call it before importing
    ``core.ssm`` or megatron's ``gated_delta_net`` (already-imported modules are fixed up too).

    share_storage_copy: replace the C++ share-storage helper of CheckpointWithoutOutput with a
    storage copy (default; avoids a ~20 s compile).
    training: also :func:`install_cpu_training_shims` (DDP, optimizer, grad clipping, local
    attention, and the torch l2norm speed stand-in)."""
    with _collector_paused_then_frozen():  # the first install imports most of megatron
        _install_layer_shims(share_storage_copy)
        if training or training_loop:
            install_cpu_training_shims()
        if training_loop:
            install_cpu_training_loop_shims()


@contextlib.contextmanager
def _collector_paused_then_frozen():
    """The first time in a process: run the block with Python's cyclic collector paused, then
    move every object alive into the collector's permanent generation (``gc.freeze``), and
    freeze again at interpreter exit. Later: just the block.

    A process that imports torch and megatron holds millions of long-lived objects, and each
    full collection walks all of them: during the imports, and several times while the
    interpreter shuts down, about 2 s each on a 2-core CPU, in every process that a test or a
    CPU run starts. Frozen objects are not walked, nor collected: freezing happens once, where a
    process first installs the shims (right after its imports, when there is little garbage to
    keep), and at exit, where the process frees everything anyway."""
    global _COLLECTOR_FROZEN
    if _COLLECTOR_FROZEN:
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
    _COLLECTOR_FROZEN = True
    atexit.register(gc.freeze)  # atexit handlers run before the interpreter's collections


def _install_layer_shims(share_storage_copy: bool) -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.cuda.current_device = lambda: "cpu"
        if not hasattr(torch.cpu, "device"):
            torch.cpu.device = lambda index: contextlib.nullcontext()

    import megatron.core.jit as mjit

    mjit.disable_jit_fuser()
    if "megatron.core.ssm.gated_delta_net.common" in sys.modules:
        from megatron.core.ssm.gated_delta_net.common import _GDNBase

        unwrap_compiled(_GDNBase)

    from megatron.core.tensor_parallel import random as mrandom

    if not has_cuda:
        mrandom._get_cuda_rng_state = _cpu_rng_state
        mrandom._set_cuda_rng_state = _set_cpu_rng_state
        mrandom.CudaRNGStatesTracker.add = _tracker_add_cpu
        logging.getLogger(mrandom.__name__).addFilter(_DropCpuRngWarning())
    if share_storage_copy:
        mrandom._get_share_storage = lambda: _share_storage_copy

    from megatron.core.extensions.transformer_engine import HAVE_TE

    if not HAVE_TE:
        from core.transformer.rms_norm import LocalNorm

        for name in TE_NORM_FALLBACK_MODULES:
            importlib.import_module(name).TENorm = LocalNorm

    if not has_cuda:
        import triton.runtime.autotuner as autotuner

        def _do_bench(self):
            return lambda kernel_call, quantiles=None: [1.0, 1.0, 1.0] if quantiles else 1.0

        autotuner.Autotuner.do_bench = property(_do_bench)
    _INSTALLED = True


# ----------------------------------------------------------------------------------------------
# Training level: megatron's DDP, optimizer, grad clipping, local attention
# ----------------------------------------------------------------------------------------------

# megatron modules with `device='cuda'` literals (or CUDA stream calls) on the training path.
TRAINING_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",  # the fp16 loss scale
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",  # torch.cuda.synchronize after p2p
    # the MoE all-to-all dispatcher: a side stream for its device-to-host copies of the splits
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.utils",  # get_default_causal_mask of the local attention
    "megatron.core.utils",  # local_multi_tensor_l2_norm (grad norm without apex)
    # dist_checkpointing's torch_dist writer synchronises CUDA after staging tensors on the host
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
)
# Modules of megatron.training's loop with `device='cuda'` literals, CUDA stream /
# synchronisation or CUDA RNG calls on pretrain's path (checkpoint save and load included).
TRAINING_LOOP_MODULES = (
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.models.dist_utils",
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
    "megatron.training.checkpointing",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "ones_like",
              "empty_like", "full_like", "arange", "rand", "randn")


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

    def record_event(self, event=None):
        return _NullEvent()


class _NullEvent:
    """A CUDA event stand-in (what a stream records; the CPU has nothing to wait for)."""

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
        # The CPU is the one "device": megatron's initialize sets up model parallelism and the
        # RNG tracker only when torch.cuda.device_count() > 0.
        self.device_count = lambda: 1
        self.set_device = lambda *a, **k: None
        # The "CUDA" generator is the CPU generator (as in the layer shims' RNG tracker).
        self.get_rng_state = _cpu_rng_state
        self.set_rng_state = _set_cpu_rng_state

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


def torch_l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype=None) -> torch.Tensor:
    """CPU speed stand-in for FLA's Triton ``l2norm``: ``x / sqrt(sum(x^2) + eps)`` over the last
    dim, fp32 math, result in ``output_dtype`` (default: x's dtype). Same formula as FLA's
    kernel, not bitwise the kernel (see the module docstring)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def install_cpu_training_shims() -> None:
    """The training-level shims of the module docstring (installs the layer-level ones first if
    needed). Idempotent; a no-op when CUDA is available. Call before building the model."""
    global _TRAINING_INSTALLED
    if _TRAINING_INSTALLED or torch.cuda.is_available():
        return
    _install_layer_shims(share_storage_copy=True)
    proxy = _CpuTorch()
    for name in TRAINING_MODULES:
        mod = importlib.import_module(name)
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy
    gdn_common = importlib.import_module("megatron.core.ssm.gated_delta_net.common")
    gdn_common.l2norm = torch_l2norm  # the CPU speed stand-in (module docstring)
    torch_fsdp2 = importlib.import_module(
        "megatron.core.distributed.torch_fully_sharded_data_parallel")
    if getattr(torch_fsdp2, "HAVE_FSDP", False):
        torch_fsdp2.DeviceMesh = _CpuDeviceMesh
    token_dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    token_dispatcher.maybe_move_tensor_to_cpu = host_copy_on_the_cpu
    language_module = importlib.import_module(
        "megatron.core.models.common.language_module.language_module").LanguageModule
    language_module.setup_embeddings_and_output_layer = _tensors_stay_on_the_cpu(
        language_module.setup_embeddings_and_output_layer)
    _TRAINING_INSTALLED = True


def host_copy_on_the_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's ``maybe_move_tensor_to_cpu`` (the MoE all-to-all dispatcher's device-to-host
    copy of its token splits) where the tensors are on the CPU already: megatron's returns a CPU
    tensor unchanged, so ``as_numpy`` would not apply and the splits would reach
    ``all_to_all_single`` as a tensor instead of the numbers it takes."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _tensors_stay_on_the_cpu(method):
    """``method`` run with ``Tensor.cuda()`` returning the tensor itself."""

    @functools.wraps(method)
    def on_the_cpu(*args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *_, **__: self
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    return on_the_cpu


class _CpuDeviceMesh:
    """megatron's TorchFullyShardedDataParallel builds its FSDP2 mesh as
    ``DeviceMesh.from_group(group, "cuda")``: the same mesh on the CPU (gloo)."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(group, "cpu", *args, **kwargs)


def _optimizer_with_cuda_type_names(get_megatron_optimizer):
    """megatron's get_megatron_optimizer built, and its step run, under :func:`cpu_tensor_types`
    (what the examples do by hand around their own optimizer calls)."""

    @functools.wraps(get_megatron_optimizer)
    def build(*args, **kwargs):
        with cpu_tensor_types():
            optimizer = get_megatron_optimizer(*args, **kwargs)
        step = optimizer.step

        @functools.wraps(step)
        def step_with_cuda_type_names(*step_args, **step_kwargs):
            with cpu_tensor_types():
                return step(*step_args, **step_kwargs)

        optimizer.step = step_with_cuda_type_names
        return optimizer

    return build


def install_cpu_training_loop_shims() -> None:
    """The training-loop shims of the module docstring (installs the training-level ones first):
    megatron.training's ``pretrain`` on the CPU. Idempotent; a no-op when CUDA is available.
    Call before ``pretrain`` (megatron.training is imported here)."""
    global _TRAINING_LOOP_INSTALLED
    if _TRAINING_LOOP_INSTALLED or torch.cuda.is_available():
        return
    install_cpu_training_shims()
    training = importlib.import_module("megatron.training.training")
    training.initialize_megatron = functools.partial(training.initialize_megatron,
                                                     allow_no_cuda=True)
    # The jit fuser is off on the CPU: nothing to warm up, and functions torch.compile'd at
    # import time (before the layer shims disabled the fuser) go back to eager.
    training.set_jit_fusion_options = lambda *args, **kwargs: None
    # validate_args asks the GPU's architecture at TP/CP > 1: answer the H200's (Hopper, 9).
    importlib.import_module("megatron.training.arguments").get_device_arch_version = lambda: 9
    training.get_megatron_optimizer = _optimizer_with_cuda_type_names(
        training.get_megatron_optimizer)
    for name, mod in list(sys.modules.items()):
        if name.startswith("megatron.") and mod is not None:
            unwrap_compiled(mod)
    proxy = _CpuTorch()
    for name in TRAINING_LOOP_MODULES:
        mod = importlib.import_module(name)
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy
    _TRAINING_LOOP_INSTALLED = True


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


# ----------------------------------------------------------------------------------------------
# Process group
# ----------------------------------------------------------------------------------------------


def parallel_sizes() -> Optional[tuple]:
    """(tp, pp, cp, ep, etp, vp) of megatron's initialised parallel_state; None if there is none."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_virtual_pipeline_model_parallel_world_size())


def init_model_parallel_sizes(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                              etp: Optional[int] = None, vp: Optional[int] = None,
                              seed: int = 1234) -> None:
    """megatron's parallel_state with these sizes in the current world (``etp`` None: megatron's
    default, the TP size; ``vp`` None: no virtual stages), then megatron's RNG tracker reseeded.
    A parallel_state that already has them is kept. Otherwise the groups the previous
    initialisation created are destroyed with it: megatron's ``destroy_model_parallel`` only
    drops its references, and each gloo group left alive keeps three threads that wake up
    (a world of 4 ranks that went through its layouts held ~240 groups per rank, and its
    context switches took most of two cores)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_sizes() != (tp, pp, cp, ep, tp if etp is None else etp, vp):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        _destroy_groups(_megatron_groups)
        before = set(torch.distributed.distributed_c10d._world.pg_map)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            context_parallel_size=cp, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp, virtual_pipeline_model_parallel_size=vp)
        _megatron_groups[:] = [group for group in torch.distributed.distributed_c10d._world.pg_map
                               if group not in before]
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


# The process groups that init_model_parallel_sizes' last megatron initialisation created.
_megatron_groups: list = []


def _destroy_groups(groups: list) -> None:
    """Destroy ``groups`` (process groups that megatron no longer holds) where they still exist:
    not the default group, nor any group after the default one was destroyed."""
    world = torch.distributed.distributed_c10d._world
    for group in groups:
        if group in world.pg_map and group is not torch.distributed.GroupMember.WORLD:
            torch.distributed.destroy_process_group(group)
    groups.clear()
    gc.collect()  # a group's threads end when the last reference to it goes (module cycles too)


def init_cpu_model_parallel(
    tp_size: int = 1,
    rank: int = 0,
    world_size: Optional[int] = None,
    init_file: Optional[str] = None,
    seed: int = 1234,
) -> None:
    """Initialise a gloo default process group (file rendezvous) and megatron's parallel_state
    with ``tensor_model_parallel_size=tp_size``, then seed megatron's RNG tracker.

    Single process: ``init_cpu_model_parallel()`` (a temporary rendezvous file is made).
    Several processes: give every rank the same ``init_file`` and its ``rank``. Where CUDA is
    available nothing is patched (megatron's RNG tracker seeds the CUDA generator)."""
    if not torch.cuda.is_available():
        install_cpu_shims()  # the tracker's CUDA RNG state on the CPU generator
    world_size = world_size or tp_size
    if not torch.distributed.is_initialized():
        if init_file is None:
            if world_size != 1:
                raise ValueError(
                    "init_cpu_model_parallel: init_file is required with world_size > 1")
            fd, init_file = tempfile.mkstemp(prefix="gloo_rdv_")
            os.close(fd)
            os.unlink(init_file)
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
    init_model_parallel_sizes(tp=tp_size, seed=seed)


def destroy_cpu_model_parallel() -> None:
    """Undo :func:`init_cpu_model_parallel` (parallel_state and the default process group)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# FLA kernels of megatron's non-deterministic GDN path (packed sequences)
# ----------------------------------------------------------------------------------------------


def _sequence_bounds(cu_seqlens: Optional[torch.Tensor], total: int) -> list:
    if cu_seqlens is None:
        return [(0, total)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def torch_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                 output_final_state=False, use_qk_l2norm_in_kernel=False,
                                 cu_seqlens=None, **kwargs):
    """CPU stand-in for FLA's ``chunk_gated_delta_rule`` ([B, T, H, D] inputs): megatron's torch
    chunk rule (``torch_chunk_gated_delta_rule``, its ``deterministic_mode`` path) applied to
    each sequence of ``cu_seqlens`` on its own (B = 1 then, as FLA requires). No recurrent state
    in or out (megatron's training forward passes none)."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule as rule

    if initial_state is not None or output_final_state:
        raise NotImplementedError("torch_chunk_gated_delta_rule: no initial or final state")
    if scale is not None and scale != q.shape[-1] ** -0.5:
        raise NotImplementedError("torch_chunk_gated_delta_rule: only the default scale")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError("torch_chunk_gated_delta_rule: cu_seqlens requires batch size 1")
    outputs = [
        rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]
        for s, e in _sequence_bounds(cu_seqlens, q.shape[1])
    ]
    return torch.cat(outputs, dim=1), None


def torch_causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None,
                        output_final_state=False, activation=None, cu_seqlens=None, **kwargs):
    """CPU stand-in for FLA's ``causal_conv1d``: x [B, T, D], weight [D, W]; a depthwise causal
    ``F.conv1d`` (as megatron's ``deterministic_mode`` path) on each sequence of ``cu_seqlens``,
    then silu when ``activation`` is 'silu' / 'swish'."""
    if residual is not None or initial_state is not None or output_final_state:
        raise NotImplementedError("torch_causal_conv1d: no residual, initial or final state")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"torch_causal_conv1d: activation must be None, 'silu' or 'swish', "
                         f"got {activation!r}")
    width = weight.shape[-1]

    def conv(segment):  # the operations of megatron's deterministic_mode path, in its order
        y = torch.nn.functional.conv1d(segment.transpose(1, 2).contiguous(), weight.unsqueeze(1),
                                       bias, padding=width - 1, groups=weight.shape[0])
        y = y[..., :segment.shape[1]]
        if activation is not None:
            y = torch.nn.functional.silu(y)
        return y.transpose(1, 2)

    bounds = _sequence_bounds(cu_seqlens, x.shape[1])
    if len(bounds) == 1:
        return conv(x), None
    return torch.cat([conv(x[:, s:e]) for s, e in bounds], dim=1), None


def install_cpu_fla_stand_ins() -> None:
    """Point megatron's GatedDeltaNet (``megatron.core.ssm.gated_delta_net.gdn``) at
    :func:`torch_chunk_gated_delta_rule` and :func:`torch_causal_conv1d` (module docstring).
    Call before building the modules (the rule is bound at construction). A no-op when CUDA is
    available: FLA's kernels run there."""
    if torch.cuda.is_available():
        return
    install_cpu_shims()
    gdn = importlib.import_module("megatron.core.ssm.gated_delta_net.gdn")
    gdn.chunk_gated_delta_rule = torch_chunk_gated_delta_rule
    gdn.causal_conv1d = torch_causal_conv1d
