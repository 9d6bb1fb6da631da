"""The out_norm weight gradient of a whole GDN TransformerLayer at TP = 2, eager and under
megatron's local CUDA graphs, against the eager TP = 1 step (test-side only).

One rank of a 2-process run (NCCL on 2 GPUs, gloo on the CPU), flag on
(``fused_gated_norm=True``), bf16 params, ``grad_reduce_in_fp32``, megatron's torch chunk rule
(``deterministic_mode``). The layer (input norm, core.ssm.GatedDeltaNet, MLP; no Transformer
Engine) is wrapped in megatron's DistributedDataParallel; a step is zero_grad_buffer, forward,
backward, the stock ``finalize_model_grads``; the result is the out_norm ``main_grad``.

    "tp1"            the reference: TP 1, eager (the same on both ranks: DP 2 of equal data)
    "tp2-sp"         TP 2, sequence parallelism on (megatron sums the partial dW itself)
    "tp2"            TP 2, sequence parallelism off (the backward scales dW by 2, AVG over TP)
    "tp2-cuda-graph" as "tp2" with ``cuda_graph_impl="local"``: megatron's CudaGraphManager
                     records step 1 eagerly, ``create_cudagraphs()`` captures forward and
                     backward (the bwd graph adds the weight gradients to main_grad), step 2
                     replays both; its main_grad is the result. GPU only.

Used by tests/ssm/test_gdn_tp_cuda_graphs.py.
"""

from __future__ import annotations

import faulthandler
import sys

import torch

from core.testing.gdn_tp import TP_OVERRIDES, wrap_ddp

SEQ, BATCH = 32, 2
SEED = 1234


def layer_config(tp_size: int, **overrides):
    from core.testing.gdn import gdn_config

    return gdn_config(params_dtype=torch.bfloat16, fused_gated_norm=True, deterministic_mode=True,
                      tensor_model_parallel_size=tp_size, **TP_OVERRIDES, **overrides)


def shard_layer_state(full: dict, config, rank: int, tp_size: int) -> dict:
    """TP shard of a TP = 1 GDN TransformerLayer state dict: the GDN under ``self_attention.``
    as core.testing.gdn.shard_gdn_state_dict; the MLP's fc1 rows and fc2 columns split; the
    norms replicated."""
    from core.testing.gdn import shard_gdn_state_dict

    out = shard_gdn_state_dict(full, config, rank, tp_size, prefix="self_attention.")
    for key, dim in (("mlp.linear_fc1.weight", 0), ("mlp.linear_fc2.weight", 1)):
        out[key] = full[key].chunk(tp_size, dim=dim)[rank].clone()
    return out


def _parallel(tp_size: int, cudagraphable_rng: bool = False) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    model_parallel_cuda_manual_seed(SEED, use_cudagraphable_rng=cudagraphable_rng,
                                    force_reset_rng=True)


def _layer(config, state: dict, device):
    from core.testing.gdn import build_gdn_layer

    # seed=None: keep the RNG tracker _parallel set up (the CUDA-graph case needs its
    # cudagraph-safe one); the weights come from ``state``.
    layer = build_gdn_layer(config, seed=None).to(device)
    layer.load_state_dict(state)
    return layer


def ddp_step(model, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    from megatron.core.distributed import finalize_model_grads

    model.zero_grad_buffer()
    out = model(x.detach().requires_grad_(True), attention_mask=None)[0]
    out.backward(dy)
    finalize_model_grads([model])
    return model.module.self_attention.out_norm.weight.main_grad.detach().clone()


def reset_cuda_graphs() -> None:
    """megatron's CUDA-graph record is global: cleared before and after the graphed case."""
    from megatron.core.transformer.cuda_graphs import CudaGraphManager, _CudagraphGlobalRecord

    _CudagraphGlobalRecord.cudagraph_created = False
    _CudagraphGlobalRecord.cudagraph_record = []
    CudaGraphManager.global_mempool = None


def counting_norm_calls():
    """``counting_calls`` of GatedDeltaNet's Python norm code (``_apply_gated_norm``): a step
    replayed from megatron's CUDA graphs makes none."""
    from core.ssm.gated_delta_net import GatedDeltaNet
    from core.testing.gdn import counting_calls

    return counting_calls(GatedDeltaNet, "_apply_gated_norm")


def _cuda_graph_step(state: dict, rank: int, tp_size: int, x, dy, device) -> dict:
    """Step 1 eager (recorded), create_cudagraphs(), step 2 replayed; returns step 2's dW and
    how many times the Python norm code ran during step 2 (0: the graphs ran)."""
    from core.testing.gdn import eager_megatron_gdn

    # megatron's local CUDA graphs hook save_for_backward during capture, which its torch.compile'd
    # (jit_fuser) GDN methods and fused bias-dropout-add do not survive (flag on or off): those
    # run eagerly here.
    # A rank stuck in a collective (capture or replay out of step with its peer) prints every
    # thread's stack before the NCCL timeout ends the process without one.
    faulthandler.dump_traceback_later(60, exit=False, file=sys.stderr)
    try:
        with eager_megatron_gdn():
            return _captured_step(state, rank, tp_size, x, dy, device)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _captured_step(state: dict, rank: int, tp_size: int, x, dy, device) -> dict:
    from megatron.core.transformer.cuda_graphs import create_cudagraphs

    reset_cuda_graphs()
    _parallel(tp_size, cudagraphable_rng=True)
    config = layer_config(tp_size, cuda_graph_impl="local", bias_dropout_fusion=False)
    layer = _layer(config, shard_layer_state(state, config, rank, tp_size), device)
    model = wrap_ddp(layer)
    eager_dw = ddp_step(model, x, dy)
    create_cudagraphs()
    try:
        with counting_norm_calls() as calls:
            replay_dw = ddp_step(model, x, dy)
    finally:
        runners = layer.cudagraph_manager.cudagraph_runners
        graphs = [(r.fwd_graph is not None, r.bwd_graph is not None) for r in runners]
        reset_cuda_graphs()
    return dict(dw=replay_dw, eager_dw=eager_dw, python_norm_calls_in_replay=len(calls),
                graphs=graphs, grad_scale=layer.self_attention.out_norm_weight_grad_scale)


def run_rank(rank: int, tp_size: int, device: torch.device, cuda_graphs: bool) -> dict:
    """Every case of the module docstring on this rank; returns {case: dict(dw=..., ...)}."""
    from core.testing.gdn import build_gdn_layer, layer_inputs, randomize_norm_weights

    _parallel(1)
    reference = build_gdn_layer(layer_config(1), seed=SEED).to(device)
    randomize_norm_weights(reference)
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()
             if isinstance(v, torch.Tensor)}
    x, dy = layer_inputs(SEQ, BATCH, reference.config.hidden_size, seed=3, device=device)
    results = {"tp1": dict(dw=ddp_step(wrap_ddp(reference), x, dy).cpu(), grad_scale=1.0)}

    for name, sp in (("tp2-sp", True), ("tp2", False)):
        _parallel(tp_size)
        config = layer_config(tp_size, sequence_parallel=sp)
        layer = _layer(config, shard_layer_state(state, config, rank, tp_size), device)
        xs, dys = (x.chunk(tp_size)[rank], dy.chunk(tp_size)[rank]) if sp else (x, dy)
        results[name] = dict(dw=ddp_step(wrap_ddp(layer), xs, dys).cpu(),
                             grad_scale=layer.self_attention.out_norm_weight_grad_scale)
    if cuda_graphs:
        try:
            graphed = _cuda_graph_step(state, rank, tp_size, x, dy, device)
        except Exception:  # recorded, so that the eager cases are still reported
            import traceback

            results["tp2-cuda-graph"] = {"error": traceback.format_exc()}
        else:
            results["tp2-cuda-graph"] = {k: (v.cpu() if torch.is_tensor(v) else v)
                                         for k, v in graphed.items()}
    return results


def spawn_worker(rank: int, tp_size: int, init_file: str, out_dir: str, cuda_graphs: bool) -> None:
    """torch.multiprocessing.spawn entry: NCCL on GPU ``rank`` when CUDA is there, else gloo
    with the CPU shims (parallel_state is set up per case by ``run_rank``)."""
    from core.testing.parallel import init_world, save_rank_results

    if not torch.cuda.is_available():
        from core.testing.cpu import install_cpu_shims

        install_cpu_shims(training=True)
        torch.set_num_threads(1)  # several ranks share few cores
    device = init_world(rank, tp_size, init_file)
    if cuda_graphs:
        # megatron's deterministic_mode rule is not capturable; every case of the run (TP 1
        # included) takes the same capturable rule.
        import megatron.core.ssm.gated_delta_net.gdn as gdn

        from core.testing.gdn import recurrent_gated_delta_rule

        gdn.torch_chunk_gated_delta_rule = recurrent_gated_delta_rule
    save_rank_results(lambda: run_rank(rank, tp_size, device, cuda_graphs), out_dir, rank,
                      graphs_captured_nccl=cuda_graphs)
