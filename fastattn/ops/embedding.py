"""fastattn.ops.embedding: y = dropout(W[tokens] · scale + positions), the model's embedding of
its tokens and their positions (sections 3.4, 3.5, 5.4), around kernels/embedding.py's fused
Triton kernels.

fastattn.backend.implementation("embedding", ...) picks what runs: "torch" runs F.embedding, a
mul, an add and ops.dropout (PyTorch's autograd); the Triton implementations run the
torch.library op fastattn::embedding_fwd, whose CUDA registration is the Triton launcher and
whose CPU registration is the Triton launcher under Triton's interpreter, or else a PyTorch
reference (for direct calls; its mask comes from torch's generator seeded with the op's seed,
not from the kernels' Philox). Its backward, fastattn::embedding_bwd, forms the row gradients in
one kernel and sums them per token with embedding_dense_backward. Dropout randomness comes from
a per-call seed (fastattn.ops.seeds: torch's generator, so torch.manual_seed reproduces it, or a
device table inside seeds.from_device, for CUDA graphs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastattn.backend import check_float, implementation
from fastattn.kernels import embedding as kernels
from fastattn.ops import seeds
from fastattn.ops.seeds import dropout

INDEX_DTYPES = (torch.int32, torch.int64)


def _impl(device: torch.device, *dtypes: torch.dtype) -> str:
    dtype = dtypes[0] if len(dtypes) == 1 else torch.promote_types(*dtypes)
    return implementation("embedding", device, dtype)


def _reference_keep(seed: torch.Tensor | None, shape: tuple[int, ...], dropout_p: float
                    ) -> torch.Tensor | None:
    """The CPU reference kernels' keep mask: torch's generator seeded with the op's seed."""
    if dropout_p == 0:
        return None
    generator = torch.Generator().manual_seed(int(seed))
    return torch.rand(shape, generator=generator) >= dropout_p


@torch.library.custom_op("fastattn::embedding_fwd", mutates_args=(), device_types="cuda")
def _embedding_fwd(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    seed: torch.Tensor | None,
    scale: float,
    dropout_p: float,
    copy_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y (M, N), y in copy_dtype or empty) for tokens (M,), weight (V, N) and positions (L, N)
    with unit column stride; token row r is at position r mod L."""
    return kernels.embedding_forward(tokens, weight, positions, seeds.kernel_argument(seed),
                                     scale, dropout_p, copy_dtype)


@_embedding_fwd.register_kernel("cpu")
def _(tokens, weight, positions, seed, scale, dropout_p, copy_dtype):
    if _impl(weight.device, weight.dtype, positions.dtype) == "triton-interpreter":
        if torch.bfloat16 in (weight.dtype, positions.dtype, copy_dtype):
            # The interpreter has no bf16 (it reads the raw bits): float32 copies, rounded after.
            y, _ = kernels.embedding_forward(tokens, weight.float(), positions.float(),
                                             seeds.kernel_argument(seed), scale, dropout_p)
            y = y.to(torch.promote_types(weight.dtype, positions.dtype))
            return y, y.to(copy_dtype) if copy_dtype else y.new_empty(0)
        return kernels.embedding_forward(tokens, weight, positions, seeds.kernel_argument(seed),
                                         scale, dropout_p, copy_dtype)
    rows = positions.repeat(len(tokens) // len(positions), 1)  # each token row's position
    keep = _reference_keep(seed, rows.shape, dropout_p)
    y = embedding_reference(tokens, weight, rows, scale, keep, dropout_p)
    return y, y.to(copy_dtype) if copy_dtype else y.new_empty(0)


@_embedding_fwd.register_fake
def _(tokens, weight, positions, seed, scale, dropout_p, copy_dtype):
    dtype = torch.promote_types(weight.dtype, positions.dtype)
    y = weight.new_empty((tokens.shape[0], positions.shape[1]), dtype=dtype)
    return y, torch.empty_like(y, dtype=copy_dtype) if copy_dtype else y.new_empty(0)


@torch.library.custom_op("fastattn::embedding_bwd", mutates_args=(), device_types="cuda")
def _embedding_bwd(
    dy: torch.Tensor,
    dy_copy: torch.Tensor | None,
    tokens: torch.Tensor,
    seed: torch.Tensor | None,
    num_weights: int,
    scale: float,
    dropout_p: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight gradient (num_weights, N) in `dtype` from dy (M, N) and dy_copy (the gradient
    of y's copy, added to dy's in float32)."""
    return kernels.embedding_backward(dy, dy_copy, tokens, seeds.kernel_argument(seed),
                                      num_weights, scale, dropout_p, dtype)


@_embedding_bwd.register_kernel("cpu")
def _(dy, dy_copy, tokens, seed, num_weights, scale, dropout_p, dtype):
    if _impl(dy.device, dtype) == "triton-interpreter":
        if torch.bfloat16 in (dy.dtype, dtype, None if dy_copy is None else dy_copy.dtype):
            # The interpreter has no bf16: float32 copies, rounded after.
            return kernels.embedding_backward(
                dy.float(), None if dy_copy is None else dy_copy.float(), tokens,
                seeds.kernel_argument(seed), num_weights, scale, dropout_p,
                torch.float32).to(dtype)
        return kernels.embedding_backward(dy, dy_copy, tokens, seeds.kernel_argument(seed),
                                          num_weights, scale, dropout_p, dtype)
    g = dy.to(torch.promote_types(dy.dtype, torch.float32))  # float64 stays float64
    if dy_copy is not None:
        g = g + dy_copy
    keep = _reference_keep(seed, g.shape, dropout_p)
    if keep is not None:
        g = torch.where(keep, g / (1 - dropout_p), 0)
    return torch.ops.aten.embedding_dense_backward((g * scale).to(dtype), tokens, num_weights,
                                                   -1, False)


@_embedding_bwd.register_fake
def _(dy, dy_copy, tokens, seed, num_weights, scale, dropout_p, dtype):
    return dy.new_empty((num_weights, dy.shape[1]), dtype=dtype)


def _setup_context(ctx, inputs, output):
    tokens, weight, _, seed, scale, dropout_p, _ = inputs
    ctx.save_for_backward(tokens, seed)
    ctx.num_weights, ctx.weight_dtype = weight.shape[0], weight.dtype
    ctx.scale, ctx.dropout_p = scale, dropout_p
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dy_copy):
    tokens, seed = ctx.saved_tensors
    if dy is None:  # only y's copy was used: its gradient is dy's
        dy, dy_copy = dy_copy, None
    dw = None if dy is None else _embedding_bwd(dy, dy_copy, tokens, seed, ctx.num_weights,
                                                ctx.scale, ctx.dropout_p, ctx.weight_dtype)
    return None, dw, None, None, None, None, None


torch.library.register_autograd("fastattn::embedding_fwd", _backward,
                                setup_context=_setup_context)


def embedding_reference(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    scale: float = 1.0,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """(weight[tokens] · scale + positions) · keep / (1 - p) in the inputs' dtype, for any dtype
    including float64; `keep` is an explicit dropout keep mask (None: no dropout)."""
    h = F.embedding(tokens, weight) * scale + positions
    return h if keep is None else torch.where(keep, h / (1 - dropout_p), 0)


def embedding(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    scale: float = 1.0,
    dropout_p: float = 0.0,
    copy_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """dropout(weight[tokens] · scale + positions).

    tokens (..., L) are int32 or int64 ids in [0, V); weight (V, N); positions (L, N), the row of
    each position along tokens' last dimension. All floating tensors are float16, bfloat16,
    float32 or float64 (others raise TypeError). Dropout keeps an element with probability
    1 - dropout_p and scales it by 1 / (1 - dropout_p): pass 0.0 outside training. Returns y
    (..., L, N) in the promotion of weight's and positions' dtypes; with `copy_dtype`
    (autocast's dtype, say) (y, y rounded to it), written by the same kernel: the input of the
    next matrix products, sparing their cast, its backward and the add of y's two gradients
    (the backward adds them in float32, as autograd would; ops.layer_norm_residual's
    copy_dtype). The Triton kernels give weight its gradient, not positions: positions that
    require one run PyTorch's ops, as float64 does. Token ids are not range-checked on a GPU
    (that would sync): there an id outside [0, V) reads nothing out of bounds and gives a NaN
    row, and NaN gradients (to row 0), which the trainer's guard reports; on CPU they raise
    IndexError. All draw their dropout randomness from torch's generator: torch.manual_seed
    reproduces it.
    """
    if tokens.dtype not in INDEX_DTYPES:
        raise TypeError(f"embedding: tokens has dtype {str(tokens.dtype).removeprefix('torch.')}"
                        "; accepted: int32, int64")
    check_float("embedding", weight=weight, positions=positions)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (vocabulary, features), got shape "
                         f"{tuple(weight.shape)}")
    if tokens.dim() == 0:
        raise ValueError("tokens must have a last dimension of positions, got a scalar")
    expected = (tokens.shape[-1], weight.shape[1])
    if positions.shape != expected:
        raise ValueError(f"positions must have shape {expected} (tokens' last dimension, "
                         f"weight's features), got {tuple(positions.shape)}")
    if tokens.device != weight.device or positions.device != weight.device:
        raise ValueError(f"tokens ({tokens.device}), weight ({weight.device}) and positions "
                         f"({positions.device}) must be on one device")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if (_impl(weight.device, weight.dtype, positions.dtype) == "torch" or tokens.numel() == 0
            or (positions.requires_grad and torch.is_grad_enabled())):
        y = dropout(F.embedding(tokens, weight) * scale + positions, dropout_p)
        return (y, y.to(copy_dtype)) if copy_dtype else y
    # On CPU (the interpreter) a cheap check; a traced graph cannot branch on data.
    if (tokens.device.type == "cpu" and not torch.compiler.is_compiling()
            and not 0 <= tokens.min() <= tokens.max() < len(weight)):
        raise IndexError(f"embedding: token ids must be in [0, {len(weight)}), got "
                         f"{int(tokens.min())} .. {int(tokens.max())}")
    seed = seeds.draw(1) if dropout_p > 0 else None
    y, y_copy = _embedding_fwd(
        tokens.reshape(-1).contiguous(), weight if weight.stride(1) == 1 else weight.contiguous(),
        positions.contiguous(), seed, scale, dropout_p, copy_dtype,
    )
    shape = (*tokens.shape, weight.shape[1])
    return (y.view(shape), y_copy.view(shape)) if copy_dtype else y.view(shape)
