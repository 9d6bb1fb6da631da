"""Fused kernels of the project: the GDN output gated RMSNorm (training and inference).

``core.fusions.fused_gated_norm`` is the training *module* (kernels, launch wrappers, autograd,
``fused_gated_norm`` the function, ``validate_gated_norm``):

    from core.fusions.fused_gated_norm import fused_gated_norm

``fused_gdn_gated_rms_norm`` is the inference *function* (vLLM's contract), defined in
``core.fusions.gated_norm_inference``:

    from core.fusions import fused_gdn_gated_rms_norm
"""

from core.fusions import fused_gated_norm  # noqa: F401  (the module, under its own name)
from core.fusions.fused_gated_norm import validate_gated_norm
from core.fusions.gated_norm_inference import fused_gdn_gated_rms_norm

__all__ = ["fused_gdn_gated_rms_norm", "validate_gated_norm"]
