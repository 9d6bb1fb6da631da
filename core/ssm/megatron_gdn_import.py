"""megatron-core's GatedDeltaNet module, imported with the cause named where FLA breaks it.

megatron's module imports FLA and catches only its ImportError. An FLA release that refuses the
installed Triton fails with something else deep inside FLA: fla-core 0.4.2 and 0.5.0-0.5.2 under
Triton 3.9 raise Triton's ``ValueError: key contains names that are not kernel arguments`` from
an autotune decorator. A ``megatron-core[dev]`` install (flash-linear-attention~=0.4.0) beside
torch 2.15 resolves exactly that pair. The package's modules that need megatron's GDN import it
through ``import_megatron_gdn`` first, so that such an environment fails with an ImportError that
names FLA, both versions and the way out (README, Versions) instead of a Triton traceback.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import traceback
from types import ModuleType
from typing import Optional

MEGATRON_GDN = "megatron.core.ssm.gated_delta_net"


def import_megatron_gdn() -> ModuleType:
    """``megatron.core.ssm.gated_delta_net``; raises ImportError (from the original error) where
    it fails inside FLA's package, and any other error unchanged."""
    try:
        return importlib.import_module(MEGATRON_GDN)
    except ImportError:
        raise
    except Exception as error:
        explained = fla_import_error(error)
        if explained is None:
            raise
        raise explained from error


def fla_import_error(error: BaseException) -> Optional[ImportError]:
    """The ImportError to raise for ``error`` when it was raised inside FLA's package while
    megatron's GatedDeltaNet module imported it; None for an error raised elsewhere."""
    fla_dirs = _package_dirs("fla")
    raised_in_fla = any(
        os.path.abspath(frame.filename).startswith(tuple(os.path.join(d, "") for d in fla_dirs))
        for frame in traceback.extract_tb(error.__traceback__))
    if not raised_in_fla:
        return None
    first_line = (str(error).splitlines() or [""])[0]
    return ImportError(
        f"megatron-core's GatedDeltaNet cannot be imported: FLA ({_distribution('fla')}), which it "
        f"imports, fails under {_distribution('triton')} with {type(error).__name__}: "
        f"{first_line} This FLA release does not support this Triton release. Install a pair "
        "that imports: with triton 3.9, fla-core 0.3.2-0.4.1 or 0.6.0 (0.4.2 and 0.5.x fail); "
        "with triton 3.8 (torch < 2.15) any of them. Beside megatron-core[dev], which pins "
        "flash-linear-attention~=0.4.0, add \"torch<2.15\" (README, Versions).")


def _package_dirs(name: str) -> list[str]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # ValueError: a half-imported module without a spec
        return []
    return [os.path.abspath(d) for d in (spec.submodule_search_locations or ())] if spec else []


def _distribution(package: str) -> str:
    """'<distribution> <version>' of the installed distribution that provides ``package``."""
    names = importlib.metadata.packages_distributions().get(package) or [package]
    try:
        return f"{names[0]} {importlib.metadata.version(names[0])}"
    except importlib.metadata.PackageNotFoundError:
        return f"{package}, version unknown"
