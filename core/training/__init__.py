"""megatron.training (megatron's command line and training loop) with the fused GDN output norm:
the command-line flags and the config built from them."""

from core.training.arguments import add_gdn_fusion_args, transformer_config_from_args

__all__ = ["add_gdn_fusion_args", "transformer_config_from_args"]
