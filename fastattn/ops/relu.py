"""fastattn.ops.relu: ReLU's backward fused with the bias gradient of the linear map before it,
around kernels/relu.py's Triton kernel (whose docstring has the math). An internal building block
of the model's feed-forward (fastattn.fused_model._LinearReLU), not exported from fastattn.ops.

fastattn.backend.implementation("relu_backward_bias", ...) picks what runs: "torch" runs the
PyTorch reference (threshold_backward, then a sum: two launches on a GPU); the others run the
torch.library op fastattn::relu_backward_bias, whose CUDA registration is the Triton launcher
(one launch) and whose CPU registration is the launcher under Triton's interpreter, or the
reference.
"""

from __future__ import annotations

import torch

from fastattn.backend import FLOAT_DTYPES, check_float, implementation
from fastattn.kernels import relu as kernels


def _impl(grad: torch.Tensor, h: torch.Tensor) -> str:
    return implementation("relu_backward_bias", grad.device,
                          torch.promote_types(grad.dtype, h.dtype))


@torch.library.custom_op("fastattn::relu_backward_bias", mutates_args=(), device_types="cuda")
def _relu_backward_bias(grad: torch.Tensor, h: torch.Tensor, bias_dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, db) for 2-D grad and h of one shape, with unit column stride and at least one row."""
    return kernels.relu_backward_bias(grad, h, bias_dtype)


@_relu_backward_bias.register_kernel("cpu")
def _(grad, h, bias_dtype):
    if _impl(grad, h) == "triton-interpreter":  # the one override
        if torch.bfloat16 in (grad.dtype, h.dtype, bias_dtype):
            # The interpreter has no bf16 (it reads the raw bits): float32 copies, rounded after.
            g, db = kernels.relu_backward_bias(grad.float(), h.float(), torch.float32)
            return g.to(grad.dtype), db.to(bias_dtype)
        return kernels.relu_backward_bias(grad, h, bias_dtype)
    return relu_backward_bias_reference(grad, h, bias_dtype)


@_relu_backward_bias.register_fake
def _(grad, h, bias_dtype):
    return torch.empty_like(grad), grad.new_empty(grad.shape[-1], dtype=bias_dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, features) with unit column stride, a view whenever possible."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(1) == 1 else t.contiguous()


def relu_backward_bias_reference(grad: torch.Tensor, h: torch.Tensor, bias_dtype: torch.dtype
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """relu_backward_bias in PyTorch, for any dtype including float64 (summed in float64 there,
    so the model's float64 gradients are the ops' one by one)."""
    g = torch.ops.aten.threshold_backward(grad, h, 0).to(grad.dtype)  # F.relu's own backward
    accumulate = torch.promote_types(g.dtype, torch.float32)
    return g, g.reshape(-1, g.shape[-1]).sum(0, dtype=accumulate).to(bias_dtype)


def relu_backward_bias(grad: torch.Tensor, h: torch.Tensor, bias_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of h = relu(x W^T + b), given h and grad, the gradient of h: (g, db) with
    g = grad where h > 0, else 0 (threshold_backward(grad, h, 0), F.relu's own backward: a NaN
    h passes grad on), in grad's dtype and shape, and db = g summed over every dimension but the
    last, accumulated in float32 (float64 for float64) and stored in bias_dtype: b's gradient.

    grad and h share a shape (..., N) and are float16, bfloat16, float32 or float64 (other
    dtypes raise TypeError naming them), as is bias_dtype. The Triton kernel computes both in
    one launch, db deterministically (summed in a fixed order, without atomics)."""
    check_float("relu_backward_bias", grad=grad, h=h)
    if bias_dtype not in FLOAT_DTYPES:
        name = lambda d: str(d).removeprefix("torch.")
        raise TypeError(f"relu_backward_bias: bias_dtype is {name(bias_dtype)}; accepted: "
                        f"{', '.join(name(d) for d in FLOAT_DTYPES)}")
    if h.shape != grad.shape:
        raise ValueError(f"h shape {tuple(h.shape)} != grad shape {tuple(grad.shape)}")
    if grad.dim() == 0:
        raise ValueError("relu_backward_bias needs a feature dimension: got 0-d grad and h")
    if grad.numel() == 0 or _impl(grad, h) == "torch":
        return relu_backward_bias_reference(grad, h, bias_dtype)
    g, db = _relu_backward_bias(_rows(grad), _rows(h), bias_dtype)
    return g.view(grad.shape), db
