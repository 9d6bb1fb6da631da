"""Fused kernels of the project: the GDN output gated RMSNorm (training and inference)."""

from core.fusions.fused_gated_norm import fused_gated_norm, validate_gated_norm

__all__ = ["fused_gated_norm", "validate_gated_norm"]
