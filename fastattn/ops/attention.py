"""fastattn.ops.attention: scaled dot-product attention (Vaswani et al., 2017, eq. 1), the op
around kernels/attention.py's Triton kernels.

    O = dropout(softmax(Q K^T * scale + bias)) V        Q: (B, H, Lq, D), K, V: (B, H, Lk, D)

Semantics are those of torch.nn.functional.scaled_dot_product_attention, with one deliberate
difference: a query row that may attend to no key at all returns zeros and passes zero gradients
(PyTorch's math path returns NaN there). The contract at the edges, the same on every path:
- Empty inputs (B, H, Lq, Lk or D = 0) give empty outputs as SDPA does, before any kernel runs:
  (B, H, Lq, D); with Lk = 0 every row attends to no key, so zeros, with zero gradients for q.
- A NaN (or inf) in query row i makes output row i NaN, as softmax does (PyTorch's fused CPU
  kernel returns 0 there unmasked; its math path NaN); NaN in a key or value a row attends to
  makes that row NaN. Whether a NaN hidden from a row by the mask or causality reaches it is
  not specified (PyTorch's own kernels differ).
- The mask is a constant: no gradient flows to it, also for a float mask that requires grad.
- Head dims above the Triton kernels' 256 run PyTorch (fastattn._C on CPU where it applies).
dropout_p is applied on every call (as in PyTorch; pass 0.0 in eval mode); the mask is drawn
from a (seed, offset) pair (fastattn.ops.seeds: from torch's default generator, or a device
table inside seeds.from_device, for CUDA graphs) and regenerated in the backward: by the Triton
kernels from Philox, by the CPU kernels from fastattn._C's counter-based hash (csrc/dropout.h,
the one residual dropout uses).

fastattn.backend.implementation("attention", ...) picks, per call, what runs: "torch" runs
_attention_torch below (PyTorch's autograd); the others run the torch.library op
fastattn::attention_forward, whose CUDA registration is the Triton launcher and whose CPU
registration is fastattn._C (csrc/attention.cpp: one task per (batch, head), float32 inside),
or the Triton launcher under Triton's interpreter. The implementation is an argument of the op,
so its fake tensors are laid out as the kernel that will run lays them out.

attention_packed takes q, k, v as the columns of projection outputs (a self-attention's fused
q/k/v projection; a cross-attention's queries, and its keys and values side by side): its
backward, fastattn::attention_backward_into, writes their gradients into one buffer per
projection, laid out like it, where split's backward would concatenate them (a launch per layer
on a GPU).

Sections: the CPU kernels, the torch.library registration with autograd (and attention_packed's
autograd.Function), the PyTorch path, the public ops, the reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fastattn.backend import check_float, implementation
from fastattn.kernels import attention as kernels
from fastattn.kernels.attention import MAX_HEAD_DIM, causal_shift, unit_last_stride
from fastattn.ops import seeds

CAUSAL_ALIGNMENTS = {False: None, True: "top_left", "top_left": "top_left",
                     "bottom_right": "bottom_right"}


# ---------------------------------------------------------------------------------------------
# CPU kernels: fastattn._C, and the Triton interpreter override
# ---------------------------------------------------------------------------------------------

def _native_args(q, k, attn_mask, causal):
    """(bias, causal, causal shift) for fastattn._C: the mask as a float32 additive bias at its
    own size, viewed as (B, H, Lq, Lk) with stride 0 on broadcast dims."""
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    bias = None
    if attn_mask is not None:
        bias = (torch.zeros(attn_mask.shape, device=q.device).masked_fill_(~attn_mask, -math.inf)
                if attn_mask.dtype == torch.bool else attn_mask.float())
        bias = bias.expand(b, h, lq, lk)
    return bias, causal is not None, causal_shift(causal, lq, lk)


def _native_seed(rng: torch.Tensor | None, dropout_p: float) -> int:
    return int(rng[0]) if dropout_p > 0 else 0


def _attention_forward_native(q, k, v, attn_mask, rng, causal, dropout_p, scale):
    q, k, v = (unit_last_stride(x) for x in (q, k, v))
    return torch.ops.fastattn.cpu_attention_fwd(q, k, v, *_native_args(q, k, attn_mask, causal),
                                                scale, dropout_p, _native_seed(rng, dropout_p))


def _attention_backward_native(grad_out, q, k, v, out, lse, attn_mask, rng, causal, dropout_p,
                               scale):
    q, k, v, grad_out = (unit_last_stride(x) for x in (q, k, v, grad_out))
    return torch.ops.fastattn.cpu_attention_bwd(grad_out, q, k, v, out, lse,
                                                *_native_args(q, k, attn_mask, causal), scale,
                                                dropout_p, _native_seed(rng, dropout_p))

def _without_bf16(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Triton's CPU interpreter reads bf16 as raw bits (numpy has no bf16), so there bf16 tensors
    are computed as fp32 copies; GPUs run the bf16 kernels."""
    return tuple(x.float() if x is not None and x.dtype == torch.bfloat16 else x for x in tensors)


def _backward_needed(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _dropout_keep_mask(q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """The bool keep-mask (B, H, Lq, Lk) that the next attention(q, k, v, dropout_p=dropout_p)
    call on the same backend will draw, given the same RNG state: the PyTorch path draws its mask
    here, and tests, which reset the seed, call this, reset it again and compare attention against
    the reference under this mask. The mask does not depend on q's dtype."""
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if implementation("attention", q.device, torch.float32).startswith("triton"):
        return kernels.dropout_keep_mask(b, h, lq, lk, dropout_p, seeds.draw(2), q.device)
    if implementation("dropout", q.device, torch.float32) == "fastattn._C":
        # fastattn._C's mask of row (b H + h) Lq + i, column j, as its attention kernels draw it.
        # An op taking the seed as a tensor, so torch.compile traces this without a break.
        seed = seeds.draw(2)[:1]
        ones = torch.ones(b * h * lq, lk)
        return seeds.seeded_dropout(ones, seed, dropout_p).ne(0).view(b, h, lq, lk)
    return torch.rand((b, h, lq, lk), device=q.device) >= dropout_p


# ---------------------------------------------------------------------------------------------
# torch.library registration: opaque to torch.compile, with fake tensors and autograd; one
# kernel per device
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fastattn::attention_forward", mutates_args=(), device_types="cuda")
def _attention_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          attn_mask: torch.Tensor | None, rng: torch.Tensor | None,
                          causal: str | None, dropout_p: float, scale: float,
                          impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.attention_forward(q, k, v, attn_mask, rng, causal, dropout_p, scale)


@_attention_forward_op.register_kernel("cpu")
def _(q, k, v, attn_mask, rng, causal, dropout_p, scale, impl):
    if impl == "triton-interpreter":  # the one override: the Triton kernels on CPU tensors
        out, lse = kernels.attention_forward(*_without_bf16(q, k, v, attn_mask), rng, causal,
                                             dropout_p, scale)
        return out.to(q.dtype), lse
    return _attention_forward_native(q, k, v, attn_mask, rng, causal, dropout_p, scale)


@_attention_forward_op.register_fake
def _(q, k, v, attn_mask, rng, causal, dropout_p, scale, impl):
    return kernels.heads_last_empty(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fastattn::attention_backward", mutates_args=(), device_types="cuda")
def _attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           attn_mask: torch.Tensor | None, rng: torch.Tensor | None,
                           causal: str | None, dropout_p: float, scale: float,
                           impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernels.attention_backward(grad_out, q, k, v, out, lse, attn_mask, rng, causal,
                                      dropout_p, scale)


@_attention_backward_op.register_kernel("cpu")
def _(grad_out, q, k, v, out, lse, attn_mask, rng, causal, dropout_p, scale, impl):
    if impl == "triton-interpreter":
        grads = kernels.attention_backward(*_without_bf16(grad_out, q, k, v, out), lse,
                                           *_without_bf16(attn_mask), rng, causal, dropout_p,
                                           scale)
        return tuple(g.to(q.dtype) for g in grads)
    return _attention_backward_native(grad_out, q, k, v, out, lse, attn_mask, rng, causal,
                                      dropout_p, scale)


@_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, attn_mask, rng, causal, dropout_p, scale, impl):
    return tuple(kernels.heads_last_empty(x) for x in (q, k, v))


# attention_backward writing into buffers it is given, so that the gradients of q, k, v that are
# columns of one packed projection output land in one buffer laid out like it
# (attention_packed): no concatenation, which split's backward would launch. The plain backward
# above returns new tensors, which spares fastattn._C's CPU kernels a copy.
@torch.library.custom_op("fastattn::attention_backward_into", mutates_args=("dq", "dk", "dv"),
                         device_types="cuda")
def _attention_backward_into_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           attn_mask: torch.Tensor | None, rng: torch.Tensor | None,
                           causal: str | None, dropout_p: float, scale: float, impl: str,
                           dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Writes the gradients of <out, grad_out> with respect to q, k, v into dq, dk, dv: shaped
    like q, k, v (B, H, L, D), unit stride over D, dk's strides equal to dv's (heads-last, or
    columns of one packed buffer)."""
    kernels.attention_backward(grad_out, q, k, v, out, lse, attn_mask, rng, causal, dropout_p,
                               scale, grads=(dq, dk, dv))


@_attention_backward_into_op.register_kernel("cpu")
def _(grad_out, q, k, v, out, lse, attn_mask, rng, causal, dropout_p, scale, impl, dq, dk, dv):
    if impl == "triton-interpreter" and q.dtype != torch.bfloat16:
        kernels.attention_backward(grad_out, q, k, v, out, lse, attn_mask, rng, causal,
                                   dropout_p, scale, grads=(dq, dk, dv))
        return
    # bf16 under the interpreter, and fastattn._C: the plain backward's new tensors, copied
    grads = _attention_backward_op(grad_out, q, k, v, out, lse, attn_mask, rng, causal,
                                   dropout_p, scale, impl)
    for buffer, grad in zip((dq, dk, dv), grads, strict=True):
        buffer.copy_(grad)


@_attention_backward_into_op.register_fake
def _(grad_out, q, k, v, out, lse, attn_mask, rng, causal, dropout_p, scale, impl, dq, dk, dv):
    return None


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, rng, causal, dropout_p, scale, impl = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, rng)
    ctx.causal, ctx.dropout_p, ctx.scale, ctx.impl = causal, dropout_p, scale, impl
    ctx.mark_non_differentiable(lse)
    # No zeros launched for lse's gradient, which never exists; out's always does (the one
    # differentiable output: backward runs only for it).
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, attn_mask, rng = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(grad_out, q, k, v, out, lse, attn_mask, rng, ctx.causal,
                                        ctx.dropout_p, ctx.scale, ctx.impl)
    return dq, dk, dv, None, None, None, None, None, None


_attention_forward_op.register_autograd(_backward, setup_context=_setup_context)


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """A projection's output (B, L, H·D) -> the heads (B, H, L, D) attention takes, a view."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """Attention's output (B, H, L, D) -> (B, L, H·D), the heads side by side (Concat)."""
    return x.transpose(1, 2).flatten(2)


def _unpack(x: torch.Tensor, kv: torch.Tensor | None, heads: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, H, L, D) as views of attention_packed's inputs: x's thirds, without kv; else
    x, and kv's halves."""
    parts = x.chunk(3, -1) if kv is None else (x, *kv.chunk(2, -1))
    return tuple(split_heads(t, heads) for t in parts)


class _PackedAttention(torch.autograd.Function):
    """The op's forward on views of the packed projection outputs; the backward allocates one
    gradient per packed input, shaped like it, and has the backward op write dq, dk, dv into its
    columns (what split's backward would concatenate)."""

    @staticmethod
    def forward(ctx, x, kv, heads, attn_mask, rng, causal, dropout_p, scale, impl):
        out, lse = _attention_forward_op(*_unpack(x, kv, heads), attn_mask, rng, causal,
                                         dropout_p, scale, impl)
        ctx.save_for_backward(x, kv, out, lse, attn_mask, rng)
        ctx.heads, ctx.causal, ctx.dropout_p, ctx.scale, ctx.impl = (heads, causal, dropout_p,
                                                                     scale, impl)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, kv, out, lse, attn_mask, rng = ctx.saved_tensors
        grad_x = x.new_empty(x.shape)
        grad_kv = None if kv is None else kv.new_empty(kv.shape)
        _attention_backward_into_op(grad_out, *_unpack(x, kv, ctx.heads), out, lse, attn_mask,
                                    rng, ctx.causal, ctx.dropout_p, ctx.scale, ctx.impl,
                                    *_unpack(grad_x, grad_kv, ctx.heads))
        needs_x, needs_kv = ctx.needs_input_grad[:2]
        return (grad_x if needs_x else None, grad_kv if needs_kv else None,
                None, None, None, None, None, None, None)


# ---------------------------------------------------------------------------------------------
# PyTorch path (CPU, or FASTATTN_BACKEND=torch)
# ---------------------------------------------------------------------------------------------


def _allowed_mask(causal: str | None, attn_mask: torch.Tensor | None, lq: int, lk: int,
                  device: torch.device) -> torch.Tensor | None:
    """The mask to give PyTorch: attn_mask combined with the causal band, an (Lq, Lk) bool."""
    if causal is None:
        return attn_mask
    band = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(causal_shift(causal, lq, lk))
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


def _with_nan_rows(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """out with NaN in the rows whose query holds a NaN or inf: PyTorch's fused CPU kernel
    returns 0 there without a mask (its math path, and softmax, NaN). On CPU one sum over q
    decides (no device to synchronise; out untouched in the usual all-finite case); on GPUs and
    under torch.compile, without a branch on data, the rows' sums times 0, NaN where q is not
    finite, are added to out."""
    if q.device.type == "cpu" and not torch.compiler.is_compiling():
        if torch.isfinite(q.sum(dtype=torch.float32)):
            return out
    return out + (q.sum(-1, keepdim=True, dtype=torch.float32) * 0).to(out.dtype)


def _attention_torch(q, k, v, causal, attn_mask, dropout_p, scale):
    lq, lk = q.shape[2], k.shape[2]
    if attn_mask is not None:  # a constant on every path: no gradient flows to it
        attn_mask = attn_mask.detach()
        if attn_mask.is_floating_point():
            attn_mask = attn_mask.to(q.dtype)  # PyTorch wants a float mask in q's dtype
    if (q.device.type == "cpu" and _backward_needed(q, k, v)
            and lk <= _CPU_EXPLICIT_MAX_KEYS.get(q.dtype, 0) and dropout_p == 0):
        return attention_reference(q, k, v, causal=causal or False, attn_mask=attn_mask,
                                   scale=scale)
    if dropout_p == 0.0 and attn_mask is None and causal in (None, "top_left"):
        # No row can be empty: top-left causal always allows key 0. PyTorch's fused CPU kernel
        # turns a NaN query row into zeros only without a mask: a zero (1, 1, 1, Lk) mask, which
        # costs nothing measurable, makes it propagate the NaN; causal calls (and GPUs, whose
        # kernels fastattn does not test for it) check q instead.
        if causal is not None or q.device.type != "cpu":
            return _with_nan_rows(F.scaled_dot_product_attention(
                q, k, v, is_causal=causal is not None, scale=scale), q)
        zero = q.new_zeros(1, 1, 1, lk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=zero, scale=scale)
    mask = _allowed_mask(causal, attn_mask, lq, lk, q.device)
    empty = None
    if mask is not None:  # empty rows attend uniformly (finite), then read zero: zero gradients
        # Unconditional (no data-dependent branch) so torch.compile traces it as one graph.
        empty = _empty_rows(mask)
        mask = mask | empty if mask.dtype == torch.bool else mask.masked_fill(empty, 0.0)
    if dropout_p == 0.0:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        if q.device.type != "cpu":  # on CPU the masked fused kernel propagates NaN itself
            out = _with_nan_rows(out, q)
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
    check_float("attention", q=q, k=k, v=v)
    if not (q.dtype == k.dtype == v.dtype):
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
    if scale is not None and not math.isfinite(float(scale)):
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


def _attention_empty(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA's result where q or k is empty (B, H, Lq, Lk or D = 0), differentiably, with no
    kernel launched: (q k^T) v is (B, H, Lq, D), empty or, for Lk = 0, zeros (each row attends
    to no key), and its gradients are SDPA's (zeros or empty). NaNs in q meet no key: zeros."""
    return (q @ k.transpose(-2, -1)) @ v


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              causal: bool | str = False, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q (B, H, Lq, D) and k, v (B, H, Lk, D) -> (B, H, Lq, D).

    As torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p,
    is_causal=causal, scale=scale), except that rows allowed no key return zeros with zero
    gradients. causal: False, True / "top_left" (key j <= query i, PyTorch's alignment) or
    "bottom_right" (j <= i + Lk - Lq). attn_mask: bool (True = attend) or float (added),
    broadcastable to (B, H, Lq, Lk); a constant: no gradient flows to it, even if it requires
    one. scale defaults to D ** -0.5. q, k, v: float16, bfloat16, float32 or float64. Empty
    inputs give SDPA's empty (or, for Lk = 0, zero) output; a NaN in a query row gives NaN in
    that output row, on every path. What runs is fastattn.backend.implementation("attention",
    ...): the Triton kernels (fp16, bf16, fp32; head dims up to 256, wider ones fall back),
    fastattn._C's CPU kernels (fp32, bf16) or PyTorch.
    """
    return _attention(q, k, v, causal, attn_mask, dropout_p, scale)


def attention_packed(x: torch.Tensor, kv: torch.Tensor | None = None, *, heads: int,
                     causal: bool | str = False, attn_mask: torch.Tensor | None = None,
                     dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """attention(q, k, v, ...) (B, H, Lq, D) for heads packed in projection outputs, as
    x.split(...) and unflatten(-1, (heads, D)).transpose(1, 2) would unpack them: without kv,
    x is a self-attention's fused projection (B, L, 3·H·D), q, k, v side by side; with kv, x is
    the queries (B, Lq, H·D) and kv the keys and values (B, Lk, 2·H·D), keys first.

    Same values and gradients as attention() on those views. Where the op runs (not the PyTorch
    path), the backward writes dq, dk, dv straight into one gradient per packed input, laid out
    like it (for cross-attention dk and dv share kv's, dq is x's): no concatenation of the
    three, which the views' backward (split's) would launch."""
    n = 3 if kv is None else 1
    if (x.dim() != 3 or heads < 1 or x.shape[-1] % (n * heads)
            or (kv is not None and (kv.dim() != 3 or kv.shape[-1] != 2 * x.shape[-1]))):
        raise ValueError(f"attention_packed: for {heads} heads, x must be (B, L, 3·H·D) without "
                         f"kv, or x (B, Lq, H·D) and kv (B, Lk, 2·H·D); got x {tuple(x.shape)}, "
                         f"kv {None if kv is None else tuple(kv.shape)}")
    return _attention(*_unpack(x, kv, heads), causal, attn_mask, dropout_p, scale,
                      packed=(x, kv, heads))


def _attention(q, k, v, causal, attn_mask, dropout_p, scale, packed=None):
    """attention(); with packed = (x, kv, heads), attention_packed's, q, k, v being their views."""
    _check_inputs(q, k, v, causal, attn_mask, dropout_p, scale)
    if q.numel() == 0 or k.numel() == 0:
        return _attention_empty(q, k, v)
    alignment = CAUSAL_ALIGNMENTS[causal]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    impl = implementation("attention", q.device, q.dtype, _backward_needed(q, k, v),
                          masked=attn_mask is not None or alignment is not None,
                          head_dim=q.shape[-1])
    if impl == "torch":
        return _attention_torch(q, k, v, alignment, attn_mask, dropout_p, scale)
    assert not impl.startswith("triton") or q.shape[-1] <= MAX_HEAD_DIM, impl
    if attn_mask is not None:
        attn_mask = attn_mask.detach()  # the op's autograd gives it no gradient anyway
    rng = seeds.draw(2) if dropout_p > 0 else None
    if packed is not None:
        return _PackedAttention.apply(*packed, attn_mask, rng, alignment, float(dropout_p), scale,
                                      impl)
    out, _ = _attention_forward_op(q, k, v, attn_mask, rng, alignment, float(dropout_p), scale,
                                   impl)
    return out


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def attention_probabilities(q: torch.Tensor, k: torch.Tensor, *, causal: bool | str = False,
                            attn_mask: torch.Tensor | None = None,
                            scale: float | None = None) -> torch.Tensor:
    """The attention weights softmax(q k^T * scale + bias) (B, H, Lq, Lk), masked to zero on
    fully masked rows, explicitly in the inputs' dtype: the one reference of attention's
    softmax (attention_reference, the model's and the drop-in's weights, decoding's explicit
    step)."""
    alignment = CAUSAL_ALIGNMENTS[causal]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    lq, lk = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-2, -1)) * scale
    mask = _allowed_mask(alignment, attn_mask, lq, lk, q.device)
    if mask is None:
        return torch.softmax(s, dim=-1)
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    empty = _empty_rows(mask)
    # Softmax of an all -inf row is NaN, in its gradient too: give it finite scores first.
    return torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool | str = False, attn_mask: torch.Tensor | None = None,
                        dropout_p: float = 0.0, scale: float | None = None,
                        dropout_keep: torch.Tensor | None = None) -> torch.Tensor:
    """The explicit math in the inputs' dtype (use fp64 for ground truth):
    attention_probabilities(q, k, ...) times dropout_keep / (1 - p) when dropout_p > 0
    (dropout_keep, a bool (B, H, Lq, Lk) mask, is then required), times v."""
    p = attention_probabilities(q, k, causal=causal, attn_mask=attn_mask, scale=scale)
    if dropout_p > 0:
        if dropout_keep is None:
            raise ValueError("attention_reference: dropout_p > 0 needs the dropout_keep mask")
        p = p * dropout_keep / (1.0 - dropout_p)
    return p @ v
