"""fastattn.ops.layer_norm: y = LayerNorm(residual + dropout(x)) over the last dim, the paper's
sub-layer connection, around kernels/layer_norm.py's fused Triton kernels.

fastattn.backend.implementation("layer_norm_residual", ...) picks what runs: "torch" runs
dropout(), an add and F.layer_norm (PyTorch's autograd); the others run the torch.library op
fastattn::layer_norm_residual_fwd, whose CUDA registration is the Triton launcher and whose CPU
registration is fastattn._C's one-pass kernel (csrc/layer_norm.cpp, float32 inside), or the
Triton launcher under Triton's interpreter. Dropout randomness comes from a per-call seed
(fastattn.ops.seeds: torch's generator, so torch.manual_seed reproduces it, or a device table
inside seeds.from_device, for CUDA graphs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastattn.backend import check_float, implementation, native_reads_as_is
from fastattn.kernels import layer_norm as kernels
from fastattn.kernels.layer_norm import MAX_FEATURES, separate_dresidual
from fastattn.ops import seeds
from fastattn.ops.seeds import cpu_seed, dropout


def _impl(x: torch.Tensor, residual: torch.Tensor | None, *params: torch.Tensor | None) -> str:
    return implementation("layer_norm_residual", x.device, x.dtype,
                          residual_dtype=None if residual is None else residual.dtype,
                          param_dtypes=tuple(p.dtype for p in params if p is not None))


@torch.library.custom_op("fastattn::layer_norm_residual_fwd", mutates_args=(),
                         device_types="cuda")
def _layer_norm_residual_fwd(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    eps: float,
    dropout_p: float,
    return_residual: bool,
    copy_dtype: torch.dtype | None,
    x_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, sum or empty, y in copy_dtype or empty, mean, rstd) for 2-D x and residual with
    unit column stride; x_bias (N,) is added to x first."""
    return kernels.layer_norm_residual_forward(x, residual, weight, bias,
                                               seeds.kernel_argument(seed), eps, dropout_p,
                                               return_residual, copy_dtype, x_bias)


@_layer_norm_residual_fwd.register_kernel("cpu")
def _(x, residual, weight, bias, seed, eps, dropout_p, return_residual, copy_dtype, x_bias):
    if _impl(x, residual, weight, bias) == "triton-interpreter":  # the one override
        return kernels.layer_norm_residual_forward(x, residual, weight, bias,
                                                   seeds.kernel_argument(seed), eps, dropout_p,
                                                   return_residual, copy_dtype, x_bias)
    y, s, mean, rstd = torch.ops.fastattn.cpu_layer_norm_residual_fwd(
        _with_bias(x, x_bias), residual, weight, bias, cpu_seed(seed), eps, dropout_p,
        return_residual,
    )
    return y, s, y.to(copy_dtype) if copy_dtype else y.new_empty(0), mean, rstd


@_layer_norm_residual_fwd.register_fake
def _(x, residual, weight, bias, seed, eps, dropout_p, return_residual, copy_dtype, x_bias):
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = x.new_empty(x.shape, dtype=dtype)
    s = torch.empty_like(y) if return_residual else y.new_empty(0)
    y_copy = torch.empty_like(y, dtype=copy_dtype) if copy_dtype else y.new_empty(0)
    mean = x.new_empty(x.shape[0], dtype=torch.float32)
    return y, s, y_copy, mean, torch.empty_like(mean)


def _with_bias(x: torch.Tensor, x_bias: torch.Tensor | None) -> torch.Tensor:
    """x + x_bias in x's dtype, for fastattn._C's kernels (the Triton kernels add in fp32)."""
    return x if x_bias is None else (x + x_bias).to(x.dtype)


@torch.library.custom_op("fastattn::layer_norm_residual_bwd", mutates_args=(),
                         device_types="cuda")
def _layer_norm_residual_bwd(
    dy: torch.Tensor,
    dsum: torch.Tensor | None,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    has_bias: bool,
    seed: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dropout_p: float,
    dy_copy: torch.Tensor | None,
    x_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dresidual or empty, fp32 dweight and dbias or empty, dx_bias in x_bias's dtype or
    empty); dy_copy is the gradient of y's copy, added to dy's; dresidual is empty when it
    equals dx (custom ops may not return aliases)."""
    return kernels.layer_norm_residual_backward(dy.contiguous(), _contiguous(dsum), x, residual,
                                                weight, has_bias, seeds.kernel_argument(seed),
                                                mean, rstd, dropout_p, _contiguous(dy_copy),
                                                x_bias)


@_layer_norm_residual_bwd.register_kernel("cpu")
def _(dy, dsum, x, residual, weight, has_bias, seed, mean, rstd, dropout_p, dy_copy, x_bias):
    dy, dsum = dy.contiguous(), _contiguous(dsum)
    if _impl(x, residual, weight) == "triton-interpreter":
        return kernels.layer_norm_residual_backward(dy, dsum, x, residual, weight, has_bias,
                                                    seeds.kernel_argument(seed), mean, rstd,
                                                    dropout_p, _contiguous(dy_copy), x_bias)
    y_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    # What autograd would do for y's two uses: cast the copy's gradient back, add the two.
    dy = dy.to(y_dtype) if dy_copy is None else dy + dy_copy
    dx, dr, dw, db = torch.ops.fastattn.cpu_layer_norm_residual_bwd(
        dy, dsum, _with_bias(x, x_bias), residual, weight, has_bias, cpu_seed(seed), mean,
        rstd, dropout_p,
    )
    dxb = dx.new_empty(0) if x_bias is None else dx.sum(0, dtype=torch.float32).to(x_bias.dtype)
    return dx, dr, dw, db, dxb


@_layer_norm_residual_bwd.register_fake
def _(dy, dsum, x, residual, weight, has_bias, seed, mean, rstd, dropout_p, dy_copy, x_bias):
    N = x.shape[1]
    separate = separate_dresidual(x, residual, dropout_p)
    dr = torch.empty_like(residual) if separate else x.new_empty(0)
    fp32 = lambda on: x.new_empty(N if on else 0, dtype=torch.float32)
    dxb = x.new_empty(0) if x_bias is None else torch.empty_like(x_bias)
    return torch.empty_like(x), dr, fp32(weight is not None), fp32(has_bias), dxb


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, seed, eps, dropout_p, return_residual, _, x_bias = inputs
    _, _, _, mean, rstd = output
    ctx.save_for_backward(x, residual, weight, seed, mean, rstd, x_bias)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.dropout_p = dropout_p
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dsum, dy_copy, _dmean, _drstd):
    x, residual, weight, seed, mean, rstd, x_bias = ctx.saved_tensors
    if dy is None and dy_copy is not None:  # only y's copy was used: its gradient is dy's
        dy, dy_copy = dy_copy, None
    elif dy is None:  # only the returned sum was used downstream
        dy = torch.zeros_like(x, dtype=dsum.dtype if dsum is not None else x.dtype)
    has_bias = ctx.bias_dtype is not None
    dx, dr, dw, db, dxb = _layer_norm_residual_bwd(
        dy, dsum, x, residual, weight, has_bias, seed, mean, rstd, ctx.dropout_p, dy_copy, x_bias
    )
    if residual is None:
        dr = None
    elif not separate_dresidual(x, residual, ctx.dropout_p):
        dr = dx
    return (
        dx, dr, dw.to(weight.dtype) if weight is not None else None,
        db.to(ctx.bias_dtype) if has_bias else None,
        None, None, None, None, None, dxb if x_bias is not None else None,
    )


torch.library.register_autograd(
    "fastattn::layer_norm_residual_fwd", _backward, setup_context=_setup_context
)


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """t as (rows, features) with unit column stride, a view whenever possible."""
    if t is None:
        return None
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(1) == 1 else t.contiguous()


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def layer_norm_residual_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm(residual + x * keep / (1 - p)), the sum) in the inputs' dtype, for any dtype
    including float64; `keep` is an explicit dropout keep mask (None: no dropout)."""
    h = x if keep is None else torch.where(keep, x / (1 - dropout_p), 0)
    s = h if residual is None else residual + h
    return F.layer_norm(s, s.shape[-1:], weight, bias, eps), s


def layer_norm_residual(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    dropout_p: float = 0.0,
    return_residual: bool = False,
    copy_dtype: torch.dtype | None = None,
    x_bias: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """LayerNorm(residual + dropout(x)) over the last dimension, with optional affine parameters.

    x and residual (or None) share a shape (..., N); weight and bias are (N,) or None; all are
    float16, bfloat16, float32 or float64 (other dtypes raise TypeError naming them). Dropout is
    applied to x with probability `dropout_p`: pass 0.0 outside training. With
    `return_residual=True` returns (y, residual + dropout(x)), the stream a pre-norm stack
    carries on. With `copy_dtype` (autocast's dtype, say) also returns y rounded to it, written
    by the same kernel, as (y, copy) or (y, sum, copy): the input of the next matrix products,
    which spares their cast, its backward and the add of y's two gradients (the backward adds
    them in float32, as autograd would). `x_bias` (N,), the bias of the linear map that made x,
    is added to x before dropout (by the Triton kernels, in float32: its gradient is summed in
    their backward, sparing the map's bias-gradient launch). The output dtype is the promotion
    of x's and residual's dtypes. The Triton kernel handles N <= MAX_FEATURES; wider rows raise
    ValueError there. On CPU, float32 runs
    fastattn._C's one-pass kernel (no row limit), as does a bfloat16 x beside a float32 residual
    (read as it is: post-norm under autocast), other bfloat16 and float16 inputs run it on
    float32 copies, and float64 runs dropout(), an add and F.layer_norm. All draw their dropout
    randomness from torch's generator: torch.manual_seed reproduces it.
    """
    check_float("layer_norm_residual", x=x, residual=residual, weight=weight, bias=bias,
                x_bias=x_bias)
    N = x.shape[-1]
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias), ("x_bias", x_bias)):
        if p is not None and p.shape != (N,):
            raise ValueError(f"{name} must have shape ({N},), got {tuple(p.shape)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    impl = _impl(x, residual, weight, bias)
    if x_bias is not None and not (impl.startswith("triton") and x.numel()):
        x, x_bias = x + x_bias, None  # PyTorch's add and its gradient
    if impl == "fastattn._C" and not native_reads_as_is(
            "cpu", x.dtype, None if residual is None else residual.dtype,
            tuple(p.dtype for p in (weight, bias) if p is not None)) and x.numel():
        # Mixed dtypes the kernel does not read as they are: run it on float32 copies.
        dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
        out = layer_norm_residual(
            x.float(), _float(residual), _float(weight), _float(bias), eps, dropout_p,
            return_residual,
        )
        y, s = out if return_residual else (out, None)
        return _outputs(y.to(dtype), s if s is None else s.to(dtype), copy_dtype)
    if x.numel() == 0 or impl == "torch":
        h = dropout(x, dropout_p)
        y, s = layer_norm_residual_reference(h, residual, weight, bias, eps)
        return _outputs(y, s if return_residual else None, copy_dtype)
    if impl.startswith("triton") and N > MAX_FEATURES:
        raise ValueError(
            f"layer_norm_residual's Triton kernel supports at most {MAX_FEATURES} features per "
            f"row, got {N}"
        )
    seed = seeds.draw(1) if dropout_p > 0 else None
    y, s, y_copy, _, _ = _layer_norm_residual_fwd(
        _rows(x), _rows(residual), _contiguous(weight), _contiguous(bias), seed, eps, dropout_p,
        return_residual, copy_dtype, _contiguous(x_bias),
    )
    return _outputs(y.view(x.shape), s.view(x.shape) if return_residual else None,
                    copy_dtype, y_copy.view(x.shape) if copy_dtype else None)


def _outputs(y: torch.Tensor, s: torch.Tensor | None, copy_dtype: torch.dtype | None,
             y_copy: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """layer_norm_residual's return value: y, then the sum if asked for, then y's copy if asked
    for (y.to(copy_dtype) unless the kernel wrote it)."""
    if copy_dtype is not None and y_copy is None:
        y_copy = y.to(copy_dtype)
    out = (y,) + ((s,) if s is not None else ()) + ((y_copy,) if copy_dtype else ())
    return out if len(out) > 1 else y
