"""megatron's Transformer Engine specs on a machine without Transformer Engine (test-side only).

megatron-core's GDN specs name TE classes (the GPT block spec of the ``gated_delta_net``
attention variant, the hybrid stack spec). Without TE their builders stop at
``TESpecProvider`` (None), and the TE names are stand-ins that cannot be built. Two helpers let
the tests take those real spec trees as they are and build models from them on the CPU:

    with megatron_te_spec_builders():
        spec = get_transformer_block_with_experimental_attention_variant_spec(config)
    model = GPTModel(config, transformer_layer_spec=te_to_local(spec), ...)

``te_to_local`` swaps each TE class for megatron-core's own module with the same role
(:func:`te_to_local_map`); the structure of the tree is kept, so two trees that differ only in
the GDN class build models whose keys differ only if the GDN class changes them. TE's linear
layer that fuses the input norm (``TELayerNormColumnParallelLinear``) becomes
:class:`NormedColumnParallelLinear`, the config's norm followed by megatron's
ColumnParallelLinear, so the model computes what the TE model computes (state-dict keys of the
norm differ from TE's).

``compare_gdn_swap(a, b)`` asserts that ``b`` is ``a`` with only the GDN class changed, and
``spec_fingerprint(spec)`` records a tree's node identities (to show a spec was not mutated);
``checkpoint_keys(model)`` maps state-dict names to distributed-checkpoint keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib

from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGDN
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from core.ssm.gated_delta_net import GatedDeltaNet

# megatron modules whose TE spec builders look up TESpecProvider as a module global.
SPEC_BUILDER_MODULES = (
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
)


@contextlib.contextmanager
def megatron_te_spec_builders():
    """Within the block, megatron's TE spec builders run without Transformer Engine (they only
    assemble spec objects; nothing is built). A no-op where TE is installed."""
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    saved = []
    for name in SPEC_BUILDER_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "TESpecProvider", None) is None:
            saved.append((module, "TESpecProvider" in vars(module), getattr(module, "TESpecProvider", None)))
            module.TESpecProvider = TESpecProvider
    try:
        yield
    finally:
        for module, existed, value in saved:
            if existed:
                module.TESpecProvider = value
            else:
                del module.TESpecProvider


class NormedColumnParallelLinear(ColumnParallelLinear):
    """TE's ``TELayerNormColumnParallelLinear`` from megatron-core modules: the config's norm
    (:class:`~core.transformer.rms_norm.LocalNorm`, ``norm``) over the input, then megatron's
    ColumnParallelLinear with the same arguments. Under sequence parallelism the norm runs on
    this rank's tokens before the linear layer gathers them, as TE's does."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        from core.transformer.rms_norm import LocalNorm

        super().__init__(input_size, output_size, config=config, **kwargs)
        self.norm = LocalNorm(config, input_size, eps=config.layernorm_epsilon)

    def forward(self, input_, *args, **kwargs):
        return super().forward(self.norm(input_), *args, **kwargs)


def te_to_local_map() -> dict:
    """TE class (or its stand-in without TE) -> megatron-core's own module of the same role."""
    import megatron.core.extensions.transformer_engine as te
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from core.transformer.rms_norm import LocalNorm

    return {
        te.TELayerNormColumnParallelLinear: NormedColumnParallelLinear,
        te.TEColumnParallelLinear: ColumnParallelLinear,
        te.TERowParallelLinear: RowParallelLinear,
        te.TEDotProductAttention: DotProductAttention,
        te.TENorm: LocalNorm,
    }


def te_to_local(spec):
    """``spec`` with every TE class of :func:`te_to_local_map` replaced (a copy; see
    ``core.models.gdn_specs.replace_modules``)."""
    from core.models.gdn_specs import replace_modules

    return replace_modules(spec, te_to_local_map())


def compare_gdn_swap(a, b, path="spec"):
    """Assert that spec tree ``b`` is ``a`` with megatron's GatedDeltaNet replaced by
    core.ssm.GatedDeltaNet and nothing else changed; return how many were replaced. A walk of
    its own (not core.models.gdn_specs.replace_modules), so it can judge that function."""
    if isinstance(a, ModuleSpec):
        assert isinstance(b, ModuleSpec), path
        swapped = 0
        if a.module is MegatronGDN:
            assert b.module is GatedDeltaNet, f"{path}.module"
            swapped = 1
        else:
            assert b.module is a.module, f"{path}.module"
        for name in ("params", "submodules", "metainfo"):
            swapped += compare_gdn_swap(getattr(a, name), getattr(b, name), f"{path}.{name}")
        return swapped
    if isinstance(a, type) or a is None:
        if a is MegatronGDN:
            assert b is GatedDeltaNet, path
            return 1
        assert b is a, path
        return 0
    if dataclasses.is_dataclass(a):
        assert type(b) is type(a), path
        return sum(compare_gdn_swap(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
                   for f in dataclasses.fields(a))
    if isinstance(a, functools.partial):
        assert type(b) is type(a) and len(a.args) == len(b.args), path
        assert a.keywords.keys() == b.keywords.keys(), path
        return (compare_gdn_swap(a.func, b.func, f"{path}.func")
                + sum(compare_gdn_swap(x, y, f"{path}.args") for x, y in zip(a.args, b.args))
                + sum(compare_gdn_swap(a.keywords[k], b.keywords[k], f"{path}.{k}") for k in a.keywords))
    if isinstance(a, (list, tuple)):
        assert type(b) is type(a) and len(b) == len(a), path
        return sum(compare_gdn_swap(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    if isinstance(a, dict):
        assert type(b) is type(a) and b.keys() == a.keys(), path
        return sum(compare_gdn_swap(a[k], b[k], f"{path}[{k!r}]") for k in a)
    assert b is a or b == a, path
    return 0


def spec_fingerprint(node, path="spec", out=None, seen=None):
    """(path, id, type) of every node reachable from a spec tree: differs after any mutation."""
    out = [] if out is None else out
    seen = set() if seen is None else seen
    out.append((path, id(node), type(node)))
    if id(node) in seen or isinstance(node, type):
        return out
    seen.add(id(node))
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            spec_fingerprint(getattr(node, f.name), f"{path}.{f.name}", out, seen)
    elif isinstance(node, functools.partial):
        for i, x in enumerate((node.func, *node.args, *node.keywords.values())):
            spec_fingerprint(x, f"{path}<{i}>", out, seen)
    elif isinstance(node, (list, tuple)):
        for i, x in enumerate(node):
            spec_fingerprint(x, f"{path}[{i}]", out, seen)
    elif isinstance(node, dict):
        for k, x in node.items():
            spec_fingerprint(x, f"{path}[{k!r}]", out, seen)
    return out


def checkpoint_keys(model) -> dict:
    """``{state-dict name: key in a distributed checkpoint}`` of ``model.sharded_state_dict()``
    (megatron's ``sharded_state_dict_keys_map`` renames the latter, not the former)."""
    return {name: getattr(value, "key", None) for name, value in model.sharded_state_dict().items()}
