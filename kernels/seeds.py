"""Dropout inside the Triton kernels: how a kernel reads its seed and draws its keep mask. The
seeds come from fastattn.ops.seeds (an int64 drawn per call from torch's CPU generator, passed
by value: no launch, no sync; or, under fastattn.ops.seeds.from_device, a pointer to a slot of a
device table a CUDA graph refills), and every backward regenerates its forward's mask from the
same seed instead of storing it.

- `scalar`: the seed's value, loaded first when it comes through a pointer.
- `keep_mask`: one row's mask, Philox(seed; column, row): residual LayerNorm and embedding.
- `tile_keep_mask`: a (queries x keys) tile's mask, Philox(seed; offset + flat index): attention.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scalar(x):
    """x, or the value x points to: seeds come by value, or through a pointer from a table a CUDA
    graph refills (fastattn.ops.seeds). Shared by every kernel that takes a dropout seed, each of
    which marks its seeds do_not_specialize: Triton would make a value of 1 a constexpr, which has
    no dtype (Triton 3.9's tl.to_tensor could wrap it, but 3.6 does not export it)."""
    if x.dtype.is_ptr():
        x = tl.load(x)
    return x


@triton.jit
def keep_mask(seed, row, cols, dropout_p):
    """Dropout keep mask of elements (row, cols): uniform(Philox(seed; cols, row)) >= p."""
    zero = tl.zeros_like(cols)
    bits, _, _, _ = tl.philox(seed, cols, (zero + row).to(tl.int32), zero, zero)
    return tl.uint_to_uniform_float(bits) >= dropout_p


@triton.jit
def tile_keep_mask(philox_seed, philox_offset, bh, row_start, col_start, Lq, Lk, dropout_p,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keep-mask of the (BLOCK_M queries from row_start) x (BLOCK_N keys from col_start) tile of
    attention head bh. One Philox call yields four 32-bit numbers, so each counter covers four
    keys: counter = offset + flat index of (bh, row, key // 4). Every element has its own bits,
    and the backward, visiting the same tiles, redraws exactly the forward's mask."""
    rows = row_start + tl.arange(0, BLOCK_M)[:, None]
    groups = col_start // 4 + tl.arange(0, BLOCK_N // 4)[None, :]
    counter = philox_offset + (bh.to(tl.int64) * Lq + rows) * tl.cdiv(Lk, 4) + groups
    r0, r1, r2, r3 = tl.randint4x(philox_seed, counter)
    bits = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK_M, BLOCK_N])
    return tl.uint_to_uniform_float(bits) >= dropout_p
