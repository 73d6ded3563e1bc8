"""Fused residual + dropout + LayerNorm: y = LayerNorm(residual + dropout(x)) over the last dim.

This is the paper's sub-layer connection, LayerNorm(x + Dropout(Sublayer(x))), in one pass over
memory. One program normalises one row held in registers, so every element of x and of the
residual is read once and y is written once (plus the sum when the caller asks for it).

Bytes moved per element in the forward, e = element size (2 for fp16/bf16), compulsory traffic
of each kernel (`forward_bytes` computes totals, with weight, bias and row statistics too):

    residual  dropout  return_residual   fused      unfused (dropout -> add -> layer_norm)
    yes       no       no                3e  (6)    add 3e + layer_norm 2e            = 5e  (10)
    yes       yes      no                3e  (6)    dropout 2e+1 (mask) + 3e + 2e     = 7e+1 (15)
    yes       yes      yes               4e  (8)    the sum is already materialised   = 7e+1 (15)
    no        yes      no                2e  (4)    dropout 2e+1 + layer_norm 2e      = 4e+1 (9)

Dropout draws its keep mask from Philox keyed by a per-call seed (an int64 tensor drawn from
torch's generator, so torch.manual_seed reproduces it) with the element's (column, row) as the
counter; the backward regenerates the same mask instead of storing it. The backward recomputes
the sum from x and residual (both are kept alive by the caller anyway) and the saved fp32 mean
and rstd; dweight and dbias are summed from fp32 per-program partials, with no atomics, so they
are deterministic. Rows wider than BWD_MAX_BLOCK take a two-pass backward over column chunks
(the second pass rereads the row from L2), so no configuration spills registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastattn._native import native_cpu
from fastattn.backend import use_triton

MAX_FEATURES = 16384  # one row lives in registers; wider rows would spill


def _use_kernel(x: torch.Tensor) -> bool:
    """Whether to run the Triton kernels, which compute in fp32: float64, the reference
    precision, always runs on PyTorch."""
    return x.dtype != torch.float64 and use_triton(x)


@triton.jit
def _keep_mask(seed, row, cols, dropout_p):
    """Dropout keep mask of elements (row, cols): uniform(Philox(seed; cols, row)) >= p."""
    zero = tl.zeros_like(cols)
    bits, _, _, _ = tl.philox(seed, cols, (zero + row).to(tl.int32), zero, zero)
    return tl.uint_to_uniform_float(bits) >= dropout_p


@triton.jit
def _layer_norm_fwd_kernel(
    X, R, W, B, Y, S, Mean, Rstd, Seed,
    stride_x, stride_r, stride_y, stride_s,
    N, eps, dropout_p,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_SUM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One row per program.

    s = r + x * keep / (1 - p)
    mean = sum(s) / N,  rstd = 1 / sqrt(sum((s - mean)^2) / N + eps)
    y = (s - mean) * rstd * w + b
    """
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    s = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = _keep_mask(tl.load(Seed), row, cols, dropout_p)
        s = tl.where(keep, s / (1.0 - dropout_p), 0.0)
    if HAS_RESIDUAL:
        s += tl.load(R + row.to(tl.int64) * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_SUM:
        tl.store(S + row.to(tl.int64) * stride_s + cols, s.to(S.dtype.element_ty), mask=mask)
    mean = tl.sum(s, axis=0) / N
    centered = tl.where(mask, s - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / N + eps)
    y = centered * rstd
    if HAS_WEIGHT:
        y *= tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row.to(tl.int64) * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit
def _recompute_xhat(X, R, Seed, row, cols, mask, stride_x, stride_r, mean, rstd, dropout_p,
                    HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """xhat = (r + x * keep / (1 - p) - mean) * rstd of row's `cols`, and the keep mask."""
    s = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    keep = mask
    if HAS_DROPOUT:
        keep = _keep_mask(tl.load(Seed), row, cols, dropout_p)
        s = tl.where(keep, s / (1.0 - dropout_p), 0.0)
    if HAS_RESIDUAL:
        s += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, (s - mean) * rstd, 0.0), keep


@triton.jit
def _store_input_grads(ds, keep, DSUM, DR, DX, row, cols, mask, stride_dsum, stride_dr,
                       stride_dx, dropout_p, HAS_DSUM: tl.constexpr,
                       STORE_DRESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """Adds the returned sum's gradient to ds; stores dresidual = ds, dx = ds * keep / (1 - p)."""
    if HAS_DSUM:
        ds += tl.load(DSUM + row * stride_dsum + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_DRESIDUAL:
        tl.store(DR + row * stride_dr + cols, ds.to(DR.dtype.element_ty), mask=mask)
    if HAS_DROPOUT:
        ds = tl.where(keep, ds / (1.0 - dropout_p), 0.0)
    tl.store(DX + row * stride_dx + cols, ds.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(
    DY, DSUM, X, R, W, Mean, Rstd, Seed, DX, DR, DW, DB,
    stride_dy, stride_dsum, stride_x, stride_r, stride_dx, stride_dr,
    M, N, rows_per_program, dropout_p,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_DSUM: tl.constexpr, STORE_DRESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A contiguous block of rows per program, each row held in registers; the block's dW, dB
    partials accumulate in registers (fp32).

    xhat = (s - mean) * rstd,  g = dy * w
    ds = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dsum     (dsum: grad of the returned sum)
    dresidual = ds,  dx = ds * keep / (1 - p)
    dW[program] = sum over its rows of dy * xhat,  dB[program] = sum of dy
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 rows: row * stride may pass 2**31
    for row in range(row_start, tl.minimum(row_start + rows_per_program, M)):
        rstd = tl.load(Rstd + row)
        xhat, keep = _recompute_xhat(X, R, Seed, row, cols, mask, stride_x, stride_r,
                                     tl.load(Mean + row), rstd, dropout_p,
                                     HAS_RESIDUAL, HAS_DROPOUT)
        g = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            db += g
        if HAS_WEIGHT:
            dw += g * xhat
            g *= tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        ds = (g - (xhat * tl.sum(g * xhat, axis=0) + tl.sum(g, axis=0)) / N) * rstd
        _store_input_grads(ds, keep, DSUM, DR, DX, row, cols, mask, stride_dsum, stride_dr,
                           stride_dx, dropout_p, HAS_DSUM, STORE_DRESIDUAL, HAS_DROPOUT)
    if HAS_WEIGHT:
        tl.store(DW + pid * N + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB + pid * N + cols, db, mask=mask)


@triton.jit
def _layer_norm_bwd_wide_kernel(
    DY, DSUM, X, R, W, Mean, Rstd, Seed, DX, DR, DW, DB,
    stride_dy, stride_dsum, stride_x, stride_r, stride_dx, stride_dr,
    M, N, rows_per_program, dropout_p,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_DSUM: tl.constexpr, STORE_DRESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The same math for rows wider than registers hold with their partials: BLOCK_N-column
    chunks, two passes per row. Pass 1 sums g * xhat and g, and adds dy * xhat, dy to this
    program's own dW, dB partial rows in global memory; pass 2 rereads the row (from L2) and
    stores the input gradients."""
    pid = tl.program_id(0)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        if HAS_WEIGHT:
            tl.store(DW + pid * N + cols, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=cols < N)
        if HAS_BIAS:
            tl.store(DB + pid * N + cols, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=cols < N)
    row_start = pid.to(tl.int64) * rows_per_program
    for row in range(row_start, tl.minimum(row_start + rows_per_program, M)):
        mean, rstd = tl.load(Mean + row), tl.load(Rstd + row)
        sum_g_xhat = 0.0
        sum_g = 0.0
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            xhat, keep = _recompute_xhat(X, R, Seed, row, cols, mask, stride_x, stride_r, mean,
                                         rstd, dropout_p, HAS_RESIDUAL, HAS_DROPOUT)
            g = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:  # each thread rereads what it wrote, in the same layout
                tl.store(DB + pid * N + cols, tl.load(DB + pid * N + cols, mask=mask) + g,
                         mask=mask)
            if HAS_WEIGHT:
                tl.store(DW + pid * N + cols,
                         tl.load(DW + pid * N + cols, mask=mask) + g * xhat, mask=mask)
                g *= tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            sum_g_xhat += tl.sum(g * xhat, axis=0)
            sum_g += tl.sum(g, axis=0)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            xhat, keep = _recompute_xhat(X, R, Seed, row, cols, mask, stride_x, stride_r, mean,
                                         rstd, dropout_p, HAS_RESIDUAL, HAS_DROPOUT)
            g = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                g *= tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            ds = (g - (xhat * sum_g_xhat + sum_g) / N) * rstd
            _store_input_grads(ds, keep, DSUM, DR, DX, row, cols, mask, stride_dsum, stride_dr,
                               stride_dx, dropout_p, HAS_DSUM, STORE_DRESIDUAL, HAS_DROPOUT)


def _num_warps(block_n: int) -> int:
    """Forward: at most 32 fp32 elements of a row per thread."""
    return min(max(block_n // 512, 1), 16)


BWD_MAX_BLOCK = 4096  # widest row the one-pass backward holds in registers with its partials
WIDE_BLOCK = 2048  # column chunk of the two-pass backward


def _bwd_config(n: int) -> tuple:
    """(kernel, BLOCK_N, num_warps) of the backward for rows of n features: at most 8 elements
    per thread, which keeps the register-resident kernel within 128 registers."""
    block_n = triton.next_power_of_2(n)
    if block_n <= BWD_MAX_BLOCK:
        return _layer_norm_bwd_kernel, block_n, min(max(block_n // 256, 1), 16)
    return _layer_norm_bwd_wide_kernel, WIDE_BLOCK, WIDE_BLOCK // 256


def _num_programs(x: torch.Tensor, rows: int) -> int:
    """Backward programs: one per SM on CUDA (few partials to sum), a handful in the interpreter."""
    if x.device.type == "cuda":
        return min(rows, torch.cuda.get_device_properties(x.device).multi_processor_count)
    return min(rows, 4)


def _separate_dresidual(x: torch.Tensor, residual: torch.Tensor | None, dropout_p: float) -> bool:
    """dresidual equals dx unless dropout scales dx or the dtypes differ."""
    return residual is not None and (dropout_p > 0 or residual.dtype != x.dtype)


def _empty(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


@torch.library.custom_op("fastattn::layer_norm_residual_fwd", mutates_args=())
def _layer_norm_residual_fwd(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    eps: float,
    dropout_p: float,
    return_residual: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, sum or empty, mean, rstd) for 2-D x and residual with unit column stride."""
    if native_cpu(x, dtypes=_NATIVE):
        return torch.ops.fastattn.cpu_layer_norm_residual_fwd(
            x, residual, weight, bias, 0 if seed is None else int(seed), eps, dropout_p,
            return_residual,
        )
    M, N = x.shape
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = torch.empty((M, N), dtype=dtype, device=x.device)
    s = torch.empty_like(y) if return_residual else _empty(y)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    block_n = triton.next_power_of_2(N)
    _layer_norm_fwd_kernel[(M,)](
        x, residual, weight, bias, y, s, mean, rstd, seed,
        x.stride(0), 0 if residual is None else residual.stride(0), y.stride(0),
        s.stride(0) if return_residual else 0,
        N, eps, dropout_p,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, HAS_DROPOUT=dropout_p > 0, STORE_SUM=return_residual,
        BLOCK_N=block_n, num_warps=_num_warps(block_n),
    )
    return y, s, mean, rstd


@_layer_norm_residual_fwd.register_fake
def _(x, residual, weight, bias, seed, eps, dropout_p, return_residual):
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = x.new_empty(x.shape, dtype=dtype)
    s = torch.empty_like(y) if return_residual else y.new_empty(0)
    mean = x.new_empty(x.shape[0], dtype=torch.float32)
    return y, s, mean, torch.empty_like(mean)


@torch.library.custom_op("fastattn::layer_norm_residual_bwd", mutates_args=())
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dresidual or empty, fp32 dweight or empty, fp32 dbias or empty); dresidual is empty
    when it equals dx (custom ops may not return aliases)."""
    M, N = x.shape
    dy = dy.contiguous()
    dsum = None if dsum is None else dsum.contiguous()
    if native_cpu(x, dtypes=_NATIVE):
        return torch.ops.fastattn.cpu_layer_norm_residual_bwd(
            dy, dsum, x, residual, weight, has_bias, 0 if seed is None else int(seed), mean, rstd,
            dropout_p,
        )
    dx = torch.empty_like(x)
    store_dr = _separate_dresidual(x, residual, dropout_p)
    dr = torch.empty_like(residual) if store_dr else _empty(x)
    programs = _num_programs(x, M)
    partial = lambda on: x.new_empty((programs, N) if on else 0, dtype=torch.float32)
    dw, db = partial(weight is not None), partial(has_bias)
    kernel, block_n, num_warps = _bwd_config(N)
    kernel[(programs,)](
        dy, dsum, x, residual, weight, mean, rstd, seed, dx, dr, dw, db,
        dy.stride(0), 0 if dsum is None else dsum.stride(0), x.stride(0),
        0 if residual is None else residual.stride(0), dx.stride(0),
        dr.stride(0) if store_dr else 0, M, N, triton.cdiv(M, programs), dropout_p,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=has_bias,
        HAS_DROPOUT=dropout_p > 0, HAS_DSUM=dsum is not None, STORE_DRESIDUAL=store_dr,
        BLOCK_N=block_n, num_warps=num_warps,
    )
    return dx, dr, dw.sum(0) if weight is not None else dw, db.sum(0) if has_bias else db


@_layer_norm_residual_bwd.register_fake
def _(dy, dsum, x, residual, weight, has_bias, seed, mean, rstd, dropout_p):
    N = x.shape[1]
    separate = _separate_dresidual(x, residual, dropout_p)
    dr = torch.empty_like(residual) if separate else x.new_empty(0)
    dw = x.new_empty(N if weight is not None else 0, dtype=torch.float32)
    db = x.new_empty(N if has_bias else 0, dtype=torch.float32)
    return torch.empty_like(x), dr, dw, db


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, seed, eps, dropout_p, return_residual = inputs
    _, _, mean, rstd = output
    ctx.save_for_backward(x, residual, weight, seed, mean, rstd)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.dropout_p = dropout_p
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dsum, _dmean, _drstd):
    x, residual, weight, seed, mean, rstd = ctx.saved_tensors
    if dy is None:  # only the returned sum was used downstream
        dy = torch.zeros_like(x, dtype=dsum.dtype if dsum is not None else x.dtype)
    has_bias = ctx.bias_dtype is not None
    dx, dr, dw, db = _layer_norm_residual_bwd(
        dy, dsum, x, residual, weight, has_bias, seed, mean, rstd, ctx.dropout_p
    )
    if residual is None:
        dr = None
    elif not _separate_dresidual(x, residual, ctx.dropout_p):
        dr = dx
    return (
        dx, dr, dw.to(weight.dtype) if weight is not None else None,
        db.to(ctx.bias_dtype) if has_bias else None,
        None, None, None, None,
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


# CPU dtypes the float32 fastattn._C kernels take after a conversion: under CPU autocast the
# conversions cost less than the unfused PyTorch chain (serial dropout generator) they replace.
_UPCAST = (torch.float32, torch.bfloat16, torch.float16)
# x's dtypes the CPU layer_norm_residual kernels read as they are (bfloat16 beside a float32
# residual only).
_NATIVE = (torch.float32, torch.bfloat16)


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _draw_seed(device: torch.device) -> torch.Tensor:
    """A fresh dropout seed from torch's generator for `device`, kept on the device (no sync)."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


@torch.library.custom_op("fastattn::seeded_dropout", mutates_args=())
def _seeded_dropout(x: torch.Tensor, seed: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """x · keep / (1 - p) on CPU float32, keep a function of (seed, position): fastattn._C's
    cpu_dropout, with layer_norm_residual's mask. Its backward is itself applied to the grad."""
    return torch.ops.fastattn.cpu_dropout(x, int(seed), dropout_p)


@_seeded_dropout.register_fake
def _(x, seed, dropout_p):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _seeded_dropout_setup_context(ctx, inputs, output):
    ctx.seed, ctx.dropout_p = inputs[1], inputs[2]


torch.library.register_autograd(
    "fastattn::seeded_dropout",
    lambda ctx, grad: (_seeded_dropout(grad, ctx.seed, ctx.dropout_p), None, None),
    setup_context=_seeded_dropout_setup_context,
)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """F.dropout(x, p, training) for p in [0, 1). On CPU PyTorch draws masks from a serial
    generator (dropout was a fifth of a small model's step), so float32, bfloat16 and float16
    take fastattn._C's counter-based mask (layer_norm_residual's), computed in float32, and
    float64 compares torch.rand against p (bernoulli_ is 4x slower than rand there). GPUs run
    F.dropout."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training)
    if native_cpu(x, dtypes=_UPCAST):
        return _seeded_dropout(x.float(), _draw_seed(x.device), p).to(x.dtype)
    return x * (torch.rand(x.shape, device=x.device) >= p) * (1.0 / (1.0 - p))


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm(residual + dropout(x)) over the last dimension, with optional affine parameters.

    x and residual (or None) share a shape (..., N); weight and bias are (N,) or None. Dropout is
    applied to x with probability `dropout_p`: pass 0.0 outside training. With
    `return_residual=True` returns (y, residual + dropout(x)), the stream a pre-norm stack
    carries on. The output dtype is the promotion of x's and residual's dtypes. The Triton
    kernel handles N <= MAX_FEATURES; wider rows raise ValueError there. On CPU, float32 runs
    fastattn._C's one-pass kernel (no row limit), as does a bfloat16 x beside a float32 residual
    (read as it is: post-norm under autocast), other bfloat16 and float16 inputs run it on
    float32 copies, and float64 runs dropout(), an add and F.layer_norm. All draw their dropout randomness from
    torch's generator: torch.manual_seed reproduces it.
    """
    N = x.shape[-1]
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (N,):
            raise ValueError(f"{name} must have shape ({N},), got {tuple(p.shape)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    mixed = x.dtype != torch.float32 or (residual is not None and residual.dtype != x.dtype)
    # Post-norm under CPU autocast: the kernel reads a bfloat16 sublayer output beside the
    # float32 residual stream as it is, not a float32 copy (and returns dx in bfloat16).
    bf16_beside_fp32 = (residual is not None and x.dtype == torch.bfloat16
                        and native_cpu(x, dtypes=_NATIVE) and native_cpu(residual, weight, bias))
    if mixed and not bf16_beside_fp32 and x.numel() \
            and native_cpu(x, residual, weight, bias, dtypes=_UPCAST):
        dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
        out = layer_norm_residual(
            x.float(), _float(residual), _float(weight), _float(bias), eps, dropout_p,
            return_residual,
        )
        return tuple(t.to(dtype) for t in out) if return_residual else out.to(dtype)
    if x.numel() == 0 or not (_use_kernel(x) or bf16_beside_fp32
                              or native_cpu(x, residual, weight, bias)):
        h = dropout(x, dropout_p)
        y, s = layer_norm_residual_reference(h, residual, weight, bias, eps)
        return (y, s) if return_residual else y
    if _use_kernel(x) and N > MAX_FEATURES:
        raise ValueError(
            f"layer_norm_residual's Triton kernel supports at most {MAX_FEATURES} features per "
            f"row, got {N}"
        )
    seed = _draw_seed(x.device) if dropout_p > 0 else None
    y, s, _, _ = _layer_norm_residual_fwd(
        _rows(x), _rows(residual), _contiguous(weight), _contiguous(bias), seed, eps, dropout_p,
        return_residual,
    )
    y = y.view(x.shape)
    return (y, s.view(x.shape)) if return_residual else y


def _dropout_keep_mask(x: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """The keep mask layer_norm_residual(x, ...) draws at the current RNG state (for tests):
    the op's own returned sum of dropout(ones) and zeros."""
    ones = torch.ones_like(x)
    _, s = layer_norm_residual(
        ones, torch.zeros_like(x), None, None, dropout_p=dropout_p, return_residual=True
    )
    return s != 0


def forward_bytes(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    residual: bool = True,
    dropout: bool = False,
    return_residual: bool = False,
) -> tuple[int, int]:
    """(fused, unfused) bytes the forward moves for inputs of `shape`: compulsory reads and
    writes of every kernel, including weight, bias and the fp32 per-row statistics. The unfused
    chain is dropout (writes a 1-byte mask) -> add -> layer_norm, as PyTorch eager runs it."""
    e = torch.finfo(dtype).bits // 8
    features = shape[-1]
    elements = 1
    for d in shape:
        elements *= d
    rows = elements // max(features, 1)
    params = 2 * features * e + rows * 8  # weight + bias read, mean + rstd written
    fused = elements * e * (2 + residual + return_residual) + params
    unfused = elements * (2 * e) + params  # layer_norm reads the sum, writes y
    if dropout:
        unfused += elements * (2 * e + 1)  # read x, write the dropped x and the mask
    if residual:
        unfused += elements * 3 * e  # read both operands, write the sum
    return fused, unfused


def compile_configs() -> list[dict]:
    """Every (kernel, block size, warps) the launchers pick, all features on (most registers)."""
    fwd_signature = {
        "X": "*fp16:16", "R": "*fp16:16", "W": "*fp32:16", "B": "*fp32:16", "Y": "*fp16:16", "S": "*fp16:16",
        "Mean": "*fp32:16", "Rstd": "*fp32:16", "Seed": "*i64:16",
        "stride_x": "i32:16", "stride_r": "i32:16", "stride_y": "i32:16", "stride_s": "i32:16",
        "N": "i32", "eps": "fp32", "dropout_p": "fp32",
    }
    bwd_signature = {
        "DY": "*fp16:16", "DSUM": "*fp16:16", "X": "*fp16:16", "R": "*fp16:16", "W": "*fp32:16",
        "Mean": "*fp32:16", "Rstd": "*fp32:16", "Seed": "*i64:16", "DX": "*fp16:16", "DR": "*fp16:16",
        "DW": "*fp32:16", "DB": "*fp32:16",
        "stride_dy": "i32:16", "stride_dsum": "i32:16", "stride_x": "i32:16", "stride_r": "i32:16",
        "stride_dx": "i32:16", "stride_dr": "i32:16",
        "M": "i32", "N": "i32", "rows_per_program": "i32", "dropout_p": "fp32",
    }
    flags = dict(HAS_RESIDUAL=True, HAS_WEIGHT=True, HAS_BIAS=True, HAS_DROPOUT=True)
    bwd_flags = dict(flags, HAS_DSUM=True, STORE_DRESIDUAL=True)
    launches = []
    for log2 in range(MAX_FEATURES.bit_length()):
        n = 2**log2
        launches.append(("layer_norm_fwd", _layer_norm_fwd_kernel, fwd_signature,
                         dict(flags, STORE_SUM=True, BLOCK_N=n), _num_warps(n)))
        if n <= BWD_MAX_BLOCK:
            kernel, block_n, num_warps = _bwd_config(n)
            launches.append(("layer_norm_bwd", kernel, bwd_signature,
                             dict(bwd_flags, BLOCK_N=block_n), num_warps))
    kernel, block_n, num_warps = _bwd_config(MAX_FEATURES)
    launches.append(("layer_norm_bwd_wide", kernel, bwd_signature,
                     dict(bwd_flags, BLOCK_N=block_n), num_warps))
    return [
        dict(
            name=f"{name}_N{constexprs['BLOCK_N']}", fn=fn,
            signature={**signature, **{k: "constexpr" for k in constexprs}},
            constexprs=constexprs, num_warps=num_warps, num_stages=1,
        )
        for name, fn, signature, constexprs, num_warps in launches
    ]
