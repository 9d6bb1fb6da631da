"""Test-side helpers over spec trees and models: ``compare_gdn_swap(a, b)`` asserts that ``b`` is
``a`` with only the GDN class changed, ``spec_fingerprint(spec)`` records a tree's node
identities (to show a spec was not mutated), ``checkpoint_keys(model)`` maps state-dict names to
distributed-checkpoint keys. Building megatron's TE specs without Transformer Engine is library
API: ``core.models.te_free_specs``.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGDN
from megatron.core.transformer.spec_utils import ModuleSpec

from core.ssm.gated_delta_net import GatedDeltaNet


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
                + sum(compare_gdn_swap(a.keywords[k], b.keywords[k], f"{path}.{k}")
                      for k in a.keywords))
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
