#!/usr/bin/env python
"""Pretrain a small Qwen3-Next-style hybrid GPT (Gated DeltaNet + attention) with megatron-core,
with the fused GDN output gated norm switched on or off.

``--gdn-pre-gated-delta-rule-fusion`` also turns on the fusion before the gated delta rule
(``TransformerConfig.gdn_pre_gated_delta_rule_fusion``; off by default) in every run, --compare's
included: the runs then differ in the output norm only.

    bash tools/setup_venv.sh && .venv/bin/python examples/pretrain_gdn.py --compare

Megatron pieces, as a Megatron user wires them: ``GPTModel`` with the hybrid block spec of
``core.models.gdn_specs`` (GDN layers, an attention layer every ``--linear-attention-freq``
layers), ``Float16Module`` for bf16, ``DistributedDataParallel``, ``get_megatron_optimizer``
(Adam) with ``OptimizerParamScheduler`` (warm-up + cosine), ``finalize_model_grads`` once per
step. Data: the byte-tokenised corpus under examples/data (nothing is downloaded).

Without a GPU it runs on the CPU: Triton kernels in the interpreter (TRITON_INTERPRET=1, set
below before anything imports triton), the no-GPU shims of ``core.testing.cpu`` (the one module
that holds them, layer and training level: ``install_cpu_shims(training=True)``), gloo, and
``deterministic_mode=True`` (megatron's torch chunk path: FLA's chunk kernel does not run in the
interpreter). Two CPU runs of one command repeat bit for bit: a fixed intra-op thread count
(``--cpu-threads``) and torch's deterministic algorithms, both printed in the setup line. With a
GPU: NCCL, FLA's kernels and bigger defaults.

Tensor parallelism: ``--tp N`` spawns N processes (torch.multiprocessing), or run it under
``torchrun --nproc-per-node N`` (world size = tp x dp). docs/pretraining.md has the details.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import os
import re
import shutil
import sys
import tempfile
import time
import warnings

import torch

HAS_CUDA = torch.cuda.is_available()
# As megatron's launch scripts do (ordering of TP/SP communication and compute kernels).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
if not HAS_CUDA:
    # Must happen before the first `import triton` anywhere (core.fusions, FLA, megatron).
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import pretrain_data  # noqa: E402  (examples/, after the environment is set)
import pretrain_report  # noqa: E402

# Model sizes: (CPU default, GPU default). Any of them can be overridden on the command line.
# The GPU default's GDN layer has Qwen3-Next's shapes (hidden 2048, 16 key / 32 value heads of
# 128), so the layer GPU check and this run share FLA's autotuned kernels.
SIZES = {
    "hidden_size": (64, 2048),
    "num_layers": (4, 8),
    "ffn_hidden_size": (192, 5632),
    "num_attention_heads": (4, 16),
    "num_query_groups": (2, 2),
    "kv_channels": (16, 128),
    "linear_num_key_heads": (2, 16),
    "linear_num_value_heads": (4, 32),
    "linear_key_head_dim": (16, 128),
    "linear_value_head_dim": (16, 128),
    "seq_length": (128, 2048),
    "micro_batch_size": (4, 4),
    "steps": (250, 300),
}


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None)" where the help says it
        if action.default in (None, False, argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    g = p.add_argument_group("the fusions")
    g.add_argument("--fused-gated-norm", action=argparse.BooleanOptionalAction, default=True,
                   help="TransformerConfig.fused_gated_norm: the fused GDN output gated norm")
    g.add_argument("--gdn-pre-gated-delta-rule-fusion", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="TransformerConfig.gdn_pre_gated_delta_rule_fusion: the fusion before "
                        "the gated delta rule (conv1d + SiLU, q/k L2 norm, g and beta), in "
                        "every run (--compare's too)"),
    g.add_argument("--compare", action="store_true",
                   help="train with the flag off, then on (then the noise-floor run), same data "
                        "and seed; summary table + PNG")
    g.add_argument("--noise-floor", action=argparse.BooleanOptionalAction, default=True,
                   help="with --compare, a third run: flag off with the GDN out_norm weights "
                        "nudged by one ulp, to show how far any last-bit change drifts")
    g.add_argument("--paired-check-every", type=int, default=25,
                   help="with --compare: every N steps of the flag-off run, also run the step's "
                        "forward/backward with the fused path on the SAME weights and batch and "
                        "record the loss and gradient differences (0: never)")
    g.add_argument("--recompute-norm", action="store_true",
                   help="selective recompute of the GDN output norm "
                        "(recompute_granularity='selective', recompute_modules=['gdn_norm_out'])")
    g = p.add_argument_group("parallelism and precision")
    g.add_argument("--tp", type=int, default=1, help="tensor-model-parallel size")
    g.add_argument("--dp", type=int, default=1,
                   help="data-parallel size when spawning (under torchrun: world size / tp)")
    g.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism (TP>1)")
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 params/activations, fp32 main params (default: on with a GPU, "
                        "off on the CPU)")
    g.add_argument("--jit-fuser", action=argparse.BooleanOptionalAction, default=True,
                   help="megatron's jit_fuser (torch.compile of the unfused GDN norm, as "
                        "megatron ships it) on a GPU; --no-jit-fuser gives the eager unfused "
                        "path, the exact reference of the numerics contract. Always off on the "
                        "CPU")
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads per process on the CPU (default: 2 // number of "
                        "processes, at least 1). A fixed number, not the machine's core count: "
                        "how a reduction is split over threads decides its rounding")
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="config.deterministic_mode (megatron's torch GDN chunk path); forced on "
                        "the CPU, off by default on a GPU (FLA's kernels)")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None, help="default: CPU 4 / GPU 4")
    g.add_argument("--num-micro-batches", type=int, default=1,
                   help="gradient-accumulation micro-batches per step")
    g.add_argument("--seq-length", type=int, default=None, help="default: CPU 128 / GPU 2048")
    g.add_argument("--steps", type=int, default=None, help="default: CPU 250 / GPU 300")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--lr", type=float, default=None, help="peak LR (default: CPU 3e-3, GPU 1e-3)")
    g.add_argument("--min-lr", type=float, default=None, help="default: lr / 10")
    g.add_argument("--warmup-steps", type=int, default=None, help="default: steps / 10")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--eval-batches", type=int, default=4, help="held-out batches at the end")
    g = p.add_argument_group("model (defaults: small on the CPU, bigger on a GPU)")
    for name, (cpu, gpu) in SIZES.items():
        if name in ("seq_length", "micro_batch_size", "steps"):
            continue
        g.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"default: CPU {cpu} / GPU {gpu}")
    g.add_argument("--linear-attention-freq", type=int, default=4,
                   help="an attention layer every N layers, GDN otherwise (N > num layers: "
                        "GDN only)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=os.path.join("runs", "pretrain_gdn"),
                   help="output folder: summary.txt, losses.csv, loss_curves.png, run_*.json")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    col = 1 if HAS_CUDA else 0
    for name, values in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, values[col])
    # Every count is checked before anything divides by it or builds a model from it.
    for name in ("tp", "dp", "steps", "num_micro_batches", "linear_attention_freq",
                 *SIZES):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("eval_batches", "paired_check_every"):  # 0: none
        if getattr(args, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    train, held_out = pretrain_data.load_corpus()
    splits = [("training", len(train))]
    if args.eval_batches:
        splits.append(("held-out", len(held_out)))
    for split, tokens in splits:  # a window is seq_length + 1 tokens, its start in [0, high)
        if args.seq_length + 2 > tokens:
            raise SystemExit(f"--seq-length must be at most {tokens - 2} (the {split} split of the "
                             f"corpus has {tokens} tokens), got {args.seq_length}")
    if args.num_attention_heads % args.num_query_groups:
        raise SystemExit(f"--num-attention-heads {args.num_attention_heads} must be a multiple "
                         f"of --num-query-groups {args.num_query_groups}")
    if args.sequence_parallel and args.seq_length % args.tp:
        raise SystemExit(f"--sequence-parallel splits the sequence over the TP ranks: "
                         f"--seq-length {args.seq_length} must be divisible by --tp {args.tp}")
    if args.bf16 is None:
        args.bf16 = HAS_CUDA
    if args.deterministic is None:
        args.deterministic = not HAS_CUDA
    if not HAS_CUDA:
        args.jit_fuser = False
    if HAS_CUDA and args.cpu_threads is not None:
        raise SystemExit("--cpu-threads applies to CPU runs only (no GPU visible)")
    if not HAS_CUDA:
        if args.cpu_threads is None:
            world_size = int(os.environ.get("WORLD_SIZE", args.tp * args.dp))
            args.cpu_threads = max(1, 2 // world_size)
        if args.cpu_threads < 1:
            raise SystemExit(f"--cpu-threads must be >= 1, got {args.cpu_threads}")
    if not HAS_CUDA and not args.deterministic:
        raise SystemExit("--no-deterministic needs a GPU: FLA's chunk kernel does not run in the "
                         "Triton interpreter")
    if args.lr is None:
        args.lr = 1e-3 if HAS_CUDA else 3e-3
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    if args.warmup_steps is None:
        args.warmup_steps = pretrain_report.default_warmup_steps(args.steps)
    if not 0 <= args.warmup_steps < args.steps:  # megatron's scheduler decays after the warm-up
        raise SystemExit(f"--warmup-steps must be >= 0 and < --steps {args.steps}, "
                         f"got {args.warmup_steps}")
    if args.sequence_parallel and args.tp == 1:
        raise SystemExit("--sequence-parallel needs --tp > 1")
    if (HAS_CUDA and "LOCAL_RANK" not in os.environ
            and args.tp * args.dp > torch.cuda.device_count()):
        raise SystemExit(f"--tp {args.tp} x --dp {args.dp} needs {args.tp * args.dp} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    return args


def setup_line(args: argparse.Namespace, world_size: int) -> str:
    kinds = ["attn" if (i + 1) % args.linear_attention_freq == 0 else "gdn"
             for i in range(args.num_layers)]
    dev = (torch.cuda.get_device_name() if HAS_CUDA else
           f"CPU (Triton interpreter, gloo, {args.cpu_threads} intra-op thread"
           f"{'s' if args.cpu_threads > 1 else ''}/process, torch deterministic algorithms)")
    return (f"{dev}; layers {'/'.join(kinds)}, hidden {args.hidden_size}, GDN heads "
            f"{args.linear_num_key_heads}k/{args.linear_num_value_heads}v x "
            f"{args.linear_key_head_dim}/{args.linear_value_head_dim}; seq {args.seq_length}, "
            f"micro-batch {args.micro_batch_size} x {args.num_micro_batches}, "
            f"TP {args.tp}{' +SP' if args.sequence_parallel else ''}, DP {world_size // args.tp}; "
            f"{'bf16' if args.bf16 else 'fp32'}; fusion before the gated delta rule "
            f"{'on' if args.gdn_pre_gated_delta_rule_fusion else 'off'}; recompute-norm "
            f"{'on' if args.recompute_norm else 'off'}; deterministic_mode "
            f"{'on' if args.deterministic else 'off'}; megatron jit_fuser "
            f"{'torch.compile' if args.jit_fuser else 'off'}; seed {args.seed}; "
            f"{args.steps} steps")


# ----------------------------------------------------------------------------------------------
# Megatron model, optimizer, one run
# ----------------------------------------------------------------------------------------------


def padded_vocab_size(tp: int, divisible_by: int = 128) -> int:
    multiple = divisible_by * tp
    return int(math.ceil(pretrain_data.VOCAB_SIZE / multiple) * multiple)


def build_config(args: argparse.Namespace, fused: bool):
    import torch.nn.functional as F

    from core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        # Qwen3-Next style: RMSNorm, SwiGLU, no biases, QK-norm, hybrid GDN/attention.
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=args.linear_attention_freq,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=args.linear_key_head_dim,
        linear_value_head_dim=args.linear_value_head_dim,
        linear_num_key_heads=args.linear_num_key_heads,
        linear_num_value_heads=args.linear_num_value_heads,
        # the flags, and selective recompute of the GDN output norm
        fused_gated_norm=fused,
        gdn_pre_gated_delta_rule_fusion=args.gdn_pre_gated_delta_rule_fusion,
        recompute_granularity="selective" if args.recompute_norm else None,
        recompute_modules=["gdn_norm_out"] if args.recompute_norm else None,
        # parallelism, precision
        tensor_model_parallel_size=args.tp,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
        deterministic_mode=args.deterministic,
        use_cpu_initialization=not HAS_CUDA,
        # torch paths everywhere (no TE, no apex, nothing JIT-compiled on the CPU)
        bias_dropout_fusion=HAS_CUDA,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def build_model(args: argparse.Namespace, config):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from core.models.gdn_specs import get_gdn_hybrid_block_spec

    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gdn_hybrid_block_spec(config),
        vocab_size=padded_vocab_size(args.tp),
        max_sequence_length=args.seq_length,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    if HAS_CUDA:
        model.cuda(torch.cuda.current_device())
    if args.bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=False,
        check_for_nan_in_grad=True,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_optimizer(args: argparse.Namespace, model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=False,
    )
    with _cpu_optimizer_context():
        optimizer = get_megatron_optimizer(opt_config, [model])
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.warmup_steps,
        lr_decay_steps=args.steps,
        lr_decay_style="cosine",
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def _cpu_optimizer_context():
    if HAS_CUDA:
        return contextlib.nullcontext()
    from core.testing.cpu import cpu_tensor_types

    return cpu_tensor_types()


def out_norm_params(model) -> list[torch.Tensor]:
    """The GDN output-norm weights (one [value_head_dim] vector per GDN layer)."""
    return [p for n, p in model.named_parameters() if ".out_norm." in n]


def out_norm_tp_max_diff(model) -> float:
    """Max |w_rank - w_rank0| of the GDN out_norm weights over the tensor-parallel group (0.0 means
    identical on every TP rank). Collective: every rank must call it."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp = torch.distributed.get_world_size(group)
    flat = torch.cat([p.detach().float().reshape(-1) for p in out_norm_params(model)])
    gathered = [torch.empty_like(flat) for _ in range(tp)]
    torch.distributed.all_gather(gathered, flat, group=group)
    return max(float((g - gathered[0]).abs().max()) for g in gathered)


def loss_of(output: torch.Tensor, batch) -> torch.Tensor:
    """Mean next-byte cross-entropy of a micro-batch (output: per-token losses [b, s])."""
    mask = batch.loss_mask
    return (output.float() * mask).sum() / mask.sum()


def gdn_modules(model) -> list:
    from core.ssm.gated_delta_net import GatedDeltaNet

    return [m for m in model.modules() if isinstance(m, GatedDeltaNet)]


def forward_backward(model, optimizer, micro) -> torch.Tensor:
    """Forward and backward of one step's micro-batches into DDP's grad buffers (the grads are
    finalized by the caller); returns the mean loss (detached)."""
    step_loss = None
    for i, b in enumerate(micro):
        sync_ctx = model.no_sync() if i < len(micro) - 1 else contextlib.nullcontext()
        with sync_ctx:
            output = model(b.tokens, b.position_ids, None, labels=b.labels)
            loss = loss_of(output, b)
            part = loss.detach() / len(micro)
            step_loss = part if step_loss is None else step_loss + part
            optimizer.scale_loss(loss / len(micro)).backward()
    return step_loss


def paired_check(model, optimizer, micro) -> dict:
    """Same weights, same batch: loss and finalized grads of four passes, the GDN modules'
    switch flipped for this one step and restored (the grad buffers are left zeroed):
    unfused as configured (the reference), unfused again (the run-to-run floor of everything
    else, e.g. nondeterministic kernels), unfused eager (megatron's norm code as written, with
    the intermediate rounding that torch.compile drops), fused. Returns each pass's loss
    difference to the reference and ||g - g_ref|| / ||g_ref|| over all parameters (all ranks)
    and over the out_norm weights alone; the fused pass's under the original keys; and how many
    fused norm calls each pass made (this rank; only the fused pass makes any)."""
    from megatron.core.distributed import finalize_model_grads

    from core.testing.gdn import counting_fused_norm_calls, eager_megatron_gdn

    modules = gdn_modules(model)
    saved = [m.fused_gated_norm for m in modules]
    passes = {"off": (False, contextlib.nullcontext), "repeat": (False, contextlib.nullcontext),
              "eager": (False, eager_megatron_gdn), "on": (True, contextlib.nullcontext)}
    losses, grads, fused_calls = {}, {}, {}
    try:
        for name, (fused, context) in passes.items():
            for m in modules:
                m.fused_gated_norm = fused
            model.zero_grad_buffer()
            optimizer.zero_grad()
            with context(), counting_fused_norm_calls() as calls:
                losses[name] = float(forward_backward(model, optimizer, micro))
            fused_calls[name] = len(calls)
            finalize_model_grads([model])
            grads[name] = {n: p.main_grad.detach().float().clone()
                           for n, p in model.named_parameters() if p.requires_grad}
    finally:
        for m, f in zip(modules, saved):
            m.fused_gated_norm = f
        model.zero_grad_buffer()
        optimizer.zero_grad()
    # (pass, reference, key prefix): the fused pass's numbers keep the original keys.
    pairs = (("repeat", "off", "repeat_"), ("eager", "off", "eager_"), ("on", "off", ""),
             ("on", "eager", "on_vs_eager_"))
    dev = next(iter(grads["off"].values())).device
    sums = torch.zeros(len(pairs), 4, dtype=torch.float64, device=dev)
    for i, (name, ref_name, _) in enumerate(pairs):
        for n, ref in grads[ref_name].items():
            d2 = (grads[name][n] - ref).double().square().sum()
            g2 = ref.double().square().sum()
            norm = 1.0 if ".out_norm." in n else 0.0
            sums[i] += torch.stack([d2, g2, d2 * norm, g2 * norm])
    # Replicated parameters are counted once per rank: fine for a ratio.
    torch.distributed.all_reduce(sums)
    rel = (sums[:, [0, 2]] / sums[:, [1, 3]].clamp_min(1e-300)).sqrt().tolist()
    result = {"loss_off": losses["off"], "fused_norm_calls": fused_calls}
    for (name, ref_name, prefix), (all_rel, norm_rel) in zip(pairs, rel):
        result.update({f"{prefix}dloss": losses[name] - losses[ref_name],
                       f"{prefix}grad_rel": all_rel, f"{prefix}out_norm_grad_rel": norm_rel})
    return result


def nudge_out_norm_weights(model) -> None:
    """Moves every GDN out_norm weight up by one ulp of its dtype (1.0 -> 1.0000001 in fp32,
    1.0078125 in bf16): a last-bit perturbation at the place the fusion touches."""
    with torch.no_grad():
        for p in out_norm_params(model):
            p.add_(p.abs() * torch.finfo(p.dtype).eps)


def build_run(args: argparse.Namespace, fused: bool, nudge: bool = False) -> tuple:
    """The model (built from scratch, the same seed every time), its optimizer and LR scheduler,
    with the config hooks megatron's training loop sets. nudge: perturb the out_norm weights by
    one ulp first (the noise-floor run)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed, force_reset_rng=True)
    config = build_config(args, fused)
    model = build_model(args, config)
    if nudge:
        nudge_out_norm_weights(model)  # before the optimizer copies fp32 main params
    optimizer, scheduler = build_optimizer(args, model)
    # What megatron's training loop sets on the config (the pipeline schedules read them).
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, micro) -> tuple[float, "float | None", int]:
    """One optimizer step on ``micro`` (this rank's micro-batches): (the loss averaged over
    data-parallel ranks, the grad norm, how many fused norms this rank ran)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    from core.testing.gdn import counting_fused_norm_calls

    model.zero_grad_buffer()
    optimizer.zero_grad()
    with counting_fused_norm_calls() as calls:
        step_loss = forward_backward(model, optimizer, micro)
    finalize_model_grads([model])  # DP all-reduce, TP reduction of replicated norm grads
    with _cpu_optimizer_context():
        update_ok, grad_norm, _ = optimizer.step()
    if update_ok:
        scheduler.step(increment=1)
    dp_size = parallel_state.get_data_parallel_world_size()
    if dp_size > 1:
        torch.distributed.all_reduce(step_loss, group=parallel_state.get_data_parallel_group())
        step_loss /= dp_size
    return float(step_loss), grad_norm, len(calls)  # float() syncs the device


def train_one(args: argparse.Namespace, fused: bool, label: str, world_size: int,
              nudge: bool = False, paired_every: int = 0) -> dict:
    """Builds the model (:func:`build_run`) and trains ``args.steps`` steps.
    nudge: perturb the out_norm weights by one ulp before training (the noise-floor run).
    paired_every: every N steps, run :func:`paired_check` on the step's weights and batch first."""
    from megatron.core import parallel_state

    rank = torch.distributed.get_rank()
    tp = args.tp
    dp_size = parallel_state.get_data_parallel_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if HAS_CUDA else torch.device("cpu")
    model, optimizer, scheduler = build_run(args, fused, nudge)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[{label}] {type(model.module).__name__} params/rank {n_params:,}, "
              f"GDN out_norm weights: {len(out_norm_params(model))}", flush=True)

    train, held_out = pretrain_data.load_corpus()
    batches = pretrain_data.train_batches(
        train, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        num_micro_batches=args.num_micro_batches, dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=dp_size, seed=args.seed, device=device)
    tokens_per_step = args.seq_length * args.micro_batch_size * args.num_micro_batches * dp_size

    losses, step_times, grad_norms, lrs, tp_diffs, paired = [], [], [], [], [], []
    fused_norm_calls = 0  # this rank's, in the training steps
    bar = _progress_bar(args, label) if rank == 0 and not args.no_progress else None
    model.train()
    for step in range(1, args.steps + 1):
        micro = next(batches)
        if paired_every and (step == 1 or step % paired_every == 0):
            paired.append(dict(step=step, **paired_check(model, optimizer, micro)))
        t0 = time.perf_counter()
        loss_value, grad_norm, calls = train_step(model, optimizer, scheduler, micro)
        step_times.append(time.perf_counter() - t0)
        fused_norm_calls += calls
        if tp > 1:
            tp_diffs.append(out_norm_tp_max_diff(model))
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"[{label}] non-finite loss {loss_value} at step {step}")
        losses.append(loss_value)
        grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
        lrs.append(optimizer.param_groups[0]["lr"])
        if bar is not None:
            recent = step_times[-10:]
            postfix = {"loss": f"{loss_value:.4f}",
                       "tok/s": f"{tokens_per_step * len(recent) / sum(recent):,.0f}"}
            if tp > 1:
                postfix["tp_w_diff"] = f"{tp_diffs[-1]:.0e}" if tp_diffs[-1] else "0"
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()

    held_out_loss = evaluate(args, model, held_out, device)
    result = {
        "label": label,
        "fused_gated_norm": fused,
        "gdn_pre_gated_delta_rule_fusion": args.gdn_pre_gated_delta_rule_fusion,
        "gdn_layers": len(gdn_modules(model)),
        "fused_norm_calls": fused_norm_calls,
        "out_norm_nudged": nudge,
        "steps": args.steps,
        "losses": losses,
        "step_times": step_times,
        "grad_norms": grad_norms,
        "lrs": lrs,
        "tokens_per_step": tokens_per_step,
        "held_out_loss": held_out_loss,
        "tp_out_norm_max_diff": tp_diffs if tp > 1 else None,
        "paired_checks": paired,
        # On the CPU the kernels run in the Triton interpreter: the report does not call its
        # times the flag's speed.
        "triton_interpreter": not HAS_CUDA,
        "args": {k: v for k, v in vars(args).items()},
        "world_size": world_size,
    }
    del model, optimizer, scheduler
    gc.collect()
    if HAS_CUDA:
        torch.cuda.empty_cache()
    return result


class _PlainProgress:
    """Stand-in for tqdm when it is not installed: a line every 10 % of the steps."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self.postfix = total, desc, 0, {}
        self.every = max(1, total // 10)

    def set_postfix(self, postfix: dict, refresh: bool = False) -> None:
        self.postfix = postfix

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            extra = ", ".join(f"{k}={v}" for k, v in self.postfix.items())
            print(f"{self.desc}: step {self.n}/{self.total} {extra}", flush=True)

    def close(self) -> None:
        pass


def _progress_bar(args: argparse.Namespace, label: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(args.steps, label)
    return tqdm(total=args.steps, desc=label, dynamic_ncols=True, mininterval=0.5,
                file=sys.stdout)


@torch.no_grad()
def evaluate(args: argparse.Namespace, model, held_out: torch.Tensor, device) -> float:
    if args.eval_batches <= 0:
        return float("nan")
    model.eval()
    batches = pretrain_data.held_out_batches(
        held_out, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        num_batches=args.eval_batches, device=device)
    total = sum(float(loss_of(model(b.tokens, b.position_ids, None, labels=b.labels), b))
                for b in batches) / len(batches)
    model.train()
    return total


# ----------------------------------------------------------------------------------------------
# Processes
# ----------------------------------------------------------------------------------------------


def worker(rank: int, world_size: int, args: argparse.Namespace, init_method: str) -> None:
    """One rank: process group, parallel_state, the run(s), and (rank 0) the report."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*absl.logging is not installed.*")
    if HAS_CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        if not args.jit_fuser:
            _disable_megatron_jit_fuser()
    else:
        from core.testing.cpu import install_cpu_shims

        install_cpu_shims(training=True)  # layer + training shims, l2norm speed stand-in
        # Repeatable bits on the CPU. The thread count fixes how reductions are split. Torch's
        # default index_put_(accumulate=True) with several threads adds with atomics in whatever
        # order the threads run (so the order follows the machine's load); it is the backward
        # of megatron's deterministic_mode embedding lookup (weight[tokens]). Deterministic
        # algorithms make it add in index order.
        torch.set_num_threads(args.cpu_threads)
        torch.use_deterministic_algorithms(True)
    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron.core import parallel_state

    torch.distributed.init_process_group(
        "nccl" if HAS_CUDA else "gloo", init_method=init_method, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(minutes=10))
    if world_size % args.tp:
        raise SystemExit(f"world size {world_size} is not a multiple of --tp {args.tp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    setup = setup_line(args, world_size)
    if rank == 0:
        print(setup, flush=True)

    if args.compare:
        plan = [("fused_gated_norm=off", False, False, args.paired_check_every),
                ("fused_gated_norm=on", True, False, 0)]
        if args.noise_floor:
            plan.append(("off, out_norm w +1ulp", False, True, 0))
    else:
        plan = [(f"fused_gated_norm={'on' if args.fused_gated_norm else 'off'}",
                 args.fused_gated_norm, False, 0)]
    runs = []
    try:
        for label, fused, nudge, paired_every in plan:
            runs.append(train_one(args, fused, label, world_size, nudge=nudge,
                                  paired_every=paired_every))
        if rank == 0:
            title = "examples/pretrain_gdn.py: " + setup
            table = pretrain_report.write_outputs(
                args.out, runs, setup, _wrap(title, 110),
                pretrain_report.run_environment(getattr(args, "command_line", None)))
            print("\n" + table, flush=True)
            print(f"\nwrote {args.out}/summary.txt, losses.csv, loss_curves.png, run_*.json",
                  flush=True)
        torch.distributed.barrier()
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _disable_megatron_jit_fuser() -> None:
    """megatron's jit_fuser decorates at import time: switch it off and unwrap what was already
    compiled (the GDN norm/gate helpers), so the unfused path runs eagerly."""
    import megatron.core.jit as mjit

    from core.testing.gdn import unwrap_jit_gdn_methods

    mjit.disable_jit_fuser()
    unwrap_jit_gdn_methods()


def _wrap(text: str, width: int) -> str:
    words, lines, cur = text.split(" "), [], ""
    for w in words:
        if len(cur) + len(w) + 1 > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    return "\n".join(lines + [cur])


def _spawn_entry(rank: int, world_size: int, args: argparse.Namespace, init_method: str) -> None:
    worker(rank, world_size, args, init_method)


# The config fields build_config takes straight from an option of this script.
OPTION_OF_FIELD = {
    **{field: "--" + field.replace("_", "-") for field in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
        "kv_channels", "linear_attention_freq", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "sequence_parallel")},
    "tensor_model_parallel_size": "--tp",
}


def check_config(args: argparse.Namespace) -> None:
    """megatron's own rules of the model settings (head counts against TP and each other, ...),
    in this process, before any rank is spawned; the message names the options of the fields
    it mentions."""
    try:
        build_config(args, args.fused_gated_norm)
    except (ValueError, AssertionError, TypeError) as exc:
        options = [OPTION_OF_FIELD[word] for word in dict.fromkeys(re.findall(r"[a-z_]+", str(exc)))
                   if word in OPTION_OF_FIELD]
        named = f" [options: {', '.join(options)}]" if options else ""
        raise SystemExit(f"megatron refuses these model settings: {exc}{named}") from None


def main(argv=None) -> None:
    args = resolve_defaults(build_parser().parse_args(argv))
    check_config(args)
    args.command_line = [__file__, *(sys.argv[1:] if argv is None else argv)]  # for the report
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://")
        rank0 = int(os.environ["RANK"]) == 0
    else:
        world_size = args.tp * args.dp
        rdv_dir = tempfile.mkdtemp(prefix="pretrain_gdn_rdv_")
        init_method = f"file://{os.path.join(rdv_dir, 'store')}"
        try:
            if world_size == 1:
                worker(0, 1, args, init_method)
            else:
                import torch.multiprocessing as mp

                mp.spawn(_spawn_entry, args=(world_size, args, init_method), nprocs=world_size,
                         join=True)
        finally:
            shutil.rmtree(rdv_dir, ignore_errors=True)
        rank0 = True
    if rank0:
        print(f"total wall time {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
