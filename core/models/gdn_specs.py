"""Specs that build Gated DeltaNet models whose GDN layers are core.ssm.GatedDeltaNet (the class
that implements the fused output norm and the fusion before the gated delta rule), on top of
megatron-core's own spec functions.

    use_fused_gdn(spec)                   any megatron spec tree with megatron's GatedDeltaNet
                                          replaced by ours, fused whatever the config (nothing
                                          built, input untouched)
    assert_fused_gdn(model)               raises, naming the layers, unless every GDN layer of
                                          a built Megatron model runs the fusion
    replace_modules(spec, {old: new})     the spec rewrite both of the above rest on
    get_gdn_hybrid_block_spec(config)     GPTModel block of the gated_delta_net attention variant:
                                          megatron's block spec (TE), or the same block from
                                          megatron's local layer specs (no TE)
    get_gdn_module_spec(use_te, config)   the GDN mixer
    get_gdn_layer_spec(use_te, config)    a TransformerLayer: GDN mixer + dense MLP
    get_attention_layer_spec(use_te)      megatron's standard attention TransformerLayer

HybridModel ('G' layers of a ``hybrid_layer_pattern``): ``use_fused_gdn(hybrid_stack_spec)``
(``megatron.core.models.hybrid.hybrid_layer_specs``); megatron's hybrid stack is TE-only.

``use_te=None`` uses Transformer Engine when it is installed and ``config.transformer_impl`` is
'transformer_engine' (megatron's default); ``False`` forces megatron-core's own modules
(ColumnParallelLinear / RowParallelLinear / DotProductAttention and
:class:`core.transformer.LocalNorm`), which work on any device; ``True`` without TE raises.
The ``get_gdn_*`` builders leave the fusions to the config (``fused_gated_norm``, or megatron
main's name ``gdn_gated_output_norm_fusion``; ``gdn_pre_gated_delta_rule_fusion``; unset: off).
:func:`use_fused_gdn` switches them in the spec itself, which serves any config, megatron's
own TransformerConfig included (what megatron's pretrain scripts build, with no fusion field),
as do the ready-made specs for megatron's ``--spec`` option in ``core.models.fused_gdn_specs``.

Example::

    config = TransformerConfig(..., experimental_attention_variant="gated_delta_net",
                               linear_attention_freq=4, normalization="RMSNorm",
                               activation_func=F.silu, fused_gated_norm=True)
    model = GPTModel(config, transformer_layer_spec=get_gdn_hybrid_block_spec(config),
                     vocab_size=..., max_sequence_length=...)
    assert_fused_gdn(model)

    # a spec from megatron, or from a framework on top of it: our GDN class, fused
    model = HybridModel(config, use_fused_gdn(hybrid_stack_spec), ...)
    assert_fused_gdn(model)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
from typing import Any, Mapping, NamedTuple, Optional

import torch

# First: megatron's GDN specs import its GatedDeltaNet, which imports FLA; through core.ssm an FLA
# that fails under the installed Triton is named as the cause (core.ssm.megatron_gdn_import).
from core.ssm.gated_delta_net import GatedDeltaNet  # isort: skip

from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.models.gpt import experimental_attention_variant_module_specs as _mgdn
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGatedDeltaNet
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from core.fusions.gated_norm_validation import check_bool
from core.transformer.rms_norm import LocalNorm
from core.transformer.transformer_config import (
    GATED_OUTPUT_NORM_NAMES,
    PRE_GATED_DELTA_RULE_NAME,
    gated_output_norm_fusion,
    gdn_out_norm_zero_centered,
    pre_gated_delta_rule_fusion_setting,
)

try:
    import transformer_engine  # noqa: F401  # pylint: disable=unused-import

    HAVE_TE = True
except ImportError:
    HAVE_TE = False


def replace_modules(spec: Any, replacements: Mapping[Any, Any],
                    params: Optional[Mapping[Any, Mapping[str, Any]]] = None) -> Any:
    """A copy of a spec tree with every occurrence of a key of ``replacements`` (a class,
    function or any other object, matched by identity) replaced by its value, and the
    ``params`` of every ``ModuleSpec`` whose module (after the replacement) is a key of
    ``params`` updated with its value (the keyword arguments megatron's ``build_module`` passes
    to that module). Nothing is built.

    ``spec`` is anything megatron takes as a spec: a ``ModuleSpec``, a submodules dataclass
    (``TransformerBlockSubmodules``, ``TransformerLayerSubmodules``, ``HybridStackSubmodules``,
    ...), a list / tuple of them, or a bare class. The walk descends into dataclass fields,
    lists, tuples, dicts (``params``, ``metainfo``) and ``functools.partial`` builders (megatron's
    MLP / MoE submodules), and resolves a ``ModuleSpec.module`` given as an import path
    ``(module, name)`` when ``name`` is the name of a replaced object.

    The input is not modified. A node none of whose descendants changes is returned as is (the
    same object); a changed node is a shallow copy with the changed fields set (no
    ``__init__`` / ``__post_init__`` re-run). A node shared by several parents (megatron's block
    builders reuse one mixer spec for every GDN layer) maps to one shared copy.

    A spec *function* (what megatron.training's ``GPTModelConfig`` and Megatron-Bridge's
    providers take as ``transformer_layer_spec``, e.g.
    ``get_transformer_block_with_experimental_attention_variant_spec`` or a ``functools.partial``
    of one) gives a function with its signature (``vp_stage`` included) that calls it and
    replaces in what it returns. None (megatron's "default spec") and anything else that is no
    spec are refused (TypeError): returning them unchanged would hide that nothing was replaced."""
    if spec is None:
        raise TypeError(
            "replace_modules: spec is None, which megatron reads as its default spec (with its "
            "own GatedDeltaNet): pass the spec itself, e.g. core.models.get_gdn_hybrid_block_spec "
            "for a GPT model or megatron's hybrid_stack_spec for a hybrid one")
    # a ModuleSpec is a dataclass; classes and functools.partial builders are callable
    if not (isinstance(spec, (list, tuple)) or dataclasses.is_dataclass(spec) or callable(spec)):
        raise TypeError(f"replace_modules: spec must be a spec, a list of specs or a spec "
                        f"function, got {type(spec).__name__} {spec!r}")
    rewrite = _Rewrite(tuple(replacements.items()), tuple((params or {}).items()))
    if not (rewrite.pairs or rewrite.params):
        return spec
    if _is_spec_function(spec) and _replacement(spec, rewrite.pairs) is _NO_REPLACEMENT:
        @functools.wraps(spec)
        def spec_with_replacements(*args, **kwargs):
            return _replace(spec(*args, **kwargs), rewrite, {})

        return spec_with_replacements
    return _replace(spec, rewrite, {})


class _Rewrite(NamedTuple):
    """What replace_modules changes: ``(old, new)`` pairs, and ``(module, params)`` pairs."""
    pairs: tuple
    params: tuple


def _is_spec_function(spec: Any) -> bool:
    """A callable that builds a spec (a function, a bound method, a ``functools.partial`` of a
    function, an object with ``__call__``), not a spec node: a class (the module itself), a
    partial of a class (megatron's MLP / MoE builders), a ModuleSpec or another dataclass."""
    if isinstance(spec, functools.partial):
        return not inspect.isclass(spec.func)
    return (callable(spec) and not inspect.isclass(spec) and not isinstance(spec, ModuleSpec)
            and not dataclasses.is_dataclass(spec))


def _replacement(node: Any, pairs) -> Any:
    for old, new in pairs:
        if node is old:
            return new
    return _NO_REPLACEMENT


_NO_REPLACEMENT = object()


def _resolve_module_path(module: Any, pairs) -> Any:
    """``ModuleSpec.module`` given as ``(import path, name)``: the object it names, when the name
    is one of the replaced objects' names; else the tuple itself (not imported)."""
    if not (isinstance(module, tuple) and len(module) == 2
            and all(isinstance(p, str) for p in module)):
        return module
    path, name = module
    if name not in {getattr(old, "__name__", None) for old, _ in pairs}:
        return module
    try:
        return getattr(importlib.import_module(path), name)
    except (ImportError, AttributeError):
        return module


def _replace(node: Any, rewrite: _Rewrite, memo: dict) -> Any:
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = node  # a cycle, if any, keeps the original reference
    new = _replace_uncached(node, rewrite, memo)
    memo[key] = new
    return new


def _replace_uncached(node: Any, rewrite: _Rewrite, memo: dict) -> Any:
    pairs = rewrite.pairs
    replacement = _replacement(node, pairs)
    if replacement is not _NO_REPLACEMENT:
        return replacement
    if isinstance(node, type) or node is None or isinstance(node, (str, bytes, int, float)):
        return node
    if isinstance(node, ModuleSpec):
        module = _resolve_module_path(node.module, pairs)
        new_module = _replace(module, rewrite, memo)
        # a path that resolves to an object not replaced stays written as a path
        changes = {"module": new_module} if new_module is not module else {}
        for name in ("params", "submodules", "metainfo"):
            value = getattr(node, name)
            new_value = _replace(value, rewrite, memo)
            if new_value is not value:
                changes[name] = new_value
        params = _params_update(new_module, changes.get("params", node.params), rewrite.params)
        if params is not None:
            changes["params"] = params
        return _with_fields(node, changes)
    if dataclasses.is_dataclass(node):
        changes = {}
        for field in dataclasses.fields(node):
            if not hasattr(node, field.name):
                continue
            value = getattr(node, field.name)
            new_value = _replace(value, rewrite, memo)
            if new_value is not value:
                changes[field.name] = new_value
        return _with_fields(node, changes)
    if isinstance(node, functools.partial):
        func = _replace(node.func, rewrite, memo)
        args = [_replace(a, rewrite, memo) for a in node.args]
        keywords = {k: _replace(v, rewrite, memo) for k, v in node.keywords.items()}
        if func is node.func and all(a is b for a, b in zip(args, node.args)) and all(
            keywords[k] is v for k, v in node.keywords.items()
        ):
            return node
        return type(node)(func, *args, **keywords)
    if isinstance(node, (list, tuple)):
        items = [_replace(item, rewrite, memo) for item in node]
        if all(a is b for a, b in zip(items, node)):
            return node
        if isinstance(node, list):
            return type(node)(items)
        return type(node)._make(items) if hasattr(type(node), "_make") else type(node)(items)
    if isinstance(node, dict):
        items = {k: _replace(v, rewrite, memo) for k, v in node.items()}
        if all(items[k] is v for k, v in node.items()):
            return node
        new = copy.copy(node)
        new.update(items)
        return new
    return node


def _params_update(module: Any, params: Any, updates) -> Optional[dict]:
    """``params`` with the updates for ``module``, or None where nothing changes."""
    for target, update in updates:
        if module is target:
            if all(k in params and params[k] is v for k, v in update.items()):
                return None
            return {**params, **update}
    return None


def _with_fields(node: Any, changes: dict) -> Any:
    if not changes:
        return node
    new = copy.copy(node)
    for name, value in changes.items():
        object.__setattr__(new, name, value)  # frozen dataclasses too
    return new


def use_fused_gdn(spec: Any, *, gated_output_norm: bool = True,
                  pre_gated_delta_rule: bool = False) -> Any:
    """``spec`` with megatron's ``GatedDeltaNet`` replaced by :class:`core.ssm.GatedDeltaNet`,
    whose layers run the fusions asked for here, whatever config they are built with.

    ``gated_output_norm`` (megatron main's ``gdn_gated_output_norm_fusion``): True, the
    default, sets the GDN specs' param ``fused_gated_norm=True``, so every GDN layer built from
    the result runs the fused output norm, with megatron's own TransformerConfig too (no fusion
    field: what megatron's ``pretrain_gpt.py`` / ``pretrain_hybrid.py`` build), and with one
    that leaves the switch unset. A config that turns the fusion off (``fused_gated_norm`` or
    ``gdn_gated_output_norm_fusion`` False) fails the build with a ValueError saying how to
    fix it; so does a config that violates the fusion's rules (RMSNorm, a silu gate, ...).
    False builds our class with the unfused norm (a config that turns the fusion on fails).
    ``pre_gated_delta_rule`` (megatron main's ``gdn_pre_gated_delta_rule_fusion``): the fusion
    before the recurrence, the same way through the param ``pre_gated_delta_rule_fusion``
    (False, the default, builds our class without it; a config that turns it on then fails the
    build, saying how to fix it). The two are independent and compose. Either argument that is
    not a bool raises TypeError. Check the built model with ``assert_fused_gdn(model)`` (same
    keywords).

    Works on any spec megatron (or a framework on top of it) builds: the GPT block spec of the
    ``gated_delta_net`` attention variant
    (``get_transformer_block_with_experimental_attention_variant_spec`` and its per-layer list),
    the hybrid stack spec (``megatron.core.models.hybrid.hybrid_stack_spec``, whose 'G' layers
    hold the GDN), TE, local or Kitchen backends, dense or MoE MLPs, MTP
    blocks, lists / tuples of any of these. Everything except the GDN class and its param is
    left as it is (same submodules, other params, metainfo); nothing is built and the input is
    not modified (see :func:`replace_modules`). Our class takes megatron's constructor
    arguments and builds the same parameters, so state-dict and sharded-state-dict keys (and so
    checkpoints) do not change. The zero-centring override (``gdn_out_norm_zero_centered_gamma``)
    and the TP gradient fix of the output norm come with our class.

    A subclass of megatron's GatedDeltaNet other than ours is someone else's layer and is left
    alone; :func:`assert_fused_gdn` names it.

    A spec function gives a spec function (``use_fused_gdn(provider.transformer_layer_spec)``:
    same signature, the replacement made in what it builds); None, a string or another non-spec
    raises TypeError."""
    _check_fusions("use_fused_gdn", gated_output_norm, pre_gated_delta_rule)
    params = {"fused_gated_norm": gated_output_norm,
              "pre_gated_delta_rule_fusion": pre_gated_delta_rule}
    return replace_modules(spec, {MegatronGatedDeltaNet: GatedDeltaNet}, {GatedDeltaNet: params})


def _check_fusions(entry: str, gated_output_norm, pre_gated_delta_rule) -> None:
    """The fusion keywords of :func:`use_fused_gdn` and :func:`assert_fused_gdn` are bools
    (TypeError)."""
    check_bool(entry, "gated_output_norm", gated_output_norm)
    check_bool(entry, "pre_gated_delta_rule", pre_gated_delta_rule)


def _with_our_gdn(spec: Any) -> Any:
    """``spec`` with our GatedDeltaNet in place of megatron's and no param: the config of the
    model decides whether the fusions run (the spec builders below, which take it)."""
    return replace_modules(spec, {MegatronGatedDeltaNet: GatedDeltaNet})


def _only_ours_honours(config) -> list:
    """The settings of ``config`` that megatron's GatedDeltaNet silently ignores (TypeError for
    a field of the wrong type, named as validate_gdn_config names it)."""
    asked = []
    if gated_output_norm_fusion(config):
        asked.append(" / ".join(f"{name}=True" for name in GATED_OUTPUT_NORM_NAMES
                                if getattr(config, name, None) is True))
    if pre_gated_delta_rule_fusion_setting(config):
        asked.append(f"{PRE_GATED_DELTA_RULE_NAME}=True")
    if gdn_out_norm_zero_centered(config) != bool(config.layernorm_zero_centered_gamma):
        asked.append(
            f"gdn_out_norm_zero_centered_gamma={config.gdn_out_norm_zero_centered_gamma} "
            f"(layernorm_zero_centered_gamma={config.layernorm_zero_centered_gamma})"
        )
    return asked


def _model_chunks(model) -> list:
    """``(path prefix, chunk)`` of a Megatron model: a MegatronModule (any megatron wrapper:
    DDP, FSDP, Float16Module, and torch's DistributedDataParallel around one) or a non-empty
    list / tuple of them (megatron's model chunks). TypeError for anything else."""
    rule = ("model must be a Megatron model: a megatron.core.transformer.module.MegatronModule "
            "(GPTModel, HybridModel, a GDN layer; or megatron's DDP / Float16Module around one) "
            "or a list / tuple of such model chunks")
    if isinstance(model, (list, tuple)):
        if not model:
            raise TypeError(f"assert_fused_gdn: {rule}, got an empty {type(model).__name__}")
        chunks = [(f"[{i}].", chunk) for i, chunk in enumerate(model)]
    else:
        chunks = [("", model)]
    for prefix, chunk in chunks:
        inner = chunk
        while isinstance(inner, _WRAPPERS) and isinstance(getattr(inner, "module", None),
                                                          torch.nn.Module):
            inner = inner.module
        if not isinstance(inner, MegatronModule):
            where = f" (chunk {prefix[1:-2]})" if prefix else ""
            wrapped = f" wrapping {type(inner).__name__}" if inner is not chunk else ""
            raise TypeError(f"assert_fused_gdn: {rule}, got {type(chunk).__name__}{wrapped}"
                            f"{where}")
    return chunks


# The module classes that hold a model as ``.module``: megatron's data-parallel wrappers (DDP,
# FSDP), Float16Module, torch's DistributedDataParallel.
_WRAPPERS = (_BaseDataParallel, Float16Module, torch.nn.parallel.DistributedDataParallel)


def assert_fused_gdn(model, *, gated_output_norm: bool = True,
                     pre_gated_delta_rule: bool = False) -> None:
    """Raise unless every GDN layer of ``model`` runs the fusions asked for; a model (or a
    pipeline stage) that holds no GDN layer passes. Keywords as :func:`use_fused_gdn`'s.

    ``gated_output_norm=True`` (the default): every GDN layer must be
    :class:`core.ssm.GatedDeltaNet` with its fused output norm on (its ``fused_gated_norm``
    attribute). ``pre_gated_delta_rule=True``: every GDN layer must be ours with the fusion
    before the gated delta rule on (its ``pre_gated_delta_rule_fusion`` attribute). A keyword
    that is False asks nothing of that fusion; with both False only a layer of another
    GatedDeltaNet class whose config asks for something only ours does (either fusion, or a
    ``gdn_out_norm_zero_centered_gamma`` that differs from ``layernorm_zero_centered_gamma``)
    is refused, since it would ignore that setting.

    Raises TypeError when ``model`` is not a Megatron model (see below) and when some offending
    layer is of another class than ours; ValueError when every offending layer is ours with
    a fusion asked for off. The message names every such module path and says how to fix it.

    ``model``: a ``megatron.core.transformer.module.MegatronModule`` (megatron's DDP, FSDP and
    Float16Module wrappers included, and torch's DDP around one) or a non-empty list / tuple of
    them (megatron's model chunks); paths of a list are prefixed with the chunk index.

    Why an explicit check after the model is built, rather than an automatic one: the flag
    lives in the config and the class in the spec, and nothing megatron runs sees both before
    the layer exists. The config's ``__post_init__`` never sees a spec; our GatedDeltaNet's
    constructor never runs when the spec names megatron's class; a hook inside megatron's
    class (patching its ``__init__`` or ``build_module``) would change megatron process-wide for
    every model, including ones that never import this package. The built model is the one
    place where both are known, and walking its modules costs microseconds per layer, once.
    Launchers call it right after building the model (examples/pretrain_gdn_megatron.py: as
    a post-wrap hook of megatron's model config)."""
    _check_fusions("assert_fused_gdn", gated_output_norm, pre_gated_delta_rule)
    # The fusions asked for: {their name in a message: the attribute of our class that says
    # whether a layer runs it}.
    fusions = {name: attribute for name, attribute, asked in (
        ("the fused output norm", "fused_gated_norm", gated_output_norm),
        ("the fusion before the gated delta rule", "pre_gated_delta_rule_fusion",
         pre_gated_delta_rule)) if asked}
    other_class, asked_for = [], []
    unfused = {fusion: [] for fusion in fusions}
    for prefix, chunk in _model_chunks(model):
        for name, module in chunk.named_modules():
            if not isinstance(module, MegatronGatedDeltaNet):
                continue
            path = f"{prefix}{name or '<root>'}"
            if isinstance(module, GatedDeltaNet):
                for fusion, attribute in fusions.items():
                    if getattr(module, attribute) is not True:
                        unfused[fusion].append(path)
                continue
            asked = [*fusions, *_only_ours_honours(module.config)]
            if asked:
                other_class.append(f"{path} ({type(module).__module__}."
                                   f"{type(module).__qualname__})")
                asked_for.extend(a for a in asked if a not in asked_for)
    problems = []
    if other_class:
        problems.append(
            f"these GDN layers are another GatedDeltaNet class than "
            f"core.ssm.gated_delta_net.GatedDeltaNet and would silently ignore "
            f"{', '.join(asked_for)}: {'; '.join(other_class)}")
    for fusion, paths in unfused.items():
        if paths:
            problems.append(
                f"these GDN layers are ours with {fusion} off (their config turns it off or "
                f"leaves it unset, and their spec does not switch it on): {'; '.join(paths)}")
    if problems:
        error = TypeError if other_class else ValueError
        keywords = f"gated_output_norm={gated_output_norm}"
        if pre_gated_delta_rule:
            keywords += ", pre_gated_delta_rule=True"
        raise error(f"assert_fused_gdn({keywords}): {' and '.join(problems)}. "
                    f"{_how_to_fuse(gated_output_norm, pre_gated_delta_rule)}")


def _how_to_fuse(gated_output_norm: bool, pre_gated_delta_rule: bool) -> str:
    """How to build a model that runs the fusions assert_fused_gdn asks for, for its message."""
    if not pre_gated_delta_rule:
        return ("Build the model from core.models.use_fused_gdn(spec) (it turns the fusion on), "
                "or set the config's fused_gated_norm (megatron main: "
                "gdn_gated_output_norm_fusion) to True with "
                "core.models.get_gdn_hybrid_block_spec(config); pass gated_output_norm=False to "
                "check a model built without the fusion on purpose.")
    fields = ["fused_gated_norm (megatron main: gdn_gated_output_norm_fusion)"] * (
        gated_output_norm) + [PRE_GATED_DELTA_RULE_NAME]
    return (f"Build the model from core.models.use_fused_gdn(spec, gated_output_norm="
            f"{gated_output_norm}, pre_gated_delta_rule=True), or set the config's "
            f"{' and '.join(fields)} to True with core.models.get_gdn_hybrid_block_spec(config); "
            "pass pre_gated_delta_rule=False to check a model built without that fusion on "
            "purpose.")


def _use_te(use_te: Optional[bool], config=None) -> bool:
    """Whether to build with Transformer Engine. None: when TE is installed and the config (if
    any) asks for it (``transformer_impl='transformer_engine'``, megatron's default)."""
    impl = getattr(config, "transformer_impl", "transformer_engine")
    check_bool("gdn_specs", "use_te", use_te,
               "Transformer Engine when installed and transformer_impl asks for it")
    if use_te is None:
        return HAVE_TE and impl == "transformer_engine"
    if use_te and impl != "transformer_engine":
        raise ValueError(
            "use_te=True requires config.transformer_impl='transformer_engine' (megatron's TE "
            f"spec builders refuse anything else), got {impl!r}"
        )
    if use_te and not HAVE_TE:
        raise ImportError(
            "use_te=True but Transformer Engine is not installed; pass use_te=None (auto) or "
            "False to build with megatron-core's own modules"
        )
    return use_te


def _local_norms(spec):
    """megatron's local specs with WrappedTorchNorm (torch.nn.RMSNorm / LayerNorm, which refuse
    zero-centred gamma and sequence parallelism and round RMSNorm differently from TE) replaced
    by :class:`core.transformer.LocalNorm` (our TE-numerics RMSNorm for RMSNorm configs, megatron's
    WrappedTorchNorm for LayerNorm ones)."""
    return replace_modules(spec, {WrappedTorchNorm: LocalNorm})


def _megatron_local_gdn_module_spec() -> ModuleSpec:
    """The GDN mixer from megatron-core's own modules, naming megatron's class. megatron has no
    working one: its builder (``get_gated_delta_net_module_spec``) takes in_proj from
    ``backend.column_parallel_layer_norm_linear()``, which is None for the local backend, and
    marks the input norm as fused. Here in_proj is a plain ColumnParallelLinear, so the layer
    keeps its own input norm (``fuse_input_layernorm=False``), and the output norm is LocalNorm."""
    return ModuleSpec(
        module=MegatronGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=LocalNorm, out_proj=RowParallelLinear
        ),
        metainfo={"fuse_input_layernorm": False},
    )


def _default_te_config():
    """For megatron's TE GDN module builder, which reads config.normalization only."""
    from core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                             normalization="RMSNorm")


def get_gdn_module_spec(use_te: Optional[bool] = None, config=None) -> ModuleSpec:
    """Spec of the GDN mixer: :class:`core.ssm.gated_delta_net.GatedDeltaNet`.

    TE: megatron's ``get_gated_delta_net_module_spec(config)`` (TELayerNormColumnParallelLinear
    with the layer's input norm fused in, TENorm, TERowParallelLinear; Kitchen when
    ``config.use_kitchen``) with our class in place of megatron's; ``config`` None means plain
    TE and RMSNorm. Without TE: ColumnParallelLinear, LocalNorm, RowParallelLinear, the input norm a
    separate layer module (``fuse_input_layernorm=False``); megatron has no local GDN spec (see
    ``_megatron_local_gdn_module_spec``)."""
    if _use_te(use_te, config):
        if config is None:
            from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

            spec = _mgdn.get_gated_delta_net_module_spec(_default_te_config(), TESpecProvider())
        else:
            spec = _mgdn.get_gated_delta_net_module_spec(config)
        return _with_our_gdn(spec)
    return _with_our_gdn(_megatron_local_gdn_module_spec())


def _with_gdn_mixer(layer: ModuleSpec, mixer: ModuleSpec) -> ModuleSpec:
    """megatron's attention layer spec with the GDN mixer as its self_attention, as megatron's
    GDN-variant block builder assembles a GDN layer (the input norm is fused into the mixer's
    in_proj exactly when it was fused into linear_qkv: both come from the same backend).
    Local specs map the separate input norm's sharded keys onto the mixer's in_proj (the TE
    layout, ``self_attention.in_proj.layer_norm_weight``), as megatron's local attention spec
    maps them onto ``linear_qkv``: distributed checkpoints of the two backends match."""
    submodules = layer.submodules
    keys_map = dict(submodules.sharded_state_dict_keys_map)
    if not mixer.metainfo["fuse_input_layernorm"]:
        keys_map["input_layernorm."] = "self_attention.in_proj.layer_norm_"
    return dataclasses.replace(
        layer,
        submodules=dataclasses.replace(
            submodules, self_attention=mixer, sharded_state_dict_keys_map=keys_map
        ),
    )


def get_attention_layer_spec(use_te: Optional[bool] = None,
                             qk_layernorm: bool = False) -> ModuleSpec:
    """A standard causal self-attention TransformerLayer with a dense MLP: megatron's
    ``get_gpt_layer_with_transformer_engine_spec``, or without TE megatron's
    ``get_gpt_layer_local_spec`` (RMSNorm) with its norms made LocalNorm (megatron's
    WrappedTorchNorm refuses sequence parallelism and zero-centred gamma)."""
    if _use_te(use_te):
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    return _local_norms(get_gpt_layer_local_spec(qk_layernorm=qk_layernorm,
                                                 normalization="RMSNorm"))


def get_gdn_layer_spec(use_te: Optional[bool] = None, config=None) -> ModuleSpec:
    """A TransformerLayer whose self_attention is the GDN mixer, followed by a dense MLP:
    :func:`get_attention_layer_spec` with the mixer of :func:`get_gdn_module_spec`. Without TE
    the input and pre-MLP norms are LocalNorm modules; with TE they are fused into in_proj /
    fc1."""
    te = _use_te(use_te, config)
    return _with_gdn_mixer(get_attention_layer_spec(te), get_gdn_module_spec(te, config))


def get_gdn_hybrid_block_spec(
    config,
    use_te: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """Per-layer specs of a GDN / attention hybrid, for ``GPTModel(transformer_layer_spec=...)``.
    Its GDN layers are our class, the fused output norm switched by ``config`` (unset: off;
    ``use_fused_gdn`` of the result switches it on whatever the config).

    TE: megatron's own
    ``get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage, pp_rank)``
    (its layer pattern, MoE pattern, MLA / qk_l2_norm / qk_layernorm attention, Kitchen backend,
    pipeline slicing and final norm, whatever megatron's version of it supports).

    Without TE (``use_te=False``, or auto with TE absent or ``transformer_impl='local'``):
    megatron's builder cannot serve (its attention layers always come from the TE layer spec and
    its GDN spec has no local in_proj), so the same block is assembled here from megatron's
    local pieces: ``get_gpt_layer_local_spec`` for every layer (dense or MoE by
    ``get_moe_layer_pattern``; qk_layernorm, qk_l2_norm, MLA and Kitchen from the config), the
    GDN mixer of :func:`get_gdn_module_spec` in the layers ``get_linear_attention_pattern``
    marks (layer ``i`` is attention when ``(i + 1) % linear_attention_freq == 0``; a list is the
    pattern, 1 = GDN), megatron's pipeline slicing, and LocalNorm for every norm (megatron's
    WrappedTorchNorm refuses zero-centred gamma and sequence parallelism)."""
    if config.experimental_attention_variant != "gated_delta_net":
        raise ValueError(
            "get_gdn_hybrid_block_spec requires experimental_attention_variant='gated_delta_net', "
            f"got {config.experimental_attention_variant!r}"
        )
    if _use_te(use_te, config):
        return _with_our_gdn(
            _mgdn.get_transformer_block_with_experimental_attention_variant_spec(
                config, vp_stage=vp_stage, pp_rank=pp_rank
            )
        )
    return _with_our_gdn(_local_norms(_megatron_local_gdn_block_spec(config, vp_stage, pp_rank)))


def _megatron_local_gdn_block_spec(config, vp_stage, pp_rank) -> TransformerBlockSubmodules:
    """The no-TE block of :func:`get_gdn_hybrid_block_spec` before its two rewrites (megatron's
    classes and norms throughout)."""
    attention_pattern = _mgdn.get_linear_attention_pattern(config)
    moe_pattern = (
        _mgdn.get_moe_layer_pattern(config) if config.num_moe_experts is not None
        else [0] * config.num_layers
    )
    common = dict(
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        normalization=config.normalization,
        qk_l2_norm=config.qk_l2_norm,
        use_kitchen=config.use_kitchen,
        use_kitchen_attention=config.use_kitchen_attention,
        kitchen_attention_backend=config.kitchen_attention_backend,
    )
    gdn = _megatron_local_gdn_module_spec()
    layers = {}  # (moe, gdn) -> layer spec, one object per kind as in megatron's builder
    for moe in sorted(set(moe_pattern)):
        attention_layer = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts if moe else None,
            moe_grouped_gemm=config.moe_grouped_gemm if moe else False,
            **common,
        )
        layers[moe, 0] = attention_layer
        layers[moe, 1] = _with_gdn_mixer(attention_layer, gdn)
    layer_specs = [layers[moe_pattern[i], attention_pattern[i]] for i in range(config.num_layers)]

    if config.pipeline_model_parallel_layout is not None:
        local_ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
        )
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_ids = range(offset, offset + count)
    return TransformerBlockSubmodules(
        layer_specs=[layer_specs[i] for i in local_ids], layer_norm=LocalNorm
    )
