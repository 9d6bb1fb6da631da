"""State-space / linear-attention layers: megatron's GatedDeltaNet with the fused output norm."""

from core.ssm.gated_delta_net import GatedDeltaNet
from core.ssm.tp_grad_reduction import megatron_tp_grad_reduction, scale_grad

__all__ = ["GatedDeltaNet", "megatron_tp_grad_reduction", "scale_grad"]
