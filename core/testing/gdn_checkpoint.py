"""Megatron distributed checkpoints of one GatedDeltaNet layer across parallel layouts
(test-side only).

A checkpoint is what ``megatron.core.dist_checkpointing.save`` writes from the module's
``sharded_state_dict()`` (megatron's ``_GDNBase.sharded_state_dict``: in_proj / conv1d split
into their q/k/v/... sections per TP rank, A_log / dt_bias / out_proj sharded, out_norm
replicated) with the default ``torch_dist`` backend; loading goes through
``dist_checkpointing.load`` into the ``sharded_state_dict()`` of a module of another layout.
Nothing of the fusion flags (the fused output norm, ``fused``; the fused pre-recurrence region,
``pre_fusion``: gdn_pre_gated_delta_rule_fusion) or of the TP gradient handling is in the
checkpoint (no buffer, no extra state), so a checkpoint of one setting loads under the other.
A setting is a dict of :func:`build_layer`'s flags, e.g. ``dict(fused=True, pre_fusion=True)``.

    reference = make_reference(path, on, off)   # TP 1 weights, input, outputs of both settings
    save_layer(module, directory) / load_layer(module, directory)

``spawn_worker`` runs one rank of the TP = 2 side: save a checkpoint of the ``off`` setting from
the reference's shard, load the TP = 1 checkpoint of the ``on`` setting. On the CPU the writer
needs
``install_cpu_shims(training=True)`` (it synchronises CUDA) and ``psutil`` (it logs the
process's memory).
"""

from __future__ import annotations

import os

import torch

from core.testing.gdn_tp import TP_OVERRIDES

SEQ, BATCH = 24, 2


def build_layer(fused: bool, tp_size: int, seed: int, pre_fusion: bool = False):
    """A fp32 GatedDeltaNet of the TP test's sizes (heads split over TP 1, 2, 4, 8); ``fused``:
    the fused output norm, ``pre_fusion``: the fused pre-recurrence region."""
    from core.testing.gdn import build_gdn_module, gdn_config

    config = gdn_config(params_dtype=torch.float32, fused_gated_norm=fused,
                        gdn_pre_gated_delta_rule_fusion=pre_fusion,
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


def make_reference(path: str, on: dict, off: dict) -> dict:
    """TP = 1 (parallel_state initialised with TP 1): weights with distinct norm weights, an
    input and the layer output under the settings ``on`` and ``off`` ("out_on", "out_off");
    saved to ``path`` and returned."""
    from core.testing.gdn import randomize_norm_weights

    module = build_layer(tp_size=1, seed=11, **on)
    randomize_norm_weights(module)
    state = state_of(module)
    x = torch.randn(SEQ, BATCH, module.config.hidden_size,
                    generator=torch.Generator().manual_seed(4))
    other = build_layer(tp_size=1, seed=12, **off)
    other.load_state_dict(state)
    ref = dict(state=state, x=x, out_on=output_of(module, x), out_off=output_of(other, x))
    torch.save(ref, path)
    return ref


def run_rank(rank: int, tp_size: int, ref_path: str, save_dir: str, load_dir: str,
             setting: dict) -> dict:
    """One TP rank under ``setting``: the reference's shard saved to ``save_dir``; a fresh
    module (other seed) loaded from ``load_dir``. Returns the outputs and states of both."""
    from core.testing.gdn import shard_gdn_state_dict

    ref = torch.load(ref_path, weights_only=True)
    saver = build_layer(tp_size=tp_size, seed=21, **setting)
    shard = shard_gdn_state_dict(ref["state"], saver.config, rank, tp_size)
    saver.load_state_dict(shard)
    save_layer(saver, save_dir)
    loader = build_layer(tp_size=tp_size, seed=22, **setting)
    load_layer(loader, load_dir)
    return dict(shard=shard, saved_out=output_of(saver, ref["x"]),
                loaded_state=state_of(loader), loaded_out=output_of(loader, ref["x"]))


def spawn_worker(rank: int, tp_size: int, init_file: str, ref_path: str, save_dir: str,
                 load_dir: str, out_dir: str, setting: dict) -> None:
    """torch.multiprocessing.spawn entry: gloo on the CPU."""
    from core.testing.cpu import (destroy_cpu_model_parallel, init_cpu_model_parallel,
                                  install_cpu_shims)

    install_cpu_shims(training=True)
    torch.set_num_threads(1)
    init_cpu_model_parallel(tp_size=tp_size, rank=rank, world_size=tp_size, init_file=init_file)
    try:
        result = run_rank(rank, tp_size, ref_path, save_dir, load_dir, setting)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_cpu_model_parallel()
