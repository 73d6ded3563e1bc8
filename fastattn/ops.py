"""The public fused ops. Each lives with its Triton kernels and PyTorch reference in
fastattn.kernels.<op>; the backend switch (fastattn.backend) picks the implementation per call."""

from fastattn.kernels.attention import attention
from fastattn.kernels.cross_entropy import label_smoothed_cross_entropy, linear_cross_entropy
from fastattn.kernels.layer_norm import dropout, layer_norm_residual

__all__ = [
    "attention",
    "dropout",
    "label_smoothed_cross_entropy",
    "layer_norm_residual",
    "linear_cross_entropy",
]
