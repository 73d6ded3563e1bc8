"""fastattn: fused Triton kernels for the Transformer and a faithful model to train and serve it."""

from fastattn import ops
from fastattn._native import native
from fastattn.backend import get_backend, set_backend

__version__ = "0.1.0"
__all__ = ["get_backend", "native", "ops", "set_backend"]
