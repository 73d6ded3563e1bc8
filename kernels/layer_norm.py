"""LayerNorm(residual + dropout(x)). PLACEHOLDER: reference only until the kernel lands (issue 4)."""

from __future__ import annotations

import torch.nn.functional as F


def layer_norm_residual(
    x, residual, weight, bias, eps=1e-5, dropout_p=0.0, return_residual=False, training=True
):
    h = F.dropout(x, dropout_p, training=training) if dropout_p > 0 else x
    s = h if residual is None else residual + h
    y = F.layer_norm(s, (s.shape[-1],), weight, bias, eps)
    return (y, s) if return_residual else y
