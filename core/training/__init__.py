"""megatron.training (megatron's command line and training loop) with the fused GDN output norm:
the command-line flags, the config built from them, and what megatron's initialize needs from the
megatron-core wheel."""

from core.training.arguments import add_gdn_fusion_args, transformer_config_from_args
from core.training.initialize import use_prebuilt_dataset_helpers

__all__ = ["add_gdn_fusion_args", "transformer_config_from_args", "use_prebuilt_dataset_helpers"]
