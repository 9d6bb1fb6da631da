"""Fused kernels of the project: the GDN output gated RMSNorm (training and inference).

The entry points are re-exported under their modules' own names, so ``core.fusions.fused_gated_norm``
is the *function* here; to reach (or patch) the module, use
``importlib.import_module("core.fusions.fused_gated_norm")``.
"""

from core.fusions.fused_gated_norm import fused_gated_norm, validate_gated_norm
from core.fusions.fused_gdn_gated_rms_norm import fused_gdn_gated_rms_norm

__all__ = ["fused_gated_norm", "fused_gdn_gated_rms_norm", "validate_gated_norm"]
