"""Thin nn.Modules over fastattn.ops: a drop-in torch.nn.MultiheadAttention, the fused residual
LayerNorm and the label-smoothed loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from fastattn import ops
from fastattn.ops.attention import attention_probabilities, merge_heads, split_heads

__all__ = [
    "LabelSmoothedCrossEntropy",
    "MultiHeadAttention",
    "ResidualLayerNorm",
    "replace_multihead_attention",
]


class MultiHeadAttention(nn.Module):
    """Drop-in replacement for torch.nn.MultiheadAttention running on fastattn.ops.attention.

    Same constructor, parameters, state_dict, forward signature and return values as torch's
    module (see its documentation); a torch state_dict loads strictly and gives the same outputs
    and gradients. Masks follow torch's convention: in ``attn_mask`` (L, S) or (N·H, L, S) and
    ``key_padding_mask`` (N, S), True means "do not attend" and floats are added to the scores.
    ``need_weights=True`` (torch's default) computes the weights explicitly and returns them;
    pass ``need_weights=False`` to run the fused attention kernel. Differences from torch, all
    deliberate: a query row whose keys are all masked gives zeros (torch gives NaN);
    ``is_causal=True`` without ``attn_mask`` means causal (top-left aligned) instead of an error;
    masks are constants: a float ``attn_mask`` or ``key_padding_mask`` that requires grad gets
    no gradient (torch's gives it one), on both paths. Empty inputs (L, S or N = 0) give torch's
    empty or, for S = 0, zero-attention outputs, also where torch's own fused path raises.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} "
                f"and num_heads={num_heads} instead"
            )
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.add_zero_attn = add_zero_attn

        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's initialisation, so that a fixed seed gives torch's weights."""
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    # torch's own; nn.TransformerEncoderLayer's inference fast path calls it on its self_attn.
    merge_masks = nn.MultiheadAttention.merge_masks

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """A fastattn copy of a torch.nn.MultiheadAttention: same configuration, weights, mode."""
        weight = module.out_proj.weight
        new = cls(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            bias=module.in_proj_bias is not None,
            add_bias_kv=module.bias_k is not None,
            add_zero_attn=module.add_zero_attn,
            kdim=module.kdim,
            vdim=module.vdim,
            batch_first=module.batch_first,
            device=weight.device,
            dtype=weight.dtype,
        )
        new.load_state_dict(module.state_dict(), strict=True)
        return new.train(module.training)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """query (L, N, E), key (S, N, kdim), value (S, N, vdim), or (N, L, E)... with batch_first,
        or unbatched (L, E), (S, kdim), (S, vdim). Returns the output shaped like query and, with
        need_weights, the weights (N, L, S) averaged over heads or (N, H, L, S) per head (without
        N when unbatched); S counts the extra bias_k and zero-attention keys."""
        batched = self._check_inputs(query, key, value, key_padding_mask, attn_mask)
        batch_first = self.batch_first
        if not batched:  # a batch of one, batch first (torch ignores batch_first here too)
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
            batch_first = True
        n = query.shape[0 if batch_first else 1]

        # torch's reading of the is_causal hint next to a mask: the mask is assumed causal and
        # dropped where the fused path can use causal=True, otherwise the mask alone decides.
        if is_causal and attn_mask is not None:
            if key_padding_mask is None and not need_weights:
                attn_mask = None
            else:
                is_causal = False

        q, k, v = self._project(query, key, value)
        q, k, v = (_split_heads(x, self.num_heads, batch_first) for x in (q, k, v))
        k, v, extra_keys = self._extra_keys(k, v)
        mask = _attention_mask(attn_mask, key_padding_mask, n, self.num_heads, query.dtype)
        if mask is not None and extra_keys:
            mask = F.pad(mask, (0, extra_keys), value=True if mask.dtype == torch.bool else 0.0)
        dropout_p = self.dropout if self.training else 0.0

        weights = None
        if need_weights:
            out, weights = _attention_with_weights(q, k, v, mask, is_causal, dropout_p)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not batched:
                weights = weights.squeeze(0)
        else:
            out = ops.attention(q, k, v, causal=is_causal, attn_mask=mask, dropout_p=dropout_p)
        out = self.out_proj(_merge_heads(out, batch_first))
        return (out if batched else out.squeeze(0)), weights

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The input projections, one matrix product where the inputs are shared."""
        e = self.embed_dim
        b = [None] * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        if not self._qkv_same_embed_dim:
            ws = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        elif query is key and key is value:
            return F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        elif key is value:
            bias_kv = None if self.in_proj_bias is None else self.in_proj_bias[e:]
            k, v = F.linear(key, self.in_proj_weight[e:], bias_kv).chunk(2, dim=-1)
            return F.linear(query, self.in_proj_weight[:e], b[0]), k, v
        else:
            ws = self.in_proj_weight.chunk(3)
        inputs = (query, key, value)
        return tuple(F.linear(x, w, bias) for x, w, bias in zip(inputs, ws, b, strict=True))

    def _extra_keys(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
        """Appends the learned bias_k/bias_v key and the all-zero key of add_zero_attn."""
        n, h, _, d = k.shape
        extra_k, extra_v = [], []
        if self.bias_k is not None:
            extra_k.append(self.bias_k.view(1, h, 1, d).expand(n, h, 1, d))
            extra_v.append(self.bias_v.view(1, h, 1, d).expand(n, h, 1, d))
        if self.add_zero_attn:
            extra_k.append(k.new_zeros(n, h, 1, d))
            extra_v.append(v.new_zeros(n, h, 1, d))
        if not extra_k:
            return k, v, 0
        return torch.cat([k, *extra_k], dim=2), torch.cat([v, *extra_v], dim=2), len(extra_k)

    def _check_inputs(self, query, key, value, key_padding_mask, attn_mask) -> bool:
        """Torch's shape rules with clear messages; returns whether the input is batched."""
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be 2-D (unbatched) or 3-D, got {tuple(query.shape)}")
        batched = query.dim() == 3
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"key and value must be {query.dim()}-D like query, got shapes "
                f"{tuple(key.shape)} and {tuple(value.shape)}"
            )
        seq, batch = (1, 0) if batched and self.batch_first else (0, 1)
        for name, x, dim in (("query", query, self.embed_dim), ("key", key, self.kdim),
                             ("value", value, self.vdim)):
            if x.shape[-1] != dim:
                raise ValueError(f"{name} must have {dim} features, got shape {tuple(x.shape)}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key and value must agree in all but the feature dimension, got shapes "
                f"{tuple(key.shape)} and {tuple(value.shape)}"
            )
        if batched and key.shape[batch] != query.shape[batch]:
            raise ValueError(
                f"query and key must have the same batch size, got shapes {tuple(query.shape)} "
                f"and {tuple(key.shape)}"
            )
        l, s = query.shape[seq], key.shape[seq]
        n = query.shape[batch] if batched else 1
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
                raise TypeError(f"only bool and floating types of {name} are supported, got "
                                f"{mask.dtype}")
        if key_padding_mask is not None:
            expected = (n, s) if batched else (s,)
            if tuple(key_padding_mask.shape) != expected:
                raise ValueError(
                    f"key_padding_mask must have shape {expected}, got "
                    f"{tuple(key_padding_mask.shape)}"
                )
        if attn_mask is not None:
            allowed = [(l, s), (n * self.num_heads, l, s)]
            if tuple(attn_mask.shape) not in allowed:
                raise ValueError(
                    f"attn_mask must have shape {allowed[0]} or {allowed[1]} (N·num_heads, L, S), "
                    f"got {tuple(attn_mask.shape)}"
                )
        return batched


def _split_heads(x: Tensor, heads: int, batch_first: bool) -> Tensor:
    """(N, L, H·D) or (L, N, H·D) -> (N, H, L, D), a view (ops.attention.split_heads)."""
    return split_heads(x if batch_first else x.transpose(0, 1), heads)


def _merge_heads(x: Tensor, batch_first: bool) -> Tensor:
    """(N, H, L, D) -> (N, L, H·D) or (L, N, H·D) (ops.attention.merge_heads)."""
    return merge_heads(x) if batch_first else merge_heads(x).transpose(0, 1)


def _attention_mask(
    attn_mask: Tensor | None, key_padding_mask: Tensor | None, n: int, heads: int,
    dtype: torch.dtype,
) -> Tensor | None:
    """Torch's two masks (True = masked, or additive floats) as one mask for ops.attention
    (True = attend, or additive floats), broadcastable to (N, H, L, S). Masks are constants:
    detached, so that no gradient reaches them on either path."""
    masks = []
    if attn_mask is not None:
        attn_mask = attn_mask.detach()
        per_head = attn_mask.dim() == 3  # (N·H, L, S)
        masks.append(attn_mask.unflatten(0, (n, heads)) if per_head else attn_mask)
    if key_padding_mask is not None:  # sizes spelled out: -1 is ambiguous with N or S = 0
        masks.append(key_padding_mask.detach().view(n, 1, 1, key_padding_mask.shape[-1]))
    if not masks:
        return None
    if all(m.dtype == torch.bool for m in masks):
        allowed = ~masks[0]
        return allowed if len(masks) == 1 else allowed & ~masks[1]
    additive = [
        torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(m, float("-inf"))
        if m.dtype == torch.bool else m.to(dtype)
        for m in masks
    ]
    return additive[0] if len(additive) == 1 else additive[0] + additive[1]


def _attention_with_weights(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, dropout_p: float
) -> tuple[Tensor, Tensor]:
    """Attention that also returns its weights (N, H, L, S), after dropout as in torch: the
    weights are ops.attention.attention_probabilities (a row with every key masked attends to
    nothing)."""
    weights = attention_probabilities(q, k, causal=causal, attn_mask=mask)
    if dropout_p > 0.0:
        weights = F.dropout(weights, dropout_p)
    return weights @ v, weights


def replace_multihead_attention(model: nn.Module) -> nn.Module:
    """Replaces every torch.nn.MultiheadAttention inside ``model`` by a fastattn
    MultiHeadAttention with the same configuration and weights, in place, and returns the model
    (the new module itself if ``model`` is a torch MultiheadAttention). Shared modules stay
    shared."""
    if type(model) is nn.MultiheadAttention:
        return MultiHeadAttention.from_torch(model)
    converted: dict[int, MultiHeadAttention] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.MultiheadAttention:
                if id(child) not in converted:
                    converted[id(child)] = MultiHeadAttention.from_torch(child)
                setattr(parent, name, converted[id(child)])
    return model


class ResidualLayerNorm(nn.Module):
    """LayerNorm(residual + Dropout(x)) in one fused op: the paper's sub-layer connection
    (section 5.4). Parameters are named like nn.LayerNorm's; dropout acts only in training."""

    def __init__(
        self,
        normalized_shape: int,
        dropout: float = 0.0,
        eps: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dropout = dropout
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(normalized_shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(normalized_shape, device=device, dtype=dtype))

    def forward(self, x: Tensor, residual: Tensor, copy_dtype: torch.dtype | None = None,
                x_bias: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x, residual (..., d) -> (..., d); with copy_dtype, also its copy in that dtype; x_bias
        is added to x first (ops.layer_norm_residual's arguments)."""
        dropout_p = self.dropout if self.training else 0.0
        return ops.layer_norm_residual(x, residual, self.weight, self.bias, self.eps, dropout_p,
                                       copy_dtype=copy_dtype, x_bias=x_bias)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, dropout={self.dropout}, eps={self.eps}"


class LabelSmoothedCrossEntropy(nn.Module):
    """Cross-entropy with label smoothing (section 5.4), like
    nn.CrossEntropyLoss(label_smoothing=...) but with classes in the last dimension:
    logits (..., V), target (...) -> a scalar, or per-position losses (...) with
    reduction="none". Targets equal to ``ignore_index`` count for nothing."""

    def __init__(
        self, smoothing: float = 0.0, ignore_index: int = -100, reduction: str = "mean"
    ) -> None:
        super().__init__()
        if not 0.0 <= smoothing <= 1.0:
            raise ValueError(f"smoothing must be in [0, 1], got {smoothing}")
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.smoothing = smoothing
        self.ignore_index = ignore_index
        self.reduction = reduction

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        if logits.shape[:-1] != target.shape:
            raise ValueError(
                f"target shape {tuple(target.shape)} must be logits shape "
                f"{tuple(logits.shape)} without its last (class) dimension"
            )
        loss = ops.label_smoothed_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), self.smoothing,
            self.ignore_index, self.reduction,
        )
        return loss.view(target.shape) if self.reduction == "none" else loss

    def extra_repr(self) -> str:
        return (
            f"smoothing={self.smoothing}, ignore_index={self.ignore_index}, "
            f"reduction={self.reduction}"
        )
