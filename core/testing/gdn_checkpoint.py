"""Megatron distributed checkpoints of one GatedDeltaNet layer across parallel layouts
(test-side only).

A checkpoint is what ``megatron.core.dist_checkpointing.save`` writes from the module's
``sharded_state_dict()`` (megatron's ``_GDNBase.sharded_state_dict``: in_proj / conv1d split
into their q/k/v/... sections per TP rank, A_log / dt_bias / out_proj sharded, out_norm
replicated) with the default ``torch_dist`` backend; loading goes through
``dist_checkpointing.load`` into the ``sharded_state_dict()`` of a module of another layout.
Nothing of the fused-norm flag or of the TP gradient handling is in the checkpoint (no buffer,
no extra state), so a checkpoint of one flag loads under the other.

    reference = make_reference(path)            # TP 1 weights, input, outputs flag on and off
    save_layer(module, directory) / load_layer(module, directory)

``spawn_worker`` runs one rank of the TP = 2 side: save a flag-off checkpoint from the
reference's shard, load the TP = 1 flag-on checkpoint. On the CPU the writer needs
``install_cpu_shims(training=True)`` (it synchronises CUDA) and ``psutil`` (it logs the
process's memory).
"""

from __future__ import annotations

import os

import torch

from core.testing.gdn_tp import TP_OVERRIDES

SEQ, BATCH = 24, 2


def build_layer(fused: bool, tp_size: int, seed: int):
    """A fp32 GatedDeltaNet of the TP test's sizes (heads split over TP 1, 2, 4, 8)."""
    from core.testing.gdn import build_gdn_module, gdn_config

    config = gdn_config(params_dtype=torch.float32, fused_gated_norm=fused,
                        tensor_model_parallel_size=tp_size, **TP_OVERRIDES)
    return build_gdn_module(config, seed=seed)


def state_of(module) -> dict:
    """The module's tensors (cloned, on the CPU)."""
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()
            if isinstance(v, torch.Tensor)}


def output_of(module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module(x.to(module.out_norm.weight.device), attention_mask=None)[0].cpu()


def save_layer(module, directory: str) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(module.sharded_state_dict(), directory)


def load_layer(module, directory: str) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(module.sharded_state_dict(), directory)
    module.load_state_dict(state)


def make_reference(path: str) -> dict:
    """TP = 1 (parallel_state initialised with TP 1): weights with distinct norm weights, an
    input and the layer output with the flag on and off; saved to ``path`` and returned."""
    from core.testing.gdn import randomize_norm_weights

    module = build_layer(fused=True, tp_size=1, seed=11)
    randomize_norm_weights(module)
    state = state_of(module)
    x = torch.randn(SEQ, BATCH, module.config.hidden_size,
                    generator=torch.Generator().manual_seed(4))
    unfused = build_layer(fused=False, tp_size=1, seed=12)
    unfused.load_state_dict(state)
    ref = dict(state=state, x=x, out_fused=output_of(module, x), out_unfused=output_of(unfused, x))
    torch.save(ref, path)
    return ref


def run_rank(rank: int, tp_size: int, ref_path: str, save_dir: str, load_dir: str) -> dict:
    """One TP rank, flag off: the reference's shard saved to ``save_dir``; a fresh module
    (other seed) loaded from ``load_dir``. Returns the outputs and states of both."""
    from core.testing.gdn import shard_gdn_state_dict

    ref = torch.load(ref_path, weights_only=True)
    saver = build_layer(fused=False, tp_size=tp_size, seed=21)
    shard = shard_gdn_state_dict(ref["state"], saver.config, rank, tp_size)
    saver.load_state_dict(shard)
    save_layer(saver, save_dir)
    loader = build_layer(fused=False, tp_size=tp_size, seed=22)
    load_layer(loader, load_dir)
    return dict(shard=shard, saved_out=output_of(saver, ref["x"]),
                loaded_state=state_of(loader), loaded_out=output_of(loader, ref["x"]))


def spawn_worker(rank: int, tp_size: int, init_file: str, ref_path: str, save_dir: str,
                 load_dir: str, out_dir: str) -> None:
    """torch.multiprocessing.spawn entry: gloo on the CPU."""
    from core.testing.cpu import (destroy_cpu_model_parallel, init_cpu_model_parallel,
                                  install_cpu_shims)

    install_cpu_shims(training=True)
    torch.set_num_threads(1)
    init_cpu_model_parallel(tp_size=tp_size, rank=rank, world_size=tp_size, init_file=init_file)
    try:
        result = run_rank(rank, tp_size, ref_path, save_dir, load_dir)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_cpu_model_parallel()
