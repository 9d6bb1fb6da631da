"""State-space / linear-attention layers: megatron's GatedDeltaNet with the fused output norm."""

from core.ssm.gated_delta_net import GatedDeltaNet, mark_tp_partial_grad

__all__ = ["GatedDeltaNet", "mark_tp_partial_grad"]
