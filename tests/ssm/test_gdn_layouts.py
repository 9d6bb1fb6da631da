"""The layout matrix on the CPU (gloo, spawned processes): GDN models (a GPTModel's and a
HybridModel's, MTP included) under TP, SP, CP, packed
sequences, PP (virtual stages too), EP (MoE MLPs), the distributed optimizer, torch FSDP2,
selective and full recompute, and what megatron's training loop adds around a step
(micro-batches, overlapping grad reduce and param gather, per-token loss, fp16 loss scaling),
flag on and off, against the same model at TP 1 / CP 1 / one stage / EP 1
(core.testing.parallel; docs/usage.md, section "Parallel layouts and features"). The layouts of
:data:`PRE_FUSION_WORLDS` run the fused pre-recurrence region as well
(gdn_pre_gated_delta_rule_fusion), output norm flag on and off, against the same reference.

Per layout and flag: every parameter's gradient after megatron's stock finalize_model_grads
equals the reference gradient (sharded like the parameter) within fp32 tolerance on every rank,
and after megatron's optimizer step every parameter is bit-identical on the ranks holding the
same shard (the GDN out_norm weight: on every rank). Four spawns in all (2 and 4 processes, for
:data:`WORLDS` and for :data:`PRE_FUSION_WORLDS`, so that ``-k pre-fusion`` runs only the
latter), each running all the layouts of its group, flag on and off; one reference computation
per model and batch, in this process.

On a machine with CUDA the matrix runs all the same, on the CPU: the spawned ranks and the
reference (then spawned too) see no GPU (CUDA_VISIBLE_DEVICES="", the Triton interpreter), so
they take the gloo / CPU path of the harness. tests/ssm/test_gdn_layouts_gpu.py runs the layouts
the CPU cannot (or only through stand-ins) over NCCL. The few tests that build a model in this
process need it to see no GPU, and are skipped where it does."""

import contextlib
import copy
import dataclasses
import os
import re

import pytest
import torch

from core.testing.cpu import init_cpu_model_parallel
from core.testing.parallel import (DECAY_PARAMS, GPT_LAYERS, HYBRID_DECODER, MOE_SIZES,
                                   REFERENCE, Layout, case_key, grad_errors, grad_mismatches,
                                   layout_config, make_reference, partial_out_norm_grad,
                                   reference_worker, replica_mismatches, run_case, spawn_layouts,
                                   twin_mismatches)

OVERLAP_PARAM_GATHER_TWINS = (
    Layout("tp2-dp2-overlap-distopt-2steps", tp=2, dp=2, overlap_grad_reduce=True,
           distributed_optimizer=True, steps=2),
    Layout("tp2-dp2-overlap-param-gather", tp=2, dp=2, overlap_grad_reduce=True,
           distributed_optimizer=True, overlap_param_gather=True, steps=2),
)
WORLDS = {
    2: (
        Layout("tp2", tp=2),
        Layout("tp2-sp", tp=2, sequence_parallel=True),
        Layout("cp2", cp=2),
        # the distributed optimizer shards over the DP x CP group (2 ranks here)
        Layout("cp2-distopt-recompute", cp=2, distributed_optimizer=True, recompute=True),
        Layout("thd-tp2-sp", tp=2, sequence_parallel=True, packed=True),
        Layout("thd-cp2-recompute", cp=2, packed=True, recompute=True),
        Layout("pp2", pp=2, model="gpt"),
        # the interleaved schedule: two virtual stages of one layer on each pipeline rank
        Layout("pp2-vp2", pp=2, vp=2, model="gpt"),
        # MoE MLPs, experts over EP, not split over TP (expert_tensor_parallel_size 1)
        Layout("moe-tp2-sp-ep2", tp=2, sequence_parallel=True, ep=2, model="gpt-moe"),
        Layout("moe-dp2-ep2", dp=2, ep=2, model="gpt-moe"),  # experts over the DP ranks
        # a LayerNorm output norm (flag off): its bias gradient is a per-rank partial too
        Layout("layernorm-tp2", tp=2, model="gdn-layernorm"),
        # SP off, so the module scales the partial dW: accumulated over two micro-batches,
        # reduced in buckets as the backward runs, and recomputed
        Layout("tp2-mb2-overlap-recompute", tp=2, micro_batches=2, overlap_grad_reduce=True,
               recompute=True),
        Layout("gpt-tp2-full-recompute", tp=2, full_recompute=True, model="gpt"),
        # fp16 parameters with megatron's dynamic loss scaler (the gradients hold the scale)
        Layout("tp2-fp16", tp=2, fp16=True),
        # megatron's HybridModel, GDN layers in the decoder and in its multi-token prediction
        Layout("hybrid-tp2-sp", tp=2, sequence_parallel=True, model="hybrid"),
        # its two stages: GDN, GDN | attention, MLP and the MTP depth with the embedding's copy
        Layout("hybrid-pp2", pp=2, model="hybrid"),
        # two virtual stages of one layer on each rank: GDN, attention | GDN, MLP and MTP
        Layout("hybrid-pp2-vp2", pp=2, vp=2, model="hybrid"),
    ),
    4: (
        Layout("tp4", tp=4),
        Layout("tp4-sp", tp=4, sequence_parallel=True),
        Layout("tp2-cp2-sp", tp=2, cp=2, sequence_parallel=True),
        Layout("tp2-dp2-sp-distopt", tp=2, dp=2, sequence_parallel=True,
               distributed_optimizer=True),
        Layout("thd-tp2-cp2-sp-recompute", tp=2, cp=2, sequence_parallel=True, packed=True,
               recompute=True),
        Layout("pp2-tp2-sp-recompute", pp=2, tp=2, sequence_parallel=True, recompute=True,
               model="gpt"),
        Layout("moe-tp4-sp-ep4-recompute", tp=4, sequence_parallel=True, ep=4, recompute=True,
               model="gpt-moe"),
        # two replicas of each expert (expert data parallelism), sharded by the optimizer
        Layout("moe-tp2-sp-dp2-ep2-distopt", tp=2, sequence_parallel=True, dp=2, ep=2,
               distributed_optimizer=True, model="gpt-moe"),
        # experts split over TP as well (megatron's default expert_tensor_parallel_size = TP),
        # tokens sent by megatron's default dispatcher, all-gather (the other MoE layouts use
        # all-to-all, as Qwen3-Next; at ETP 2 it gathers uneven token counts over the ETP
        # ranks, which gloo's all-gather refuses)
        Layout("moe-tp2-sp-dp2-ep2-etp2", tp=2, sequence_parallel=True, dp=2, ep=2, etp=2,
               model="gpt-moe", token_dispatcher="allgather"),
        Layout("pp2-vp2-tp2-sp-recompute", pp=2, vp=2, tp=2, sequence_parallel=True,
               recompute=True, model="gpt"),
        Layout("layernorm-tp2-dp2-distopt", tp=2, dp=2, distributed_optimizer=True,
               model="gdn-layernorm"),
        # SP off (the module scales the partial dW) with CP, with bucketed overlapping reduces
        # and the distributed optimizer, and in pipeline stages with virtual stages
        Layout("tp2-cp2", tp=2, cp=2),
        Layout("tp2-dp2-overlap-distopt", tp=2, dp=2, overlap_grad_reduce=True,
               distributed_optimizer=True),
        Layout("pp2-vp2-tp2-recompute", pp=2, vp=2, tp=2, recompute=True, model="gpt"),
        # megatron's torch FSDP2 wrapper with every parameter sharded over DP 2
        Layout("torch-fsdp2-tp2-dp2", tp=2, dp=2, torch_fsdp2=True),
        # two steps, the second's parameters all-gathered as the forward reaches them
        # (--overlap-param-gather), against the same two steps gathered in the optimizer step
        OVERLAP_PARAM_GATHER_TWINS[0],
        OVERLAP_PARAM_GATHER_TWINS[1],
        # megatron's per-token loss (--calculate-per-token-loss) over CP and micro-batches
        Layout("tp2-cp2-mb2-per-token-loss", tp=2, cp=2, micro_batches=2, per_token_loss=True),
        # DDP averaging in the collective (ReduceOp.AVG) with the distributed optimizer
        Layout("tp2-dp2-avg-in-collective-distopt", tp=2, dp=2, average_in_collective=True,
               distributed_optimizer=True),
        # the hybrid model with SP off: the module scales the partial dW, the MTP layer's too
        Layout("hybrid-tp2-dp2-distopt", tp=2, dp=2, distributed_optimizer=True, model="hybrid"),
        Layout("hybrid-pp2-tp2-sp", pp=2, tp=2, sequence_parallel=True, model="hybrid"),
    ),
}
# The same layouts with the fused region between in_proj and the recurrence
# (gdn_pre_gated_delta_rule_fusion): heads and conv channels split over TP, the CP all-to-all
# with its head permutation (conv weight / bias, A_log and dt_bias read as per-rank slices),
# packed sequences alone and with CP, pipeline stages, recompute, the distributed optimizer,
# torch FSDP2.
PRE_FUSION_WORLDS = {
    2: (
        Layout("tp2-sp", tp=2, sequence_parallel=True, pre_fusion=True),
        Layout("thd-tp2-sp", tp=2, sequence_parallel=True, packed=True, pre_fusion=True),
        Layout("cp2", cp=2, pre_fusion=True),
        Layout("thd-cp2-recompute", cp=2, packed=True, recompute=True, pre_fusion=True),
        Layout("pp2", pp=2, model="gpt", pre_fusion=True),
        Layout("gpt-tp2-full-recompute", tp=2, full_recompute=True, model="gpt",
               pre_fusion=True),
        # the hybrid model's GDN layers, its MTP depth's included
        Layout("hybrid-pp2", pp=2, model="hybrid", pre_fusion=True),
    ),
    4: (
        Layout("tp2-cp2-sp", tp=2, cp=2, sequence_parallel=True, pre_fusion=True),
        Layout("thd-tp2-cp2-sp-recompute", tp=2, cp=2, sequence_parallel=True, packed=True,
               recompute=True, pre_fusion=True),
        Layout("tp2-dp2-distopt", tp=2, dp=2, distributed_optimizer=True, pre_fusion=True),
        # megatron's torch FSDP2 wrapper: the region reads the all-gathered conv weight, A_log
        # and dt_bias, whose gradients are reduce-scattered to the shards
        Layout("torch-fsdp2-tp2-dp2", tp=2, dp=2, torch_fsdp2=True, pre_fusion=True),
    ),
}
# One spawn per group: (world size, pre_fusion) -> its layouts.
SPAWN_GROUPS = {**{(size, False): layouts for size, layouts in WORLDS.items()},
                **{(size, True): layouts for size, layouts in PRE_FUSION_WORLDS.items()}}
HAS_CUDA = torch.cuda.is_available()
# The environment of the spawned processes: no GPU, so the harness takes its gloo / CPU path
# (core.testing.parallel.init_world, core.testing.cpu's shims) on any machine.
CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
# Tests that build and run a model in this process (the layout cases spawn CPU processes).
in_a_cpu_process = pytest.mark.cpu_shims


@contextlib.contextmanager
def _spawned_processes_on_the_cpu():
    """While the block spawns processes, they inherit an environment without a GPU."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in CPU_ONLY_ENV.items():
            patch.setenv(name, value)
        yield


CASES = [(layout, fused) for group in SPAWN_GROUPS.values() for layout in group
         for fused in layout.flag_values]
CASE_IDS = [case_key(layout, fused) for layout, fused in CASES]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The TP 1 / CP 1 / one-stage reference: weights, batches and gradients (path, dict)."""
    from core.fusions.fused_gated_norm import interpreter_loop_problem

    if interpreter_loop_problem():  # this process or the spawned ones interpret the kernels
        pytest.skip(interpreter_loop_problem())
    tmp = tmp_path_factory.mktemp("layouts")
    path = str(tmp / "reference.pt")
    if not HAS_CUDA:
        init_cpu_model_parallel(tp_size=1)
        return path, make_reference(path)
    import torch.multiprocessing as mp

    # this process sees the GPU: compute it in one that does not
    with _spawned_processes_on_the_cpu():
        mp.spawn(reference_worker, nprocs=1, join=True,
                 args=(os.path.join(tmp, "rendezvous_reference"), path))
    return path, torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def worlds(reference, tmp_path_factory):
    """``worlds(n, pre_fusion=False)``: every rank's results of that group's n-process world
    (:data:`SPAWN_GROUPS`; spawned once, on first use)."""
    cache = {}

    def results(world_size: int, pre_fusion: bool = False) -> list:
        group = (world_size, pre_fusion)
        if group not in cache:
            out = tmp_path_factory.mktemp(f"world{world_size}{'-pre-fusion' * pre_fusion}")
            with _spawned_processes_on_the_cpu():
                cache[group] = spawn_layouts(SPAWN_GROUPS[group], reference[0], str(out))
        return cache[group]

    return results


def _records(worlds, layout: Layout, fused: bool) -> list:
    key = case_key(layout, fused)
    records = [rank[key] for rank in worlds(layout.world_size, layout.pre_fusion)]
    for rank, record in enumerate(records):
        if "error" in record:
            pytest.fail(f"{key} raised on rank {rank}:\n{record['error']}")
    return records


@pytest.mark.parametrize("layout, fused", CASES, ids=CASE_IDS)
def test_every_gradient_matches_reference(worlds, layout, fused):
    records = _records(worlds, layout, fused)
    # the case ran the path it names: the fused kernel or not, recompute or not, on every rank
    scaled = layout.tp > 1 and not layout.sequence_parallel  # the module completes the partial
    for record in records:
        assert record["fused_modules"] and set(record["fused_modules"]) == {fused}
        assert record["pre_fused_modules"] == [layout.pre_fusion] * len(record["fused_modules"])
        assert set(record["recompute_modules"]) == {layout.recompute}
        out_norms = {name for name in record["grads"] if name.endswith("out_norm.weight")}
        assert out_norms and (out_norms <= record["tp_avg_tagged"]) == scaled
        assert scaled or not out_norms & record["tp_avg_tagged"]
        if layout.torch_fsdp2:  # every parameter sharded over DP
            assert record["sharded"] == set(record["grads"])
        else:
            assert not record["sharded"]
    if layout.distributed_optimizer:
        assert all("owned" in record for record in records)
    assert grad_mismatches(records) == []
    # the largest gradient errors per layout (shown with -s)
    errors = grad_errors(records)
    decay = [e for n, e in errors.items() if n.rsplit(".", 1)[-1] in DECAY_PARAMS]
    print(f"\n{case_key(layout, fused)}: largest gradient error "
          f"{max(e for n, e in errors.items() if n.rsplit('.', 1)[-1] not in DECAY_PARAMS):.1e}, "
          f"out_norm {max(e for n, e in errors.items() if n.endswith('out_norm.weight')):.1e}, "
          f"A_log / dt_bias {max(decay, default=0.0):.1e}")


@pytest.mark.parametrize("layout, fused", CASES, ids=CASE_IDS)
def test_parameters_bit_identical_across_ranks_after_step(worlds, layout, fused):
    records = _records(worlds, layout, fused)
    assert replica_mismatches(records) == []
    # the out_norm weight of each GDN layer: held by every rank of its stage
    holders = {}
    for record in records:
        for name in record["params"]:
            if name.endswith("out_norm.weight"):
                holders.setdefault(name, []).append(record["coords"]["rank"])
    assert holders
    assert sum(len(ranks) for ranks in holders.values()) >= layout.world_size
    assert all(len(ranks) == layout.world_size // layout.pp for ranks in holders.values())


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_overlapped_param_gather_equals_gather_in_the_optimizer_step(worlds, fused):
    """With --overlap-param-gather the second step's forward reads parameters that DDP's
    pre-hooks all-gather as it reaches them (the fused path reads out_norm.weight without
    calling out_norm, so it runs out_norm's pre-hooks itself). Every rank's second-step
    gradients and parameters equal, bit for bit, those of the same two steps with the
    parameters gathered in the optimizer step."""
    gathered_in_step, overlapped = (_records(worlds, layout, fused)
                                    for layout in OVERLAP_PARAM_GATHER_TWINS)
    assert len(gathered_in_step) == len(overlapped) == 4
    assert all(len(record["later_grads"]) == 1 for record in (*gathered_in_step, *overlapped))
    assert twin_mismatches(gathered_in_step, overlapped) == []
    for record in gathered_in_step:  # the second step's gradients: of the updated parameters
        assert not torch.equal(record["later_grads"][0]["out_norm.weight"],
                               record["grads"]["out_norm.weight"])


LAYERNORM_CASES = [(layout, fused) for layout, fused in CASES if layout.model == "gdn-layernorm"]


@pytest.mark.parametrize("layout, fused", LAYERNORM_CASES,
                         ids=[case_key(layout, fused) for layout, fused in LAYERNORM_CASES])
def test_layernorm_bias_is_compared_and_tagged(worlds, layout, fused):
    """The LayerNorm layouts check the output norm's bias as well (each TP rank's bias gradient
    is a partial sum over its heads, as the weight's): both are compared on every rank, and
    both carry the tag that has finalize_model_grads reduce them over TP."""
    for record in _records(worlds, layout, fused):
        assert {"out_norm.weight", "out_norm.bias"} <= set(record["grads"])
        assert record["tp_avg_tagged"] >= {"out_norm.weight", "out_norm.bias"}


def _decoder_layers(record: dict) -> set:
    """The numbers of the decoder layers whose parameters a rank's record holds."""
    return {int(m.group(1)) for name in record["params"]
            if (m := re.match(r"decoder\.layers\.(\d+)\.", name))}


VIRTUAL_PIPELINE_CASES = [(layout, fused) for layout, fused in CASES if layout.vp > 1]


@pytest.mark.parametrize("layout, fused", VIRTUAL_PIPELINE_CASES,
                         ids=[case_key(layout, fused) for layout, fused in VIRTUAL_PIPELINE_CASES])
def test_virtual_pipeline_stages_interleave_the_layers(worlds, layout, fused):
    """With virtual stages, pipeline rank r holds layers r, r + PP, ... (one model chunk each):
    the interleaved schedule ran, not one contiguous stage per rank."""
    for record in _records(worlds, layout, fused):
        layers = _decoder_layers(record)
        pp_rank = record["coords"]["pp"]
        expected = list(range(pp_rank, layout.decoder_layers, layout.pp))
        assert sorted(layers) == expected, (record["coords"], layers)


HYBRID_PIPELINE_CASES = [(layout, fused) for layout, fused in CASES
                         if layout.model == "hybrid" and layout.pp > 1]


@pytest.mark.parametrize("layout, fused", HYBRID_PIPELINE_CASES,
                         ids=[case_key(layout, fused) for layout, fused in HYBRID_PIPELINE_CASES])
def test_hybrid_stages_split_the_pattern_and_the_last_holds_the_mtp_depth(worlds, layout, fused):
    """The hybrid model over two pipeline stages. Without virtual stages the first holds layers
    0-1 (GDN, GDN) and the embedding, the last layers 2-3. With two virtual stages each rank
    holds every other layer (0 and 2: GDN, attention; 1 and 3: GDN, MLP), one per model chunk.
    The last rank holds the MTP depth (its GDN layer fused with the flag) and the embedding's
    copy that MTP reads."""
    expected = {(2, 1): ([0, 1], [2, 3]), (2, 2): ([0, 2], [1, 3])}[layout.pp, layout.vp]
    for record in _records(worlds, layout, fused):
        names = set(record["params"])
        layers = _decoder_layers(record)
        last = record["coords"]["pp"] == 1
        assert sorted(layers) == expected[last], (record["coords"], layers)
        assert any(name.startswith("mtp.") for name in names) == last
        assert "embedding.word_embeddings.weight" in names
        gdn_layers = sum(HYBRID_DECODER[i] == "G" for i in expected[last])
        assert record["fused_modules"] == [fused] * (gdn_layers + last), record["coords"]


MOE_CASES = [(layout, fused) for layout, fused in CASES if layout.ep > 1]


@pytest.mark.parametrize("layout, fused", MOE_CASES,
                         ids=[case_key(layout, fused) for layout, fused in MOE_CASES])
def test_moe_layers_dispatch_with_the_layouts_dispatcher(worlds, layout, fused):
    """Every MoE layer of every rank sends its tokens with the dispatcher the layout names
    (megatron's MoEAlltoAllTokenDispatcher or MoEAllGatherTokenDispatcher)."""
    expected = {"alltoall": "MoEAlltoAllTokenDispatcher",
                "allgather": "MoEAllGatherTokenDispatcher"}[layout.token_dispatcher]
    for record in _records(worlds, layout, fused):
        assert record["token_dispatchers"] == {expected}, record["coords"]


@pytest.mark.parametrize("layout, fused", MOE_CASES,
                         ids=[case_key(layout, fused) for layout, fused in MOE_CASES])
def test_experts_are_split_over_the_expert_parallel_ranks(worlds, layout, fused):
    """Each rank holds num_moe_experts / EP experts of every MoE layer, those of its EP rank
    (split over expert tensor parallelism where ETP > 1), and every expert lies on world / EP
    ranks (its ETP shards and expert-data-parallel replicas): the layout is expert parallel, not
    a replicated MoE."""
    experts = MOE_SIZES["num_moe_experts"]
    per_rank = experts // layout.ep
    holders = {}
    for record in _records(worlds, layout, fused):
        ep_rank = record["coords"]["ep"]
        held = {}
        for name in record["params"]:
            match = re.search(r"^(decoder\.layers\.\d+)\.mlp\.experts\.local_experts\.(\d+)\."
                              r"linear_fc1\.weight$", name)
            if match:
                held.setdefault(match.group(1), []).append(int(match.group(2)))
        assert len(held) == GPT_LAYERS, held  # every layer of the GPT model has MoE MLPs
        for layer, indices in held.items():
            assert sorted(indices) == list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
            for index in indices:
                holders.setdefault((layer, index), []).append(record["coords"]["rank"])
    assert len(holders) == GPT_LAYERS * experts
    assert all(len(ranks) == layout.world_size // layout.ep for ranks in holders.values())
    # an expert's fc1 weight: [moe_ffn_hidden_size / ETP, hidden] on every rank
    fc1_rows = {record["params"][name].shape[0] for record in _records(worlds, layout, fused)
                for name in record["params"] if name.endswith(".linear_fc1.weight")
                and ".local_experts." in name}
    assert fc1_rows == {MOE_SIZES["moe_ffn_hidden_size"] // layout.etp}


def test_pre_fusion_cases_are_named_apart_and_set_the_config_field():
    """A pre-fusion layout's case never shares a key with the same layout without the fusion
    (every case of the matrix has its own), and its config turns the fusion on."""
    plain = Layout("tp2-sp", tp=2, sequence_parallel=True)
    pre = dataclasses.replace(plain, pre_fusion=True)
    assert {case_key(pre, fused) for fused in (True, False)}.isdisjoint(
        {case_key(plain, fused) for fused in (True, False)})
    assert len(set(CASE_IDS)) == len(CASE_IDS)
    assert layout_config(pre, fused=True).gdn_pre_gated_delta_rule_fusion is True
    assert not layout_config(plain, fused=True).gdn_pre_gated_delta_rule_fusion
    with pytest.raises(TypeError, match="pre_fusion must be a bool, got str"):
        Layout("tp2-sp", tp=2, sequence_parallel=True, pre_fusion="true")


# ----------------------------------------------------------------------------------------------
# The checks catch what they are for
# ----------------------------------------------------------------------------------------------


@in_a_cpu_process
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_comparison_catches_unreduced_out_norm_gradient(reference, worlds, fused):
    """Give each TP 2 rank the out_norm gradient of its own heads only (what it holds when no
    TP reduction happens): the comparison flags exactly that parameter on every rank."""
    layout = WORLDS[2][0]
    assert layout.tp == 2 and not layout.sequence_parallel
    records = copy.deepcopy(_records(worlds, layout, fused))
    init_cpu_model_parallel(tp_size=1)
    partials = [partial_out_norm_grad(reference[1], fused, r, layout.tp) for r in range(layout.tp)]
    full = reference[1]["grads"][f"gdn-sbhd-{'fused' if fused else 'unfused'}"]["out_norm.weight"]
    torch.testing.assert_close(sum(partials), full, rtol=1e-5, atol=1e-7)  # the genuine pieces
    for record in records:
        record["grads"]["out_norm.weight"] = partials[record["coords"]["tp"]]
    failures = grad_mismatches(records)
    assert len(failures) == layout.tp, failures
    assert all("out_norm.weight" in failure for failure in failures), failures


def test_replica_check_catches_one_ulp(worlds):
    records = copy.deepcopy(_records(worlds, WORLDS[2][1], True))
    weight = records[1]["params"]["out_norm.weight"]
    weight[3] = torch.nextafter(weight[3], torch.tensor(float("inf")))
    failures = replica_mismatches(records)
    assert len(failures) == 1 and "out_norm.weight: rank 1 differs" in failures[0], failures


def test_distributed_optimizer_coverage_check(worlds):
    """A rank whose owned range of a parameter is dropped leaves that part unchecked: flagged."""
    layout = WORLDS[2][3]
    assert layout.distributed_optimizer
    records = copy.deepcopy(_records(worlds, layout, True))
    owners = [r for r in records
              if r["owned"]["out_norm.weight"][1] > r["owned"]["out_norm.weight"][0]]
    assert owners
    owners[0]["owned"]["out_norm.weight"] = (0, 0)
    failures = grad_mismatches(records)
    assert len(failures) == 1 and "out_norm.weight" in failures[0] \
        and "owned by exactly one rank" in failures[0], failures


# ----------------------------------------------------------------------------------------------
# Packed sequences: what megatron refuses, and the CPU kernels they run on
# ----------------------------------------------------------------------------------------------


def _packed_params(cu):
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def _gdn(reference, **layout_changes):
    from core.testing.gdn import build_gdn_module

    init_cpu_model_parallel(tp_size=1)
    layout = dataclasses.replace(REFERENCE["gdn"], **layout_changes)
    module = build_gdn_module(layout_config(layout, fused=True), seed=99)
    module.load_state_dict(reference[1]["weights"]["gdn"])
    return module


@in_a_cpu_process
@pytest.mark.parametrize("deterministic, batch, message", [
    (True, 1, "Packed sequence does not support deterministic mode"),
    (False, 2, "Packed sequence expects batch dimension to be 1"),
], ids=["deterministic_mode", "batch2"])
def test_megatron_refuses_packed_sequences(reference, deterministic, batch, message):
    """megatron's GatedDeltaNet takes THD only without deterministic_mode (FLA's kernels; on the
    CPU the stand-ins of core.testing.cpu) and with B = 1."""
    module = _gdn(reference, packed=not deterministic)
    data = reference[1]["data"]["thd"]
    hidden = data["hidden"].expand(-1, batch, -1).contiguous()
    with pytest.raises(AssertionError, match=message):
        module(hidden, attention_mask=None, packed_seq_params=_packed_params(data["cu_seqlens"]))


@in_a_cpu_process
def test_packed_output_equals_each_sequence_alone(reference):
    """The packed reference computes each sequence as if alone (the stand-ins honour cu_seqlens
    and megatron's THD path keeps sequences apart)."""
    module = _gdn(reference, packed=True)
    data = reference[1]["data"]["thd"]
    cu = data["cu_seqlens"]
    packed, _ = module(data["hidden"], attention_mask=None, packed_seq_params=_packed_params(cu))
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone, _ = module(data["hidden"][start:end], attention_mask=None)
        torch.testing.assert_close(packed[start:end], alone, rtol=1e-5, atol=1e-6)


@in_a_cpu_process
def test_stand_ins_equal_megatron_deterministic_path(reference):
    """Without cu_seqlens the CPU stand-ins of FLA's kernels are megatron's deterministic_mode
    path: same output and gradients (sbhd, B = 2)."""
    data = reference[1]["data"]["sbhd"]
    results = []
    for packed in (False, True):  # packed=True: deterministic_mode off, the stand-ins run
        module = _gdn(reference, packed=packed)
        hidden = data["hidden"].clone().requires_grad_(True)
        output, _ = module(hidden, attention_mask=None)
        (output * data["loss_weight"]).sum().backward()
        results.append((output.detach(), hidden.grad,
                        {n: p.grad for n, p in module.named_parameters()}))
    (out_a, dx_a, grads_a), (out_b, dx_b, grads_b) = results
    assert torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@in_a_cpu_process
def test_fsdp_layout_refused_without_cuda(reference):
    """Megatron-FSDP runs on GPUs only (tests/ssm/test_gdn_layouts_gpu.py::fsdp-tp2): the harness
    says so before megatron fails on torch.cuda.current_device()."""
    init_cpu_model_parallel(tp_size=1)
    with pytest.raises(RuntimeError, match="Megatron-FSDP needs CUDA"):
        run_case(Layout("fsdp", fsdp=True), True, reference[1], torch.device("cpu"))
