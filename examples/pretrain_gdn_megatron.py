#!/usr/bin/env python
"""Pretrain a small Gated DeltaNet hybrid GPT with megatron's own training loop
(``megatron.training.pretrain``), the fused GDN output norm switched by ``--fused-gated-norm``
(or megatron main's name of it, ``--gdn-gated-output-norm-fusion``) and the fusion before the
gated delta rule by ``--gdn-pre-gated-delta-rule-fusion`` (megatron main's flag; independent of
the output norm, off unless given).

    python examples/data/build_indexed.py --output-prefix runs/data/stdlib_docstrings
    torchrun --nproc-per-node 2 examples/pretrain_gdn_megatron.py \\
        --tensor-model-parallel-size 2 --sequence-parallel --transformer-impl local \\
        --experimental-attention-variant gated_delta_net --linear-attention-freq 4 \\
        --fused-gated-norm --recompute-granularity selective --recompute-modules gdn_norm_out \\
        --data-path runs/data/stdlib_docstrings --split 98,2,0 \\
        --tokenizer-type NullTokenizer --vocab-size 256 ...   (examples/run_megatron_pairs.py
                                                               has complete command lines)

Everything is megatron's except three functions, written as megatron 0.19's pretrain_gpt.py
and pretrain_hybrid.py write them: the model is a ``GPTModelConfig`` (megatron's
``gpt_config_from_args``) whose transformer config is
``core.training.transformer_config_from_args(args)`` and whose layer spec is megatron's GDN block
spec with our GDN class (:func:`gdn_block_spec`; ``--spec MODULE NAME``, megatron's option,
passes that spec through ``core.models.use_fused_gdn`` with the flag's setting instead), or, with
``--hybrid-layer-pattern`` (its 'G' layers are the GDN; multi-token prediction after '/'),
a ``HybridModelConfig`` (``hybrid_config_from_args``) with megatron's hybrid stack spec through
``use_fused_gdn`` (:func:`gdn_hybrid_stack_spec`); a post-wrap hook runs ``assert_fused_gdn`` on
the built model (every GDN layer running the fusions whose flags are given, every one ours
without them);
:func:`forward_step` (megatron's TP broadcast of the batch to the first and last pipeline
stage and to a stage with MTP layers, its split over context-parallel ranks, masked token
loss) and
:func:`train_valid_test_datasets_provider` (megatron's ``BlendedMegatronDatasetBuilder`` with
``GPTDataset`` on ``--data-path``, or ``MockGPTDataset`` with ``--mock-data``). Logging, LR
schedule, optimizer, DDP, checkpoint save (``--save``) and resume (``--load``) are megatron's.

``--megatron-transformer-config`` builds the model config as megatron's own pretrain_gpt.py and
pretrain_hybrid.py do: megatron's TransformerConfig (which has no fusion field) and the
``--spec`` as given, so that the spec switches the fusion
(``--spec core.models.fused_gdn_specs gpt_block_spec``, or ``hybrid_stack_spec`` with
``--hybrid-layer-pattern``; their ``*_both_fusions`` variants for the fusion before the gated
delta rule too); it refuses the fusion flags, and the model must run the fused output norm.

``--gdn-metrics-out FILE`` also writes, from the last rank, one JSON record per training
iteration: the exact loss of the iteration's whole batch (the sum of masked token losses over
every micro-batch and data-parallel rank / their token count; megatron's "lm loss" log line
rounds it, and megatron-core 0.19.2 with ``--log-interval 1`` prints the mean of iterations 1
and 2 at iteration 2), the wall time since the previous iteration, and the memory allocated
between the start and the end of each micro-batch's forward (what the forward keeps for backward
plus the output), for examples/run_megatron_pairs.py.

Without a GPU (CI, tests) the launcher runs on the CPU through ``core.testing.cpu``'s shims
(``install_cpu_shims(training_loop=True)``; gloo, Triton interpreter, ``--deterministic-mode``,
``--use-cpu-initialization``, which it asks for before training: the flags of
examples/run_megatron_pairs.py's CPU runs); core/testing/cpu.py lists where megatron's loop
needs the shims. megatron's hybrid stack is made of Transformer Engine modules: the CPU run
builds it with ``core.models.te_to_local``'s megatron-core stand-ins.
"""

import dataclasses
import importlib
import inspect
import json
import os
import sys
import time
from functools import partial
from typing import Optional

_PROGRAM_START = time.time()

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

HAS_CUDA = torch.cuda.is_available()
# As megatron's launch scripts do (ordering of TP/SP communication and compute kernels).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
if not HAS_CUDA:
    # Must happen before the first `import triton` anywhere (core.fusions, FLA, megatron).
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from core.testing.cpu import install_cpu_shims  # noqa: E402

    install_cpu_shims(training_loop=True)  # before megatron.training and the GDN are imported

# megatron's GatedDeltaNet imports FLA: an FLA that fails under the installed Triton is named
# as the cause here, before megatron.training imports it (core.ssm.megatron_gdn_import).
import core.ssm  # noqa: E402, F401

from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import (  # noqa: E402
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
)
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec  # noqa: E402
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.core.utils import (  # noqa: E402
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training import get_args, pretrain, print_rank_0  # noqa: E402
from megatron.training import set_startup_timestamps  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    gpt_config_from_args,
    hybrid_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils import get_blend_and_blend_per_split  # noqa: E402

from core.models.gdn_specs import (  # noqa: E402
    HAVE_TE,
    assert_fused_gdn,
    get_gdn_hybrid_block_spec,
    use_fused_gdn,
)
from core.ssm.gated_delta_net import GatedDeltaNet  # noqa: E402
from core.training import (  # noqa: E402
    add_gdn_fusion_args,
    transformer_config_from_args,
    use_prebuilt_dataset_helpers,
)
from core.transformer import (  # noqa: E402
    gated_output_norm_fusion,
    pre_gated_delta_rule_fusion_setting,
)

# ----------------------------------------------------------------------------------------------
# Command line: megatron's, plus the fusion flags and this launcher's metrics file
# ----------------------------------------------------------------------------------------------


def add_launcher_args(parser):
    """megatron extra_args_provider: the fusion flags (core.training) and --gdn-metrics-out."""
    add_gdn_fusion_args(parser)
    group = parser.add_argument_group(title="pretrain_gdn_megatron.py")
    group.add_argument("--gdn-metrics-out", default=None,
                       help="JSON file (written by the last rank): per training iteration the "
                            "exact loss, wall time and forward activation memory")
    group.add_argument("--megatron-transformer-config", action="store_true",
                       help="build the model as megatron's own pretrain_gpt.py / "
                            "pretrain_hybrid.py do: megatron's TransformerConfig (no fusion "
                            "fields) and the --spec as given, which switches the fusions "
                            "(core.models.fused_gdn_specs); the fusion flags are refused")
    return parser


def check_launcher_scope(args) -> None:
    """This launcher trains a model with GDN layers: a GPT of the gated_delta_net attention
    variant, without multi-token prediction (which megatron.training's GPT builder cannot build
    for that variant), or a HybridModel whose pattern has 'G' layers (MTP included), which
    megatron builds from Transformer Engine modules; the TE implementation only where TE is
    installed."""
    check_spec_name(args.spec)
    if args.megatron_transformer_config:
        if args.spec is None:
            raise ValueError("--megatron-transformer-config: megatron's TransformerConfig has no "
                             "fusion field, so the spec switches the fusion: pass --spec, e.g. "
                             "--spec core.models.fused_gdn_specs gpt_block_spec")
        zero_centered = args.gdn_out_norm_zero_centered_gamma is not None
        ignored = [flag for flag, given in (
            ("--fused-gated-norm", args.fused_gated_norm),
            ("--gdn-gated-output-norm-fusion", getattr(args, "gdn_gated_output_norm_fusion", None)),
            ("--gdn-pre-gated-delta-rule-fusion",
             getattr(args, "gdn_pre_gated_delta_rule_fusion", None)),
            ("--gdn-out-norm-zero-centered-gamma", zero_centered)) if given]
        if ignored:
            raise ValueError(f"--megatron-transformer-config: megatron's TransformerConfig has "
                             f"no field for {', '.join(ignored)}; the spec switches the fusion")
    if args.hybrid_layer_pattern is not None:
        if args.experimental_attention_variant is not None:
            raise ValueError(
                "--hybrid-layer-pattern builds megatron's HybridModel, whose 'G' layers are the "
                "GDN: leave out --experimental-attention-variant (the GPT model's GDN layers)")
        if "G" not in args.hybrid_layer_pattern:
            raise ValueError(f"--hybrid-layer-pattern {args.hybrid_layer_pattern!r} has no GDN "
                             "layer ('G'): nothing for --fused-gated-norm to act on")
        if HAS_CUDA and not HAVE_TE:
            raise ValueError("--hybrid-layer-pattern: megatron's HybridModel needs Transformer "
                             "Engine (its hybrid stack spec and its final norm are TE modules), "
                             "which is not installed")
    elif args.experimental_attention_variant != "gated_delta_net":
        raise ValueError("examples/pretrain_gdn_megatron.py trains a model with GDN layers: pass "
                         "--experimental-attention-variant gated_delta_net (and "
                         "--linear-attention-freq), or a --hybrid-layer-pattern with 'G' layers")
    elif args.mtp_num_layers:
        raise ValueError(
            "--mtp-num-layers: megatron.training 0.19's GPTModelConfig builds the MTP block from "
            "get_gpt_decoder_layer_specs, which refuses the gated_delta_net attention variant "
            "(an AssertionError after the model build starts). Multi-token prediction with GDN "
            "layers trains as megatron's HybridModel: --hybrid-layer-pattern with the MTP "
            "depths after '/', e.g. 'GGG*/G-'"
        )
    if not HAS_CUDA:  # the CPU run (core.testing.cpu's shims)
        needs = [flag for flag, ok in (
            ("--deterministic-mode (megatron's torch chunk rule: FLA's Triton chunk kernel does "
             "not run in the Triton interpreter)", args.deterministic_mode),
            ("--distributed-backend gloo (NCCL needs GPUs)", args.distributed_backend == "gloo"),
            ("--use-cpu-initialization", args.use_cpu_initialization)) if not ok]
        if needs:
            raise ValueError("without a GPU the launcher runs on the CPU, which needs "
                             + "; ".join(needs))
    if args.transformer_impl == "transformer_engine" and not HAVE_TE:
        raise ValueError("--transformer-impl transformer_engine (megatron's default) needs "
                         "Transformer Engine, which is not installed: pass "
                         "--transformer-impl local")


def check_spec_name(spec) -> None:
    """``--spec MODULE NAME`` must name an attribute of MODULE. megatron reads it as
    ``vars(module)[NAME]``, whose bare KeyError names neither, so a mistyped NAME is refused here
    with the names MODULE offers: a module's own answer where it has one
    (``core.models.fused_gdn_specs`` lists its specs), else the spec objects and functions it
    defines. A MODULE that does not import is left to megatron, which logs why
    (:func:`model_config_from_args` then refuses the missing spec)."""
    if spec is None:
        return
    if len(spec) != 2:
        raise ValueError(f"--spec takes MODULE NAME, got {len(spec)} value(s): {' '.join(spec)}")
    module_path, name = spec
    try:
        module = importlib.import_module(module_path)
    except ImportError:
        return
    if name in vars(module):
        return
    if "__getattr__" in vars(module):
        try:
            getattr(module, name)
        except AttributeError as error:
            raise ValueError(f"--spec {module_path} {name}: {error}") from None
    defined = sorted(
        key for key, value in vars(module).items() if not key.startswith("_") and (
            (dataclasses.is_dataclass(value) and not isinstance(value, type))
            or isinstance(value, partial)
            or (inspect.isfunction(value) and value.__module__ == module.__name__)))
    raise ValueError(f"--spec {module_path} {name}: {module_path} has no attribute {name!r}; "
                     f"its specs and functions are: {', '.join(defined)}")


# ----------------------------------------------------------------------------------------------
# Model: megatron's GPTModelConfig or HybridModelConfig, its spec passed through use_fused_gdn
# ----------------------------------------------------------------------------------------------


def gdn_block_spec(model_config, vp_stage=None):
    """The layer spec of the GDN hybrid GPT, with our GatedDeltaNet
    (``core.models.get_gdn_hybrid_block_spec``). ``--transformer-impl transformer_engine``:
    megatron's own spec of the gated_delta_net attention variant, our class in it. ``local``
    (no Transformer Engine): megatron has no GDN spec without TE (its GDN in_proj is TE's
    norm-fused linear), so the same layer pattern is built from megatron's local modules."""
    config = model_config.transformer
    return get_gdn_hybrid_block_spec(config, use_te=config.transformer_impl == "transformer_engine",
                                     vp_stage=vp_stage)


_GDN_LAYERS: dict = {}  # filled by check_fused_gdn, written to --gdn-metrics-out


def check_fused_gdn(model_chunks, gated_output_norm: bool = True,
                    pre_gated_delta_rule: Optional[bool] = False):
    """megatron post-wrap hook: refuse a model whose GDN layers do not run the fusions as asked
    (``gated_output_norm``, ``pre_gated_delta_rule``: whether the run asks for them; None: the
    spec decides, nothing is asked) or would ignore a flag; count the GDN layers (ours, with
    the fused output norm on, with the fusion before the gated delta rule on) for
    --gdn-metrics-out."""
    assert_fused_gdn(model_chunks, gated_output_norm=gated_output_norm,
                     pre_gated_delta_rule=bool(pre_gated_delta_rule))
    _GDN_LAYERS.update(gated_output_norm=gated_output_norm,
                       pre_gated_delta_rule=pre_gated_delta_rule)
    layers = [m for chunk in model_chunks for m in chunk.modules()
              if isinstance(m, GatedDeltaNet)]
    counts = torch.tensor([len(layers), sum(m.fused_gated_norm for m in layers),
                           sum(m.pre_gated_delta_rule_fusion for m in layers)],
                          device=torch.cuda.current_device() if HAS_CUDA else "cpu")
    if mpu.get_pipeline_model_parallel_world_size() > 1:  # each stage holds other layers
        torch.distributed.all_reduce(counts, group=mpu.get_pipeline_model_parallel_group())
    config_class = type(get_attr_wrapped_model(model_chunks[0], "config"))
    _GDN_LAYERS.update(count=int(counts[0]), fused=int(counts[1]), pre_fused=int(counts[2]),
                       config_class=f"{config_class.__module__}.{config_class.__qualname__}")
    return model_chunks


def gdn_hybrid_stack_spec(spec=None, gated_output_norm: bool = True,
                          pre_gated_delta_rule: bool = False):
    """``use_fused_gdn`` of ``spec`` (``--spec``) or megatron's ``hybrid_stack_spec``: its 'G'
    layers hold our GatedDeltaNet, in the decoder and in the multi-token prediction depths, the
    fused output norm and the fusion before the gated delta rule on or off as
    ``gated_output_norm`` and ``pre_gated_delta_rule`` say."""
    return use_fused_gdn(te_stand_ins(hybrid_stack_spec if spec is None else spec),
                         gated_output_norm=gated_output_norm,
                         pre_gated_delta_rule=pre_gated_delta_rule)


def te_stand_ins(spec):
    """``spec`` on a GPU; on the CPU its TE modules swapped for megatron-core's
    (``core.models.te_to_local``): megatron's hybrid stack is made of TE modules."""
    if HAS_CUDA:
        return spec
    from core.models import te_to_local

    return te_to_local(spec)


def model_config_from_args(args):
    """megatron's model config from the command line, with our transformer config and spec.
    ``--hybrid-layer-pattern``: a HybridModelConfig with :func:`gdn_hybrid_stack_spec`. Else a
    GPTModelConfig with ``--spec`` (megatron's: a spec or spec function by module and name)
    through ``use_fused_gdn`` with the flags' settings, or :func:`gdn_block_spec`.
    ``--megatron-transformer-config``: what megatron's own pretrain scripts build, megatron's
    TransformerConfig and the ``--spec`` as it is (the CPU run's TE stand-ins aside)."""
    stock = args.megatron_transformer_config
    config = None if stock else transformer_config_from_args(args)
    # Our config: its flags decide, and every spec follows them. megatron's: the spec switches
    # the fusions, and the model must run the fused output norm (the other is the spec's choice).
    fused = True if stock else bool(gated_output_norm_fusion(config))
    pre_fused = None if stock else bool(pre_gated_delta_rule_fusion_setting(config))
    hybrid = args.hybrid_layer_pattern is not None
    config_from_args = hybrid_config_from_args if hybrid else gpt_config_from_args
    model_config = config_from_args(args, config=config)
    spec_field = "hybrid_stack_spec" if hybrid else "transformer_layer_spec"
    spec = getattr(model_config, spec_field)  # megatron's import of --spec, else None
    if args.spec is not None and spec is None:  # megatron logs the import error and goes on
        raise ValueError(f"--spec {' '.join(args.spec)}: megatron could not import it")
    if stock:
        spec = te_stand_ins(spec) if hybrid else spec
    elif hybrid:
        spec = gdn_hybrid_stack_spec(spec, gated_output_norm=fused, pre_gated_delta_rule=pre_fused)
    elif spec is None:
        spec = gdn_block_spec  # the config decides
    else:
        spec = use_fused_gdn(spec, gated_output_norm=fused, pre_gated_delta_rule=pre_fused)
    setattr(model_config, spec_field, spec)
    model_config.post_wrap_hooks.append(partial(check_fused_gdn, gated_output_norm=fused,
                                                pre_gated_delta_rule=pre_fused))
    return model_config


# ----------------------------------------------------------------------------------------------
# Data: megatron's GPT datasets (indexed dataset of examples/data, or mock)
# ----------------------------------------------------------------------------------------------


def gpt_dataset_config_from_args(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """megatron's GPT datasets, built on tensor-parallel rank 0 (the batch is broadcast).
    ``vp_stage``: megatron passes it with virtual pipeline stages; every stage reads the same
    datasets."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation and test datasets ({dataset_type.__name__}) ...")
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples,
        lambda: mpu.get_tensor_model_parallel_rank() == 0,
        gpt_dataset_config_from_args(args),
    ).build()


# megatron builds the datasets on TP rank 0 and broadcasts (pretrain_gpt.py sets the same).
train_valid_test_datasets_provider.is_distributed = True


# ----------------------------------------------------------------------------------------------
# Forward step and the per-iteration record of --gdn-metrics-out
# ----------------------------------------------------------------------------------------------

_RECORDS: list[dict] = []  # one per training micro-batch


def get_batch(data_iterator, config, vp_stage=None):
    """This rank's micro-batch: read on TP rank 0 and broadcast over TP (the first pipeline stage
    gets the tokens, the last the labels, a stage with multi-token prediction both, another
    stage nothing), then megatron's load-balanced split over context-parallel ranks."""
    args = get_args()
    first = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    mtp = mtp_on_this_rank(layout=config.pipeline_model_parallel_layout,
                           mtp_num_layers=config.mtp_num_layers, ignore_virtual=False,
                           vp_stage=vp_stage)
    if not (first or last or mtp):
        return None, None, None, None, None
    batch = {}
    if mpu.get_tensor_model_parallel_rank() == 0:
        batch = {key: value.to(torch.cuda.current_device(), non_blocking=True)
                 if isinstance(value, torch.Tensor) else value
                 for key, value in next(data_iterator).items()}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=first,
        is_pipeline_last_stage=last,
    )
    if args.context_parallel_size > 1:
        batch = get_batch_on_this_cp_rank({**batch, "cu_seqlens": None}, is_hybrid_cp=False,
                                          cp_group=mpu.get_context_parallel_group())
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"),
            batch["position_ids"])


def loss_func(loss_mask: torch.Tensor, record, output_tensor: torch.Tensor):
    """megatron's masked token loss: (sum, token count, {'lm loss': [sum, count]})."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    if record is not None:
        # Each data- and context-parallel rank holds its share of the batch: the iteration's
        # loss sums them all (in float64: no rounding beyond megatron's per-rank fp32 sums).
        totals = torch.stack([loss.detach().double(), num_tokens.double()])
        torch.distributed.all_reduce(totals,
                                     group=mpu.get_data_parallel_group(with_context_parallel=True))
        record["loss_sum"], record["tokens"] = totals[0], totals[1]
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, get_attr_wrapped_model(model, "config"), vp_stage)
    record = None
    # one record per training micro-batch, where its loss is computed (the last pipeline stage)
    if (model.training and get_args().gdn_metrics_out
            and mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)):
        record = {"iteration": get_args().curr_iteration + 1, "time": time.perf_counter()}
        _RECORDS.append(record)
    before = torch.cuda.memory_allocated() if HAS_CUDA else None
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels,
                          loss_mask=loss_mask)
    if record is not None and HAS_CUDA:
        record["forward_kept_bytes"] = torch.cuda.memory_allocated() - before
    return output_tensor, partial(loss_func, loss_mask, record)


def write_metrics(path: str) -> None:
    """The records of --gdn-metrics-out, grouped per iteration (last rank writes)."""
    if torch.distributed.get_rank() != torch.distributed.get_world_size() - 1:
        return
    iterations = {}
    for r in _RECORDS:
        it = iterations.setdefault(r["iteration"], {"loss_sum": 0.0, "tokens": 0,
                                                    "start": r["time"], "forward_kept_bytes": []})
        it["loss_sum"] += float(r["loss_sum"])
        it["tokens"] += int(r["tokens"])
        if "forward_kept_bytes" in r:
            it["forward_kept_bytes"].append(r["forward_kept_bytes"])
    rows, previous = [], None
    for number in sorted(iterations):
        it = iterations[number]
        rows.append({"iteration": number, "loss": it["loss_sum"] / it["tokens"],
                     "tokens": it["tokens"],
                     "seconds_since_previous": None if previous is None else it["start"] - previous,
                     "forward_kept_bytes": max(it["forward_kept_bytes"], default=None)})
        previous = it["start"]
    args = get_args()
    summary = {
        "fused_gated_norm": _GDN_LAYERS.get("gated_output_norm"),
        # None with --megatron-transformer-config: the spec decides (gdn_layers_pre_fused)
        "gdn_pre_gated_delta_rule_fusion": _GDN_LAYERS.get("pre_gated_delta_rule"),
        "megatron_transformer_config": args.megatron_transformer_config,
        "transformer_config_class": _GDN_LAYERS.get("config_class"),
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "expert_model_parallel_size": args.expert_model_parallel_size,
        "num_experts": args.num_experts,
        "hybrid_layer_pattern": args.hybrid_layer_pattern,
        "mtp_num_layers": args.mtp_num_layers,
        "global_batch_size": args.global_batch_size,
        "seq_length": args.seq_length,
        "loaded_iteration": args.iteration if args.load else None,
        "gdn_layers": _GDN_LAYERS.get("count"),
        "gdn_layers_fused": _GDN_LAYERS.get("fused"),
        "gdn_layers_pre_fused": _GDN_LAYERS.get("pre_fused"),
        "device": torch.cuda.get_device_name() if HAS_CUDA else "cpu",
        "max_memory_allocated": torch.cuda.max_memory_allocated() if HAS_CUDA else None,
        "iterations": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)


def main() -> None:
    set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
    use_prebuilt_dataset_helpers()
    args = parse_and_validate_args(extra_args_provider=add_launcher_args,
                                   args_defaults={"tokenizer_type": "NullTokenizer"})
    check_launcher_scope(args)
    pretrain(
        pretrain_cfg_container_from_args(args, model_config_from_args(args)),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )
    if args.gdn_metrics_out:
        write_metrics(args.gdn_metrics_out)


if __name__ == "__main__":
    main()
