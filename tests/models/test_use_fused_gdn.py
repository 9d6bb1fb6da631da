"""use_fused_gdn on megatron's own GDN specs (the GPT block spec of the gated_delta_net variant,
dense and MoE; the hybrid stack spec; lists, tuples, import paths): only the GDN class changes,
the input is untouched, and the models built from both specs have the same state-dict and
sharded-state-dict keys. assert_fused_gdn rejects a model that asks for the fusion but holds
megatron's class."""

from core.testing.cpu import init_cpu_model_parallel, install_cpu_shims

install_cpu_shims()

import dataclasses  # noqa: E402
import functools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt import experimental_attention_variant_module_specs as mexp  # noqa: E402
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec  # noqa: E402
from megatron.core.models.hybrid.hybrid_model import HybridModel  # noqa: E402
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGDN  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

from core.models.gdn_specs import assert_fused_gdn, use_fused_gdn  # noqa: E402
from core.ssm import GatedDeltaNet  # noqa: E402
from core.testing.gdn import gdn_config  # noqa: E402
from core.testing.specs import megatron_te_spec_builders, te_to_local  # noqa: E402

VOCAB, SEQ = 64, 16


@pytest.fixture(scope="module", autouse=True)
def _model_parallel():
    init_cpu_model_parallel(tp_size=1)


def _config(moe: bool = False, **overrides):
    kwargs = dict(num_layers=4, linear_attention_freq=2, params_dtype=torch.float32)
    if moe:
        kwargs.update(num_moe_experts=2, moe_layer_freq=[1, 0, 0, 1], moe_router_topk=2,
                      moe_ffn_hidden_size=32)
    kwargs.update(overrides)
    return gdn_config(**kwargs)


def _megatron_block_spec(config):
    with megatron_te_spec_builders():
        return mexp.get_transformer_block_with_experimental_attention_variant_spec(config)


# --- an independent structural comparison (not use_fused_gdn's own walk) ---------------------


def _compare(a, b, path="spec"):
    """Assert b is a with megatron's GDN class swapped for ours; return how many were swapped."""
    if isinstance(a, ModuleSpec):
        assert isinstance(b, ModuleSpec), path
        swapped = 0
        if a.module is MegatronGDN:
            assert b.module is GatedDeltaNet, f"{path}.module"
            swapped = 1
        else:
            assert b.module is a.module, f"{path}.module"
        for name in ("params", "submodules", "metainfo"):
            swapped += _compare(getattr(a, name), getattr(b, name), f"{path}.{name}")
        return swapped
    if isinstance(a, type) or a is None:
        if a is MegatronGDN:
            assert b is GatedDeltaNet, path
            return 1
        assert b is a, path
        return 0
    if dataclasses.is_dataclass(a):
        assert type(b) is type(a), path
        return sum(_compare(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
                   for f in dataclasses.fields(a))
    if isinstance(a, functools.partial):
        assert type(b) is type(a) and len(a.args) == len(b.args), path
        assert a.keywords.keys() == b.keywords.keys(), path
        return (_compare(a.func, b.func, f"{path}.func")
                + sum(_compare(x, y, f"{path}.args") for x, y in zip(a.args, b.args))
                + sum(_compare(a.keywords[k], b.keywords[k], f"{path}.{k}") for k in a.keywords))
    if isinstance(a, (list, tuple)):
        assert type(b) is type(a) and len(b) == len(a), path
        return sum(_compare(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    if isinstance(a, dict):
        assert type(b) is type(a) and b.keys() == a.keys(), path
        return sum(_compare(a[k], b[k], f"{path}[{k!r}]") for k in a)
    assert b is a or b == a, path
    return 0


def _fingerprint(node, path="spec", out=None, seen=None):
    """(path, id, type) of every node reachable from ``node``: changes if anything is mutated."""
    out = [] if out is None else out
    seen = set() if seen is None else seen
    out.append((path, id(node), type(node)))
    if id(node) in seen or isinstance(node, type):
        return out
    seen.add(id(node))
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _fingerprint(getattr(node, f.name), f"{path}.{f.name}", out, seen)
    elif isinstance(node, functools.partial):
        for i, x in enumerate((node.func, *node.args, *node.keywords.values())):
            _fingerprint(x, f"{path}<{i}>", out, seen)
    elif isinstance(node, (list, tuple)):
        for i, x in enumerate(node):
            _fingerprint(x, f"{path}[{i}]", out, seen)
    elif isinstance(node, dict):
        for k, x in node.items():
            _fingerprint(x, f"{path}[{k!r}]", out, seen)
    return out


def _check_swap(spec, expected_swaps):
    before = _fingerprint(spec)
    fused = use_fused_gdn(spec)
    assert _compare(spec, fused) == expected_swaps
    assert _fingerprint(spec) == before, "use_fused_gdn modified its input"
    assert use_fused_gdn(fused) is fused  # nothing left to replace: the same object back
    return fused


# --- spec trees --------------------------------------------------------------------------------


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gpt_block_spec_of_the_gdn_variant(moe):
    spec = _megatron_block_spec(_config(moe=moe))
    fused = _check_swap(spec, expected_swaps=2)  # layers 0 and 2 are GDN (freq 2)
    gdn = [layer.submodules.self_attention for layer in fused.layer_specs]
    assert gdn[0] is gdn[2], "megatron's shared mixer spec stays shared"
    assert fused.layer_specs[1] is spec.layer_specs[1]  # attention layers: the same objects
    if moe:  # the MoE builder of layer 0 is untouched
        assert fused.layer_specs[0].submodules.mlp.func.__name__ == "MoELayer"
        assert fused.layer_specs[0].submodules.mlp is spec.layer_specs[0].submodules.mlp


def test_layer_spec_list_and_tuple_and_local_backend():
    config = _config()
    with megatron_te_spec_builders():
        layers = mexp.get_transformer_layer_with_experimental_attention_variant_spec(config)
    fused = _check_swap(layers, expected_swaps=2)
    assert isinstance(fused, list)
    assert isinstance(_check_swap(tuple(layers), expected_swaps=2), tuple)
    from megatron.core.models.backends import LocalSpecProvider

    local = mexp.get_gated_delta_net_module_spec(config, backend=LocalSpecProvider())
    assert _check_swap(local, expected_swaps=1).module is GatedDeltaNet


def test_hybrid_stack_spec():
    fused = _check_swap(hybrid_stack_spec, expected_swaps=1)
    assert fused.submodules.gdn_layer.submodules.self_attention.module is GatedDeltaNet
    for name in ("mamba_layer", "attention_layer", "mlp_layer", "moe_layer", "mtp_block_spec"):
        assert getattr(fused.submodules, name) is getattr(hybrid_stack_spec.submodules, name)


def test_bare_class_import_path_and_foreign_subclass():
    assert use_fused_gdn(MegatronGDN) is GatedDeltaNet
    by_path = ModuleSpec(module=("megatron.core.ssm.gated_delta_net", "GatedDeltaNet"))
    assert use_fused_gdn(by_path).module is GatedDeltaNet
    other = ModuleSpec(module=("megatron.core.transformer.attention", "SelfAttention"))
    assert use_fused_gdn(other) is other

    class TheirGDN(MegatronGDN):
        pass

    theirs = ModuleSpec(module=TheirGDN)
    assert use_fused_gdn(theirs) is theirs


# --- built models: same keys -------------------------------------------------------------------


def _keys(model):
    state = {k: tuple(v.shape) for k, v in model.state_dict().items() if torch.is_tensor(v)}
    sharded = sorted(model.sharded_state_dict().keys())
    return state, sharded


def _gdn_types(model):
    return [type(m) for m in model.modules() if isinstance(m, MegatronGDN)]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gpt_model_keys_unchanged(moe):
    config = _config(moe=moe)
    spec = te_to_local(_megatron_block_spec(config))
    megatron_model = GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB,
                              max_sequence_length=SEQ)
    ours = GPTModel(config, transformer_layer_spec=use_fused_gdn(spec), vocab_size=VOCAB,
                    max_sequence_length=SEQ)
    assert _gdn_types(megatron_model) == [MegatronGDN] * 2
    assert _gdn_types(ours) == [GatedDeltaNet] * 2
    if moe:
        assert type(ours.decoder.layers[0].mlp).__name__ == "MoELayer"
    state_a, sharded_a = _keys(megatron_model)
    state_b, sharded_b = _keys(ours)
    assert state_a == state_b
    assert sharded_a == sharded_b
    assert any("self_attention.out_norm.weight" in k for k in sharded_a)


def test_hybrid_model_keys_unchanged():
    config = _config(num_layers=4, linear_attention_freq=None, experimental_attention_variant=None)
    spec = te_to_local(hybrid_stack_spec)
    kwargs = dict(vocab_size=VOCAB, max_sequence_length=SEQ, hybrid_layer_pattern="G*G-",
                  post_process=False)  # the final norm of HybridStack is TENorm, hard-coded
    megatron_model = HybridModel(config, spec, **kwargs)
    ours = HybridModel(config, use_fused_gdn(spec), **kwargs)
    assert _gdn_types(megatron_model) == [MegatronGDN] * 2
    assert _gdn_types(ours) == [GatedDeltaNet] * 2
    state_a, sharded_a = _keys(megatron_model)
    state_b, sharded_b = _keys(ours)
    assert state_a == state_b
    assert sharded_a == sharded_b


# --- assert_fused_gdn ------------------------------------------------------------------------


def _gpt(config, spec):
    return GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def test_assert_fused_gdn_names_megatron_layers():
    config = _config(fused_gated_norm=True)
    spec = te_to_local(_megatron_block_spec(config))
    model = _gpt(config, spec)
    with pytest.raises(TypeError, match="fused_gated_norm=True") as info:
        assert_fused_gdn(model)
    message = str(info.value)
    assert "decoder.layers.0.self_attention" in message
    assert "decoder.layers.2.self_attention" in message
    assert "decoder.layers.1" not in message
    with pytest.raises(TypeError, match=r"\[1\]\.decoder\.layers\.0\.self_attention"):
        assert_fused_gdn([_gpt(config, use_fused_gdn(spec)), model])  # model chunks
    assert_fused_gdn(_gpt(config, use_fused_gdn(spec)))  # ours: passes


def test_assert_fused_gdn_zero_centring_override_and_no_op():
    override = _config(layernorm_zero_centered_gamma=True, gdn_out_norm_zero_centered_gamma=False)
    spec = te_to_local(_megatron_block_spec(override))
    with pytest.raises(TypeError, match="gdn_out_norm_zero_centered_gamma=False"):
        assert_fused_gdn(_gpt(override, spec))
    plain = _config()
    assert_fused_gdn(_gpt(plain, te_to_local(_megatron_block_spec(plain))))  # nothing asked
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        assert_fused_gdn("model")
