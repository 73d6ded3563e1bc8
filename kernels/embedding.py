"""Fused token embedding + positions + dropout as Triton kernels and their launchers (the op is
fastattn.ops.embedding): y = dropout(W[token] · scale + P[position]) per token row.

Unfused, a GPU runs embedding, mul, add and dropout forward, autocast's cast of y for the first
matrix product, and backward the cast's gradient, the add of y's two gradients, dropout's and the
scale's mul and embedding_dense_backward. Here the forward is one kernel, which also writes y's
copy in autocast's dtype beside y when asked (as the LayerNorm kernels do); the backward is one
kernel forming the row gradients (y's and its copy's summed in float32) and then
torch.ops.aten.embedding_dense_backward for the weight gradient: deterministic on CUDA (it sums
each token's rows in order; torch.use_deterministic_algorithms does not flag it), unlike
index_add_, whose CUDA kernel adds the rows of repeated tokens with atomics.

Dropout draws its keep mask as kernels/layer_norm.py does (kernels/seeds.py): Philox keyed by a
per-call int64 seed passed by value (or through a pointer, under fastattn.ops.seeds.from_device),
with the element's (column, row) as the counter; the backward regenerates it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastattn.kernels.seeds import keep_mask, scalar

MAX_BLOCK = 1024  # columns per program: 8 fp32 per thread at 4 warps; wider rows take more


@triton.jit(do_not_specialize=["seed"])
def _embedding_fwd_kernel(
    Tokens, W, P, Y, Y_COPY, seed,
    stride_w, stride_p, L, N, V, scale, dropout_p,
    HAS_DROPOUT: tl.constexpr, STORE_COPY: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (row, j): columns j·BLOCK_N ... of token row `row` (position row mod L).

    y = (W[token] * scale + P[row mod L]) * keep / (1 - p)     (in float32, stored in Y's dtype)
    y_copy = y as stored, rounded to Y_COPY's dtype (to nearest even, as y.to(dtype))
    A token outside [0, V) reads row 0 instead and gives a NaN row (training has no range check on a
    GPU, which would sync: the NaN reaches the loss, and the trainer's guard skips the update).
    """
    seed = scalar(seed)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    token = tl.load(Tokens + row).to(tl.int64)  # token · stride_w may pass 2**31
    valid = (token >= 0) & (token < V)
    w = tl.load(W + tl.where(valid, token, 0) * stride_w + cols, mask=mask, other=0.0)
    w = tl.where(valid, w.to(tl.float32), float("nan"))
    p = tl.load(P + (row % L).to(tl.int64) * stride_p + cols, mask=mask, other=0.0)
    y = w * scale + p.to(tl.float32)
    if HAS_DROPOUT:
        y = tl.where(keep_mask(seed, row, cols, dropout_p), y / (1.0 - dropout_p), 0.0)
    y = y.to(Y.dtype.element_ty)
    offsets = row.to(tl.int64) * N + cols
    tl.store(Y + offsets, y, mask=mask)
    if STORE_COPY:
        tl.store(Y_COPY + offsets, y.to(Y_COPY.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _embedding_bwd_kernel(
    DY, DY_COPY, G, Tokens, SafeTokens, seed, N, V, scale, dropout_p,
    HAS_DY_COPY: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (row, j), contiguous rows of N: the gradient of token row `row`'s W row,

    g = (dy + dy_copy) * keep / (1 - p) * scale     (summed in float32, stored in G's dtype)
    SafeTokens[row] = token, or 0 with a NaN row g for a token outside [0, V): the weight
    gradient's scatter never writes out of bounds, and NaN reaches the gradient norm's guard.
    """
    seed = scalar(seed)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    offsets = row.to(tl.int64) * N + cols
    token = tl.load(Tokens + row)
    valid = (token >= 0) & (token < V)
    if tl.program_id(1) == 0:
        tl.store(SafeTokens + row, tl.where(valid, token, 0))
    g = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_DY_COPY:
        g += tl.load(DY_COPY + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        g = tl.where(keep_mask(seed, row, cols, dropout_p), g / (1.0 - dropout_p), 0.0)
    g = tl.where(valid, g * scale, float("nan"))
    tl.store(G + offsets, g.to(G.dtype.element_ty), mask=mask)


def _config(n: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for rows of n columns: at most 8 elements per thread."""
    block_n = min(max(triton.next_power_of_2(n), 16), MAX_BLOCK)
    return block_n, max(block_n // 256, 1)


def embedding_forward(
    tokens: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, seed: int | torch.Tensor,
    scale: float, dropout_p: float, copy_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y (M, N), y in copy_dtype or empty) for tokens (M,), weight (V, N) and positions (L, N)
    with unit column stride, token row r at position r mod L; y's dtype is weight's and
    positions' promotion. seed: an int, or a one-element int64 tensor on weight's device the
    kernel reads (fastattn.ops.seeds)."""
    M, (L, N) = tokens.numel(), positions.shape
    y = weight.new_empty((M, N), dtype=torch.promote_types(weight.dtype, positions.dtype))
    y_copy = torch.empty_like(y, dtype=copy_dtype) if copy_dtype else y.new_empty(0)
    block_n, num_warps = _config(N)
    _embedding_fwd_kernel[(M, triton.cdiv(N, block_n))](
        tokens, weight, positions, y, y_copy, seed, weight.stride(0), positions.stride(0), L, N,
        weight.shape[0], scale, dropout_p, HAS_DROPOUT=dropout_p > 0, STORE_COPY=copy_dtype is not None,
        BLOCK_N=block_n, num_warps=num_warps,
    )
    return y, y_copy


def embedding_backward(
    dy: torch.Tensor, dy_copy: torch.Tensor | None, tokens: torch.Tensor, seed: int | torch.Tensor,
    num_weights: int, scale: float, dropout_p: float, dtype: torch.dtype,
) -> torch.Tensor:
    """The weight gradient (num_weights, N) in `dtype` for dy (M, N) and dy_copy (the gradient
    of y's copy, added to dy's; both read contiguous, copied here if they are not) of tokens
    (M,): the row gradients, then embedding_dense_backward (deterministic) sums them per token."""
    dy = dy.contiguous()
    dy_copy = None if dy_copy is None else dy_copy.contiguous()
    M, N = dy.shape
    g = dy.new_empty((M, N), dtype=dtype)
    safe_tokens = torch.empty_like(tokens)
    block_n, num_warps = _config(N)
    _embedding_bwd_kernel[(M, triton.cdiv(N, block_n))](
        dy, dy_copy, g, tokens, safe_tokens, seed, N, num_weights, scale, dropout_p,
        HAS_DY_COPY=dy_copy is not None, HAS_DROPOUT=dropout_p > 0, BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return torch.ops.aten.embedding_dense_backward(g, safe_tokens, num_weights, -1, False)


def compile_configs() -> list[dict]:
    """Every (kernel, BLOCK_N, warps) the launchers pick, all features on: float32 rows (the
    residual stream under autocast) with a bfloat16 copy."""
    fwd_signature = {
        "Tokens": "*i64:16", "W": "*fp32:16", "P": "*fp32:16", "Y": "*fp32:16",
        "Y_COPY": "*bf16:16", "seed": "i64", "stride_w": "i32:16", "stride_p": "i32:16",
        "L": "i32", "N": "i32", "V": "i32", "scale": "fp32", "dropout_p": "fp32",
    }
    bwd_signature = {
        "DY": "*fp32:16", "DY_COPY": "*bf16:16", "G": "*fp32:16", "Tokens": "*i64:16",
        "SafeTokens": "*i64:16", "seed": "i64", "N": "i32", "V": "i32", "scale": "fp32",
        "dropout_p": "fp32",
    }
    launches = []
    for log2 in range(4, MAX_BLOCK.bit_length()):
        block_n, num_warps = _config(2**log2)
        launches += [
            ("embedding_fwd", _embedding_fwd_kernel, fwd_signature,
             dict(HAS_DROPOUT=True, STORE_COPY=True, BLOCK_N=block_n), num_warps),
            ("embedding_bwd", _embedding_bwd_kernel, bwd_signature,
             dict(HAS_DY_COPY=True, HAS_DROPOUT=True, BLOCK_N=block_n), num_warps),
        ]
    return [
        dict(name=f"{name}_N{constexprs['BLOCK_N']}", fn=fn,
             signature={**signature, **{k: "constexpr" for k in constexprs}},
             constexprs=constexprs, num_warps=num_warps, num_stages=1)
        for name, fn, signature, constexprs, num_warps in launches
    ]
