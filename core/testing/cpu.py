"""No-GPU shims that let megatron-core 0.19 build and run a GatedDeltaNet layer on the CPU.

Test-side only: the library (``core.*`` outside ``core.testing``) never imports this module.
Used by the tests and by the CPU pretraining example. Everything here patches megatron-core,
torch or triton in-process; nothing is written to disk except a file-based rendezvous.

    from core.testing.cpu import install_cpu_shims, init_cpu_model_parallel
    install_cpu_shims()                       # before importing megatron's gated_delta_net
    init_cpu_model_parallel(tp_size=1)        # gloo group + parallel_state + RNG tracker

What is patched (and why), all idempotent:
  * ``TRITON_INTERPRET=1`` when there is no CUDA (Triton kernels run in the interpreter).
  * ``torch.cuda.current_device`` -> ``"cpu"``: megatron allocates with
    ``device=torch.cuda.current_device()``.
  * ``megatron.core.jit.disable_jit_fuser()``; methods that were already wrapped by
    ``torch.compile`` (module imported earlier) are unwrapped.
  * The "CUDA" RNG state of ``megatron.core.tensor_parallel.random`` is mapped to the CPU
    generator (get/set state, ``CudaRNGStatesTracker.add``); the tracker's "CPU RNG state
    changed" warning, always true in that mapping, is filtered.
  * ``CheckpointWithoutOutput(fp8=False)`` sets ``self.fp8 = fp8 is not None`` (True) and then
    needs Transformer Engine; without TE the fp8 flag is forced off
    (:func:`patch_checkpoint_without_output_fp8`, also useful on a GPU without TE).
  * ``CheckpointWithoutOutput``'s zero-copy share-storage helper compiles a C++ extension
    (~20 s); replaced by a storage copy with the same observable result.
  * Triton's autotuner benchmarks through the GPU driver; on the CPU every config gets the
    same time, so the first config is picked.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import tempfile
from typing import Optional

import torch

_INSTALLED = False


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


def patch_checkpoint_without_output_fp8() -> None:
    """Make ``CheckpointWithoutOutput(fp8=False)`` mean no fp8 when Transformer Engine is absent.

    megatron-core 0.19 sets ``self.fp8 = fp8 is not None`` (True for the default False) and the
    fp8 branch calls Transformer Engine; without TE, ``gdn_norm_out`` recompute raises a
    NameError. Safe on a GPU too; a no-op when TE is installed."""
    from megatron.core.tensor_parallel import random as mrandom

    if mrandom.HAVE_TE or getattr(mrandom.CheckpointWithoutOutput, "_cpu_shim", False):
        return
    orig_init = mrandom.CheckpointWithoutOutput.__init__

    def __init__(self, fp8=False):
        orig_init(self, fp8)
        self.fp8 = False

    mrandom.CheckpointWithoutOutput.__init__ = __init__
    mrandom.CheckpointWithoutOutput._cpu_shim = True


def _unwrap_compiled(cls) -> None:
    for name, value in list(vars(cls).items()):
        orig = getattr(value, "_torchdynamo_orig_callable", None)
        if orig is not None:
            setattr(cls, name, orig)


def install_cpu_shims(share_storage_copy: bool = True) -> None:
    """Install every shim listed in the module docstring. Idempotent; call it before importing
    ``core.ssm`` or megatron's ``gated_delta_net`` (already-imported modules are fixed up too).

    share_storage_copy: replace the C++ share-storage helper of CheckpointWithoutOutput with a
    storage copy (default; avoids a ~20 s compile)."""
    global _INSTALLED
    if _INSTALLED:
        return
    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.cuda.current_device = lambda: "cpu"

    import megatron.core.jit as mjit

    mjit.disable_jit_fuser()
    if "megatron.core.ssm.gated_delta_net.common" in sys.modules:
        from megatron.core.ssm.gated_delta_net.common import _GDNBase

        _unwrap_compiled(_GDNBase)

    from megatron.core.tensor_parallel import random as mrandom

    if not has_cuda:
        mrandom._get_cuda_rng_state = _cpu_rng_state
        mrandom._set_cuda_rng_state = _set_cpu_rng_state
        mrandom.CudaRNGStatesTracker.add = _tracker_add_cpu
        logging.getLogger(mrandom.__name__).addFilter(_DropCpuRngWarning())
    patch_checkpoint_without_output_fp8()
    if share_storage_copy:
        mrandom._get_share_storage = lambda: _share_storage_copy

    if not has_cuda:
        import triton.runtime.autotuner as autotuner

        def _do_bench(self):
            return lambda kernel_call, quantiles=None: [1.0, 1.0, 1.0] if quantiles else 1.0

        autotuner.Autotuner.do_bench = property(_do_bench)
    _INSTALLED = True


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
    Several processes: give every rank the same ``init_file`` and its ``rank``."""
    install_cpu_shims()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    world_size = world_size or tp_size
    if not torch.distributed.is_initialized():
        if init_file is None:
            if world_size != 1:
                raise ValueError("init_cpu_model_parallel: init_file is required with world_size > 1")
            fd, init_file = tempfile.mkstemp(prefix="gloo_rdv_")
            os.close(fd)
            os.unlink(init_file)
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy_cpu_model_parallel() -> None:
    """Undo :func:`init_cpu_model_parallel` (parallel_state and the default process group)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
