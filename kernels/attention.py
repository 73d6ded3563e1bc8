"""Scaled dot-product attention (Vaswani et al., 2017, eq. 1) as FlashAttention-2 style Triton
kernels and their launchers; the op (checks, torch.library registration, autograd, the CPU and
PyTorch paths, the reference) is fastattn.ops.attention.

    O = dropout(softmax(Q K^T * scale + bias)) V        Q: (B, H, Lq, D), K, V: (B, H, Lk, D)

- causal (the launchers take None, "top_left" or "bottom_right"): "top_left" keeps key j for
  query i when j <= i (PyTorch's is_causal); "bottom_right" keeps j <= i + Lk - Lq, for queries
  that continue a cached prefix of Lk - Lq keys.
- attn_mask: bool (True = may attend) or float (added to the scores), broadcastable to
  (B, H, Lq, Lk). The kernels read broadcast dimensions with stride 0, so a key-padding mask of
  shape (B, 1, 1, Lk) is never expanded in memory.
- dropout_p: the kernels draw the keep mask as they go from Philox with a (seed, offset) pair,
  and the backward regenerates the same mask. The pair comes by value (rng on the CPU), or
  through pointers when rng lies on the GPU (a table a CUDA graph refills: fastattn.ops.seeds).
- A query row that may attend to no key returns zeros and passes zero gradients.
- Q, K, V are read with their strides; O, dQ, dK, dV are written (and dO read) as (B, L, H, D)
  in memory, the projections' layout, so heads split and merge as views (heads_last_empty).
  dQ, dK, dV may also be columns of one wider buffer (B, L, n·H·D), the gradient of a fused
  projection (q, k, v side by side), which then needs no concatenation: the launcher passes
  their rows' width in heads (n·H).

Sections, top to bottom: the Triton kernels, their tile policy (launch_tile), the launchers.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastattn.kernels.seeds import scalar, tile_keep_mask

MAX_HEAD_DIM = 256  # the widest head the tile policy covers
NO_MASK, BOOL_MASK, FLOAT_MASK = 0, 1, 2
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _block_and_head(blocks_per_head):
    """(block, batch x head) of this program. Both share grid axis 0, blocks fastest (programs
    of one head run together and share its K and V in L2): CUDA caps axes 1 and 2 at 65,535,
    which B x H alone can pass (4,097 one-token sentences x 16 heads)."""
    pid = tl.program_id(0)
    return pid % blocks_per_head, pid // blocks_per_head


@triton.jit
def _unsigned_batch_and_head(bh, H):
    """(batch, head) of bh as 64-bit values known to be non-negative (zero-extended), for the
    backward passes' stores after their loops: with a sign extension the compiler kept b's high
    word live through the loop, one register more (an 8-byte spill of the dK/dV pass at d = 64
    on sm_80, compile report)."""
    return (bh // H).to(tl.uint32).to(tl.int64), (bh % H).to(tl.uint32).to(tl.int64)


@triton.jit
def _heads_last(b, h, rows, L, H, HEAD_DIM: tl.constexpr):
    """Offsets of `rows` of (batch b, head h) in a contiguous (B, L, H, HEAD_DIM) tensor, the
    layout of every result (and of dOut): its heads merge to (B, L, H·HEAD_DIM) as a view. With
    H the heads of a row of a wider contiguous (B, L, H', HEAD_DIM) (dQ, dK, dV's *_row_heads),
    the offsets within it of a tensor starting at one of its columns (a packed gradient's)."""
    return (b * L * H + h) * HEAD_DIM + rows.to(tl.int64) * (H * HEAD_DIM)


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
            m = tl.load(mask_ptr + rows.to(tl.int64) * stride_mm + cols,
                        mask=(rows < Lq) & (cols < Lk), other=0)
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
        k_t = tl.load(k_base + cols.to(tl.int64) * stride_kn + offs_d[:, None], mask=kv_mask,
                      other=0.0)
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
            keep = tile_keep_mask(philox_seed, philox_offset, bh, row_start, start_n, Lq, Lk,
                                  dropout_p, BLOCK_M, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        v = tl.load(v_base + cols.T.to(tl.int64) * stride_vn + offs_d[None, :], mask=kv_mask.T,
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["philox_seed", "philox_offset"])
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
    philox_seed, philox_offset = scalar(philox_seed), scalar(philox_offset)
    pid_m, bh = _block_and_head(tl.cdiv(Lq, BLOCK_M))
    b = (bh // H).to(tl.int64)  # 64-bit offsets: tensors may exceed 2**31 elements
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = (Q + b * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm
              + offs_d[None, :])
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
    o_ptrs = Out + _heads_last(b, h, offs_m[:, None], Lq, H, HEAD_DIM) + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(Lse + bh.to(tl.int64) * Lq + offs_m, lse, mask=row_ok)


@triton.jit
def _row_dot(A, B, rows, row_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """sum_d A[rows, d] * B[rows, d] in float32 for the (B, L, H, D) offsets `rows` (a column),
    CHUNK columns at a time, which keeps the dQ kernel's registers where they were without it
    (compile report; docs/benchmark-notes.md): 32 in 16 bits; in float32 the whole row at 128
    columns, else 16."""
    CHUNK: tl.constexpr = min(BLOCK_D, 32) if A.dtype.element_ty.primitive_bitwidth == 16 \
        else (BLOCK_D if BLOCK_D == 128 else 16)
    total = tl.zeros([rows.shape[0]], dtype=tl.float32)
    for start in tl.static_range(0, BLOCK_D, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        mask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
        a = tl.load(A + rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        total += tl.sum(a * tl.load(B + rows + cols[None, :], mask=mask, other=0.0).to(
            tl.float32), 1)
    return total


@triton.jit(do_not_specialize=["philox_seed", "philox_offset"])
def _attn_bwd_dkdv(Q, K, V, Mask, dOut, Lse, Delta, dK, dV,
                   stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_mb, stride_mh, stride_mm,
                   H, Lq, Lk, causal_shift, qk_scale, sm_scale, dropout_p, philox_seed,
                   philox_offset, dk_row_heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
                   KEY_MASK: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """One program owns BLOCK_N keys of one (batch, head) and loops over the query tiles that can
    see them, so dK and dV are each written once (deterministic, no atomics). Tiles are held
    transposed, keys x queries:
        P^T = 2^(S^T - lse * log2 e),  dV = sum (P^T * Z) dO,  dP^T = (V dO^T) * Z,
        dS^T = P^T * (dP^T - Delta),   dK = scale * sum dS^T Q,
    where Z = keep / (1 - p) is the regenerated dropout mask (Z = 1 without dropout).
    Only query tiles on the causal diagonal apply the causal check. The bounds need none: a key
    past Lk (k = v = 0) changes only its own rows of dK and dV, which are not stored, and a
    query past Lq (q = dO = 0, lse = +inf) has P = 0. dK and dV are laid out alike: rows of
    dk_row_heads heads (_heads_last)."""
    philox_seed, philox_offset = scalar(philox_seed), scalar(philox_offset)
    pid_n, bh = _block_and_head(tl.cdiv(Lk, BLOCK_N))
    b = (bh // H).to(tl.int64)  # 64-bit offsets: tensors may exceed 2**31 elements
    h = (bh % H).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < Lk) & (offs_d[None, :] < HEAD_DIM)
    key_rows = offs_n[:, None].to(tl.int64)
    k = tl.load(K + b * stride_kb + h * stride_kh + key_rows * stride_kn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + key_rows * stride_vn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    q_base = Q + b * stride_qb + h * stride_qh
    row0 = bh.to(tl.int64) * Lq
    mask_ptr = Mask + b * stride_mb + h * stride_mh
    cols = offs_n[:, None]

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo = 0
    m_full = 0  # from query m_full - causal_shift on, every query sees all of this block's keys
    if CAUSAL:  # the first query that may see key pid_n * BLOCK_N is that key minus the shift
        lo = tl.maximum(pid_n * BLOCK_N - causal_shift, 0) // BLOCK_M * BLOCK_M
        m_full = (pid_n + 1) * BLOCK_N - 1 - causal_shift
    for start_m in range(lo, Lq, BLOCK_M):
        rows = start_m + offs_m[None, :]
        q_mask = (rows < Lq) & (offs_d[:, None] < HEAD_DIM)
        q_t = tl.load(q_base + rows.to(tl.int64) * stride_qm + offs_d[:, None], mask=q_mask,
                      other=0.0)
        do = tl.load(dOut + _heads_last(b, h, rows.T, Lq, H, HEAD_DIM) + offs_d[None, :],
                     mask=q_mask.T, other=0.0)
        lse = tl.load(Lse + row0 + start_m + offs_m, mask=start_m + offs_m < Lq,
                      other=float("inf")) * 1.4426950408889634
        delta = tl.load(Delta + row0 + start_m + offs_m, mask=start_m + offs_m < Lq, other=0.0)
        s_t = tl.dot(k, q_t, input_precision=DOT_PRECISION) * qk_scale
        s_t = _masked_scores(s_t, rows, cols, mask_ptr, stride_mm, Lq, Lk,
                             causal_shift, MASK_KIND, KEY_MASK, CAUSAL, False)
        if CAUSAL:
            if start_m < m_full:  # a diagonal tile (the same branch for the whole program)
                s_t = tl.where(cols <= rows + causal_shift, s_t, float("-inf"))
        p_t = tl.math.exp2(s_t - lse[None, :])
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = tl.trans(tile_keep_mask(philox_seed, philox_offset, bh, start_m,
                                           pid_n * BLOCK_N, Lq, Lk, dropout_p, BLOCK_M, BLOCK_N))
            inv_keep = 1.0 / (1.0 - dropout_p)
            p_drop_t = tl.where(keep, p_t * inv_keep, 0.0)
            dp_t = tl.where(keep, dp_t * inv_keep, 0.0)
        else:
            p_drop_t = p_t
        dv += tl.dot(p_drop_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision=DOT_PRECISION)
    out_ptrs = _heads_last(*_unsigned_batch_and_head(bh, H), offs_n[:, None], Lk, dk_row_heads,
                           HEAD_DIM) + offs_d[None, :]
    tl.store(dK + out_ptrs, (dk * sm_scale).to(dK.dtype.element_ty), mask=kv_mask)
    tl.store(dV + out_ptrs, dv.to(dV.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=["philox_seed", "philox_offset"])
def _attn_bwd_dq(Q, K, V, Mask, Out, dOut, Lse, Delta, dQ,
                 stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_mb, stride_mh, stride_mm,
                 H, Lq, Lk, causal_shift, qk_scale, sm_scale, dropout_p, philox_seed,
                 philox_offset, dq_row_heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
                 KEY_MASK: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One program owns BLOCK_M queries of one (batch, head): it computes their Delta (and stores
    it for the dK/dV pass, launched after this one), then loops over the key tiles they may see
    (causal stops at the diagonal; only tiles crossing it or Lk check bounds and causality):
        Delta = rowsum(dO * O) = rowsum(P * dP) (with dropout too),
        P = 2^(S - lse * log2 e),  dP = (dO V^T) * Z,  dS = P * (dP - Delta),  dQ = scale * dS K."""
    philox_seed, philox_offset = scalar(philox_seed), scalar(philox_offset)
    pid_m, bh = _block_and_head(tl.cdiv(Lq, BLOCK_M))
    b = (bh // H).to(tl.int64)  # 64-bit offsets: tensors may exceed 2**31 elements
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row0 = bh.to(tl.int64) * Lq
    q_mask = (offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm
                + offs_d[None, :], mask=q_mask, other=0.0)
    head_rows = _heads_last(b, h, offs_m[:, None], Lq, H, HEAD_DIM) + offs_d[None, :]
    do = tl.load(dOut + head_rows, mask=q_mask, other=0.0)
    lse = tl.load(Lse + row0 + offs_m, mask=offs_m < Lq, other=float("inf")) * 1.4426950408889634
    delta = _row_dot(Out, dOut, _heads_last(b, h, offs_m[:, None], Lq, H, HEAD_DIM),
                     offs_m < Lq, HEAD_DIM, BLOCK_D)
    tl.store(Delta + row0 + offs_m, delta, mask=offs_m < Lq)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    mask_ptr = Mask + b * stride_mb + h * stride_mh
    rows = offs_m[:, None]

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys [0, n_full) need no bounds or causal check for any row of this block (as in the
    # forward); from hi on they are above the causal diagonal for every row.
    hi = Lk
    n_full = Lk
    if CAUSAL:
        hi = tl.minimum(Lk, tl.maximum((pid_m + 1) * BLOCK_M + causal_shift, 0))
        n_full = tl.minimum(Lk, tl.maximum(pid_m * BLOCK_M + causal_shift + 1, 0))
    n_full = n_full // BLOCK_N * BLOCK_N
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n[None, :]
        kv_mask = (cols < Lk) & (offs_d[:, None] < HEAD_DIM)
        k_t = tl.load(k_base + cols.to(tl.int64) * stride_kn + offs_d[:, None], mask=kv_mask,
                      other=0.0)
        v_t = tl.load(v_base + cols.to(tl.int64) * stride_vn + offs_d[:, None], mask=kv_mask,
                      other=0.0)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        s = _masked_scores(s, rows, cols, mask_ptr, stride_mm, Lq, Lk, causal_shift,
                           MASK_KIND, KEY_MASK, CAUSAL, False)
        # Only a tile crossing Lk or the diagonal (a branch uniform over the program) checks:
        # a key past Lk must get P = 0 here, as k = 0 would not cancel an infinite P.
        if start_n >= n_full:
            allowed = cols < Lk
            if CAUSAL:
                allowed &= cols <= rows + causal_shift
            s = tl.where(allowed, s, float("-inf"))
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, v_t, input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = tile_keep_mask(philox_seed, philox_offset, bh, pid_m * BLOCK_M, start_n, Lq,
                                  Lk, dropout_p, BLOCK_M, BLOCK_N)
            dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=DOT_PRECISION)
    dq_ptrs = dQ + _heads_last(*_unsigned_batch_and_head(bh, H), offs_m[:, None], Lq,
                               dq_row_heads, HEAD_DIM) + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(dQ.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=["philox_seed", "philox_offset"])
def _dropout_keep_mask_kernel(Keep, Lq, Lk, dropout_p, philox_seed, philox_offset,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Materialises the keep-mask the attention kernels draw, for tests (B*H, Lq, Lk)."""
    philox_seed, philox_offset = scalar(philox_seed), scalar(philox_offset)
    pid_m, bh = _block_and_head(tl.cdiv(Lq, BLOCK_M))
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    keep = tile_keep_mask(philox_seed, philox_offset, bh, pid_m * BLOCK_M,
                          tl.program_id(1) * BLOCK_N, Lq, Lk, dropout_p, BLOCK_M, BLOCK_N)
    tl.store(Keep + (bh.to(tl.int64) * Lq + rows) * Lk + cols, keep.to(tl.int8),
             mask=(rows < Lq) & (cols < Lk))


# Every feature set the model and the drop-in can launch, as (MASK_KIND, KEY_MASK, CAUSAL,
# DROPOUT), for the compile checks (benchmarks/attention_tiles.py, tests/test_compile_report.py):
# no mask, key padding (one row for all queries; bool or float) or a mask per query (bool or
# float), each with and without causal and dropout. MODEL_VARIANTS are the model's (encoder self
# and cross attention: key padding; decoder self-attention: causal); compile_configs() compiles
# HEAVIEST, the one the tiles were first sized for.
_MASKS = {"": (NO_MASK, False), "key padding": (BOOL_MASK, True),
          "float key padding": (FLOAT_MASK, True), "mask": (BOOL_MASK, False),
          "float mask": (FLOAT_MASK, False)}
VARIANTS = {
    "+".join(part for part in (mask, "causal" * causal, "dropout" * dropout) if part) or "none":
        (kind, key, causal, dropout)
    for mask, (kind, key) in _MASKS.items() for causal in (False, True) for dropout in (False, True)
}
MODEL_VARIANTS = ("key padding", "key padding+dropout", "causal", "causal+dropout")


# ---------------------------------------------------------------------------------------------
# Tile policy: (BLOCK_M, BLOCK_N, num_warps, num_stages) for a launch, from launch_tile() alone,
# keyed on the kernel, the padded head dim, the element size, the variant and the GPU's family
# (its shared memory per block and the rows its tensor-core products take). Four steps:
# 1. The mma.sync tile of the heaviest variant (mask + causal + dropout), by head dim
#    (_MMA_SYNC_TILES): 128 queries x 64 keys at D = 64 (the paper's head dim) in the forward,
#    fewer keys or queries as the fp32 accumulators grow with D; dK/dV holds two (BLOCK_N, D)
#    accumulators, hence narrower tiles than dQ's one (BLOCK_M, D); fp32 half the tiles or less.
#    Sized with ptxas (the compile report) so that every variant up to head dim 128 keeps within
#    255 registers without spilling on sm_80, as kernels compiled for sm_86/89/120 do too.
# 2. Families whose products are warp-group instructions (Hopper's wgmma, Blackwell's tcgen05)
#    need the product's M (the forward's and dQ's queries, dK/dV's keys) to be a multiple of 64
#    per warp group (supportMMA in Triton's lib/Analysis/Utility.cpp; below 64 wgmma falls back
#    to mma.sync): up to head dim 128 such a tile takes 8 warps and at least 64 rows there, its
#    area per warp kept (the score tile's registers per thread), _warp_group_tile.
# 3. OVERRIDES: a tile of its own for a variant (or every variant) on the families named, where
#    step 1 or 2 spilled or sat at the register cap, each with its reason.
# 4. Shared memory: the larger block, then stages, are cut until shared_bytes_estimate (an upper
#    bound, checked against every row of the compile report) fits the family's shared memory
#    per block (sm_80 163 KB, sm_86/89/120 99 KB, sm_90/100 227 KB).
# From now on a tile changes when a GPU timing says so, not from register counts (issue 69).
# ---------------------------------------------------------------------------------------------

Tile = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)


@dataclass(frozen=True)
class Family:
    """GPUs that take the same tiles: the shared memory one block may use (the opt-in maximum,
    bytes), the rows of a tensor-core product per warp group (16: mma.sync; 64: wgmma or
    tcgen05), and the shared memory its kernels take beyond shared_bytes_estimate's tiles
    (sm_100's tcgen05 kernels: up to 8,000 B more, compile report)."""

    name: str
    shared_bytes: int
    mma_rows: int
    staging_bytes: int = 0


_KIB = 1024
FAMILIES = {  # compute capability (10 x major + minor) -> family (CUDA programming guide)
    80: Family("sm80", 163 * _KIB, 16), 87: Family("sm80", 163 * _KIB, 16),
    86: Family("sm86", 99 * _KIB, 16), 89: Family("sm86", 99 * _KIB, 16),
    120: Family("sm120", 99 * _KIB, 16), 121: Family("sm120", 99 * _KIB, 16),
    90: Family("sm90", 227 * _KIB, 64), 100: Family("sm100", 227 * _KIB, 64, 8 * _KIB),
    103: Family("sm100", 227 * _KIB, 64, 8 * _KIB),
}


def family(arch: int) -> Family:
    """The family of compute capability arch; one not listed takes that of the closest listed
    below it. Volta and Turing (sm_70, sm_75) are no target: they take sm_86's (Turing's 64 KB
    of shared memory may not hold the widest heads' tiles)."""
    known = [a for a in FAMILIES if a <= arch]
    return FAMILIES[max(known) if known else 86]


# Step 1: per (kernel, element size), [(widest padded head dim, tile), ...], narrowest first.
_MMA_SYNC_TILES = {
    ("_attn_fwd", 2): [(32, (128, 32, 8, 3)), (64, (128, 64, 8, 3)), (128, (64, 32, 8, 3)),
                       (256, (64, 16, 8, 2))],  # 64 x 32 at 256 spilled 64 B on sm_90
    ("_attn_fwd", 4): [(64, (64, 32, 8, 2)), (128, (32, 32, 8, 2)), (256, (32, 32, 8, 1))],
    ("_attn_bwd_dkdv", 2): [(32, (32, 64, 8, 2)), (128, (64, 32, 8, 2)), (256, (32, 16, 8, 1))],
    ("_attn_bwd_dkdv", 4): [(64, (16, 32, 4, 2)), (128, (32, 16, 8, 2)), (256, (16, 32, 8, 1))],
    ("_attn_bwd_dq", 2): [(64, (128, 32, 8, 3)), (128, (64, 32, 8, 2)), (256, (32, 32, 8, 1))],
    ("_attn_bwd_dq", 4): [(64, (32, 32, 4, 2)), (128, (32, 32, 8, 2)), (256, (16, 16, 8, 1))],
}


def _mma_sync_tile(kernel: str, block_d: int, element_size: int) -> Tile:
    return next(tile for widest, tile in _MMA_SYNC_TILES[kernel, element_size]
                if block_d <= widest)


def _warp_group_tile(kernel: str, block_d: int, tile: Tile) -> Tile:
    """Step 2: at least 64 rows in the products' M (dK/dV's keys, else queries) and 8 warps, up
    to head dim 128 (wider heads keep the mma.sync tile: the (64, D) fp32 accumulators alone
    would take 64+ registers a thread), the area per warp kept."""
    block_m, block_n, warps, stages = tile
    if block_d > 128:
        return tile
    area = block_m * block_n * 8 // warps
    if kernel == "_attn_bwd_dkdv":
        block_n = max(block_n, 64)
        return area // block_n, block_n, 8, stages
    block_m = max(block_m, 64)
    return block_m, area // block_m, 8, stages


class Override(NamedTuple):
    """Step 3: `tile` for `kernel` at (padded head dim, element size) `entry` on `families`
    (Family names) in `variant` (a VARIANTS name, which stands for its bool and float masks
    alike: launch_tile tells masks apart only as none, key padding or per query; None: every
    variant), with exact (IEEE) fp32 products only if `exact`, else in either precision."""

    kernel: str
    variant: str | None
    families: tuple[str, ...]
    entry: tuple[int, int]
    tile: Tile
    exact: bool
    why: str


HEAVIEST = "mask+causal+dropout"
MMA_SYNC = ("sm80", "sm86", "sm120")  # the families whose products are mma.sync
WARP_GROUP = ("sm90", "sm100")  # wgmma, tcgen05
# Found with `python -m benchmarks.attention_tiles --shipped` (every variant with the launchers'
# tiles; --dtype fp32 for tf32 products, fp32-exact for IEEE ones). Exact rows come first: they
# win over a row for the same launch in either precision.
OVERRIDES = (
    Override("_attn_fwd", "key padding", MMA_SYNC, (64, 4), (64, 32, 8, 2), True,
             "the 4-warp tile below spilled 152 B in exact products with float masks; 8 warps: "
             "109 registers"),
    Override("_attn_fwd", "mask", WARP_GROUP, (64, 4), (64, 16, 8, 2), True,
             "64 x 32 spilled 32 B in exact products (no tensor cores: no M of 64 to keep); 99"),
    Override("_attn_fwd", "mask", WARP_GROUP, (128, 4), (32, 16, 8, 2), True,
             "64 x 16 spilled 208-280 B in exact products with a mask per query; 32 x 16: "
             "90-106 registers"),
    Override("_attn_fwd", "mask+dropout", WARP_GROUP, (128, 4), (32, 16, 8, 2), True,
             "as for mask"),
    Override("_attn_fwd", "mask+causal", WARP_GROUP, (128, 4), (32, 16, 8, 2), True, "as for mask"),
    Override("_attn_fwd", HEAVIEST, WARP_GROUP, (128, 4), (32, 16, 8, 2), True, "as for mask"),
    Override("_attn_bwd_dq", "mask", MMA_SYNC, (32, 2), (64, 32, 8, 3), False,
             "128 x 32 spilled 8 B with a float mask; 64 x 32: 128 registers"),
    Override("_attn_bwd_dq", "mask", MMA_SYNC, (64, 2), (64, 32, 8, 3), False,
             "128 x 32 sat at the cap (bool and float masks); 64 x 32: 206-254 registers"),
    Override("_attn_bwd_dq", "mask+dropout", MMA_SYNC, (64, 2), (64, 32, 8, 3), False,
             "as for mask"),
    Override("_attn_bwd_dq", HEAVIEST, MMA_SYNC, (64, 2), (64, 32, 8, 3), False, "as for mask"),
    Override("_attn_bwd_dq", "mask+dropout", MMA_SYNC, (16, 4), (32, 32, 8, 2), False,
             "4 warps spilled 8 B in tf32 products"),
    Override("_attn_bwd_dq", HEAVIEST, MMA_SYNC, (32, 4), (16, 32, 4, 2), False,
             "32 x 32 spilled 8-16 B in exact products"),
    Override("_attn_bwd_dq", HEAVIEST, MMA_SYNC, (64, 4), (32, 32, 4, 3), False,
             "two stages spilled 8 B at 168 registers with a float mask once dQ checked diagonal "
             "tiles only; three: 186-206, no spill"),
    Override("_attn_bwd_dq", HEAVIEST, WARP_GROUP, (64, 4), (64, 32, 8, 3), False,
             "two stages spilled 16 B at 128 registers in exact products once dQ checked "
             "diagonal tiles only; three: 133-198 in either precision"),
    Override("_attn_fwd", HEAVIEST, MMA_SYNC, (64, 2), (64, 64, 8, 3), False,
             "128 x 64 at 254-255 registers; 64 x 64: 230-234"),
    Override("_attn_fwd", HEAVIEST, MMA_SYNC, (64, 4), (32, 32, 4, 2), False,
             "64 x 32 at 8 warps reached 255 in tf32 products"),
    Override("_attn_fwd", "mask+dropout", MMA_SYNC, (64, 4), (32, 32, 4, 2), False,
             "64 x 32 at 8 warps reached 255 in tf32 products"),
    Override("_attn_fwd", "key padding", ("sm80", "sm86"), (64, 4), (64, 32, 4, 2), False,
             "8 warps spilled 8 B in tf32 products (ptxas held them to 128 registers); on sm_120 "
             "4 warps spilled 16 B and 8 take 166, no spill"),
    Override("_attn_fwd", "key padding+causal+dropout", MMA_SYNC, (16, 2), (128, 16, 8, 3), False,
             "128 x 32 spilled 8 B (held to 128 registers); 128 x 16: 121, no spill"),
    Override("_attn_fwd", "key padding+causal+dropout", ("sm80", "sm86"), (32, 4),
             (64, 32, 4, 2), False, "8 warps spilled 16 B in tf32 products; on sm_120 4 warps "
             "spilled 8 B and 8 take 175, no spill"),
    Override("_attn_bwd_dkdv", None, WARP_GROUP, (64, 2), (32, 128, 8, 2), False,
             "two warp groups of 64 keys (154-232 registers, no spill): step 2's 32 x 64 was "
             "never compiled against it, and nothing has been timed"),
    # The families sm_80 and sm_90 never were (python -m fastattn.kernels.compile_report, then
    # candidates compiled with benchmarks.attention_tiles): one family's ptxas each.
    Override("_attn_fwd", HEAVIEST, ("sm100", "sm120"), (16, 2), (128, 16, 8, 3), False,
             "128 x 32 took 255 registers (sm_120) and spilled 224 B (sm_100); 128 x 16: "
             "102-114, no spill"),
    Override("_attn_fwd", HEAVIEST, ("sm100",), (32, 2), (128, 32, 8, 2), False,
             "three stages spilled 8 B at 128 registers; two: 125, no spill"),
    Override("_attn_fwd", HEAVIEST, ("sm100",), (64, 4), (64, 16, 8, 2), True,
             "64 x 32 spilled 8 B at 128 registers in exact products; 64 x 16: 128, no spill"),
    Override("_attn_fwd", HEAVIEST, ("sm86",), (32, 4), (32, 32, 8, 2), True,
             "64 x 32 spilled 8 B at 128 registers in exact products; 32 x 32: 80, no spill"),
    Override("_attn_fwd", HEAVIEST, ("sm120",), (128, 4), (32, 16, 8, 2), True,
             "32 x 32 spilled 8 B at 128 registers in exact products; 32 x 16: 106, no spill"),
    Override("_attn_bwd_dq", HEAVIEST, ("sm86",), (128, 4), (16, 32, 8, 2), True,
             "step 4's 32 x 16 spilled 8 B at 80 registers in exact products; 16 x 32: 72, no "
             "spill"),
)


def shared_bytes_estimate(kernel: str, tile: Tile, block_d: int, element_size: int) -> int:
    """An upper bound on the shared memory a launch of `tile` takes: the tiles each loop
    iteration loads, once per pipeline stage (the forward and dQ: K and V; dK/dV: Q, dO and
    their 8-byte lse and Delta per row), plus the operands a warp-group product reads from shared
    memory once (the forward: Q; dQ: Q and dO; dK/dV: K, V and Q transposed for dK) and the
    probability and score tiles (two of BLOCK_M x BLOCK_N); a family's staging_bytes come on
    top. Triton shares buffers whose lives do not overlap, so the compiled kernels take less
    (tests check every compile report row)."""
    block_m, block_n, _, stages = tile
    scores = 2 * block_m * block_n * element_size
    if kernel == "_attn_bwd_dkdv":
        looped = 2 * block_m * block_d * element_size + 8 * block_m
        once = (2 * block_n + block_m) * block_d * element_size
    else:
        looped = 2 * block_n * block_d * element_size
        once = (block_m if kernel == "_attn_fwd" else 2 * block_m) * block_d * element_size
    return stages * looped + once + scores


def _fit_shared(kernel: str, tile: Tile, block_d: int, element_size: int, limit: int) -> Tile:
    """Step 4: tile with the larger block halved (keys on a tie) down to 16, then fewer stages,
    until its estimate fits `limit`. Blocks first: dQ at d = 128 in fp32 with one stage instead
    of two took 255 registers and spilled 240-288 B on sm_86/89/120 (compile report)."""
    block_m, block_n, warps, stages = tile
    while shared_bytes_estimate(kernel, (block_m, block_n, warps, stages), block_d,
                                element_size) > limit:
        if max(block_m, block_n) > 16:
            if block_n >= block_m:
                block_n //= 2
            else:
                block_m //= 2
        elif stages > 1:
            stages -= 1
        else:
            raise ValueError(f"{kernel}: no tile at head dim {block_d} fits {limit} B")
    return block_m, block_n, warps, stages


def launch_tile(kernel: str, head_dim: int, dtype: torch.dtype, arch: int, *, mask: str,
                causal: bool, dropout: bool, precision: str | None = None) -> Tile:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) the launchers pick for `kernel` ("_attn_fwd",
    "_attn_bwd_dkdv" or "_attn_bwd_dq") on arch (10 x major + minor) for a variant: mask
    "none", "key" (one row for every query: key padding) or "query" (a row per query), causal,
    dropout; precision: the products' ("ieee" or "tf32"; default: what a launch with `dtype`
    uses now). The tile policy above, steps 1 to 4."""
    block_d, element_size = _block_d(head_dim), 4 if dtype == torch.float32 else 2
    fam = family(arch)
    exact = element_size == 4 and (precision or _dot_precision(dtype)) == "ieee"
    override = _override(kernel, block_d, element_size, fam, exact=exact, mask=mask,
                         causal=causal, dropout=dropout)
    if override is not None:
        tile = override.tile
    else:
        tile = _mma_sync_tile(kernel, block_d, element_size)
        if fam.mma_rows == 64:
            tile = _warp_group_tile(kernel, block_d, tile)
    return _fit_shared(kernel, tile, block_d, element_size,
                       fam.shared_bytes - fam.staging_bytes)


def _override(kernel: str, block_d: int, element_size: int, fam: Family, *, exact: bool,
              **variant) -> Override | None:
    """The first of OVERRIDES for this launch (variant: tile_variant's keywords), or None."""
    return next((o for o in OVERRIDES
                 if (o.kernel, o.entry) == (kernel, (block_d, element_size))
                 and fam.name in o.families
                 and (exact or not o.exact)
                 and (o.variant is None or tile_variant(*VARIANTS[o.variant]) == variant)),
                None)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs at least 16


def _sm(x: torch.Tensor) -> int:
    """The compute capability a launch on x runs on, as 10 x major + minor (80 under the
    interpreter): launch_tile keys its tiles on it."""
    if not x.is_cuda:
        return 80
    major, minor = torch.cuda.get_device_capability(x.device)
    return 10 * major + minor


def tile_variant(mask_kind: int, key_mask: bool, causal: bool, dropout: bool) -> dict:
    """launch_tile's variant keywords (mask, causal, dropout) for the kernels' feature flags
    (MASK_KIND, KEY_MASK, CAUSAL, DROPOUT: a VARIANTS value)."""
    mask = "none" if mask_kind == NO_MASK else "key" if key_mask else "query"
    return dict(mask=mask, causal=causal, dropout=dropout)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs follow PyTorch's own matmul setting (tf32 off by default).
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


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


COMPILE_ARCHS = (80, 86, 89, 90, 100, 120)  # the architectures the compile report compiles for
KERNELS = {kernel.__name__: kernel for kernel in (_attn_fwd, _attn_bwd_dkdv, _attn_bwd_dq)}


def compile_configs() -> list[dict]:
    """Every configuration the launchers can pick on COMPILE_ARCHS, for
    fastattn.kernels.compile_report: for each (padded head dim, element size) (bf16 shares
    fp16's tiles, and head dims such as 40, 80, 96 their padded entry's; fp32 both exact and with
    tf32 allowed), each kernel in its heaviest variant, once per distinct tile, and in each
    variant with an override of its own on the architectures it applies to. A tile only some
    architectures launch names them in "archs", and its name says so: "smNN-tile" (NN: the first
    of them) for the heaviest variant's tile where it is not step 1's, "variant-tile" for an
    override of another variant."""
    precisions = {2: [("fp16", "tf32")], 4: [("fp32", "ieee"), ("fp32 tf32", "tf32")]}
    configs = []
    for block_d, element_size in itertools.product((16, 32, 64, 128, MAX_HEAD_DIM), (2, 4)):
        dtype = torch.float16 if element_size == 2 else torch.float32
        for label, precision in precisions[element_size]:
            for name, kernel in KERNELS.items():
                def tile_of(variant, arch, name=name, block_d=block_d, dtype=dtype,
                            precision=precision):
                    return launch_tile(name, block_d, dtype, arch,
                                       **tile_variant(*VARIANTS[variant]), precision=precision)

                by_tile: dict[Tile, list[int]] = {}
                for arch in COMPILE_ARCHS:
                    by_tile.setdefault(tile_of(HEAVIEST, arch), []).append(arch)
                for tile, archs in by_tile.items():
                    own = tile == _mma_sync_tile(name, block_d, element_size)
                    configs.append(_compile_config(
                        kernel, block_d, label, precision, HEAVIEST, tile,
                        HEAVIEST if own else f"{HEAVIEST} sm{archs[0]}-tile",
                        archs if len(by_tile) > 1 else None))
                variants = dict.fromkeys(
                    o.variant for o in OVERRIDES if o.variant not in (None, HEAVIEST)
                    and (o.kernel, o.entry) == (name, (block_d, element_size)))
                for variant in variants:
                    by_tile = {}
                    for arch in COMPILE_ARCHS:
                        if _override(name, block_d, element_size, family(arch),
                                     exact=precision == "ieee",
                                     **tile_variant(*VARIANTS[variant])):
                            by_tile.setdefault(tile_of(variant, arch), []).append(arch)
                    configs += [_compile_config(kernel, block_d, label, precision, variant, tile,
                                                f"{variant} variant-tile", archs)
                                for tile, archs in by_tile.items()]
    return configs


def _compile_config(kernel, block_d: int, label: str, precision: str, variant: str, tile: Tile,
                    description: str, archs) -> dict:
    mask_kind, key_mask, causal, dropout = VARIANTS[variant]
    block_m, block_n, num_warps, num_stages = tile
    config = dict(
        name=f"{kernel.__name__} d={block_d} {label} {description}", fn=kernel,
        signature=_kernel_signature(kernel, label.split()[0], mask_kind, block_d),
        constexprs=dict(HEAD_DIM=block_d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
                        MASK_KIND=mask_kind, KEY_MASK=key_mask, CAUSAL=causal, DROPOUT=dropout,
                        DOT_PRECISION=precision),
        num_warps=num_warps, num_stages=num_stages)
    if archs is not None:
        config["archs"] = tuple(archs)
    return config


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


def causal_shift(causal: str | None, lq: int, lk: int) -> int:
    return lk - lq if causal == "bottom_right" else 0


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def heads_last_empty(x: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, L, D) like x, stored as a contiguous (B, L, H, D) (see the top)."""
    b, h, length, d = x.shape
    return x.new_empty((b, length, h, d)).transpose(1, 2)


def heads_last(x: torch.Tensor) -> torch.Tensor:
    """x in heads_last_empty's layout: itself if it is (merged heads' gradients are), a copy."""
    return x if x.transpose(1, 2).is_contiguous() else heads_last_empty(x).copy_(x)


def _row_heads(g: torch.Tensor) -> int:
    """The width in heads n·H of the rows of the contiguous (B, L, n·H·D) whose columns the
    (B, H, L, D) gradient g is (H when it is heads-last): its row stride over D. The kernels
    address it so (_heads_last), with 64-bit offsets, rather than from four strides: the dK/dV
    pass's registers stay where they were (compile report)."""
    b, h, length, d = g.shape
    # A dimension of size 1 may carry any stride: one row reads its width from the batch stride
    # (or, alone in the batch, from nothing: it is never stepped over).
    n_h = (g.stride(2) if length > 1 else g.stride(0) if b > 1 else h * d) // max(d, 1)
    expected = (length * n_h * d, d, n_h * d, 1)
    if any(s != e for s, e, n in zip(g.stride(), expected, g.shape, strict=True) if n > 1) or n_h < h:
        raise ValueError(f"attention_backward: a gradient of shape {tuple(g.shape)} must be "
                         f"heads-last or columns of a contiguous (B, L, n·H·D), got strides "
                         f"{g.stride()}")
    return n_h


def _philox_args(rng: torch.Tensor | None, dropout_p: float) -> tuple:
    """The kernels' (philox_seed, philox_offset) for rng, an int64 (seed, offset): its values
    when it lies on the CPU (no sync), else pointers to its two elements, which the kernels load."""
    if dropout_p == 0:
        return 0, 0
    return tuple(rng.tolist()) if rng.device.type == "cpu" else (rng, rng[1:])


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      attn_mask: torch.Tensor | None, rng: torch.Tensor | None, causal: str | None,
                      dropout_p: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Lq, D) heads-last, fp32 log-sum-exp (B, H, Lq)); rng: int64 (seed, offset)
    when dropout_p > 0, on the CPU or on q's device (_philox_args)."""
    q, k, v = (unit_last_stride(x) for x in (q, k, v))
    b, h, lq, d = q.shape
    lk = k.shape[2]
    out = heads_last_empty(q)
    lse = torch.empty((b, h, lq), dtype=torch.float32, device=q.device)
    mask, mask_strides, mask_flags = _mask_args(attn_mask, q, k)
    seed, offset = _philox_args(rng, dropout_p)
    variant = tile_variant(mask_flags["MASK_KIND"], mask_flags["KEY_MASK"], causal is not None,
                           dropout_p > 0)
    block_m, block_n, num_warps, num_stages = launch_tile("_attn_fwd", d, q.dtype, _sm(q),
                                                          **variant)
    grid = (triton.cdiv(lq, block_m) * b * h,)
    _attn_fwd[grid](
        q, k, v, mask, out, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), *mask_strides, h, lq, lk,
        causal_shift(causal, lq, lk), scale * LOG2E, dropout_p, seed, offset,
        HEAD_DIM=d, BLOCK_D=_block_d(d), BLOCK_M=block_m, BLOCK_N=block_n, **mask_flags,
        CAUSAL=causal is not None, DROPOUT=dropout_p > 0, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages)
    return out, lse


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, attn_mask: torch.Tensor | None,
                       rng: torch.Tensor | None, causal: str | None, dropout_p: float,
                       scale: float, grads: tuple[torch.Tensor, ...] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for the forward's out (heads-last) and lse: new heads-last tensors, or, given
    grads, written into those three and returned: each shaped like q, k or v (B, H, L, D) and
    heads-last or columns of a contiguous (B, L, n·H·D) (_row_heads), dk laid out like dv."""
    q, k, v = (unit_last_stride(x) for x in (q, k, v))
    grad_out = heads_last(grad_out)
    b, h, lq, d = q.shape
    lk = k.shape[2]
    delta = torch.empty_like(lse)  # the dQ pass writes it, the dK/dV pass reads it
    if grads is None:
        grads = heads_last_empty(q), heads_last_empty(k), heads_last_empty(v)
    dq, dk, dv = grads
    if dq.shape != q.shape or dk.shape != k.shape or dv.shape != v.shape or (
            dk.stride() != dv.stride()):
        raise ValueError("attention_backward: grads must be shaped like q, k, v, dk laid out "
                         "like dv")
    mask, mask_strides, mask_flags = _mask_args(attn_mask, q, k)
    seed, offset = _philox_args(rng, dropout_p)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), *mask_strides)
    scalars = (h, lq, lk, causal_shift(causal, lq, lk), scale * LOG2E, scale, dropout_p, seed,
               offset)
    flags = dict(HEAD_DIM=d, BLOCK_D=_block_d(d), **mask_flags, CAUSAL=causal is not None,
                 DROPOUT=dropout_p > 0, DOT_PRECISION=_dot_precision(q.dtype))
    variant = tile_variant(mask_flags["MASK_KIND"], mask_flags["KEY_MASK"], causal is not None,
                           dropout_p > 0)
    block_m, block_n, num_warps, num_stages = launch_tile("_attn_bwd_dq", d, q.dtype, _sm(q),
                                                          **variant)
    _attn_bwd_dq[(triton.cdiv(lq, block_m) * b * h,)](
        q, k, v, mask, heads_last(out), grad_out, lse, delta, dq, *strides, *scalars,
        _row_heads(dq), BLOCK_M=block_m, BLOCK_N=block_n, **flags, num_warps=num_warps,
        num_stages=num_stages)
    block_m, block_n, num_warps, num_stages = launch_tile("_attn_bwd_dkdv", d, q.dtype, _sm(q),
                                                          **variant)
    _attn_bwd_dkdv[(triton.cdiv(lk, block_n) * b * h,)](
        q, k, v, mask, grad_out, lse, delta, dk, dv, *strides, *scalars, _row_heads(dk),
        BLOCK_M=block_m, BLOCK_N=block_n, **flags, num_warps=num_warps, num_stages=num_stages)
    return dq, dk, dv


def dropout_keep_mask(b: int, h: int, lq: int, lk: int, dropout_p: float, rng: torch.Tensor,
                      device: torch.device) -> torch.Tensor:
    """The bool keep-mask (B, H, Lq, Lk) the attention kernels draw from rng = (seed, offset)."""
    seed, offset = _philox_args(rng, dropout_p)
    keep = torch.empty((b, h, lq, lk), dtype=torch.int8, device=device)
    grid = (triton.cdiv(lq, 32) * b * h, triton.cdiv(lk, 32))
    _dropout_keep_mask_kernel[grid](keep, lq, lk, dropout_p, seed, offset, BLOCK_M=32,
                                    BLOCK_N=32)
    return keep.bool()
