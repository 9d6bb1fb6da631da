"""RMSNorm usable without Transformer Engine: the unfused reference of the GDN output norm and
the input norms of the no-TE layer specs.

Numerics match Transformer Engine's RMSNorm (and so megatron's unfused GDN path): all math in
fp32, ``x_hat = x * rsqrt(mean(x^2) + eps)``, ``y = x_hat * w`` (``x_hat * (1 + w)`` with
zero-centred gamma, the 1 added in fp32), ONE rounding to ``promote_types(x.dtype, w.dtype)``.
torch.nn.RMSNorm (what megatron's WrappedTorchNorm builds) rounds differently and refuses
zero-centred gamma and sequence parallelism; this module does neither.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.transformer.torch_norm import WrappedTorchNorm

from core.fusions.gated_norm_validation import check_bool, check_positive_number
from core.fusions.gated_norm_reference import rms_norm


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dim with megatron's module-builder signature.

    Args:
        config: megatron TransformerConfig (params_dtype, use_cpu_initialization,
            layernorm_zero_centered_gamma, sequence_parallel).
        hidden_size: size of the normalised (last) dim.
        eps: added to mean(x^2).
        zero_centered_gamma: ``w_eff = 1 + weight`` (weight initialised to 0). None follows
            ``config.layernorm_zero_centered_gamma``. A bool (TypeError otherwise, as for a
            non-number eps; ValueError for an eps that is not finite and > 0).

    The weight carries ``sequence_parallel = config.sequence_parallel`` (like TENorm), so the
    stock ``finalize_model_grads`` sums its grad over TP when sequence parallelism is on. As the
    GDN output norm, its TP gradient is completed by ``core.ssm.gated_delta_net`` when it is not.
    """

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        zero_centered_gamma: Optional[bool] = None,
        **_unused,
    ):
        super().__init__()
        self.config = config
        self.hidden_size = hidden_size
        check_positive_number("RMSNorm", "eps", eps)
        self.eps = float(eps)
        name = "zero_centered_gamma"
        if zero_centered_gamma is None:
            zero_centered_gamma, name = (config.layernorm_zero_centered_gamma,
                                         "config.layernorm_zero_centered_gamma")
        check_bool("RMSNorm", name, zero_centered_gamma)
        self.zero_centered_gamma = zero_centered_gamma
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(hidden_size, dtype=config.params_dtype, device=device)
        )
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.zero_centered_gamma:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The one definition of the TE-style norm, shared with the kernels' tests and benchmark.
        return rms_norm(x, self.weight, self.eps, self.zero_centered_gamma)

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"
        )


class LocalNorm:
    """Norm builder for specs without Transformer Engine: :class:`RMSNorm` when
    ``config.normalization == 'RMSNorm'``, else megatron's WrappedTorchNorm (torch LayerNorm)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization == "RMSNorm":
            return RMSNorm(config=config, hidden_size=hidden_size, eps=eps,
                           zero_centered_gamma=kwargs.get("zero_centered_gamma"))
        return WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=eps)
