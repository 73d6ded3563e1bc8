"""Scaled dot-product attention (Vaswani et al., 2017, eq. 1). PLACEHOLDER: reference only until
the Triton kernel lands (issue 3)."""

from __future__ import annotations

import torch


def attention_reference(q, k, v, *, causal=False, attn_mask=None, dropout_p=0.0, scale=None):
    """softmax(q k^T * scale + mask) v in the inputs' dtype; fully masked rows give zeros."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale
    lq, lk = q.shape[-2], k.shape[-2]
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        shift = lk - lq if causal == "bottom_right" else 0
        allowed = torch.tril(allowed, diagonal=shift)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            s = s + attn_mask
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
    if dropout_p > 0:
        p = torch.nn.functional.dropout(p, dropout_p)
    return p @ v


def attention(q, k, v, *, causal=False, attn_mask=None, dropout_p=0.0, scale=None):
    return attention_reference(
        q, k, v, causal=causal, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale
    )
