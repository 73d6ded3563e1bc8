"""Experiment (issue: "Try TMA tensor descriptors for the sm_90 forward"): the attention forward
of kernels/attention.py (_attn_fwd) with Q, K, V loaded (and O optionally stored) through Triton
tensor descriptors, for the model's training variants without dropout:
    encoder self / cross attention: key-padding mask (bool), no causal
    decoder self-attention:         causal, no mask
Experiment code (experiments/tma_forward/README.md): nothing in the project imports it.

Two flavours:
- _attn_fwd_tma:      host-side descriptors (triton.tools.tensor_descriptor.TensorDescriptor
                      arguments; ASTSource type "tensordesc<fp16[1,1,BLOCK,D]>"), 4-D over the
                      (B, H, L, D) view with its real strides, so the packed projection layouts
                      (B, L, n*H*D) are expressed exactly and the out-of-bounds zero fill applies
                      at L (per batch and head), never at a neighbour sequence.
- _attn_fwd_tma_dev:  device-side descriptors (tl.make_tensor_descriptor, needs
                      triton.set_allocator at launch): 2-D (L, D) per program at the
                      (batch, head) base pointer; same signature as the shipped kernel.
The math (online softmax in log2 units, the two loops: tiles without and with bounds/causal
checks, empty rows -> 0 / +inf lse) is the shipped kernel's: its helpers (_block_and_head,
_masked_scores, _mask_args) are imported from fastattn.kernels.attention, and the descriptor
loop below differs from the shipped _attn_fwd_tiles in its loads (desc.load, no load mask)
and in having no dropout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The shipped forward's helpers, imported as they are: only the descriptor loads and stores
# below are this experiment's own.
from fastattn.kernels.attention import LOG2E, _block_and_head, _mask_args, _masked_scores

# --- the descriptor forward -------------------------------------------------------------------

@triton.jit
def _tile_load(desc, b, h, start, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
               RANK4: tl.constexpr):
    """A (BLOCK, BLOCK_D) tile of rows [start, start + BLOCK) of (batch b, head h): rank-4
    descriptors over (B, H, L, D) take [b, h, start, 0]; per-head rank-2 ones [start, 0]. Rows
    past L (and columns past the head dim) come back as zeros (TMA's bounds fill)."""
    if RANK4:
        return desc.load([b, h, start, 0]).reshape(BLOCK, BLOCK_D)
    else:
        return desc.load([start, 0])


@triton.jit
def _tma_fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, b, h, mask_ptr, offs_m, offs_n,
                   stride_mm, Lq, Lk, causal_shift, qk_scale, lo, hi,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KIND: tl.constexpr,
                   KEY_MASK: tl.constexpr, CAUSAL: tl.constexpr, CHECK_BOUNDS: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, RANK4: tl.constexpr):
    rows = offs_m[:, None]
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n[None, :]
        # No load mask: keys past Lk are zero-filled by the copy engine, and their scores are
        # set to -inf below (CHECK_BOUNDS), as the shipped kernel does for its masked loads.
        k = _tile_load(k_desc, b, h, start_n, BLOCK_N, BLOCK_D, RANK4)
        s = tl.dot(q, k.T, input_precision=DOT_PRECISION) * qk_scale
        s = _masked_scores(s, rows, cols, mask_ptr, stride_mm, Lq, Lk, causal_shift,
                           MASK_KIND, KEY_MASK, CAUSAL, CHECK_BOUNDS)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _tile_load(v_desc, b, h, start_n, BLOCK_N, BLOCK_D, RANK4)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _tma_fwd_body(q_desc, k_desc, v_desc, o_desc, Out, Lse, mask_ptr, stride_mm, pid_m, bh, b,
                  h, H, Lq, Lk, causal_shift, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, KEY_MASK: tl.constexpr,
                  CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, RANK4: tl.constexpr,
                  O_DESC: tl.constexpr):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _tile_load(q_desc, b, h, pid_m * BLOCK_M, BLOCK_M, BLOCK_D, RANK4)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum(Lk, tl.maximum((pid_m + 1) * BLOCK_M + causal_shift, 0))
        n_full = tl.minimum(Lk, tl.maximum(pid_m * BLOCK_M + causal_shift + 1, 0))
    else:
        hi = Lk
        n_full = Lk
    n_full = n_full // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _tma_fwd_tiles(
        acc, l_i, m_i, q, k_desc, v_desc, b, h, mask_ptr, offs_m, offs_n, stride_mm, Lq, Lk,
        causal_shift, qk_scale, 0, n_full, BLOCK_N, BLOCK_D, MASK_KIND, KEY_MASK, CAUSAL, False,
        DOT_PRECISION, RANK4)
    acc, l_i, m_i = _tma_fwd_tiles(
        acc, l_i, m_i, q, k_desc, v_desc, b, h, mask_ptr, offs_m, offs_n, stride_mm, Lq, Lk,
        causal_shift, qk_scale, n_full, hi, BLOCK_N, BLOCK_D, MASK_KIND, KEY_MASK, CAUSAL, True,
        DOT_PRECISION, RANK4)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    row_ok = offs_m < Lq
    if O_DESC:  # rows past Lq are clipped by the copy engine
        if RANK4:
            o_desc.store([b, h, pid_m * BLOCK_M, 0],
                         out.to(o_desc.dtype).reshape(1, 1, BLOCK_M, BLOCK_D))
        else:
            o_desc.store([pid_m * BLOCK_M, 0], out.to(o_desc.dtype))
    else:  # heads-last (B, L, H, D) as the shipped kernel
        o_ptrs = (Out + (b.to(tl.int64) * Lq * H + h) * HEAD_DIM
                  + offs_m[:, None].to(tl.int64) * (H * HEAD_DIM) + offs_d[None, :])
        tl.store(o_ptrs, out.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(Lse + bh.to(tl.int64) * Lq + offs_m, lse, mask=row_ok)


@triton.jit
def _attn_fwd_tma(Q, K, V, Mask, Out, Lse, stride_mb, stride_mh, stride_mm,
                  H, Lq, Lk, causal_shift, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, KEY_MASK: tl.constexpr,
                  CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, O_DESC: tl.constexpr):
    """Host-side descriptors: Q, K, V (and Out when O_DESC) are rank-4 TensorDescriptors over
    the (B, H, L, D) views with blocks [1, 1, BLOCK_M or BLOCK_N, BLOCK_D]; else Out is the
    heads-last pointer."""
    pid_m, bh = _block_and_head(tl.cdiv(Lq, BLOCK_M))
    b = bh // H  # descriptor coordinates are 32-bit
    h = bh % H
    mask_ptr = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    _tma_fwd_body(Q, K, V, Out, Out, Lse, mask_ptr, stride_mm, pid_m, bh, b, h, H, Lq, Lk,
                  causal_shift, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, MASK_KIND,
                  KEY_MASK, CAUSAL, DOT_PRECISION, True, O_DESC)


@triton.jit
def _attn_fwd_tma_dev(Q, K, V, Mask, Out, Lse,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_mb, stride_mh, stride_mm,
                      H, Lq, Lk, causal_shift, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, KEY_MASK: tl.constexpr,
                      CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      O_DESC: tl.constexpr):
    """Device-side descriptors: per program, rank-2 (L, HEAD_DIM) descriptors at the (batch,
    head) base of Q, K, V (and of the heads-last Out when O_DESC): the bounds are this head's
    own rows, whatever the strides."""
    pid_m, bh = _block_and_head(tl.cdiv(Lq, BLOCK_M))
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    q_desc = tl.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[Lq, HEAD_DIM],
                                       strides=[stride_qm, 1], block_shape=[BLOCK_M, BLOCK_D])
    k_desc = tl.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, shape=[Lk, HEAD_DIM],
                                       strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D])
    v_desc = tl.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, shape=[Lk, HEAD_DIM],
                                       strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_D])
    if O_DESC:
        o_desc = tl.make_tensor_descriptor(Out + (b * Lq * H + h) * HEAD_DIM,
                                           shape=[Lq, HEAD_DIM], strides=[H * HEAD_DIM, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
    else:
        o_desc = q_desc  # unused
    mask_ptr = Mask + b * stride_mb + h * stride_mh
    _tma_fwd_body(q_desc, k_desc, v_desc, o_desc, Out, Lse, mask_ptr, stride_mm, pid_m, bh, b,
                  h, H, Lq, Lk, causal_shift, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                  MASK_KIND, KEY_MASK, CAUSAL, DOT_PRECISION, False, O_DESC)


# --- launchers (GPU or TRITON_INTERPRET=1) ------------------------------------------------------

def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available()
                       else "cpu")


def attention_forward_tma(q, k, v, attn_mask=None, causal=False, scale=None, *,
                          tiles=(128, 64, 8, 3), device_desc=False, o_desc=True):
    """(out (B, H, Lq, D) heads-last, lse (B, H, Lq)) for q, k, v (B, H, L, D) views with unit
    last stride and 16-byte-multiple other strides (the projections' layouts); causal is
    top-left (Lq == Lk in the decoder); no dropout."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    block_m, block_n, num_warps, num_stages = tiles
    block_d = max(16, triton.next_power_of_2(d))
    scale = d ** -0.5 if scale is None else scale
    out = q.new_empty((b, lq, h, d)).transpose(1, 2)
    lse = torch.empty((b, h, lq), dtype=torch.float32, device=q.device)
    mask, mask_strides, flags = _mask_args(attn_mask, q, k)
    grid = (triton.cdiv(lq, block_m) * b * h,)
    consts = dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, **flags,
                  CAUSAL=bool(causal), DOT_PRECISION="tf32" if q.dtype != torch.float32
                  else "ieee", O_DESC=o_desc, num_warps=num_warps, num_stages=num_stages)
    if device_desc:
        triton.set_allocator(_alloc)
        _attn_fwd_tma_dev[grid](
            q, k, v, mask, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *mask_strides, h, lq, lk, 0, scale * LOG2E, **consts)
    else:
        from triton.tools.tensor_descriptor import TensorDescriptor

        def desc(x, rows):
            return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, block_d])

        _attn_fwd_tma[grid](
            desc(q, block_m), desc(k, block_n), desc(v, block_n),
            mask, desc(out, block_m) if o_desc else out, lse, *mask_strides, h, lq, lk, 0,
            scale * LOG2E, **consts)
    return out, lse
