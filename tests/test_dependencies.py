"""The library does not need FLA: pyproject keeps fla-core out of the install requirements (so
the package installs beside megatron-core[dev], which pins flash-linear-attention~=0.4.0), and
every module of ``core`` outside ``core.testing`` imports, and the specs build, with FLA
unimportable. FLA is needed only to construct megatron's GatedDeltaNet (which raises then)."""

import pathlib
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLA = {"fla-core", "flash-linear-attention"}


def _requirements(items):
    return [Requirement(r) for r in items]


def test_fla_is_not_a_library_requirement_and_extras_admit_megatron_dev():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [r for r in _requirements(project["dependencies"]) if r.name in FLA]
    for extra in ("test", "examples"):
        fla = [r for r in _requirements(project["optional-dependencies"][extra]) if r.name in FLA]
        assert fla, f"extra {extra!r} must bring FLA (megatron's GatedDeltaNet needs it)"
        for requirement in fla:  # megatron-core[dev]==0.19.2 pins flash-linear-attention~=0.4.0
            assert requirement.specifier.contains("0.4.0"), (extra, str(requirement))


BLOCK_FLA = r"""
import importlib.abc, sys

class BlockFla(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fla" or name.startswith("fla."):
            raise ImportError("fla blocked")
        return None

sys.meta_path.insert(0, BlockFla())
import pkgutil, importlib
import core
names = [m.name for m in pkgutil.walk_packages(core.__path__, "core.")
         if not m.name.startswith("core.testing")]
for name in names:
    importlib.import_module(name)
from megatron.core.ssm.gated_delta_net import HAVE_FLA
assert not HAVE_FLA and "fla" not in sys.modules
from core.models import get_attention_layer_spec, get_gdn_layer_spec
get_gdn_layer_spec(use_te=False)
get_attention_layer_spec(use_te=False)
print("imported", len(names))
"""


def test_library_imports_without_fla():
    result = subprocess.run([sys.executable, "-c", BLOCK_FLA], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "imported" in result.stdout
