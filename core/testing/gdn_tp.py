"""Tensor-parallel check of the GDN output-norm weight gradient (test-side only).

What a Megatron training step does, on one GatedDeltaNet layer: the module is wrapped in
megatron's real ``megatron.core.distributed.DistributedDataParallel`` (``overlap_grad_reduce=
False``; with and without ``grad_reduce_in_fp32``; with and without ``use_distributed_optimizer``,
whose grad buffers are laid out for the sharded optimizer), forward +
backward fill DDP's ``main_grad`` buffers, then the STOCK
``megatron.core.distributed.finalize_model_grads([ddp_model])`` runs (DP all-reduce, then the
TP reduction of the non-tensor-parallel grads, where the out_norm weight's partial dW is
reduced).

The TP=1 reference (weights, inputs, output and out_norm dW, through the same DDP wrapper and
finalize) is computed once per (fused, dtype, grad_reduce_in_fp32) and saved; each TP rank then
loads its shard, runs the same step with sequence parallelism on or off and saves what it got:
the out_norm ``main_grad`` before and after finalize, the layer output.

Used by tests/ssm/test_gdn_tensor_parallel.py (gloo, CPU, TP = 2 and 4 spawned processes) and by
tools/gdn_layer.py --tp N and tests/ssm/test_gated_delta_net_gpu.py (NCCL under torchrun). On
the CPU, megatron's DDP needs the training-level shims of ``core.testing.cpu``
(``install_cpu_shims(training=True)``): its grad buffer waits on CUDA streams.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import itertools
import os
from typing import Iterable

import torch

from core.testing.parallel import rel_err  # noqa: F401  (the TP tests' metric)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# fp32 params: DDP's main_grad is fp32 either way (grad_reduce_in_fp32 only changes the config
# path). bf16 params: main_grad is fp32 with grad_reduce_in_fp32, bf16 (the param dtype) without.
DDP_VARIANTS = (("fp32", True), ("fp32", False), ("bf16", True), ("bf16", False))

CASES = tuple(
    dict(fused=f, sequence_parallel=sp, dtype=dt, grad_reduce_in_fp32=g32, distributed_optimizer=do)
    for f, sp, (dt, g32), do in itertools.product((True, False), (False, True), DDP_VARIANTS,
                                                  (False, True))
)

# Layer sizes whose heads split over TP = 1, 2, 4 and 8 ranks (key heads % tp == 0 and value
# heads % key heads == 0 are megatron's rules): 8 key heads, 16 value heads (2 per rank at TP 8).
TP_OVERRIDES = dict(hidden_size=64, num_key_heads=8, num_value_heads=16, key_head_dim=8,
                    value_head_dim=8, num_attention_heads=8)


def case_name(case: dict) -> str:
    return (f"{'fused' if case['fused'] else 'unfused'}-sp{int(case['sequence_parallel'])}"
            f"-{case['dtype']}-gradfp32{int(case['grad_reduce_in_fp32'])}"
            f"{'-distopt' if case['distributed_optimizer'] else ''}")


def ref_key(case: dict) -> tuple:
    """The TP=1 reference of a case (the distributed optimizer's buffer layout does not change
    the full gradient, so both share one)."""
    return (case["fused"], case["dtype"], case["grad_reduce_in_fp32"])


def tolerance(case: dict) -> float:
    """Relative tolerance of the TP dW against the TP=1 dW. fp32: rounding of a different
    summation order (partial sums over the heads of each rank, then the all-reduce). bf16: each
    rank's partial dW is rounded to bf16 by autograd (param.grad is bf16) before DDP adds it to
    main_grad, where TP=1 rounds the full sum once: about one bf16 ulp of the largest element
    (2^-8 = 3.9e-3 relative; measured on the CPU at TP 2 and 4: <= 1.8e-3). Twice the gradient
    (reduced twice) or a partial one is off by >= 0.5."""
    return 1e-5 if case["dtype"] == "fp32" else 8e-3


def wrap_ddp(module: torch.nn.Module, grad_reduce_in_fp32: bool = True,
             distributed_optimizer: bool = False):
    """megatron's DistributedDataParallel around ``module``, as a training script builds it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    return DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)


def build_optimizer(model, distributed_optimizer: bool):
    """megatron's optimizer for the DDP-wrapped ``model`` (Adam: the distributed optimizer takes
    no other; fp32 main params for bf16 models; no clipping)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model.module.config
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-2, clip_grad=0.0, bf16=config.params_dtype == torch.bfloat16,
        params_dtype=config.params_dtype, use_distributed_optimizer=distributed_optimizer,
    )
    with _cpu_tensor_types():
        return get_megatron_optimizer(opt_config, [model])


def _cpu_tensor_types():
    """megatron's optimizer checks ``param.type()`` against CUDA type names (CPU runs only)."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from core.testing.cpu import cpu_tensor_types

    return cpu_tensor_types()


def out_norm_weight_report(weight: torch.nn.Parameter) -> dict:
    """What the TP handling leaves on the out_norm weight: its backward hooks, the types of its
    attributes, and whether ``torch.save({"w": weight})`` loads back with ``weights_only=True``
    (value and tags)."""
    buffer = io.BytesIO()
    torch.save({"w": weight}, buffer)
    buffer.seek(0)
    try:
        loaded = torch.load(buffer, weights_only=True)["w"]
        load_error, loaded_equal, loaded_attrs = None, torch.equal(loaded, weight), vars(loaded)
    except Exception as exc:  # reported, asserted on by the test
        load_error, loaded_equal, loaded_attrs = f"{type(exc).__name__}: {exc}", False, {}
    return dict(
        backward_hooks=len(weight._backward_hooks or {}),
        attrs={k: (type(v).__name__, v if isinstance(v, (bool, int, float, str)) else None)
               for k, v in vars(weight).items()},
        load_error=load_error, loaded_equal=loaded_equal,
        loaded_attrs={k: v for k, v in loaded_attrs.items()
                      if isinstance(v, (bool, int, float, str))},
    )


def _step(module, grad_reduce_in_fp32: bool, x: torch.Tensor, dy: torch.Tensor,
          distributed_optimizer: bool = False) -> dict:
    """DDP wrap, megatron optimizer, zero grad buffer, forward, backward, stock
    finalize_model_grads, optimizer step."""
    from megatron.core.distributed import finalize_model_grads

    weight = module.out_norm.weight
    report = out_norm_weight_report(weight)  # as built, before DDP adds main_grad
    model = wrap_ddp(module, grad_reduce_in_fp32, distributed_optimizer)
    optimizer = build_optimizer(model, distributed_optimizer)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    out = model(x.contiguous(), attention_mask=None)[0]
    out.backward(dy.contiguous())
    before = weight.main_grad.detach().clone()
    finalize_model_grads([model])
    after = weight.main_grad.detach().clone()
    grad_is_none = weight.grad is None  # (the optimizer step may point .grad at main_grad)
    weight_before_step = weight.detach().clone()
    with _cpu_tensor_types():
        update_ok, _, _ = optimizer.step()
    return dict(
        out=out.detach().float().cpu(), before=before.float().cpu(), after=after.cpu(),
        main_grad_dtype=str(weight.main_grad.dtype), grad_is_none=grad_is_none,
        grad_scale=module.out_norm_weight_grad_scale,
        avg_tag=bool(getattr(weight, "average_gradients_across_tp_domain", False)),
        update_ok=bool(update_ok), weight_before_step=weight_before_step.cpu(),
        weight_after_step=weight.detach().clone().cpu(), **report,
    )


def _torch_fsdp2_step(module, grad_reduce_in_fp32: bool, x: torch.Tensor, dy: torch.Tensor,
                      distributed_optimizer: bool = False) -> dict:
    """megatron's torch FSDP2 wrapper (TorchFullyShardedDataParallel, ``--use-torch-fsdp2``),
    forward, backward, stock finalize_model_grads; the out_norm gradient before and after. Then
    the weight is replaced as ``load_state_dict(assign=True)`` does (FSDP2 takes a new sharded
    parameter, without the tag) and one more forward runs: what it raised, if anything."""
    from megatron.core.distributed import (DistributedDataParallelConfig,
                                           TorchFullyShardedDataParallel, finalize_model_grads)

    model = TorchFullyShardedDataParallel(
        config=module.config, module=module,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32))
    out = model(x.contiguous(), attention_mask=None)[0]
    out.backward(dy.contiguous())
    weight = module.out_norm.weight  # FSDP2's sharded parameter again, the one finalize reduces
    before = weight.grad.full_tensor().clone()
    finalize_model_grads([model])
    after = weight.grad.full_tensor().clone()
    avg_tag = bool(getattr(weight, "average_gradients_across_tp_domain", False))
    module.out_norm.load_state_dict(module.out_norm.state_dict(), assign=True)
    try:
        model(x.contiguous(), attention_mask=None)
        replaced_error = None
    except RuntimeError as exc:
        replaced_error = str(exc)
    return dict(out=out.detach().float().cpu(), before=before.float().cpu(), after=after.cpu(),
                grad_scale=module.out_norm_weight_grad_scale, avg_tag=avg_tag,
                replaced_error=replaced_error)


# fp32 cases under megatron's torch FSDP2 wrapper (results named "torch-fsdp2-<case>"; CPU runs).
TORCH_FSDP2_CASES = tuple(c for c in CASES if c["dtype"] == "fp32" and c["grad_reduce_in_fp32"]
                          and not c["distributed_optimizer"])


@contextlib.contextmanager
def megatron_summing_out_norm_grad():
    """A megatron-core that reduces the GDN out_norm weight gradient itself (what a fix of
    upstream issue #7452 in finalize_model_grads would do): its TP step of
    ``finalize_model_grads`` also SUM-reduces over TP every parameter named ``*out_norm.weight``
    that its sequence-parallel rule did not already sum. Simulated by wrapping megatron's
    ``_allreduce_non_tensor_model_parallel_grads`` for the duration of the block."""
    from megatron.core.utils import get_attr_wrapped_model, get_tensor_model_parallel_group_if_none

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    original = finalize._allreduce_non_tensor_model_parallel_grads

    def reduce_tp(model, config, tp_group=None):
        original(model, config, tp_group)
        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        if tp_group.size() <= 1:
            return
        for chunk in model:
            for name, param in get_attr_wrapped_model(chunk, "named_parameters")():
                summed = config.sequence_parallel and getattr(param, "sequence_parallel", False)
                if name.endswith("out_norm.weight") and param.requires_grad and not summed:
                    grad = getattr(param, "main_grad", None)
                    torch.distributed.all_reduce(param.grad if grad is None else grad,
                                                 op=torch.distributed.ReduceOp.SUM, group=tp_group)

    finalize._allreduce_non_tensor_model_parallel_grads = reduce_tp
    try:
        yield
    finally:
        finalize._allreduce_non_tensor_model_parallel_grads = original


def make_reference(path: str, seq: int = 24, batch: int = 2, cases: Iterable[dict] = CASES,
                   **config_overrides) -> None:
    """TP=1 run (parallel_state already initialised with TP=1): saves to ``path``, per
    :func:`ref_key`, the weights, inputs, output and out_norm dW (DDP main_grad after the stock
    finalize_model_grads). ``seq`` must be divisible by the TP sizes checked with SP on."""
    from core.testing.gdn import build_gdn_module, gdn_config, layer_inputs, randomize_norm_weights

    ref = {}
    for key in sorted({ref_key(c) for c in cases}):
        fused, dtype_name, g32 = key
        dtype = DTYPES[dtype_name]
        config = gdn_config(params_dtype=dtype, fused_gated_norm=fused, **config_overrides)
        module = build_gdn_module(config, seed=99)
        randomize_norm_weights(module)
        device = module.out_norm.weight.device
        # the same inputs for every key
        x, dy = layer_inputs(seq, batch, config.hidden_size, dtype, seed=3, device=device)
        state = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                 for k, v in module.state_dict().items()}
        res = _step(module, g32, x, dy)
        ref[key] = dict(state=state, x=x.cpu(), dy=dy.cpu(), out=res["out"], dw=res["after"],
                        main_grad_dtype=res["main_grad_dtype"])
    torch.save({"ref": ref, "overrides": config_overrides}, path)


# Cases also run under megatron_summing_out_norm_grad (results named "megatron-sums-<case>").
MEGATRON_SUMS_CASES = tuple(c for c in CASES if c["dtype"] == "fp32" and c["grad_reduce_in_fp32"]
                            and not c["distributed_optimizer"])


def run_rank(rank: int, tp_size: int, ref_path: str, out_path: str,
             cases: Iterable[dict] = CASES,
             megatron_sums_cases: Iterable[dict] = MEGATRON_SUMS_CASES,
             torch_fsdp2_cases: Iterable[dict] = ()) -> dict:
    """One TP rank (parallel_state initialised with ``tp_size``): every case, then the
    ``megatron_sums_cases`` under :func:`megatron_summing_out_norm_grad` and the
    ``torch_fsdp2_cases`` under megatron's torch FSDP2 wrapper; results saved to ``out_path``
    (and returned)."""
    results = _run_cases(rank, tp_size, ref_path, cases)
    with megatron_summing_out_norm_grad():
        simulated = _run_cases(rank, tp_size, ref_path, megatron_sums_cases)
    results.update({f"megatron-sums-{name}": res for name, res in simulated.items()})
    fsdp2 = _run_cases(rank, tp_size, ref_path, torch_fsdp2_cases, _torch_fsdp2_step)
    results.update({f"torch-fsdp2-{name}": res for name, res in fsdp2.items()})
    torch.save(results, out_path)
    return results


def _run_cases(rank: int, tp_size: int, ref_path: str, cases: Iterable[dict], step=_step) -> dict:
    from core.testing.gdn import build_gdn_module, gdn_config, shard_gdn_state_dict

    saved = torch.load(ref_path, weights_only=False)
    results = {}
    for case in cases:
        ref = saved["ref"][ref_key(case)]
        config = gdn_config(
            params_dtype=DTYPES[case["dtype"]], fused_gated_norm=case["fused"],
            tensor_model_parallel_size=tp_size, sequence_parallel=case["sequence_parallel"],
            **saved["overrides"],
        )
        module = build_gdn_module(config, seed=99)
        module.load_state_dict(shard_gdn_state_dict(ref["state"], config, rank, tp_size))
        device = module.out_norm.weight.device
        x, dy = ref["x"].to(device), ref["dy"].to(device)
        if case["sequence_parallel"]:
            x, dy = x.chunk(tp_size, dim=0)[rank], dy.chunk(tp_size, dim=0)[rank]
        results[case_name(case)] = step(module, case["grad_reduce_in_fp32"], x, dy,
                                        case["distributed_optimizer"])
    return results


def spawn_worker(rank: int, tp_size: int, init_file: str, ref_path: str, out_dir: str) -> None:
    """torch.multiprocessing.spawn entry: gloo on the CPU."""
    from core.testing.cpu import (destroy_cpu_model_parallel, init_cpu_model_parallel,
                                  install_cpu_shims)

    install_cpu_shims(training=True)  # megatron's DDP grad buffer on the CPU
    torch.set_num_threads(1)  # several ranks share few cores
    init_cpu_model_parallel(tp_size=tp_size, rank=rank, world_size=tp_size, init_file=init_file)
    try:
        run_rank(rank, tp_size, ref_path, os.path.join(out_dir, f"rank{rank}.pt"),
                 torch_fsdp2_cases=TORCH_FSDP2_CASES)
    finally:
        destroy_cpu_model_parallel()
