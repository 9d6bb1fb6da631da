"""core.ssm.megatron_gdn_import: megatron's GatedDeltaNet module catches only FLA's ImportError,
so an FLA release that the installed Triton refuses (fla-core 0.4.2 under Triton 3.9) breaks every
import of it with Triton's ValueError; the package's modules name FLA as the cause instead."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

# An FLA that fails to import as fla-core 0.4.2 does under Triton 3.9: Triton's autotune
# decorator raises a ValueError from one of FLA's kernel modules.
FLA_REFUSED_BY_TRITON = ("key contains names that are not kernel arguments: STAGE. Valid argument "
                         "names are: k, v")

IMPORT_THROUGH_BROKEN_FLA = r"""
import importlib, sys, triton
for name in ("core.ssm", "core.models", "core.training", "megatron.core.ssm.gated_delta_net"):
    try:
        importlib.import_module(name)
    except Exception as error:
        cause = error.__cause__
        print("RESULT", name, type(error).__name__, type(cause).__name__, repr(str(error)))
    else:
        print("RESULT", name, "imported")
print("TRITON", triton.__version__)
"""


def _install_fla_refused_by_triton(root: pathlib.Path) -> None:
    ops = root / "fla" / "ops"
    ops.mkdir(parents=True)
    (root / "fla" / "__init__.py").write_text("from fla.ops import chunk  # noqa: F401\n")
    (ops / "__init__.py").write_text("")
    (ops / "chunk.py").write_text(f"raise ValueError({FLA_REFUSED_BY_TRITON!r})\n")
    dist = root / "fla_core-0.4.2.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fla-core\nVersion: 0.4.2\n")
    (dist / "top_level.txt").write_text("fla\n")


def test_an_fla_that_fails_under_the_installed_triton_is_named_as_the_cause(tmp_path):
    """megatron's GatedDeltaNet module catches only FLA's ImportError; an FLA release that refuses
    the installed Triton raises a ValueError from deep inside FLA instead. The package's modules
    that import megatron's GDN (core.ssm, core.models, core.training) turn it into an ImportError
    naming FLA, both versions, the original error and the way out; megatron's own module keeps
    megatron's behaviour."""
    _install_fla_refused_by_triton(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", IMPORT_THROUGH_BROKEN_FLA], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    triton_version = next(line.split()[1] for line in lines if line.startswith("TRITON"))
    results = {line.split()[1]: line.split(maxsplit=2)[2] for line in lines
               if line.startswith("RESULT")}
    for name in ("core.ssm", "core.models", "core.training"):
        assert results[name].startswith("ImportError ValueError "), (name, results[name])
        for part in ("FLA (fla-core 0.4.2)", f"triton {triton_version}",
                     f"ValueError: {FLA_REFUSED_BY_TRITON}", 'add "torch<2.15"'):
            assert part in results[name], (name, part, results[name])
    assert results["megatron.core.ssm.gated_delta_net"].startswith("ValueError "), results


def test_an_error_raised_outside_fla_is_left_as_it_is():
    from core.ssm.megatron_gdn_import import fla_import_error

    try:
        raise ValueError("not FLA's")
    except ValueError as error:
        assert fla_import_error(error) is None
