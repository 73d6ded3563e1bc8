"""Scaled dot-product attention (Vaswani et al., 2017, eq. 1) as FlashAttention-2 style Triton
kernels, the PyTorch path used on CPU, and the explicit reference both are tested against.

    O = dropout(softmax(Q K^T * scale + bias)) V        Q: (B, H, Lq, D), K, V: (B, H, Lk, D)

Semantics are those of torch.nn.functional.scaled_dot_product_attention, with one deliberate
difference: a query row that may attend to no key at all returns zeros and passes zero gradients
(PyTorch's math path returns NaN there).

- causal: False; True or "top_left" keeps key j for query i when j <= i (PyTorch's is_causal);
  "bottom_right" keeps j <= i + Lk - Lq, for queries that continue a cached prefix of Lk - Lq keys.
- attn_mask: bool (True = may attend) or float (added to the scores), broadcastable to
  (B, H, Lq, Lk). The kernels read broadcast dimensions with stride 0, so a key-padding mask of
  shape (B, 1, 1, Lk) is never expanded in memory. The mask is a constant: no gradient flows to it.
- dropout_p: attention dropout, applied on every call (as in PyTorch; pass 0.0 in eval mode).
  The kernels draw the keep mask as they go from a (seed, offset) pair taken from torch's default
  generator, and the backward regenerates the same mask: the Triton kernels from Philox, the CPU
  kernels from fastattn._C's counter-based hash (csrc/dropout.h, the one residual dropout uses).

On CPU, calls that need a gradient and are masked, causal or float32 run fastattn._C's
attention (csrc/attention.cpp: one task per (batch, head) pair, float32 inside; see
_use_native), through the same torch.library ops and autograd as the Triton kernels; other CPU
calls run PyTorch's ops, with the native dropout mask where fastattn._C is built.

Sections, top to bottom: the Triton kernels, their block-size table, the launchers, the native
CPU launchers, the torch.library registration with autograd, the PyTorch path, the public op, the
reference.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastattn._native import native_cpu
from fastattn.backend import interpreter_active, use_triton
from fastattn.kernels.layer_norm import _seeded_dropout

CAUSAL_ALIGNMENTS = {False: None, True: "top_left", "top_left": "top_left",
                     "bottom_right": "bottom_right"}
MAX_HEAD_DIM = 256
NO_MASK, BOOL_MASK, FLOAT_MASK = 0, 1, 2
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _masked_scores(s, rows, cols, mask_ptr, stride_mm, Lq, Lk, causal_shift,
                   MASK_KIND: tl.constexpr, KEY_MASK: tl.constexpr, CAUSAL: tl.constexpr,
                   CHECK_BOUNDS: tl.constexpr):
    """Scores s (log2 units) for query `rows` x key `cols` (broadcastable index blocks, so both
    tile orientations work), with the mask applied: -inf where query may not attend to key.
    KEY_MASK: the mask is the same for every query (key padding), so one vector over the tile's
    keys is read. CHECK_BOUNDS=False is for tiles inside Lk and below the causal diagonal."""
    if MASK_KIND != 0:
        if KEY_MASK:
            m = tl.load(mask_ptr + cols, mask=cols < Lk, other=0)
        else:
            m = tl.load(mask_ptr + rows * stride_mm + cols, mask=(rows < Lq) & (cols < Lk),
                        other=0)
        if MASK_KIND == 1:
            s = tl.where(m != 0, s, float("-inf"))
        else:
            s += m.to(tl.float32) * 1.4426950408889634  # bias in the log2 units of s
    if CHECK_BOUNDS:
        allowed = cols < Lk
        if CAUSAL:
            allowed &= cols <= rows + causal_shift
        s = tl.where(allowed, s, float("-inf"))
    return s


@triton.jit
def _dropout_keep(philox_seed, philox_offset, bh, row_start, col_start, Lq, Lk, dropout_p,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keep-mask of the (BLOCK_M queries from row_start) x (BLOCK_N keys from col_start) tile of
    head bh. One Philox call yields four 32-bit numbers, so each counter covers four keys:
    counter = offset + flat index of (bh, row, key // 4). Every element has its own bits, and the
    backward, visiting the same tiles, redraws exactly the forward's mask."""
    rows = row_start + tl.arange(0, BLOCK_M)[:, None]
    groups = col_start // 4 + tl.arange(0, BLOCK_N // 4)[None, :]
    counter = philox_offset + (bh.to(tl.int64) * Lq + rows) * tl.cdiv(Lk, 4) + groups
    r0, r1, r2, r3 = tl.randint4x(philox_seed, counter)
    bits = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK_M, BLOCK_N])
    return tl.uint_to_uniform_float(bits) >= dropout_p


@triton.jit
def _attn_fwd_tiles(acc, l_i, m_i, q, k_base, v_base, mask_ptr, offs_m, offs_n, offs_d,
                    stride_kn, stride_vn, stride_mm, Lq, Lk, causal_shift, qk_scale,
                    dropout_p, philox_seed, philox_offset, bh, row_start, lo, hi,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    MASK_KIND: tl.constexpr, KEY_MASK: tl.constexpr, CAUSAL: tl.constexpr,
                    DROPOUT: tl.constexpr, CHECK_BOUNDS: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """Online softmax over key tiles [lo, hi): running max m_i, running sum l_i, output acc."""
    rows = offs_m[:, None]
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n[None, :]
        kv_mask = offs_d[:, None] < HEAD_DIM  # all true, folded away, unless D is padded
        if CHECK_BOUNDS:
            kv_mask &= cols < Lk
        k_t = tl.load(k_base + cols * stride_kn + offs_d[:, None], mask=kv_mask, other=0.0)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        s = _masked_scores(s, rows, cols, mask_ptr, stride_mm, Lq, Lk, causal_shift,
                           MASK_KIND, KEY_MASK, CAUSAL, CHECK_BOUNDS)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing allowed yet has m_new = -inf; shift by 0 instead so exp2 gives 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:  # the normaliser l_i sums the probabilities before dropout
            keep = _dropout_keep(philox_seed, philox_offset, bh, row_start, start_n, Lq, Lk,
                                 dropout_p, BLOCK_M, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        v = tl.load(v_base + cols.T * stride_vn + offs_d[None, :], mask=kv_mask.T, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, Mask, Out, Lse,
              stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_mb, stride_mh, stride_mm,
              H, Lq, Lk, causal_shift, qk_scale, dropout_p, philox_seed, philox_offset,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, KEY_MASK: tl.constexpr,
              CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program computes BLOCK_M query rows of one (batch, head).

    Scores are kept in log2 units, s = (q.k * scale + bias) * log2(e), so that
    softmax(x)_j = exp2(s_j - max s) / sum exp2(s - max s) uses the cheaper exp2. Key tiles are
    visited once with a running max m and sum l (online softmax, fp32 accumulation):
        m' = max(m, max_j s_j),  l' = l * 2^(m - m') + sum_j 2^(s_j - m'),
        acc' = acc * 2^(m - m') + 2^(s - m') V.
    Out = acc / l (times 1 / (1 - p) with dropout) and Lse = (m + log2 l) * ln 2 in fp32, the
    natural log-sum-exp the backward uses to recompute probabilities. Rows with no allowed key
    get Out = 0 and Lse = +inf, which makes every recomputed probability 0 in the backward.
    Causal tiles above the diagonal are never visited; tiles fully inside the allowed region skip
    the bounds and causal checks."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit offsets: tensors may exceed 2**31 elements
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    mask_ptr = Mask + b * stride_mb + h * stride_mh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys [0, n_full) need no bounds or causal checks for any row of this block; keys
    # [n_full, hi) do; keys from hi on are above the causal diagonal for every row.
    if CAUSAL:
        hi = tl.minimum(Lk, tl.maximum((pid_m + 1) * BLOCK_M + causal_shift, 0))
        n_full = tl.minimum(Lk, tl.maximum(pid_m * BLOCK_M + causal_shift + 1, 0))
    else:
        hi = Lk
        n_full = Lk
    n_full = n_full // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _attn_fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, mask_ptr, offs_m, offs_n, offs_d, stride_kn, stride_vn,
        stride_mm, Lq, Lk, causal_shift, qk_scale, dropout_p, philox_seed,
        philox_offset, bh, pid_m * BLOCK_M, 0, n_full, HEAD_DIM, BLOCK_M, BLOCK_N, MASK_KIND,
        KEY_MASK, CAUSAL, DROPOUT, False, DOT_PRECISION)
    acc, l_i, m_i = _attn_fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, mask_ptr, offs_m, offs_n, offs_d, stride_kn, stride_vn,
        stride_mm, Lq, Lk, causal_shift, qk_scale, dropout_p, philox_seed,
        philox_offset, bh, pid_m * BLOCK_M, n_full, hi, HEAD_DIM, BLOCK_M, BLOCK_N, MASK_KIND,
        KEY_MASK, CAUSAL, DROPOUT, True, DOT_PRECISION)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    if DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    row_ok = offs_m < Lq
    o_ptrs = Out + bh.to(tl.int64) * Lq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(Lse + bh.to(tl.int64) * Lq + offs_m, lse, mask=row_ok)


@triton.jit
def _attn_bwd_delta(Out, dOut, Delta, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    """Delta_i = sum_d dO_id * O_id = sum_j P_ij dP_ij (with dropout too), the row term of the
    softmax gradient dS = P * (dP - Delta). Out and dOut are contiguous (rows, HEAD_DIM)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = offs_m[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
    mask = (offs_m[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(Out + ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dOut + ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + offs_m, tl.sum(o * do, 1), mask=offs_m < n_rows)


@triton.jit
def _attn_bwd_dkdv(Q, K, V, Mask, dOut, Lse, Delta, dK, dV,
                   stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_mb, stride_mh, stride_mm,
                   H, Lq, Lk, causal_shift, qk_scale, sm_scale, dropout_p, philox_seed,
                   philox_offset, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
                   KEY_MASK: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """One program owns BLOCK_N keys of one (batch, head) and loops over the query tiles that can
    see them, so dK and dV are each written once (deterministic, no atomics). Tiles are held
    transposed, keys x queries:
        P^T = 2^(S^T - lse * log2 e),  dV = sum (P^T * Z) dO,  dP^T = (V dO^T) * Z,
        dS^T = P^T * (dP^T - Delta),   dK = scale * sum dS^T Q,
    where Z = keep / (1 - p) is the regenerated dropout mask (Z = 1 without dropout)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit offsets: tensors may exceed 2**31 elements
    h = (bh % H).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < Lk) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    q_base = Q + b * stride_qb + h * stride_qh
    row0 = bh.to(tl.int64) * Lq
    do_base = dOut + row0 * HEAD_DIM
    mask_ptr = Mask + b * stride_mb + h * stride_mh
    cols = offs_n[:, None]

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo = 0
    if CAUSAL:  # the first query that may see key pid_n * BLOCK_N is that key minus the shift
        lo = tl.maximum(pid_n * BLOCK_N - causal_shift, 0) // BLOCK_M * BLOCK_M
    for start_m in range(lo, Lq, BLOCK_M):
        rows = start_m + offs_m[None, :]
        q_mask = (rows < Lq) & (offs_d[:, None] < HEAD_DIM)
        q_t = tl.load(q_base + rows * stride_qm + offs_d[:, None], mask=q_mask, other=0.0)
        do = tl.load(do_base + rows.T * HEAD_DIM + offs_d[None, :], mask=q_mask.T, other=0.0)
        lse = tl.load(Lse + row0 + start_m + offs_m, mask=start_m + offs_m < Lq,
                      other=float("inf")) * 1.4426950408889634
        delta = tl.load(Delta + row0 + start_m + offs_m, mask=start_m + offs_m < Lq, other=0.0)
        s_t = tl.dot(k, q_t, input_precision=DOT_PRECISION) * qk_scale
        s_t = _masked_scores(s_t, rows, cols, mask_ptr, stride_mm, Lq, Lk,
                             causal_shift, MASK_KIND, KEY_MASK, CAUSAL, True)
        p_t = tl.math.exp2(s_t - lse[None, :])
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = tl.trans(_dropout_keep(philox_seed, philox_offset, bh, start_m,
                                          pid_n * BLOCK_N, Lq, Lk, dropout_p, BLOCK_M, BLOCK_N))
            inv_keep = 1.0 / (1.0 - dropout_p)
            p_drop_t = tl.where(keep, p_t * inv_keep, 0.0)
            dp_t = tl.where(keep, dp_t * inv_keep, 0.0)
        else:
            p_drop_t = p_t
        dv += tl.dot(p_drop_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision=DOT_PRECISION)
    out_ptrs = (bh.to(tl.int64) * Lk + offs_n[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(dK + out_ptrs, (dk * sm_scale).to(dK.dtype.element_ty), mask=kv_mask)
    tl.store(dV + out_ptrs, dv.to(dV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq(Q, K, V, Mask, dOut, Lse, Delta, dQ,
                 stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_mb, stride_mh, stride_mm,
                 H, Lq, Lk, causal_shift, qk_scale, sm_scale, dropout_p, philox_seed,
                 philox_offset, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
                 KEY_MASK: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One program owns BLOCK_M queries of one (batch, head) and loops over the key tiles they
    may see (causal stops at the diagonal):
        P = 2^(S - lse * log2 e),  dP = (dO V^T) * Z,  dS = P * (dP - Delta),  dQ = scale * dS K."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit offsets: tensors may exceed 2**31 elements
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row0 = bh.to(tl.int64) * Lq
    q_mask = (offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=q_mask, other=0.0)
    do = tl.load(dOut + (row0 + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], mask=q_mask,
                 other=0.0)
    lse = tl.load(Lse + row0 + offs_m, mask=offs_m < Lq, other=float("inf")) * 1.4426950408889634
    delta = tl.load(Delta + row0 + offs_m, mask=offs_m < Lq, other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    mask_ptr = Mask + b * stride_mb + h * stride_mh
    rows = offs_m[:, None]

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = Lk
    if CAUSAL:
        hi = tl.minimum(Lk, tl.maximum((pid_m + 1) * BLOCK_M + causal_shift, 0))
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n[None, :]
        kv_mask = (cols < Lk) & (offs_d[:, None] < HEAD_DIM)
        k_t = tl.load(k_base + cols * stride_kn + offs_d[:, None], mask=kv_mask, other=0.0)
        v_t = tl.load(v_base + cols * stride_vn + offs_d[:, None], mask=kv_mask, other=0.0)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        s = _masked_scores(s, rows, cols, mask_ptr, stride_mm, Lq, Lk, causal_shift,
                           MASK_KIND, KEY_MASK, CAUSAL, True)
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, v_t, input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = _dropout_keep(philox_seed, philox_offset, bh, pid_m * BLOCK_M, start_n, Lq,
                                 Lk, dropout_p, BLOCK_M, BLOCK_N)
            dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=DOT_PRECISION)
    tl.store(dQ + (row0 + offs_m[:, None]) * HEAD_DIM + offs_d[None, :],
             (dq * sm_scale).to(dQ.dtype.element_ty), mask=q_mask)


@triton.jit
def _dropout_keep_mask_kernel(Keep, Lq, Lk, dropout_p, philox_seed, philox_offset,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Materialises the keep-mask the attention kernels draw, for tests (B*H, Lq, Lk)."""
    bh = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    keep = _dropout_keep(philox_seed, philox_offset, bh, tl.program_id(0) * BLOCK_M,
                         tl.program_id(1) * BLOCK_N, Lq, Lk, dropout_p, BLOCK_M, BLOCK_N)
    tl.store(Keep + (bh.to(tl.int64) * Lq + rows) * Lk + cols, keep.to(tl.int8),
             mask=(rows < Lq) & (cols < Lk))


# ---------------------------------------------------------------------------------------------
# Block sizes: (BLOCK_M, BLOCK_N, num_warps, num_stages), keyed on the padded head dim and the
# element size, in the spirit of flash-attn's and the Triton tutorial's tables. Chosen with the
# compile report so that the heaviest variant (mask + causal + dropout) of every entry up to head
# dim 128 keeps within 255 registers per thread on sm_80 and sm_90 without spilling:
# - forward: 128 queries x 64 keys at D = 64 (the paper's head dim); fewer keys per tile below
#   (a thin Q K^T leaves the score tile, the dropout bits and the mask dominating registers)
#   and 64 x 32 above, where the (BLOCK_M, D) fp32 accumulator grows. 8 warps throughout.
# - dK/dV: two (BLOCK_N, D) fp32 accumulators per program, hence narrower tiles than the dQ
#   pass, which holds one (BLOCK_M, D) accumulator.
# - fp32 inputs: half the tiles or less. By default (torch's allow_tf32 off) the exact fp32
#   product runs on FMA units, with the operands in registers; with tf32 allowed, on tensor
#   cores. Both compile without spills from the same entries.
# Ampere and Hopper share the table; the report shows which entries Hopper runs on wgmma.
# ---------------------------------------------------------------------------------------------

FWD_CONFIGS = {  # (block_d, element size) -> config
    (16, 2): (128, 32, 8, 3), (32, 2): (128, 32, 8, 3), (64, 2): (128, 64, 8, 3),
    (128, 2): (64, 32, 8, 3), (256, 2): (64, 32, 8, 2),
    (16, 4): (64, 32, 8, 2), (32, 4): (64, 32, 8, 2), (64, 4): (64, 32, 8, 2),
    (128, 4): (32, 32, 8, 2), (256, 4): (32, 32, 8, 1),
}
BWD_DKDV_CONFIGS = {
    (16, 2): (32, 64, 8, 2), (32, 2): (32, 64, 8, 2), (64, 2): (64, 32, 8, 2),
    (128, 2): (32, 64, 8, 2), (256, 2): (32, 32, 8, 1),
    (16, 4): (16, 32, 4, 2), (32, 4): (16, 32, 4, 2), (64, 4): (16, 32, 4, 2),
    (128, 4): (32, 16, 8, 2), (256, 4): (16, 32, 8, 1),
}
BWD_DQ_CONFIGS = {
    (16, 2): (128, 32, 8, 3), (32, 2): (128, 32, 8, 3), (64, 2): (128, 32, 8, 3),
    (128, 2): (64, 32, 8, 2), (256, 2): (32, 32, 8, 1),
    (16, 4): (32, 32, 4, 2), (32, 4): (32, 32, 4, 2), (64, 4): (32, 32, 4, 2),
    (128, 4): (32, 32, 8, 2), (256, 4): (16, 16, 8, 1),
}
DELTA_TILE = 8192  # elements of O and dO per program of the Delta pass: 64 per thread


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs at least 16


def _config(table: dict, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    return table[(_block_d(head_dim), 4 if dtype == torch.float32 else 2)]


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs follow PyTorch's own matmul setting (tf32 off by default).
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


_TRITON_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _kernel_signature(kernel, dtype_name: str, mask_kind: int, head_dim: int) -> dict[str, str]:
    """The ASTSource signature of an attention kernel, for the compile report, with the ":16"
    divisibility hints Triton's launcher would find: torch allocations are 16-byte aligned, and
    the q/k/v strides are multiples of the head dim in the (B, H, L, D) and (B, L, H, D) layouts."""
    mask_type = {NO_MASK: dtype_name, BOOL_MASK: "u8", FLOAT_MASK: dtype_name}[mask_kind]
    types = {"Mask": f"*{mask_type}:16", "Lse": "*fp32:16", "Delta": "*fp32:16",
             "qk_scale": "fp32", "sm_scale": "fp32", "dropout_p": "fp32", "philox_seed": "i64",
             "philox_offset": "i64"}
    signature = {}
    # Read the Python function's own signature: works for the interpreter's kernels too.
    for name, param in inspect.signature(kernel.fn).parameters.items():
        if "constexpr" in str(param.annotation):
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        elif name in ("Q", "K", "V", "Out", "dOut", "dQ", "dK", "dV"):
            signature[name] = f"*{dtype_name}:16"
        elif name[:-1] in ("stride_q", "stride_k", "stride_v") and head_dim % 16 == 0:
            signature[name] = "i32:16"
        else:
            signature[name] = "i32"
    return signature


def compile_configs() -> list[dict]:
    """Every configuration the launchers can pick, for fastattn.kernels.compile_report: each
    table entry (padded head dim x element size; bf16 shares fp16's tiles, and head dims such as
    40, 80, 96 their padded entry's; fp32 both exact and with tf32 allowed) for the forward, both
    backward passes and the Delta pass. Each kernel is compiled in its heaviest feature set (bool
    mask per query, causal, dropout), which holds the most live registers."""
    variants = {2: [("fp16", "tf32")], 4: [("fp32", "ieee"), ("fp32 tf32", "tf32")]}
    configs = []
    for block_d, element_size in FWD_CONFIGS:
        dtype = torch.float16 if element_size == 2 else torch.float32
        for label, precision in variants[element_size]:
            dtype_name = label.split()[0]
            for kernel, table in ((_attn_fwd, FWD_CONFIGS), (_attn_bwd_dkdv, BWD_DKDV_CONFIGS),
                                  (_attn_bwd_dq, BWD_DQ_CONFIGS)):
                block_m, block_n, num_warps, num_stages = _config(table, block_d, dtype)
                configs.append(dict(
                    name=f"{kernel.__name__} d={block_d} {label} mask+causal+dropout", fn=kernel,
                    signature=_kernel_signature(kernel, dtype_name, BOOL_MASK, block_d),
                    constexprs=dict(HEAD_DIM=block_d, BLOCK_D=block_d, BLOCK_M=block_m,
                                    BLOCK_N=block_n, MASK_KIND=BOOL_MASK, KEY_MASK=False,
                                    CAUSAL=True, DROPOUT=True, DOT_PRECISION=precision),
                    num_warps=num_warps, num_stages=num_stages))
        dtype_name = _TRITON_DTYPES[dtype]
        configs.append(dict(
            name=f"_attn_bwd_delta d={block_d} {dtype_name}", fn=_attn_bwd_delta,
            signature=_kernel_signature(_attn_bwd_delta, dtype_name, NO_MASK, block_d),
            constexprs=dict(HEAD_DIM=block_d, BLOCK_D=block_d, BLOCK_M=DELTA_TILE // block_d),
            num_warps=4, num_stages=1))
    return configs


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _mask_args(attn_mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor):
    """(tensor, (batch, head, query) strides, constexpr flags) describing the mask to the
    kernels, which read keys with unit stride (contiguous loads) and broadcast dims with stride 0;
    bools as u8. A mask broadcast over queries (key padding) is read as one vector per tile."""
    if attn_mask is None:
        return q, (0, 0, 0), dict(MASK_KIND=NO_MASK, KEY_MASK=False)  # never read
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if attn_mask.stride(-1) != 1 or attn_mask.shape[-1] != lk:
        # Rare: a transposed mask, or one broadcast over keys: copy it, at its own size.
        attn_mask = attn_mask.expand(*attn_mask.shape[:-1], lk).contiguous()
    mask = attn_mask.expand(b, h, lq, lk)  # a view: broadcast dims get stride 0
    flags = dict(MASK_KIND=BOOL_MASK if mask.dtype == torch.bool else FLOAT_MASK,
                 KEY_MASK=mask.stride(2) == 0)
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask, mask.stride()[:3], flags


def _causal_shift(causal: str | None, lq: int, lk: int) -> int:
    return lk - lq if causal == "bottom_right" else 0


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _without_bf16(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Triton's CPU interpreter reads bf16 as raw bits (numpy has no bf16), so there bf16 tensors
    are computed as fp32 copies; GPUs run the bf16 kernels."""
    if not interpreter_active():
        return tensors
    return tuple(x.float() if x is not None and x.dtype == torch.bfloat16 else x for x in tensors)


def _attention_forward_triton(q, k, v, attn_mask, rng, causal, dropout_p, scale):
    dtype = q.dtype
    q, k, v, attn_mask = _without_bf16(q, k, v, attn_mask)
    q, k, v = (_unit_last_stride(x) for x in (q, k, v))
    b, h, lq, d = q.shape
    lk = k.shape[2]
    out = torch.empty((b, h, lq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, lq), dtype=torch.float32, device=q.device)
    mask, mask_strides, mask_flags = _mask_args(attn_mask, q, k)
    seed, offset = rng.tolist() if dropout_p > 0 else (0, 0)
    block_m, block_n, num_warps, num_stages = _config(FWD_CONFIGS, d, q.dtype)
    grid = (triton.cdiv(lq, block_m), b * h)
    _attn_fwd[grid](
        q, k, v, mask, out, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), *mask_strides, h, lq, lk,
        _causal_shift(causal, lq, lk), scale * LOG2E, dropout_p, seed, offset,
        HEAD_DIM=d, BLOCK_D=_block_d(d), BLOCK_M=block_m, BLOCK_N=block_n, **mask_flags,
        CAUSAL=causal is not None, DROPOUT=dropout_p > 0, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages)
    return out.to(dtype), lse


def _attention_backward_triton(grad_out, q, k, v, out, lse, attn_mask, rng, causal, dropout_p,
                               scale):
    dtype = q.dtype
    grad_out, q, k, v, out, attn_mask = _without_bf16(grad_out, q, k, v, out, attn_mask)
    q, k, v = (_unit_last_stride(x) for x in (q, k, v))
    grad_out = grad_out.contiguous()
    b, h, lq, d = q.shape
    lk = k.shape[2]
    delta = torch.empty_like(lse)
    delta_rows = DELTA_TILE // _block_d(d)
    _attn_bwd_delta[(triton.cdiv(b * h * lq, delta_rows),)](
        out, grad_out, delta, b * h * lq, HEAD_DIM=d, BLOCK_D=_block_d(d),
        BLOCK_M=delta_rows)
    dq = torch.empty((b, h, lq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, h, lk, d), dtype=k.dtype, device=q.device)
    dv = torch.empty((b, h, lk, d), dtype=v.dtype, device=q.device)
    mask, mask_strides, mask_flags = _mask_args(attn_mask, q, k)
    seed, offset = rng.tolist() if dropout_p > 0 else (0, 0)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), *mask_strides)
    scalars = (h, lq, lk, _causal_shift(causal, lq, lk), scale * LOG2E, scale, dropout_p, seed,
               offset)
    flags = dict(HEAD_DIM=d, BLOCK_D=_block_d(d), **mask_flags, CAUSAL=causal is not None,
                 DROPOUT=dropout_p > 0, DOT_PRECISION=_dot_precision(q.dtype))
    block_m, block_n, num_warps, num_stages = _config(BWD_DKDV_CONFIGS, d, q.dtype)
    _attn_bwd_dkdv[(triton.cdiv(lk, block_n), b * h)](
        q, k, v, mask, grad_out, lse, delta, dk, dv, *strides, *scalars, BLOCK_M=block_m,
        BLOCK_N=block_n, **flags, num_warps=num_warps, num_stages=num_stages)
    block_m, block_n, num_warps, num_stages = _config(BWD_DQ_CONFIGS, d, q.dtype)
    _attn_bwd_dq[(triton.cdiv(lq, block_m), b * h)](
        q, k, v, mask, grad_out, lse, delta, dq, *strides, *scalars, BLOCK_M=block_m,
        BLOCK_N=block_n, **flags, num_warps=num_warps, num_stages=num_stages)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def _philox_seed_offset() -> torch.Tensor:
    """A fresh (seed, offset) pair from torch's default CPU generator (so torch.manual_seed
    reproduces it), kept on the CPU so reading it never synchronises a GPU."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64)


def _dropout_keep_mask(q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """The bool keep-mask (B, H, Lq, Lk) that the next attention(q, k, v, dropout_p=dropout_p)
    call on the same backend will draw, given the same RNG state: the PyTorch path draws its mask
    here, and tests, which reset the seed, call this, reset it again and compare attention against
    the reference under this mask."""
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if native_cpu(q, dtypes=(q.dtype,)):  # the mask does not depend on q's dtype
        # fastattn._C's mask of row (b H + h) Lq + i, column j, as its attention kernels draw it.
        # An op taking the seed as a tensor, so torch.compile traces this without a break.
        seed = _philox_seed_offset()[:1]
        ones = torch.ones(b * h * lq, lk)
        return _seeded_dropout(ones, seed, dropout_p).ne(0).view(b, h, lq, lk)
    if not use_triton(q):
        return torch.rand((b, h, lq, lk), device=q.device) >= dropout_p
    seed, offset = _philox_seed_offset().tolist()
    keep = torch.empty((b, h, lq, lk), dtype=torch.int8, device=q.device)
    grid = (triton.cdiv(lq, 32), triton.cdiv(lk, 32), b * h)
    _dropout_keep_mask_kernel[grid](keep, lq, lk, dropout_p, seed, offset, BLOCK_M=32,
                                    BLOCK_N=32)
    return keep.bool()


# ---------------------------------------------------------------------------------------------
# Native CPU launchers (fastattn._C)
# ---------------------------------------------------------------------------------------------

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _use_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool) -> bool:
    """Whether a CPU call runs fastattn._C's kernel: when it needs a gradient, and is masked or
    causal, or float32. benchmarks/bench_attention.py's cpu_attention_paths measured it faster
    forward+backward than the explicit product and PyTorch's fused kernel at 32-512 keys (at 16
    its fp32 figures scatter around the explicit product's), with two exceptions left to PyTorch:
    unmasked bfloat16, where the explicit product's bf16 matrix products are faster, and
    inference, where the fused kernel without a backward is."""
    backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return (backward and (masked or q.dtype == torch.float32)
            and native_cpu(q, dtypes=_NATIVE_DTYPES))


def _native_args(q, k, attn_mask, causal):
    """(bias, causal, causal shift) for fastattn._C: the mask as a float32 additive bias at its
    own size, viewed as (B, H, Lq, Lk) with stride 0 on broadcast dims."""
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    bias = None
    if attn_mask is not None:
        bias = (torch.zeros(attn_mask.shape, device=q.device).masked_fill_(~attn_mask, -math.inf)
                if attn_mask.dtype == torch.bool else attn_mask.float())
        bias = bias.expand(b, h, lq, lk)
    return bias, causal is not None, _causal_shift(causal, lq, lk)


def _native_seed(rng: torch.Tensor | None, dropout_p: float) -> int:
    return int(rng[0]) if dropout_p > 0 else 0


def _attention_forward_native(q, k, v, attn_mask, rng, causal, dropout_p, scale):
    q, k, v = (_unit_last_stride(x) for x in (q, k, v))
    return torch.ops.fastattn.cpu_attention_fwd(q, k, v, *_native_args(q, k, attn_mask, causal),
                                                scale, dropout_p, _native_seed(rng, dropout_p))


def _attention_backward_native(grad_out, q, k, v, out, lse, attn_mask, rng, causal, dropout_p,
                               scale):
    q, k, v, grad_out = (_unit_last_stride(x) for x in (q, k, v, grad_out))
    return torch.ops.fastattn.cpu_attention_bwd(grad_out, q, k, v, out, lse,
                                                *_native_args(q, k, attn_mask, causal), scale,
                                                dropout_p, _native_seed(rng, dropout_p))


# ---------------------------------------------------------------------------------------------
# torch.library registration: opaque to torch.compile, with fake tensors and autograd
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fastattn::attention_forward", mutates_args=())
def _attention_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          attn_mask: torch.Tensor | None, rng: torch.Tensor | None,
                          causal: str | None, dropout_p: float,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if native_cpu(q, dtypes=_NATIVE_DTYPES):
        return _attention_forward_native(q, k, v, attn_mask, rng, causal, dropout_p, scale)
    return _attention_forward_triton(q, k, v, attn_mask, rng, causal, dropout_p, scale)


def _empty_result(x: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, L, D) like x, laid out as the op lays out its results: fastattn._C
    writes (B, L, H, D), whose heads merge to (B, L, H·D) as a view; Triton writes contiguous."""
    b, h, length, d = x.shape
    if native_cpu(x, dtypes=_NATIVE_DTYPES):
        return x.new_empty((b, length, h, d)).transpose(1, 2)
    return x.new_empty((b, h, length, d))


@_attention_forward_op.register_fake
def _(q, k, v, attn_mask, rng, causal, dropout_p, scale):
    return _empty_result(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fastattn::attention_backward", mutates_args=())
def _attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           attn_mask: torch.Tensor | None, rng: torch.Tensor | None,
                           causal: str | None, dropout_p: float,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if native_cpu(q, dtypes=_NATIVE_DTYPES):
        return _attention_backward_native(grad_out, q, k, v, out, lse, attn_mask, rng, causal,
                                          dropout_p, scale)
    return _attention_backward_triton(grad_out, q, k, v, out, lse, attn_mask, rng, causal,
                                      dropout_p, scale)


@_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, attn_mask, rng, causal, dropout_p, scale):
    return _empty_result(q), _empty_result(k), _empty_result(v)


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, rng, causal, dropout_p, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, rng)
    ctx.causal, ctx.dropout_p, ctx.scale = causal, dropout_p, scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, attn_mask, rng = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(grad_out, q, k, v, out, lse, attn_mask, rng, ctx.causal,
                                        ctx.dropout_p, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


_attention_forward_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# PyTorch path (CPU, or FASTATTN_BACKEND=torch)
# ---------------------------------------------------------------------------------------------


def _allowed_mask(causal: str | None, attn_mask: torch.Tensor | None, lq: int, lk: int,
                  device: torch.device) -> torch.Tensor | None:
    """The mask to give PyTorch: attn_mask combined with the causal band, an (Lq, Lk) bool."""
    if causal is None:
        return attn_mask
    band = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(_causal_shift(causal, lq, lk))
    if attn_mask is None:
        return band
    if attn_mask.dtype == torch.bool:
        return attn_mask & band
    return attn_mask.masked_fill(~band, float("-inf"))


def _empty_rows(mask: torch.Tensor) -> torch.Tensor:
    """(..., Lq, 1) True where a mask allows no key; shaped like the mask, never (B, H, Lq, Lk)."""
    if mask.dtype == torch.bool:
        return ~mask.any(-1, keepdim=True)
    return (mask == float("-inf")).all(-1, keepdim=True)


# PyTorch's fused CPU attention is tuned for long sequences. Up to these key lengths the explicit
# product is faster forward+backward on CPU (bf16: 3-6x at 15-128 keys; fp32: 1.2-1.8x up to 64),
# and its (Lq, Lk) scores are no bigger than a few rows of activations. Without a backward the
# fused kernel wins at every length (2-4x at 1-256 keys, fp32 and bf16): inference uses it.
_CPU_EXPLICIT_MAX_KEYS = {torch.float32: 64, torch.bfloat16: 512, torch.float16: 512}


def _attention_torch(q, k, v, causal, attn_mask, dropout_p, scale):
    lq, lk = q.shape[2], k.shape[2]
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(q.dtype)  # PyTorch wants a float mask in the inputs' dtype
    backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if (q.device.type == "cpu" and backward and lk <= _CPU_EXPLICIT_MAX_KEYS.get(q.dtype, 0)
            and dropout_p == 0):
        return attention_reference(q, k, v, causal=causal or False, attn_mask=attn_mask,
                                   scale=scale)
    if dropout_p == 0.0 and attn_mask is None and causal in (None, "top_left"):
        # No row can be empty: top-left causal always allows key 0.
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal is not None, scale=scale)
    mask = _allowed_mask(causal, attn_mask, lq, lk, q.device)
    empty = None
    if mask is not None:  # empty rows attend uniformly (finite), then read zero: zero gradients
        # Unconditional (no data-dependent branch) so torch.compile traces it as one graph.
        empty = _empty_rows(mask)
        mask = mask | empty if mask.dtype == torch.bool else mask.masked_fill(empty, 0.0)
    if dropout_p == 0.0:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:  # PyTorch's dropout draws its mask internally; draw ours so tests can reproduce it
        keep = _dropout_keep_mask(q, k, dropout_p)
        out = attention_reference(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                  dropout_keep=keep)
    return out if empty is None else out.masked_fill(empty, 0.0)


# ---------------------------------------------------------------------------------------------
# Public op
# ---------------------------------------------------------------------------------------------


def _check_inputs(q, k, v, causal, attn_mask, dropout_p, scale) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"attention: {name} must be 4-D (B, H, L, D), got shape "
                             f"{tuple(x.shape)}")
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v "
                         f"{tuple(v.shape)} must be (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D)")
    if q.shape[2] == 0 or k.shape[2] == 0 or q.shape[3] == 0:
        raise ValueError(f"attention: lengths and head dim must be >= 1, got q {tuple(q.shape)}"
                         f" and k {tuple(k.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(f"attention: q, k, v must share one floating dtype, got {q.dtype}, "
                        f"{k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention: q, k, v on different devices: {q.device}, {k.device}, "
                         f"{v.device}")
    if causal not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"attention: causal must be False, True, 'top_left' or 'bottom_right', "
                         f"got {causal!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention: dropout_p must be in [0, 1), got {dropout_p}")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"attention: scale must be finite, got {scale}")
    if attn_mask is not None:
        if not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
            raise TypeError(f"attention: attn_mask must be bool or floating, got "
                            f"{attn_mask.dtype}")
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        try:
            fits = torch.broadcast_shapes(attn_mask.shape, target) == target
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"attention: attn_mask of shape {tuple(attn_mask.shape)} does not "
                             f"broadcast to (B, H, Lq, Lk) = {target}")
        if attn_mask.device != q.device:
            raise ValueError(f"attention: attn_mask on {attn_mask.device}, q on {q.device}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              causal: bool | str = False, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q (B, H, Lq, D) and k, v (B, H, Lk, D) -> (B, H, Lq, D).

    As torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p,
    is_causal=causal, scale=scale), except that rows allowed no key return zeros with zero
    gradients. causal: False, True / "top_left" (key j <= query i, PyTorch's alignment) or
    "bottom_right" (j <= i + Lk - Lq). attn_mask: bool (True = attend) or float (added),
    broadcastable to (B, H, Lq, Lk); no gradient flows to it. scale defaults to D ** -0.5.
    Runs the Triton kernels (fp16, bf16, fp32; head dims up to 256) when
    fastattn.backend.use_triton(q) says so; else, when a masked, causal or fp32 call needs a
    gradient, fastattn._C's CPU kernels (fp32, bf16); PyTorch otherwise and for fp64.
    """
    _check_inputs(q, k, v, causal, attn_mask, dropout_p, scale)
    alignment = CAUSAL_ALIGNMENTS[causal]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if use_triton(q) and q.dtype in _TRITON_DTYPES:
        if q.shape[-1] > MAX_HEAD_DIM:
            raise ValueError(f"attention: the Triton kernels support head dims up to "
                             f"{MAX_HEAD_DIM}, got {q.shape[-1]}")
    elif not _use_native(q, k, v, masked=attn_mask is not None or alignment is not None):
        # fp64 (gradcheck, references) runs PyTorch on every backend: the kernels have no fp64.
        return _attention_torch(q, k, v, alignment, attn_mask, dropout_p, scale)
    rng = _philox_seed_offset() if dropout_p > 0 else None
    out, _ = _attention_forward_op(q, k, v, attn_mask, rng, alignment, float(dropout_p), scale)
    return out


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool | str = False, attn_mask: torch.Tensor | None = None,
                        dropout_p: float = 0.0, scale: float | None = None,
                        dropout_keep: torch.Tensor | None = None) -> torch.Tensor:
    """The explicit math in the inputs' dtype (use fp64 for ground truth):
    softmax(q k^T * scale + bias) masked to zero on fully masked rows, times dropout_keep / (1 - p)
    when dropout_p > 0 (dropout_keep, a bool (B, H, Lq, Lk) mask, is then required), times v."""
    alignment = CAUSAL_ALIGNMENTS[causal]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    lq, lk = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-2, -1)) * scale
    mask = _allowed_mask(alignment, attn_mask, lq, lk, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
        empty = _empty_rows(mask)
        # Softmax of an all -inf row is NaN, in its gradient too: give it finite scores first.
        p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    else:
        p = torch.softmax(s, dim=-1)
    if dropout_p > 0:
        if dropout_keep is None:
            raise ValueError("attention_reference: dropout_p > 0 needs the dropout_keep mask")
        p = p * dropout_keep / (1.0 - dropout_p)
    return p @ v
