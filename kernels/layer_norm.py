"""Fused residual + dropout + LayerNorm as Triton kernels and their launchers (the op is
fastattn.ops.layer_norm): y = LayerNorm(residual + dropout(x)) over the last dim.

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

Dropout draws its keep mask from Philox keyed by a per-call seed (an int64 the op draws from
torch's CPU generator, so torch.manual_seed reproduces it, passed by value: no launch, no sync;
or, under fastattn.ops.seeds.from_device, a pointer to one in a device table a CUDA graph
refills, which `scalar` loads) with the element's (column, row) as the counter
(kernels/seeds.py); the backward regenerates the same mask instead of storing it. The backward
recomputes the sum from x and residual (both are kept alive by the caller anyway) and the saved
fp32 mean and rstd; dweight and dbias are summed from fp32 per-program partials by the launch's
last program (kernels/reduction.py: one launch, summed in program order, so they are
deterministic). Rows wider than BWD_MAX_BLOCK take a two-pass backward over column chunks (the
second pass rereads the row from L2), so no configuration spills registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastattn.kernels.reduction import arrival_counter, last_program, sum_partials
from fastattn.kernels.seeds import keep_mask, scalar

MAX_FEATURES = 16384  # one row lives in registers; wider rows would spill


@triton.jit(do_not_specialize=["seed"])
def _layer_norm_fwd_kernel(
    X, XB, R, W, B, Y, Y_COPY, S, Mean, Rstd, seed,
    stride_x, stride_r, stride_y, stride_s,
    N, eps, dropout_p,
    HAS_X_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_SUM: tl.constexpr,
    STORE_COPY: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One row per program.

    s = r + (x + xb) * keep / (1 - p)        (xb: the bias of the linear map that made x)
    mean = sum(s) / N,  rstd = 1 / sqrt(sum((s - mean)^2) / N + eps)
    y = (s - mean) * rstd * w + b,  y_copy = y rounded to Y_COPY's dtype (stride_y, too)
    """
    seed = scalar(seed)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    s = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_X_BIAS:
        s += tl.load(XB + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = keep_mask(seed, row, cols, dropout_p)
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
    y = y.to(Y.dtype.element_ty)
    tl.store(Y + row.to(tl.int64) * stride_y + cols, y, mask=mask)
    if STORE_COPY:  # from y as stored, to nearest even (Triton's default), as y.to(dtype)
        tl.store(Y_COPY + row.to(tl.int64) * stride_y + cols, y.to(Y_COPY.dtype.element_ty),
                 mask=mask)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit
def _recompute_xhat(X, XB, R, seed, row, cols, mask, stride_x, stride_r, mean, rstd, dropout_p,
                    HAS_X_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    HAS_DROPOUT: tl.constexpr):
    """xhat = (r + (x + xb) * keep / (1 - p) - mean) * rstd of row's `cols`, and the keep
    mask."""
    s = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_X_BIAS:
        s += tl.load(XB + cols, mask=mask, other=0.0).to(tl.float32)
    keep = mask
    if HAS_DROPOUT:
        keep = keep_mask(seed, row, cols, dropout_p)
        s = tl.where(keep, s / (1.0 - dropout_p), 0.0)
    if HAS_RESIDUAL:
        s += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, (s - mean) * rstd, 0.0), keep


@triton.jit
def _load_dy(DY, DY_COPY, offsets, mask, HAS_DY_COPY: tl.constexpr):
    """dy (+ dy_copy) at offsets, in float32: the gradient of y and of its rounded copy."""
    g = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_DY_COPY:
        g += tl.load(DY_COPY + offsets, mask=mask, other=0.0).to(tl.float32)
    return g


@triton.jit
def _store_input_grads(ds, keep, DSUM, DR, DX, row, cols, mask, stride_dsum, stride_dr,
                       stride_dx, dropout_p, HAS_DSUM: tl.constexpr,
                       STORE_DRESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """Adds the returned sum's gradient to ds; stores dresidual = ds, dx = ds * keep / (1 - p);
    returns dx (float32)."""
    if HAS_DSUM:
        ds += tl.load(DSUM + row * stride_dsum + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_DRESIDUAL:
        tl.store(DR + row * stride_dr + cols, ds.to(DR.dtype.element_ty), mask=mask)
    if HAS_DROPOUT:
        ds = tl.where(keep, ds / (1.0 - dropout_p), 0.0)
    tl.store(DX + row * stride_dx + cols, ds.to(DX.dtype.element_ty), mask=mask)
    return ds


@triton.jit(do_not_specialize=["seed"])
def _layer_norm_bwd_kernel(
    DY, DY_COPY, DSUM, X, XB, R, W, Mean, Rstd, seed, DX, DR, DW, DB, DXB,
    DW_SUM, DB_SUM, DXB_SUM, COUNTER,
    stride_dy, stride_dsum, stride_x, stride_r, stride_dx, stride_dr,
    M, N, rows_per_program, dropout_p,
    HAS_X_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_DSUM: tl.constexpr,
    STORE_DRESIDUAL: tl.constexpr, HAS_DY_COPY: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """A contiguous block of rows per program, each row held in registers; the block's dW, dB
    partials accumulate in registers (fp32).

    dy += dy_copy                  (the gradient of y's copy, stride_dy too, in float32)
    xhat = (s - mean) * rstd,  g = dy * w
    ds = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dsum     (dsum: grad of the returned sum)
    dresidual = ds,  dx = ds * keep / (1 - p)
    dW[program] = sum over its rows of dy * xhat,  dB[program] = sum of dy,  dXB[program] = sum
    of dx;  dW = sum over programs of dW[program] (dB, dXB likewise), by the last program
    """
    seed = scalar(seed)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dxb = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 rows: row * stride may pass 2**31
    for row in range(row_start, tl.minimum(row_start + rows_per_program, M)):
        rstd = tl.load(Rstd + row)
        xhat, keep = _recompute_xhat(X, XB, R, seed, row, cols, mask, stride_x, stride_r,
                                     tl.load(Mean + row), rstd, dropout_p, HAS_X_BIAS,
                                     HAS_RESIDUAL, HAS_DROPOUT)
        g = _load_dy(DY, DY_COPY, row * stride_dy + cols, mask, HAS_DY_COPY)
        if HAS_BIAS:
            db += g
        if HAS_WEIGHT:
            dw += g * xhat
            g *= tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        ds = (g - (xhat * tl.sum(g * xhat, axis=0) + tl.sum(g, axis=0)) / N) * rstd
        dx = _store_input_grads(ds, keep, DSUM, DR, DX, row, cols, mask, stride_dsum, stride_dr,
                                stride_dx, dropout_p, HAS_DSUM, STORE_DRESIDUAL, HAS_DROPOUT)
        if HAS_X_BIAS:
            dxb += dx
    if HAS_WEIGHT:
        tl.store(DW + pid * N + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB + pid * N + cols, db, mask=mask)
    if HAS_X_BIAS:
        tl.store(DXB + pid * N + cols, dxb, mask=mask)
    _sum_partials_if_last(DW, DB, DXB, DW_SUM, DB_SUM, DXB_SUM, COUNTER, N, HAS_WEIGHT,
                          HAS_BIAS, HAS_X_BIAS, BLOCK_N)


@triton.jit(do_not_specialize=["seed"])
def _layer_norm_bwd_wide_kernel(
    DY, DY_COPY, DSUM, X, XB, R, W, Mean, Rstd, seed, DX, DR, DW, DB, DXB,
    DW_SUM, DB_SUM, DXB_SUM, COUNTER,
    stride_dy, stride_dsum, stride_x, stride_r, stride_dx, stride_dr,
    M, N, rows_per_program, dropout_p,
    HAS_X_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_DSUM: tl.constexpr,
    STORE_DRESIDUAL: tl.constexpr, HAS_DY_COPY: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The same math for rows wider than registers hold with their partials: BLOCK_N-column
    chunks, two passes per row. Pass 1 sums g * xhat and g, and adds dy * xhat, dy to this
    program's own dW, dB partial rows in global memory; pass 2 rereads the row (from L2),
    stores the input gradients and adds dx to the dXB partial row."""
    seed = scalar(seed)
    pid = tl.program_id(0)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        if HAS_WEIGHT:
            tl.store(DW + pid * N + cols, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=cols < N)
        if HAS_BIAS:
            tl.store(DB + pid * N + cols, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=cols < N)
        if HAS_X_BIAS:
            tl.store(DXB + pid * N + cols, tl.zeros((BLOCK_N,), dtype=tl.float32),
                     mask=cols < N)
    row_start = pid.to(tl.int64) * rows_per_program
    for row in range(row_start, tl.minimum(row_start + rows_per_program, M)):
        mean, rstd = tl.load(Mean + row), tl.load(Rstd + row)
        sum_g_xhat = 0.0
        sum_g = 0.0
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            xhat, keep = _recompute_xhat(X, XB, R, seed, row, cols, mask, stride_x, stride_r,
                                         mean, rstd, dropout_p, HAS_X_BIAS, HAS_RESIDUAL,
                                         HAS_DROPOUT)
            g = _load_dy(DY, DY_COPY, row * stride_dy + cols, mask, HAS_DY_COPY)
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
            xhat, keep = _recompute_xhat(X, XB, R, seed, row, cols, mask, stride_x, stride_r,
                                         mean, rstd, dropout_p, HAS_X_BIAS, HAS_RESIDUAL,
                                         HAS_DROPOUT)
            g = _load_dy(DY, DY_COPY, row * stride_dy + cols, mask, HAS_DY_COPY)
            if HAS_WEIGHT:
                g *= tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            ds = (g - (xhat * sum_g_xhat + sum_g) / N) * rstd
            dx = _store_input_grads(ds, keep, DSUM, DR, DX, row, cols, mask, stride_dsum,
                                    stride_dr, stride_dx, dropout_p, HAS_DSUM, STORE_DRESIDUAL,
                                    HAS_DROPOUT)
            if HAS_X_BIAS:
                tl.store(DXB + pid * N + cols, tl.load(DXB + pid * N + cols, mask=mask) + dx,
                         mask=mask)
    _sum_partials_if_last(DW, DB, DXB, DW_SUM, DB_SUM, DXB_SUM, COUNTER, N, HAS_WEIGHT,
                          HAS_BIAS, HAS_X_BIAS, BLOCK_N)


@triton.jit
def _sum_partials_if_last(DW, DB, DXB, DW_SUM, DB_SUM, DXB_SUM, COUNTER, N,
                          HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_X_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """In the launch's last program (kernels/reduction.py): dW = sum over programs of
    dW[program], dB and dXB likewise, in program order (deterministic) in float32; dXB stored
    in its own dtype (x_bias's: no cast launch after)."""
    if HAS_WEIGHT or HAS_BIAS or HAS_X_BIAS:
        if last_program(COUNTER):
            programs = tl.num_programs(0)
            if HAS_WEIGHT:
                sum_partials(DW, DW_SUM, programs, N, BLOCK_N)
            if HAS_BIAS:
                sum_partials(DB, DB_SUM, programs, N, BLOCK_N)
            if HAS_X_BIAS:
                sum_partials(DXB, DXB_SUM, programs, N, BLOCK_N)


def _num_warps(block_n: int) -> int:
    """Forward: at most 32 fp32 elements of a row per thread."""
    return min(max(block_n // 512, 1), 16)


BWD_MAX_BLOCK = 4096  # widest row the one-pass backward holds in registers with its partials
WIDE_BLOCK = 2048  # column chunk of the two-pass backward


def _bwd_config(n: int) -> tuple:
    """(kernel, BLOCK_N, num_warps) of the backward for rows of n features: at most 4 elements
    per thread (8 at 4096 columns, 16 warps), which keeps the register-resident kernel near 64
    registers (8 per thread reached ptxas's 128 and spilled at 2048 columns on sm_90 once the
    copy's gradient was read too)."""
    block_n = triton.next_power_of_2(n)
    if block_n <= BWD_MAX_BLOCK:
        return _layer_norm_bwd_kernel, block_n, min(max(block_n // 128, 1), 16)
    return _layer_norm_bwd_wide_kernel, WIDE_BLOCK, WIDE_BLOCK // 256


def _num_programs(x: torch.Tensor, rows: int) -> int:
    """Backward programs: one per SM on CUDA (few partials to sum), a handful in the interpreter."""
    if x.device.type == "cuda":
        return min(rows, torch.cuda.get_device_properties(x.device).multi_processor_count)
    return min(rows, 4)


def separate_dresidual(x: torch.Tensor, residual: torch.Tensor | None, dropout_p: float) -> bool:
    """dresidual equals dx unless dropout scales dx or the dtypes differ."""
    return residual is not None and (dropout_p > 0 or residual.dtype != x.dtype)


def layer_norm_residual_forward(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
    bias: torch.Tensor | None, seed: int | torch.Tensor, eps: float, dropout_p: float,
    return_residual: bool, copy_dtype: torch.dtype | None = None,
    x_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, sum or empty, y in copy_dtype or empty, mean, rstd) for 2-D x and residual with
    unit column stride; x_bias (N,) is added to x first. seed: an int, or a one-element int64
    tensor on x's device the kernel reads (fastattn.ops.seeds)."""
    M, N = x.shape
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = torch.empty((M, N), dtype=dtype, device=x.device)
    s = torch.empty_like(y) if return_residual else y.new_empty(0)
    y_copy = torch.empty_like(y, dtype=copy_dtype) if copy_dtype else y.new_empty(0)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    block_n = triton.next_power_of_2(N)
    _layer_norm_fwd_kernel[(M,)](
        x, x_bias, residual, weight, bias, y, y_copy, s, mean, rstd, seed,
        x.stride(0), 0 if residual is None else residual.stride(0), y.stride(0),
        s.stride(0) if return_residual else 0,
        N, eps, dropout_p,
        HAS_X_BIAS=x_bias is not None, HAS_RESIDUAL=residual is not None,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, HAS_DROPOUT=dropout_p > 0,
        STORE_SUM=return_residual, STORE_COPY=copy_dtype is not None, BLOCK_N=block_n,
        num_warps=_num_warps(block_n),
    )
    return y, s, y_copy, mean, rstd


def layer_norm_residual_backward(
    dy: torch.Tensor, dsum: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
    weight: torch.Tensor | None, has_bias: bool, seed: int | torch.Tensor, mean: torch.Tensor,
    rstd: torch.Tensor, dropout_p: float, dy_copy: torch.Tensor | None = None,
    x_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dresidual or empty, fp32 dweight and dbias or empty, dx_bias in x_bias's dtype or
    empty) for contiguous dy, dsum and dy_copy (the gradient of y's copy, added to dy's);
    dresidual is empty when it equals dx (custom ops may not return aliases)."""
    M, N = x.shape
    dx = torch.empty_like(x)
    store_dr = separate_dresidual(x, residual, dropout_p)
    dr = torch.empty_like(residual) if store_dr else x.new_empty(0)
    programs = _num_programs(x, M)
    partial = lambda on: x.new_empty((programs, N) if on else 0, dtype=torch.float32)
    dw, db, dxb = partial(weight is not None), partial(has_bias), partial(x_bias is not None)
    dw_sum, db_sum = (t.new_empty(N) if t.numel() else t for t in (dw, db))
    dxb_sum = dxb if x_bias is None else x_bias.new_empty(N)
    kernel, block_n, num_warps = _bwd_config(N)
    kernel[(programs,)](
        dy, dy_copy, dsum, x, x_bias, residual, weight, mean, rstd, seed, dx, dr, dw, db, dxb,
        dw_sum, db_sum, dxb_sum, arrival_counter(x.device),
        dy.stride(0), 0 if dsum is None else dsum.stride(0), x.stride(0),
        0 if residual is None else residual.stride(0), dx.stride(0),
        dr.stride(0) if store_dr else 0, M, N, triton.cdiv(M, programs), dropout_p,
        HAS_X_BIAS=x_bias is not None, HAS_RESIDUAL=residual is not None,
        HAS_WEIGHT=weight is not None, HAS_BIAS=has_bias, HAS_DROPOUT=dropout_p > 0,
        HAS_DSUM=dsum is not None, STORE_DRESIDUAL=store_dr, HAS_DY_COPY=dy_copy is not None,
        BLOCK_N=block_n, num_warps=num_warps,
    )
    return dx, dr, dw_sum, db_sum, dxb_sum


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
        "X": "*fp16:16", "XB": "*fp16:16", "R": "*fp16:16", "W": "*fp32:16", "B": "*fp32:16",
        "Y": "*fp16:16", "Y_COPY": "*fp16:16", "S": "*fp16:16",
        "Mean": "*fp32:16", "Rstd": "*fp32:16", "seed": "i64",
        "stride_x": "i32:16", "stride_r": "i32:16", "stride_y": "i32:16", "stride_s": "i32:16",
        "N": "i32", "eps": "fp32", "dropout_p": "fp32",
    }
    bwd_signature = {
        "DY": "*fp16:16", "DY_COPY": "*fp16:16", "DSUM": "*fp16:16", "X": "*fp16:16",
        "XB": "*fp16:16", "R": "*fp16:16", "W": "*fp32:16", "Mean": "*fp32:16",
        "Rstd": "*fp32:16", "seed": "i64", "DX": "*fp16:16", "DR": "*fp16:16",
        "DW": "*fp32:16", "DB": "*fp32:16", "DXB": "*fp32:16", "DW_SUM": "*fp32:16",
        "DB_SUM": "*fp32:16", "DXB_SUM": "*fp16:16", "COUNTER": "*i32",
        "stride_dy": "i32:16", "stride_dsum": "i32:16", "stride_x": "i32:16", "stride_r": "i32:16",
        "stride_dx": "i32:16", "stride_dr": "i32:16",
        "M": "i32", "N": "i32", "rows_per_program": "i32", "dropout_p": "fp32",
    }
    flags = dict(HAS_X_BIAS=True, HAS_RESIDUAL=True, HAS_WEIGHT=True, HAS_BIAS=True,
                 HAS_DROPOUT=True)
    bwd_flags = dict(flags, HAS_DSUM=True, STORE_DRESIDUAL=True, HAS_DY_COPY=True)
    launches = []
    for log2 in range(MAX_FEATURES.bit_length()):
        n = 2**log2
        launches.append(("layer_norm_fwd", _layer_norm_fwd_kernel, fwd_signature,
                         dict(flags, STORE_SUM=True, STORE_COPY=True, BLOCK_N=n), _num_warps(n)))
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
