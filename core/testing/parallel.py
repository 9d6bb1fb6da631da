"""The layout matrix: GDN models trained one step under a parallel layout and compared with the
same model at TP 1 / CP 1 / one pipeline stage / EP 1 (test-side only; never imported by the
library).

Models (fp32, tiny; :data:`GDN_SIZES`):
  * ``"gdn"``: one ``core.ssm.GatedDeltaNet`` from ``core.models.get_gdn_module_spec(False)``;
  * ``"gdn-layernorm"``: the same with ``normalization="LayerNorm"``, whose output norm has a
    bias (flag off only: the flag requires an RMSNorm);
  * ``"gpt"``: a ``GPTModel`` over ``get_gdn_hybrid_block_spec`` (4 layers: GDN, GDN, GDN,
    softmax attention), for pipeline parallelism (with virtual stages: one model chunk per
    stage, megatron's interleaved schedule);
  * ``"gpt-moe"``: the same with MoE MLPs in every layer (:data:`MOE_SIZES`, as Qwen3-Next),
    for expert parallelism (``Layout.ep``; experts split over ``Layout.etp`` ranks; tokens
    sent to them by megatron's all-to-all or all-gather dispatcher, ``Layout.token_dispatcher``);
  * ``"hybrid"``: a ``HybridModel`` over ``use_fused_gdn`` of megatron's hybrid stack spec, its
    TE modules replaced by megatron-core's (``core.models.te_to_local``), with the
    pattern :data:`HYBRID_PATTERN`: GDN layers in the decoder and in a multi-token prediction
    depth (over pipeline stages: the decoder split at '|' into PP x VP equal segments,
    :func:`hybrid_pattern`; the MTP depth on the last).

``Layout.pre_fusion`` turns ``config.gdn_pre_gated_delta_rule_fusion`` on: every GDN layer runs
the fused pre-recurrence region (core.ssm.pre_gated_delta_rule_forward); the reference stays the
model without it (same weights).

Every rank of a layout, for ``config.fused_gated_norm`` on and off (:func:`run_case`):
  builds the model for its coordinates and loads its shard of the reference weights; wraps it in
  megatron's ``DistributedDataParallel`` (or Megatron-FSDP's ``FullyShardedDataParallel``);
  builds megatron's optimizer (``get_megatron_optimizer``, Adam; the distributed optimizer where
  the layout says so); runs megatron's schedule (``get_forward_backward_func``) on its shard of
  the reference batch with the stock ``finalize_model_grads`` as
  ``config.finalize_model_grads_func``; records every parameter's ``main_grad`` next to the
  reference gradient sharded the same way (the distributed optimizer: the range the rank owns);
  steps the optimizer; repeats schedule and step ``Layout.steps`` times in all (the later
  steps' gradients recorded too) and records every parameter.

The reference is :func:`run_case` of the same code at world size 1 (:func:`make_reference`).
The test process checks the records with :func:`grad_mismatches` (every parameter's gradient
against the sharded reference) and :func:`replica_mismatches` (after the step: bit-identical
parameters on every rank holding the same shard; every rank holding a replicated parameter such
as the GDN out_norm weight holds the same bits).

Loss: megatron's legacy ``(loss, report)`` form, ``sum(output * weight)`` for the GDN module
(a fixed random ``weight``), the summed per-token cross entropy for the GPT and hybrid models.
The schedule multiplies it by the CP size and divides by the micro-batch count, DDP averages
over DP x CP: a rank's expected gradient is the reference gradient / DP (:func:`run_case`).

Data layouts: sbhd [S, B, H] for the GDN module (DP splits B; CP takes megatron's load-balanced
chunks, ``get_batch_on_this_cp_rank``; sequence parallelism splits S over TP), packed THD
(B = 1, several sequences, ``PackedSeqParams(qkv_format='thd')``; CP takes each sequence's
load-balanced chunks, :func:`thd_cp_indices`), token ids [B, S] for the GPT and hybrid models.

On the CPU (gloo) call ``core.testing.cpu.install_cpu_shims(training=True)`` and
``install_cpu_fla_stand_ins()`` first (:func:`layout_worker` does); on CUDA the same code runs
over NCCL with FLA's kernels.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import sys
import traceback
from functools import partial
from typing import NamedTuple, Optional

import torch

# hidden 32; 4 key heads and 8 value heads of 16 (split over TP 4, or TP 2 x CP 2); 4 attention
# heads of 8 in the GPT model's attention layer.
GDN_SIZES = dict(hidden_size=32, num_key_heads=4, num_value_heads=8, key_head_dim=16,
                 value_head_dim=16, num_attention_heads=4)
SEQ = 32          # divisible by 2 x CP x TP of every layout (load-balanced CP chunks, then SP)
BATCH = 2         # sbhd batch (DP 2 gives one sample per rank); GPT: one micro-batch per sample
PACKED_SEQLENS = (8, 12, 12)  # THD: three sequences, B = 1; each divisible by 2 x CP
GPT_LAYERS = 4    # linear_attention_freq 4: layers 0-2 GDN, layer 3 attention
# "hybrid": GDN, GDN, attention, MLP; one MTP depth of a GDN and an MLP layer
HYBRID_PATTERN = "GG*-/G-"
HYBRID_DECODER, HYBRID_MTP = HYBRID_PATTERN.split("/", 1)
# gpt-moe: 4 experts of 16 (2 per rank at EP 2), top-2 routing without a load-balancing loss
# and without dropping tokens; the token dispatcher is the layout's (Layout.token_dispatcher).
MOE_SIZES = dict(num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                 moe_router_load_balancing_type="none")
# megatron's MoE token dispatchers the harness runs: all-to-all (as Qwen3-Next trains with
# expert parallelism) and all-gather (megatron's default)
TOKEN_DISPATCHERS = ("alltoall", "allgather")
VOCAB = 64
LR = 1e-2
FP16_INITIAL_LOSS_SCALE = 2.0**10
# elements: with overlap_grad_reduce, every parameter closes its DDP bucket (one per parameter,
# so each gradient is reduced, and with overlap_param_gather each parameter gathered, on its own)
OVERLAP_BUCKET_SIZE = 1
# max |got - expected| / max |full reference gradient|, per parameter (docs/design.md).
FP32_TOLERANCE = 1e-5
# The GDN decay parameters' gradients are sums over tokens with heavy cancellation: at TP 1, a
# 1e-7 relative change of the weights moves them by up to 3.3e-5 in the GPT model and 1.9e-4 in
# the hybrid model's MTP layer (whose loss megatron scales by 0.1), and TP 2 (other summation
# orders) by up to 3.5e-5 and 2.0e-4. A wrong reduction (missing, doubled) is off by O(1).
DECAY_PARAM_TOLERANCE = 1e-3
DECAY_PARAMS = ("A_log", "dt_bias")
# fp16 layouts against the fp32 reference: fp16's own rounding (1e-3 to 1.6e-3 at TP 1 and 2,
# every parameter); a wrong reduction is still off by O(1).
FP16_TOLERANCE = 5e-3


def tolerance(name: str, fp16: bool = False) -> float:
    if fp16:
        return FP16_TOLERANCE
    return DECAY_PARAM_TOLERANCE if name.rsplit(".", 1)[-1] in DECAY_PARAMS else FP32_TOLERANCE


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parallel layout. ``world_size = tp * cp * pp * dp``; expert parallelism (``ep``,
    model "gpt-moe") and expert tensor parallelism (``etp``: experts split over that many ranks;
    1: not split) take their ranks from TP x DP, as megatron's do (each expert shard on
    tp * dp / (ep * etp) ranks)."""

    name: str
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    packed: bool = False                 # THD, B = 1 (FLA path: deterministic_mode off)
    distributed_optimizer: bool = False
    fsdp: bool = False                   # Megatron-FSDP (CUDA only)
    torch_fsdp2: bool = False            # megatron's torch FSDP2 wrapper (--use-torch-fsdp2)
    recompute: bool = False              # selective recompute of 'gdn_norm_out'
    full_recompute: bool = False         # megatron's full layer recompute (GPT models, uniform)
    micro_batches: int = 1               # the GDN module's batch in that many micro-batches
    overlap_grad_reduce: bool = False    # DDP's bucketed grad reduce overlapping the backward
    overlap_param_gather: bool = False   # the distributed optimizer's all-gather of the updated
                                         # parameters in the next forward (DDP's pre-hooks)
    average_in_collective: bool = False  # DDP divides by DP in the collective (ReduceOp.AVG)
    fp16: bool = False                   # fp16 parameters and megatron's dynamic loss scaler
    per_token_loss: bool = False         # calculate_per_token_loss: a (loss, tokens) sum, which
                                         # finalize_model_grads divides by the global token count
    steps: int = 1                       # training steps (the gradients of the first are compared
                                         # with the reference; later ones, with a twin layout's)
    model: str = "gdn"                   # one GatedDeltaNet ("gdn", "gdn-layernorm"), a GPTModel
                                         # ("gpt", "gpt-moe") or a HybridModel ("hybrid")
    ep: int = 1                          # expert parallelism ("gpt-moe")
    vp: int = 1                          # virtual pipeline stages per pipeline rank (GPT and
                                         # hybrid models)
    etp: int = 1                         # expert tensor parallelism ("gpt-moe")
    token_dispatcher: str = "alltoall"   # megatron's MoE token dispatcher ("gpt-moe")
    pre_fusion: bool = False             # gdn_pre_gated_delta_rule_fusion: the fused region
                                         # between in_proj and the recurrence in every GDN layer

    def __post_init__(self):
        if type(self.pre_fusion) is not bool:
            raise TypeError(f"Layout {self.name}: pre_fusion must be a bool, got "
                            f"{type(self.pre_fusion).__name__}")
        if self.model not in MODELS:
            raise ValueError(f"Layout.model must be one of {MODELS}, got {self.model!r}")
        if self.pp > 1 and self.single_gdn:
            raise ValueError(f"Layout {self.name}: pp > 1 needs a GPT or hybrid model (stages "
                             "of a model)")
        if not self.single_gdn and (self.cp > 1 or self.packed or BATCH % self.dp):
            raise ValueError(f"Layout {self.name}: the GPT and hybrid models run with TP, PP, EP "
                             f"and DP dividing their {BATCH} micro-batches")
        if (self.ep > 1 or self.etp > 1) and (self.model != "gpt-moe"
                                              or (self.tp * self.dp) % (self.ep * self.etp)):
            raise ValueError(f"Layout {self.name}: ep or etp > 1 needs model='gpt-moe' and "
                             "ep x etp dividing tp x dp")
        if self.token_dispatcher not in TOKEN_DISPATCHERS:
            raise ValueError(f"Layout {self.name}: token_dispatcher must be one of "
                             f"{TOKEN_DISPATCHERS}, got {self.token_dispatcher!r}")
        if self.vp > 1 and (self.pp == 1 or self.single_gdn
                            or self.decoder_layers % (self.pp * self.vp)):
            raise ValueError(f"Layout {self.name}: vp > 1 needs pp > 1, a GPT or hybrid model and "
                             f"pp x vp dividing its {self.decoder_layers} decoder layers")
        if self.packed and self.dp > 1:
            raise ValueError(f"Layout {self.name}: packed sequences have B = 1, so dp must be 1")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(f"Layout {self.name}: sequence_parallel needs tp > 1")
        if self.micro_batches > 1 and (not self.single_gdn or self.packed
                                       or (BATCH // self.dp) % self.micro_batches):
            raise ValueError(f"Layout {self.name}: micro_batches > 1 needs the GDN module's "
                             f"sbhd batch ({BATCH} // dp samples) to split into them")
        if self.torch_fsdp2 and (self.fsdp or self.overlap_grad_reduce
                                 or self.distributed_optimizer or not self.single_gdn):
            raise ValueError(f"Layout {self.name}: torch_fsdp2 wraps the GDN module alone, "
                             "without Megatron-FSDP, DDP's options or the distributed optimizer")
        if self.overlap_param_gather and not (self.distributed_optimizer
                                              and self.overlap_grad_reduce and self.steps > 1):
            raise ValueError(f"Layout {self.name}: overlap_param_gather needs the distributed "
                             "optimizer and overlap_grad_reduce (as megatron.training), and "
                             "steps > 1 (the gathered parameters are read by a later forward)")
        if self.per_token_loss and not self.single_gdn:
            raise ValueError(f"Layout {self.name}: per_token_loss is the GDN module's loss")
        if self.steps < 1:
            raise ValueError(f"Layout {self.name}: steps must be >= 1")
        if self.full_recompute and (not self.gpt or self.recompute):
            raise ValueError(f"Layout {self.name}: full_recompute needs a GPT model and no "
                             "selective recompute")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' and the GDN module's input dtype."""
        return torch.float16 if self.fp16 else torch.float32

    @property
    def single_gdn(self) -> bool:
        """The model is one GatedDeltaNet module (not a GPTModel or a HybridModel)."""
        return self.model in ("gdn", "gdn-layernorm")

    @property
    def decoder_layers(self) -> int:
        """The decoder layers of the GPT or hybrid model (0 for the GDN module)."""
        if self.single_gdn:
            return 0
        return len(HYBRID_DECODER) if self.model == "hybrid" else GPT_LAYERS

    @property
    def gpt(self) -> bool:
        """The model is a GPTModel ("gpt", "gpt-moe")."""
        return self.model in ("gpt", "gpt-moe")

    @property
    def flag_values(self) -> tuple:
        """The values of ``fused_gated_norm`` the layout runs (the flag refuses a LayerNorm)."""
        return (False,) if self.model == "gdn-layernorm" else (True, False)

    @property
    def data(self) -> str:
        """Which reference batch the layout runs: 'sbhd', 'thd' or 'tokens'."""
        return "tokens" if not self.single_gdn else ("thd" if self.packed else "sbhd")


MODELS = ("gdn", "gdn-layernorm", "gpt", "gpt-moe", "hybrid")
REFERENCE = {"gdn": Layout("reference"),
             "gdn-layernorm": Layout("reference-layernorm", model="gdn-layernorm"),
             "gpt": Layout("reference-gpt", model="gpt"),
             "gpt-moe": Layout("reference-gpt-moe", model="gpt-moe"),
             "hybrid": Layout("reference-hybrid", model="hybrid")}


def case_key(layout: Layout, fused: bool) -> str:
    """The case's name: the layout's, ``-pre-fusion`` where it runs the pre-recurrence fusion
    (so it never names the same layout without it), then the output norm flag."""
    pre = "-pre-fusion" if layout.pre_fusion else ""
    return f"{layout.name}{pre}-{'fused' if fused else 'unfused'}"


def reference_key(model: str, data: str, fused: bool) -> str:
    return f"{model}-{data}-{'fused' if fused else 'unfused'}"


# ----------------------------------------------------------------------------------------------
# Process groups
# ----------------------------------------------------------------------------------------------


def init_world(rank: int, world_size: int, init_file: str) -> torch.device:
    """Default process group: NCCL on CUDA (rank r on GPU r), gloo on the CPU. Returns the
    device."""
    if torch.cuda.is_available():
        # fp32 means fp32 in these comparisons (cuDNN's convolutions default to TF32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        kwargs = dict(backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        kwargs = dict(backend="gloo")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=120), **kwargs)
    return device


def init_layout(layout: Layout, seed: int = 1234) -> None:
    """megatron's parallel_state for ``layout`` in the current world, RNG reseeded
    (``core.testing.cpu.init_model_parallel_sizes``)."""
    from core.testing.cpu import init_model_parallel_sizes

    world = torch.distributed.get_world_size()
    if world != layout.world_size:
        raise ValueError(f"Layout {layout.name} needs {layout.world_size} ranks, world has {world}")
    init_model_parallel_sizes(tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                              etp=layout.etp, vp=layout.vp if layout.vp > 1 else None, seed=seed)


def coordinates() -> dict:
    from megatron.core import parallel_state as ps

    return dict(rank=torch.distributed.get_rank(), tp=ps.get_tensor_model_parallel_rank(),
                cp=ps.get_context_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                dp=ps.get_data_parallel_rank(), ep=ps.get_expert_model_parallel_rank(),
                etp=ps.get_expert_tensor_parallel_rank())


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def layout_config(layout: Layout, fused: bool):
    """The TransformerConfig of ``layout`` (fp32, :data:`GDN_SIZES`)."""
    from core.testing.gdn import gdn_config

    extra = {}
    if layout.recompute:
        extra.update(recompute_granularity="selective", recompute_modules=["gdn_norm_out"])
    if layout.full_recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    if layout.per_token_loss:
        extra.update(calculate_per_token_loss=True)
    if layout.model == "gdn-layernorm":
        extra.update(normalization="LayerNorm")
    if not layout.single_gdn:
        extra.update(num_layers=GPT_LAYERS, linear_attention_freq=4)
        if layout.pp > 1:
            extra.update(pipeline_dtype=torch.float32)
        if layout.vp > 1:
            extra.update(virtual_pipeline_model_parallel_size=layout.vp)
    if layout.model == "hybrid":  # the layers come from HYBRID_PATTERN
        extra.update(experimental_attention_variant=None, linear_attention_freq=None,
                     mtp_num_layers=1)
    if layout.pre_fusion:
        extra.update(gdn_pre_gated_delta_rule_fusion=True)
    if layout.model == "gpt-moe":
        extra.update(MOE_SIZES, moe_token_dispatcher_type=layout.token_dispatcher,
                     expert_model_parallel_size=layout.ep,
                     expert_tensor_parallel_size=layout.etp)
    return gdn_config(
        params_dtype=layout.dtype, fused_gated_norm=fused,
        tensor_model_parallel_size=layout.tp, context_parallel_size=layout.cp,
        pipeline_model_parallel_size=layout.pp, sequence_parallel=layout.sequence_parallel,
        # megatron's GDN refuses packed sequences in deterministic_mode (its torch chunk path)
        deterministic_mode=not layout.packed,
        **GDN_SIZES, **extra)


def _no_input_tensor(input_tensor) -> None:
    """``set_input_tensor`` of a single-stage module (the schedule calls it with None)."""


def vp_stages(layout: Layout) -> tuple:
    """The virtual pipeline stage of each of this rank's model chunks (None: no virtual stages,
    one chunk)."""
    return tuple(range(layout.vp)) if layout.vp > 1 else (None,)


def build_model(layout: Layout, config, seed: Optional[int] = None,
                vp_stage: Optional[int] = None) -> torch.nn.Module:
    """This rank's model: the GatedDeltaNet module, this pipeline stage of the GPT model
    (``vp_stage``: that virtual stage of it), or this pipeline stage of the hybrid model."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.enums import ModelType

    from core.models import get_gdn_hybrid_block_spec, te_to_local, use_fused_gdn
    from core.testing.gdn import _reseed, build_gdn_module

    if layout.single_gdn:
        module = build_gdn_module(config, seed=seed)
        # What megatron's schedules ask of a model chunk (a GPTModel has both).
        module.model_type = ModelType.encoder_or_decoder
        module.set_input_tensor = _no_input_tensor
        return module
    _reseed(seed)
    stage = dict(
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage)
    if layout.model == "hybrid":
        spec = use_fused_gdn(te_to_local(hybrid_stack_spec),
                             gated_output_norm=config.fused_gated_norm,
                             pre_gated_delta_rule=layout.pre_fusion)
        return HybridModel(config, spec, vocab_size=VOCAB,
                           max_sequence_length=SEQ, hybrid_layer_pattern=hybrid_pattern(layout),
                           **stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gdn_hybrid_block_spec(config, use_te=False, vp_stage=vp_stage),
        vocab_size=VOCAB, max_sequence_length=SEQ,
        # untied, as Qwen3-Next
        share_embeddings_and_output_weights=False, **stage)


def hybrid_pattern(layout: Layout) -> str:
    """:data:`HYBRID_PATTERN` with its decoder split into ``pp x vp`` equal pipeline segments
    at '|' (megatron gives segment ``vp_stage * pp + pp_rank`` to that rank's virtual stage)."""
    segments = layout.pp * layout.vp
    if segments == 1:
        return HYBRID_PATTERN
    size = len(HYBRID_DECODER) // segments
    return ("|".join(HYBRID_DECODER[i:i + size] for i in range(0, len(HYBRID_DECODER), size))
            + "/" + HYBRID_MTP)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


class Offsets(NamedTuple):
    """Where a rank's parameters sit in the one-stage, EP 1 model: its pipeline stage's first
    layer and its first expert."""
    layer: int = 0
    expert: int = 0


def global_name(name: str, offsets: Offsets) -> str:
    """A rank's parameter name in the one-stage, EP 1 model (layer and expert numbers shifted)."""
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offsets.layer}.", name)
    return _LOCAL_EXPERT.sub(
        lambda m: f".mlp.experts.local_experts.{int(m.group(1)) + offsets.expert}.", name)


def _offsets(layout: Layout, config, chunk, vp_stage: Optional[int] = None) -> Offsets:
    if layout.single_gdn:
        return Offsets()
    if layout.model == "hybrid":  # megatron numbers a stage's layers from its segment's offset
        layers = chunk.decoder.layers
        return Offsets(layers[0].layer_number - 1 if len(layers) else 0)
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    experts = (config.num_moe_experts or 0) // layout.ep
    return Offsets(get_transformer_layer_offset(config, vp_stage=vp_stage),
                   parallel_state.get_expert_model_parallel_rank() * experts)


def is_expert(param) -> bool:
    """A parameter of an MoE expert (megatron marks them ``allreduce=False``: reduced over the
    expert data-parallel group)."""
    return not getattr(param, "allreduce", True)


def shard_coordinate(layout: Layout, coords: dict, param) -> Optional[tuple]:
    """Which part of ``param`` this rank holds: ``("tp", rank)`` for a tensor-parallel shard,
    ``("etp", rank)`` for an expert's shard over expert tensor parallelism, None for the whole
    parameter. Ranks with the same coordinate hold the same values."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    if is_expert(param):
        return ("etp", coords["etp"]) if layout.etp > 1 else None
    return ("tp", coords["tp"]) if layout.tp > 1 else None


def _optimizer_group(record: dict, name: str) -> str:
    """The ranks among which the distributed optimizer shards ``name``: its data-parallel group
    (one per TP rank), or for an expert its expert-data-parallel group (one per EP x ETP rank)."""
    coords = record["coords"]
    if name in record["experts"]:
        return f"ep {coords['ep']}, etp {coords['etp']}"
    return f"tp {coords['tp']}"


def _shard_label(shard: Optional[tuple]) -> str:
    return "" if shard is None else f" ({shard[0]} {shard[1]})"


def shard_for_rank(full: dict, model: torch.nn.Module, config, tp_rank: int, tp_size: int,
                   offsets: Offsets = Offsets(), etp_rank: int = 0, etp_size: int = 1) -> dict:
    """This rank's shard of a one-stage, TP 1, EP 1 state (or gradient) dict ``full``, keyed by
    ``model``'s own state-dict names: the GDN modules' sections by ``shard_gdn_state_dict``
    (in_proj [q|k|v|z|beta|alpha] and conv1d [q|k|v] split per section), other
    tensor-parallel parameters split along their ``partition_dim`` (the rank's experts over
    expert tensor parallelism), the rest whole."""
    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    from core.testing.gdn import shard_gdn_state_dict

    gdn_prefixes = [f"{n}." if n else "" for n, m in model.named_modules()
                    if isinstance(m, _GDNBase)]
    params = dict(model.named_parameters())
    out = {}
    for name in model.state_dict():
        key = global_name(name, offsets)
        if key not in full and name not in params:
            continue  # a buffer that the dict (gradients) does not carry
        tensor = full[key]
        prefix = next((p for p in gdn_prefixes if name.startswith(p)), None)
        param = params.get(name)
        if prefix is not None:
            out[name] = shard_gdn_state_dict({name: tensor}, config, tp_rank, tp_size,
                                             prefix=prefix)[name]
        elif param is not None and getattr(param, "tensor_model_parallel", False):
            rank, size = (etp_rank, etp_size) if is_expert(param) else (tp_rank, tp_size)
            out[name] = tensor.chunk(size, dim=param.partition_dim)[rank].clone()
        elif isinstance(tensor, torch.Tensor):
            out[name] = tensor.clone()
        else:
            out[name] = tensor
    return out


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------


def make_data(seed: int = 3) -> dict:
    """The reference batches (CPU tensors): 'sbhd', 'thd' (with cu_seqlens) and 'tokens'."""
    gen = torch.Generator().manual_seed(seed)
    hidden = GDN_SIZES["hidden_size"]
    total = sum(PACKED_SEQLENS)
    cu = torch.tensor([0, *torch.tensor(PACKED_SEQLENS).cumsum(0).tolist()], dtype=torch.int32)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return dict(
        sbhd=dict(hidden=torch.randn(SEQ, BATCH, hidden, generator=gen),
                  loss_weight=torch.randn(SEQ, BATCH, hidden, generator=gen)),
        thd=dict(hidden=torch.randn(total, 1, hidden, generator=gen),
                 loss_weight=torch.randn(total, 1, hidden, generator=gen), cu_seqlens=cu),
        tokens=dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous()),
    )


def thd_cp_indices(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Token indices of a packed THD stream that CP rank ``cp_rank`` holds: each sequence cut
    into 2 x cp_size chunks, the rank taking chunks ``cp_rank`` and ``2 cp_size - 1 - cp_rank``
    (the per-sequence load balancing of Transformer Engine's ``thd_get_partitioned_indices``,
    which megatron's ``get_batch_on_this_cp_rank`` uses for THD and GDN's all-to-all undoes)."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    index = []
    for start, end in zip(cu[:-1], cu[1:]):
        if (end - start) % (2 * cp_size):
            raise ValueError(f"thd_cp_indices: sequence length {end - start} is not divisible by "
                             f"2 x cp_size = {2 * cp_size}")
        chunk = (end - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            index.extend(range(start + c * chunk, start + (c + 1) * chunk))
    return torch.tensor(index, dtype=torch.long)


def local_batches(layout: Layout, data: dict, coords: dict, device) -> list:
    """This rank's micro-batches of the reference batch ``data[layout.data]``."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = data[layout.data]
    if not layout.single_gdn:  # one sample per micro-batch, the micro-batches split over DP
        positions = torch.arange(SEQ).unsqueeze(0)
        return [dict(tokens=batch["tokens"][b:b + 1].to(device),
                     labels=batch["labels"][b:b + 1].to(device), position_ids=positions.to(device))
                for b in range(coords["dp"], BATCH, layout.dp)]
    hidden, weight = batch["hidden"], batch["loss_weight"]
    packed = None
    if layout.packed:
        cu = batch["cu_seqlens"]
        if layout.cp > 1:
            index = thd_cp_indices(cu, layout.cp, coords["cp"])
            hidden, weight = hidden.index_select(0, index), weight.index_select(0, index)
        longest = int((cu[1:] - cu[:-1]).max())
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.to(device),
                                 cu_seqlens_kv=cu.to(device), max_seqlen_q=longest,
                                 max_seqlen_kv=longest)
    else:
        hidden = hidden.chunk(layout.dp, dim=1)[coords["dp"]]
        weight = weight.chunk(layout.dp, dim=1)[coords["dp"]]
        if layout.cp > 1:
            # megatron's CP split of a [B, S, ...] batch (cu_seqlens None: per-sequence zigzag)
            split = get_batch_on_this_cp_rank(
                dict(cu_seqlens=None, hidden=hidden.transpose(0, 1), weight=weight.transpose(0, 1)),
                is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group())
            hidden, weight = split["hidden"].transpose(0, 1), split["weight"].transpose(0, 1)
    if layout.sequence_parallel:
        hidden = hidden.chunk(layout.tp, dim=0)[coords["tp"]]
        weight = weight.chunk(layout.tp, dim=0)[coords["tp"]]
    return [dict(hidden=h.contiguous().to(device, layout.dtype),
                 loss_weight=w.contiguous().to(device), packed_seq_params=packed)
            for h, w in zip(hidden.chunk(layout.micro_batches, dim=1),
                            weight.chunk(layout.micro_batches, dim=1))]


def _weighted_sum_loss(weight, output, per_token: bool = False):
    loss = (output.float() * weight).sum()
    if per_token:  # megatron's per-token form: the sum and the tokens it covers ([S, B, hidden])
        tokens = torch.tensor(output.shape[0] * output.shape[1], dtype=torch.int)
        return loss, tokens, {"loss": loss.detach()}
    return loss, {"loss": loss.detach()}


def _sum_loss(output):
    loss = output.float().sum()
    return loss, {"loss": loss.detach()}


def _gdn_forward_step(data_iterator, model, per_token: bool = False):
    batch = next(data_iterator)
    output, _ = model(batch["hidden"], attention_mask=None,
                      packed_seq_params=batch["packed_seq_params"])
    return output, partial(_weighted_sum_loss, batch["loss_weight"], per_token=per_token)


def _gpt_forward_step(data_iterator, model):
    batch = next(data_iterator)
    # labels given: the last stage returns the per-token cross entropy [B, S]
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, _sum_loss


# ----------------------------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------------------------


def _wrap(layout: Layout, config, model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if layout.fsdp:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        if not torch.cuda.is_available():
            raise RuntimeError(
                f"Layout {layout.name}: Megatron-FSDP needs CUDA (MegatronFSDP.__init__ takes "
                "torch.cuda.current_device() and creates torch.cuda.Stream side streams)")

        ddp_config = DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
            overlap_grad_reduce=False, overlap_param_gather=False, use_distributed_optimizer=True)
        # The GDN module is the FSDP unit (in a model, the TransformerLayer holding it): the
        # fused path reads out_norm.weight without calling out_norm, so the whole module's
        # parameters must be gathered before its forward.
        wrapped = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                           fsdp_unit_modules=[type(model)])
        return wrapped, wrapped.module.module
    if layout.torch_fsdp2:  # parameters sharded over DP; the module is FSDP2's unit
        from megatron.core.distributed import TorchFullyShardedDataParallel

        wrapped = TorchFullyShardedDataParallel(
            config=config, module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
        return wrapped, wrapped.module
    # overlap_grad_reduce: one bucket per parameter, each reduced as soon as its gradient is
    # ready (and, with overlap_param_gather, each gathered as the forward reaches its module)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=layout.overlap_grad_reduce,
        overlap_param_gather=layout.overlap_param_gather,
        average_in_collective=layout.average_in_collective,
        bucket_size=OVERLAP_BUCKET_SIZE if layout.overlap_grad_reduce else None,
        use_distributed_optimizer=layout.distributed_optimizer)
    wrapped = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    return wrapped, wrapped.module


def _main_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """The gradient that finalize_model_grads reduces, found as it finds it: DDP's
    ``main_grad``; Megatron-FSDP's distributed parameters carry ``.grad`` (a DTensor)."""
    from megatron.core.distributed.finalize_model_grads import _get_main_grad_attr

    return getattr(param, _get_main_grad_attr(param))


def _tp_local(tensor: torch.Tensor, param, shape, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of ``tensor``: Megatron-FSDP's DTensors of tensor-parallel parameters
    gather over TP as well (``full_tensor()`` gives the rank shards concatenated along
    ``partition_dim``); anything already of the module's local ``shape`` is returned as is."""
    if tensor.shape == shape or tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    return tensor.chunk(tp_size, dim=param.partition_dim)[tp_rank].clone()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (Megatron-FSDP's main_grad / params) as its full tensor, on the CPU."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().float().cpu().clone()


def _owned_ranges(optimizer, params: dict) -> dict:
    """Distributed optimizer: the flat [start, end) range of each parameter that this rank owns
    (its gradient is reduced there only); (0, 0) where it owns none."""
    ranges = {name: (0, 0) for name in params}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        gbuf_map = getattr(opt, "model_param_gbuf_map", None)
        if gbuf_map is None:
            continue
        for name, param in params.items():
            if param not in gbuf_map:
                continue
            gbuf_index, dtype, bucket_index = gbuf_map[param]
            param_map = opt.gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"]
            if param in param_map:
                owned = param_map[param]["param"]
                ranges[name] = (owned.start, owned.end)
    return ranges


def run_case(layout: Layout, fused: bool, reference: dict, device,
             reference_grads: Optional[dict] = None) -> dict:
    """One training step of ``layout`` on this rank (parallel_state already set by
    :func:`init_layout`); see the module docstring. ``reference`` holds 'weights' and 'data';
    ``reference_grads`` (name -> full gradient) gives each record its expected shard."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from core.testing.cpu import cpu_tensor_types

    coords = coordinates()
    config = layout_config(layout, fused)
    stages = vp_stages(layout)
    chunks = [build_model(layout, config, 99, vp_stage) for vp_stage in stages]
    # Per chunk: local parameter name -> name in the one-stage, EP 1 model, and the shapes, TP
    # attributes and expected shards of the parameters as built (Megatron-FSDP replaces the
    # parameters when it wraps the module).
    names, local_shapes, initial, expected = [], [], {}, {}
    for chunk, vp_stage in zip(chunks, stages):
        offsets = _offsets(layout, config, chunk, vp_stage)
        shard = shard_for_rank(reference["weights"][layout.model], chunk, config, coords["tp"],
                               layout.tp, offsets, coords["etp"], layout.etp)
        chunk.load_state_dict(shard)
        chunk.to(device)
        chunk_names = {n: global_name(n, offsets) for n, _ in chunk.named_parameters()}
        names.append(chunk_names)
        local_shapes.append({n: p.shape for n, p in chunk.named_parameters()})
        initial.update({chunk_names[n]: shard[n].float() for n in chunk_names})
        if reference_grads is not None:
            grads = shard_for_rank(reference_grads, chunk, config, coords["tp"], layout.tp, offsets,
                                   coords["etp"], layout.etp)
            expected.update({chunk_names[n]: grads[n].float() for n in chunk_names})
    # (global name, parameter) of every chunk as built, before any wrapper
    built = [(chunk_names[n], p) for chunk, chunk_names in zip(chunks, names)
             for n, p in chunk.named_parameters()]
    record = dict(
        coords=coords, fused=fused, fp16=layout.fp16,
        shards={name: shard_coordinate(layout, coords, p) for name, p in built},
        experts={name for name, p in built if is_expert(p)},
        fused_modules=[bool(getattr(m, "fused_gated_norm", False)) for chunk in chunks
                       for m in chunk.modules() if hasattr(m, "out_norm")],
        pre_fused_modules=[bool(getattr(m, "pre_gated_delta_rule_fusion", False))
                           for chunk in chunks for m in chunk.modules() if hasattr(m, "out_norm")],
        recompute_modules=[bool(m.recompute_norm_out) for chunk in chunks for m in chunk.modules()
                           if hasattr(m, "recompute_norm_out")],
        # the MoE layers' token dispatcher classes
        token_dispatchers={type(m.token_dispatcher).__name__ for chunk in chunks
                           for m in chunk.modules() if hasattr(m, "token_dispatcher")},
        # the parameters finalize_model_grads AVG-reduces over TP (the GDN output norms' where
        # megatron leaves their partial gradients)
        tp_avg_tagged={name for name, p in built
                       if getattr(p, "average_gradients_across_tp_domain", False)},
    )
    if reference_grads is not None:
        # DDP averages over DP x CP and the schedule multiplies the loss by CP and divides it by
        # the number of micro-batches: the GDN module's batch split over DP and micro-batches
        # gives the full gradient / (DP x micro-batches). The GPT models' micro-batches are split
        # over DP, and the schedule averages the loss over them: the full gradient.
        # With the per-token loss DDP sums over DP x CP and finalize_model_grads divides by the
        # batch's token count: the full gradient / tokens.
        # fp16: the gradients hold the loss scale (the optimizer divides it out in its step).
        share = layout.dp * layout.micro_batches if layout.single_gdn else 1
        if layout.per_token_loss:
            share = SEQ * BATCH
        if layout.fp16:
            share /= FP16_INITIAL_LOSS_SCALE
        record["expected"] = {name: grad / share for name, grad in expected.items()}
        record["expected_scale"] = {
            name: float(reference_grads[name].abs().max()) / share for name in expected}
        record["initial"] = initial

    wrapped, inner = zip(*[_wrap(layout, config, chunk) for chunk in chunks])
    with cpu_tensor_types():
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=LR, params_dtype=config.params_dtype,
                            use_distributed_optimizer=layout.distributed_optimizer or layout.fsdp,
                            fp16=layout.fp16, initial_loss_scale=FP16_INITIAL_LOSS_SCALE),
            list(wrapped))
    if layout.fp16:  # megatron.training's setup: the schedule scales the loss
        config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads  # as megatron's training loop
    if layout.overlap_grad_reduce:  # megatron.training's setup: reduce after the last micro-batch
        config.no_sync_func = [chunk.no_sync for chunk in wrapped]
        config.grad_sync_func = [chunk.start_grad_sync for chunk in wrapped]
        if len(wrapped) == 1:
            config.no_sync_func = config.no_sync_func[0]
            config.grad_sync_func = config.grad_sync_func[0]
    batches = local_batches(layout, reference["data"], coords, device)

    def each_parameter():  # (global name, parameter, local shape) of every chunk
        for module, chunk_names, shapes in zip(inner, names, local_shapes):
            for n, p in module.named_parameters():
                yield chunk_names[n], p, shapes[n]

    # Each step as megatron.training's train_step: zeroed gradient buffers, megatron's schedule
    # (with finalize_model_grads), the optimizer step.
    record["later_grads"], record["update_successful"] = [], True
    for step in range(layout.steps):
        for chunk in wrapped:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=(partial(_gdn_forward_step, per_token=layout.per_token_loss)
                               if layout.single_gdn else _gpt_forward_step),
            # the interleaved schedule reads each chunk's micro-batches from its own iterator
            data_iterator=[iter(batches) for _ in chunks] if layout.vp > 1 else iter(batches),
            model=list(wrapped), num_microbatches=len(batches), seq_length=SEQ,
            micro_batch_size=BATCH // layout.dp // layout.micro_batches if layout.single_gdn else 1,
            forward_only=False)
        grads = {name: _tp_local(_full(_main_grad(p)), p, shape, coords["tp"], layout.tp)
                 for name, p, shape in each_parameter()}
        if step == 0:
            record["grads"] = grads
            # the parameters an FSDP wrapper shards over DP are DTensors
            record["sharded"] = {name for name, p, _ in each_parameter()
                                 if hasattr(p, "full_tensor")}
            if layout.distributed_optimizer:
                record["owned"] = _owned_ranges(optimizer,
                                                {name: p for name, p, _ in each_parameter()})
        else:
            record["later_grads"].append(grads)
        with cpu_tensor_types():
            update_successful, _, _ = optimizer.step()
        record["update_successful"] &= bool(update_successful)
    if layout.overlap_param_gather:
        # the last step's parameters are gathered by the next forward; megatron.training gathers
        # them at once before an evaluation or a checkpoint
        for chunk in wrapped:
            chunk.start_param_sync(force_sync=True)
    record["params"] = {name: _tp_local(_full(p), p, shape, coords["tp"], layout.tp)
                        for name, p, shape in each_parameter()}
    return record


# ----------------------------------------------------------------------------------------------
# Reference and workers
# ----------------------------------------------------------------------------------------------


REFERENCE_CASES = tuple((model, data, fused) for model, datas in (("gdn", ("sbhd", "thd")),
                                                                   ("gdn-layernorm", ("sbhd",)),
                                                                   ("gpt", ("tokens",)),
                                                                   ("gpt-moe", ("tokens",)),
                                                                   ("hybrid", ("tokens",)))
                        for data in datas for fused in REFERENCE[model].flag_values)


def make_reference(path: str, device=None, cases=REFERENCE_CASES) -> dict:
    """The TP 1 / CP 1 / one-stage reference (parallel_state initialised at world size 1):
    the weights of every model that ``cases`` names, the batches, and for each (model, data,
    fused) of ``cases`` the gradients of :func:`run_case`; saved to ``path`` and returned."""
    from core.testing.gdn import randomize_norm_weights

    device = device or torch.device("cpu")
    reference = dict(weights={}, data=make_data(), grads={})
    for model_name in dict.fromkeys(model for model, _, _ in cases):
        layout = REFERENCE[model_name]
        init_layout(layout)
        model = build_model(layout, layout_config(layout, fused=False), seed=99)
        randomize_norm_weights(model)
        reference["weights"][model_name] = {
            k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
            for k, v in model.state_dict().items()}
    for model_name, data_name, fused in cases:
        layout = dataclasses.replace(REFERENCE[model_name], packed=data_name == "thd")
        init_layout(layout)
        record = run_case(layout, fused, reference, device)
        reference["grads"][reference_key(model_name, data_name, fused)] = record["grads"]
    torch.save(reference, path)
    return reference


def run_layouts(layouts, reference_path: str, device, fused_values=(True, False)) -> dict:
    """Every layout (all of this world's size) for each value of the flag; a case that raises
    records its traceback under 'error' (and the next case runs)."""
    reference = torch.load(reference_path, weights_only=False)
    results = {}
    for layout in layouts:
        init_layout(layout)
        for fused in (f for f in fused_values if f in layout.flag_values):
            key = case_key(layout, fused)
            try:
                grads = reference["grads"][reference_key(layout.model, layout.data, fused)]
                results[key] = run_case(layout, fused, reference, device, grads)
            except Exception:  # noqa: BLE001  (reported by the test of this case)
                results[key] = dict(error=traceback.format_exc())
    return results


def layout_worker(rank: int, world_size: int, init_file: str, reference_path: str, out_dir: str,
                  layouts, fused_values=(True, False)) -> None:
    """``torch.multiprocessing.spawn`` entry: one world, every layout of it; each rank saves
    ``rank{r}.pt`` in ``out_dir``."""
    from core.testing.cpu import install_cpu_fla_stand_ins, install_cpu_shims

    install_cpu_shims(training=True)
    install_cpu_fla_stand_ins()
    torch.set_num_threads(1)  # several ranks share few cores
    device = init_world(rank, world_size, init_file)
    save_rank_results(lambda: run_layouts(layouts, reference_path, device, fused_values),
                      out_dir, rank)


def save_rank_results(run, out_dir: str, rank: int, graphs_captured_nccl: bool = False) -> None:
    """``torch.save`` of ``run()`` as ``out_dir/rank{rank}.pt``, then the process groups torn
    down, whatever happened: the end of every spawned rank.

    ``graphs_captured_nccl``: ``run`` captured NCCL collectives in a CUDA graph, after which
    ``destroy_process_group()`` waits on the capture's pending-work count and never returns
    (pytorch/pytorch#115388). The rank then saves its results and leaves the process without
    tearing its process groups down."""
    path = os.path.join(out_dir, f"rank{rank}.pt")
    if graphs_captured_nccl:
        torch.save(run(), path)
        torch.cuda.synchronize()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    try:
        torch.save(run(), path)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def reference_worker(rank: int, init_file: str, reference_path: str,
                     cases=REFERENCE_CASES) -> None:
    """``torch.multiprocessing.spawn`` entry (one process) for :func:`make_reference`, where the
    calling process should hold no process group or device (the GPU tests)."""
    from core.testing.cpu import install_cpu_fla_stand_ins, install_cpu_shims

    install_cpu_shims(training=True)
    install_cpu_fla_stand_ins()
    device = init_world(rank, 1, init_file)
    try:
        make_reference(reference_path, device, cases)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def spawn_layouts(layouts, reference_path: str, out_dir: str, fused_values=(True, False)) -> list:
    """Run ``layouts`` (one world size) in spawned processes; returns each rank's results."""
    import torch.multiprocessing as mp

    sizes = {layout.world_size for layout in layouts}
    if len(sizes) != 1:
        raise ValueError(
            f"spawn_layouts: layouts of one world size only, got sizes {sorted(sizes)}")
    world = sizes.pop()
    mp.spawn(layout_worker, nprocs=world, join=True,
             args=(world, os.path.join(out_dir, "rendezvous"), reference_path, out_dir,
                   tuple(layouts), tuple(fused_values)))
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world)]


# ----------------------------------------------------------------------------------------------
# Checks (test process)
# ----------------------------------------------------------------------------------------------


def rel_err(got: torch.Tensor, expected: torch.Tensor, scale: Optional[float] = None) -> float:
    """max |got - expected| / scale (default: max |expected|), in float64 on the CPU."""
    got, expected = got.double().cpu(), expected.double().cpu()
    if got.shape != expected.shape:
        return float("inf")
    if expected.numel() == 0:
        return 0.0
    scale = float(expected.abs().max()) if scale is None else scale
    return float((got - expected).abs().max()) / max(scale, 1e-30)


def grad_errors(records: list) -> dict:
    """Per parameter name, the largest error over the ranks of :func:`grad_mismatches`' metric."""
    errors = {}
    for record in records:
        for name, expected in record["expected"].items():
            got = record["grads"].get(name)
            if got is None:
                errors[name] = float("inf")
                continue
            if "owned" in record:
                start, end = record["owned"][name]
                got, expected = got.flatten()[start:end], expected.flatten()[start:end]
            err = rel_err(got, expected, record["expected_scale"][name])
            errors[name] = max(errors.get(name, 0.0), err)
    return errors


def grad_mismatches(records: list, tolerance_factor: float = 1.0) -> list:
    """Every rank's every parameter gradient against its expected shard of the reference, the
    error relative to the largest element of the full reference gradient (a shard's own largest
    element can be orders of magnitude smaller), within :func:`tolerance`. With the distributed
    optimizer only the range each rank owns counts, and the owned ranges of the ranks holding
    one shard must partition it (each element owned by exactly one rank).
    ``tolerance_factor`` scales the tolerances (the GPU cases). Returns the failures (empty:
    all good)."""
    failures = []
    coverage = {}
    for record in records:
        rank = record["coords"]["rank"]
        if set(record["grads"]) != set(record["expected"]):
            failures.append(f"rank {rank}: parameter names differ from the reference's: "
                            f"{sorted(set(record['grads']) ^ set(record['expected']))}")
        for name, err in grad_errors([record]).items():
            limit = tolerance(name, record.get("fp16", False)) * tolerance_factor
            if not err <= limit:
                failures.append(f"rank {rank} {name}: rel err {err:.2e} > {limit:.0e}")
        for name, (start, end) in record.get("owned", {}).items():
            key = (name, _optimizer_group(record, name))
            numel = record["expected"][name].numel()
            coverage.setdefault(key, torch.zeros(numel, dtype=torch.int32))[start:end] += 1
    for (name, group), owners in coverage.items():
        if not bool((owners == 1).all()):
            failures.append(f"{name} ({group}): {int((owners == 1).sum())} of "
                            f"{owners.numel()} elements owned by exactly one rank")
    return failures


def partial_out_norm_grad(reference: dict, fused: bool, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The out_norm weight gradient that TP rank ``tp_rank`` of the GDN module computes from its
    own value heads alone (unreduced), obtained without any TP machinery: the TP 1 module with
    the out_proj columns of the other ranks' heads zeroed, on the reference sbhd batch (the loss
    is linear in the output, so the kept heads see the same output gradient). parallel_state
    at world size 1. The TP ranks' partials sum to the full gradient."""
    from core.testing.gdn import build_gdn_module

    config = layout_config(REFERENCE["gdn"], fused)
    module = build_gdn_module(config, seed=99)
    module.load_state_dict(reference["weights"]["gdn"])
    with torch.no_grad():
        kept = module.out_proj.weight.chunk(tp_size, dim=1)[tp_rank].clone()
        module.out_proj.weight.zero_()
        module.out_proj.weight.chunk(tp_size, dim=1)[tp_rank].copy_(kept)
    device = module.out_proj.weight.device
    batch = reference["data"]["sbhd"]
    output, _ = module(batch["hidden"].to(device), attention_mask=None)
    (output.float() * batch["loss_weight"].to(device)).sum().backward()
    return module.out_norm.weight.grad.detach().float().cpu()


def replica_mismatches(records: list) -> list:
    """After the optimizer step: every parameter bit-identical on all ranks that hold the same
    shard of it (a tensor-parallel parameter: same TP rank; any other parameter, such as the GDN
    out_norm weight: every rank holding it); and each parameter moved from its initial value
    somewhere (the step did something). Returns the failures (empty: all good)."""
    failures = []
    groups = {}
    for record in records:
        for name, value in record["params"].items():
            groups.setdefault((name, record["shards"][name]), []).append(
                (record["coords"]["rank"], value))
    for (name, shard), held in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        first_rank, first = held[0]
        for rank, value in held[1:]:
            if not torch.equal(first, value):
                diff = float((first - value).abs().max())
                failures.append(f"{name}{_shard_label(shard)}: rank {rank} differs from rank "
                                f"{first_rank} after the step (max {diff:.2e})")
    for record in records:
        if not record["update_successful"]:
            failures.append(f"rank {record['coords']['rank']}: optimizer step skipped")
        for name, value in record["params"].items():
            if "initial" in record and torch.equal(value, record["initial"][name]):
                failures.append(f"rank {record['coords']['rank']} {name}: unchanged by the step")
    return failures


def twin_mismatches(records: list, twin_records: list) -> list:
    """Two layouts that differ only in how the parameters reach the forward (e.g. gathered in
    the optimizer step or by DDP's pre-hooks with ``overlap_param_gather``): on every rank, the
    same coordinates, and every step's gradients and the final parameters bit-identical.
    Returns the failures (empty: all good)."""
    failures = []
    for record, twin in zip(records, twin_records, strict=True):
        rank = record["coords"]["rank"]
        if record["coords"] != twin["coords"]:
            failures.append(f"rank {rank}: coordinates {record['coords']} != {twin['coords']}")
            continue
        if len(record["later_grads"]) != len(twin["later_grads"]):
            failures.append(f"rank {rank}: {1 + len(record['later_grads'])} steps, the twin "
                            f"{1 + len(twin['later_grads'])}")
            continue
        steps = [("step 1", record["grads"], twin["grads"]),
                 *((f"step {i + 2}", a, b) for i, (a, b) in enumerate(
                     zip(record["later_grads"], twin["later_grads"]))),
                 ("parameters", record["params"], twin["params"])]
        for what, values, twin_values in steps:
            if values.keys() != twin_values.keys():
                failures.append(f"rank {rank} {what}: names differ: "
                                f"{sorted(values.keys() ^ twin_values.keys())}")
                continue
            failures.extend(f"rank {rank} {what} {name}: differs from the twin's"
                            for name, value in values.items()
                            if not torch.equal(value, twin_values[name]))
    return failures
