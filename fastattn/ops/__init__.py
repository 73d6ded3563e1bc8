"""The public fused ops, one file per op: public function, checks, torch.library schema, fake
and autograd registration, the PyTorch reference, and one kernel per device (CUDA -> the Triton
launchers in fastattn.kernels, CPU -> fastattn._C or PyTorch). fastattn.backend.implementation
says which runs."""

from fastattn.ops.attention import attention
from fastattn.ops.cross_entropy import label_smoothed_cross_entropy, linear_cross_entropy
from fastattn.ops.layer_norm import layer_norm_residual
from fastattn.ops.seeds import dropout

__all__ = [
    "attention",
    "dropout",
    "label_smoothed_cross_entropy",
    "layer_norm_residual",
    "linear_cross_entropy",
]
