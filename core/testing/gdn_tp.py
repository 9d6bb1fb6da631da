"""Tensor-parallel check of the GDN output-norm weight gradient (test-side only).

The TP=1 reference (weights, inputs, output and out_norm dW) is computed once and saved; each TP
rank then loads its shard, runs forward + backward with sequence parallelism on or off, with or
without a DDP-style fp32 ``main_grad``, calls the STOCK
``megatron.core.distributed.finalize_model_grads`` and saves what it got. Used by
tests/ssm/test_gdn_tensor_parallel.py (gloo, CPU, two spawned processes) and by
tests/gpu/check_gdn_layer.py (NCCL under torchrun).
"""

from __future__ import annotations

import itertools
import os
from typing import Iterable

import torch

CASES = tuple(
    dict(fused=f, sequence_parallel=sp, main_grad=mg)
    for f, sp, mg in itertools.product((True, False), (False, True), (False, True))
)


def case_name(case: dict) -> str:
    return (f"{'fused' if case['fused'] else 'unfused'}-sp{int(case['sequence_parallel'])}"
            f"-maingrad{int(case['main_grad'])}")


class DDPStandIn(torch.nn.Module):
    """The slice of megatron's DistributedDataParallel that finalize_model_grads touches, for one
    data-parallel rank: ``ddp_config``, ``finish_grad_sync`` (a no-op at DP=1) and, with
    ``main_grad=True``, fp32 ``param.main_grad`` buffers filled from ``param.grad`` by a
    post-accumulate hook that then drops ``.grad`` (what megatron's DDP does)."""

    def __init__(self, module: torch.nn.Module, main_grad: bool):
        super().__init__()
        from megatron.core.distributed import DistributedDataParallelConfig

        self.module = module
        self.config = module.config
        self.ddp_config = DistributedDataParallelConfig()
        if main_grad:
            for p in module.parameters():
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

                def hook(param):
                    param.main_grad.add_(param.grad)
                    param.grad = None

                p.register_post_accumulate_grad_hook(hook)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        pass

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def make_reference(path: str, seq: int = 24, batch: int = 2, cases: Iterable[dict] = CASES,
                   **config_overrides) -> None:
    """TP=1 run (parallel_state already initialised with TP=1): saves to ``path`` the weights,
    inputs, output and out_norm weight grad, per value of the fused flag."""
    from core.testing.gdn import build_gdn_module, gdn_config, randomize_norm_weights

    gen = torch.Generator().manual_seed(3)
    ref = {}
    for fused in sorted({c["fused"] for c in cases}):
        config = gdn_config(params_dtype=torch.float32, fused_gated_norm=fused, **config_overrides)
        module = build_gdn_module(config, seed=99)
        randomize_norm_weights(module)
        device = module.out_norm.weight.device
        x = torch.randn(seq, batch, config.hidden_size, generator=gen).to(device)
        dy = torch.randn(seq, batch, config.hidden_size, generator=gen).to(device)
        out = module(x, attention_mask=None)[0]
        out.backward(dy)
        ref[fused] = dict(
            state={k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                   for k, v in module.state_dict().items()},
            x=x.cpu(), dy=dy.cpu(), out=out.detach().cpu(),
            dw=module.out_norm.weight.grad.detach().cpu().clone(),
        )
    torch.save({"ref": ref, "overrides": config_overrides}, path)


def run_rank(rank: int, tp_size: int, ref_path: str, out_path: str,
             cases: Iterable[dict] = CASES) -> dict:
    """One TP rank (parallel_state initialised with ``tp_size``): every case, results saved to
    ``out_path`` (and returned)."""
    from megatron.core.distributed import finalize_model_grads

    from core.testing.gdn import build_gdn_module, gdn_config, shard_gdn_state_dict

    saved = torch.load(ref_path, weights_only=False)
    results = {}
    for case in cases:
        ref = saved["ref"][case["fused"]]
        config = gdn_config(
            params_dtype=torch.float32, fused_gated_norm=case["fused"],
            tensor_model_parallel_size=tp_size, sequence_parallel=case["sequence_parallel"],
            **saved["overrides"],
        )
        module = build_gdn_module(config, seed=99)
        module.load_state_dict(shard_gdn_state_dict(ref["state"], config, rank, tp_size))
        device = module.out_norm.weight.device
        chunk = DDPStandIn(module, case["main_grad"])
        x, dy = ref["x"].to(device), ref["dy"].to(device)
        if case["sequence_parallel"]:
            x, dy = x.chunk(tp_size, dim=0)[rank], dy.chunk(tp_size, dim=0)[rank]
        out = chunk(x.contiguous(), attention_mask=None)[0]
        out.backward(dy.contiguous())
        weight = module.out_norm.weight
        grad_attr = "main_grad" if case["main_grad"] else "grad"
        before = getattr(weight, grad_attr).detach().clone()
        finalize_model_grads([chunk])
        results[case_name(case)] = dict(
            out=out.detach().cpu(), before=before.cpu(),
            after=getattr(weight, grad_attr).detach().clone().cpu(),
            grad_is_none=weight.grad is None,
        )
    torch.save(results, out_path)
    return results


def spawn_worker(rank: int, tp_size: int, init_file: str, ref_path: str, out_dir: str) -> None:
    """torch.multiprocessing.spawn entry: gloo on the CPU."""
    from core.testing.cpu import destroy_cpu_model_parallel, init_cpu_model_parallel

    init_cpu_model_parallel(tp_size=tp_size, rank=rank, world_size=tp_size, init_file=init_file)
    try:
        run_rank(rank, tp_size, ref_path, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_cpu_model_parallel()
