"""The Transformer's forward in launch-saving forms: the computation of fastattn.model's modules,
on their own parameters, in fewer kernel launches. fastattn.model.Transformer.hidden (its loss
and logits) takes this path where a launch costs, on every device outside PER_OP_DEVICES (a
GPU); the plain modules stay the paper's, one op after the other, which a CPU runs (a launch
costs it nothing, the forms below measured no faster there: python -m
scripts.measure_cast_savings, and they keep the recorded runs' numbers:
tests/test_recorded_run.py). The forms, each tested against the plain modules with
PER_OP_DEVICES emptied on a CPU (tests/test_model.py, test_autocast.py, test_embedding.py):

- the embedding · √d + positions + dropout as one op (fastattn.ops.embedding), for sinusoids;
- attention on the packed projection outputs where d_k = d_v (ops.attention.attention_packed:
  its backward writes q's, k's and v's gradients into one buffer, sparing a concatenation);
- the feed-forward's ReLU in its first product's epilogue (_LinearReLU), and its backward with
  the bias gradient in one launch (ops.relu.relu_backward_bias);
- post-norm: a sub-layer's output bias added by the LayerNorm kernel after it, which sums its
  gradient too (output_projection), and under autocast the LayerNorm's copy of its output in
  autocast's dtype for the next products (Stream), sparing their cast and its backward;
- every decoder layer's memory keys and values in one product (memory_projections);
- under autocast (any device), the weights cast to its dtype per group of modules in one
  multi-tensor copy (fastattn.autocast, weight_cast_groups).

This module reads the model's modules by their names and imports no fastattn.model (which
imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastattn import ops
from fastattn.ops.attention import attention_packed, merge_heads
from fastattn.ops.embedding import embedding as fused_embedding
from fastattn.ops.relu import relu_backward_bias
from fastattn.tokens import check_tokens

__all__ = ["PER_OP_DEVICES", "Stream", "applies", "autocast_copy_dtype", "hidden",
           "memory_projections", "weight_cast_groups"]

# Devices that run the model op by op, the plain modules (the module docstring says why).
PER_OP_DEVICES = ("cpu",)

Sublayer = Callable[[Tensor], tuple[Tensor, Tensor | None]]


def applies(x: Tensor) -> bool:
    """Whether the forward on tensors like x takes this module's forms (outside
    PER_OP_DEVICES)."""
    return x.device.type not in PER_OP_DEVICES


class Stream(NamedTuple):
    """The residual stream between sub-layers: x (float32 under autocast) and, in a post-norm
    stack under autocast, the copy of x in autocast's dtype that the LayerNorm kernel wrote
    beside it for the next sub-layer's matrix products (sparing their cast, its backward and
    the add of x's two gradients: three launches; ops.layer_norm_residual's copy_dtype)."""

    x: Tensor
    copy: Tensor | None = None

    @property
    def input(self) -> Tensor:
        """What the next matrix products read: the copy if there is one."""
        return self.x if self.copy is None else self.copy


def autocast_copy_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype of the LayerNorm's copy of its output x: the one autocast would cast float32 x
    to for a matrix product, on a device outside PER_OP_DEVICES; else None."""
    device = x.device.type
    if (device in PER_OP_DEVICES or x.dtype != torch.float32
            or not torch.is_autocast_enabled(device)):
        return None
    dtype = torch.get_autocast_dtype(device)
    return None if dtype == torch.float32 else dtype


def weight_cast_groups(model: nn.Module) -> list[list[nn.Module]]:
    """The groups whose weights autocast casts together (fastattn.autocast). Under
    torch.distributed one per layer, so that a layer's gradients are ready as soon as its
    backward ends (DistributedDataParallel all-reduces them while the rest runs), and the
    memory projections' first, as one: on a GPU they are one product, whose gradients come at
    the end of the decoder's backward. Otherwise one group, the fewest launches."""
    memory_kv = [layer.cross_attention.kv for layer in model.decoder.layers]
    layers = (*model.encoder.layers, *model.decoder.layers)
    groups = [memory_kv, *([layer] for layer in layers)]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return groups
    return [[module for group in groups for module in group]]


def hidden(model: nn.Module, src: Tensor, tgt_in: Tensor) -> Stream:
    """Transformer.hidden's decoder output (B, T, d_model) as a Stream: encode, then decode, in
    this module's forms (the caller batches the weight casts)."""
    check_tokens("src", src, model.cfg.vocab_size)
    mask = model.padding_mask(src)
    # The memory projections read the float32 memory, so that their gradients sum in float32
    # (its copy under autocast goes unused).
    memory = _stack(model.encoder, _encoder_layer, embed(model, src), mask).x
    check_tokens("tgt_in", tgt_in, model.cfg.vocab_size)
    return _stack(model.decoder, _decoder_layer, embed(model, tgt_in), mask,
                  per_layer=memory_projections(model, memory))


def embed(model: nn.Module, tokens: Tensor, start: int = 0) -> Stream:
    """model.embedding(tokens, start) as the Stream a stack starts from: with sinusoids one
    fused op (fastattn.ops.embedding: one launch forward, two backward), which in a post-norm
    model under autocast also writes the copy for the first layer's products; learned
    positions keep the ops one by one, which give them their gradient."""
    embedding = model.embedding
    if hasattr(embedding, "learned_positions"):
        return Stream(embedding(tokens, start))
    dtype = None if model.cfg.pre_norm else autocast_copy_dtype(embedding.weight)
    out = fused_embedding(tokens, embedding.weight, embedding.positions(start, tokens.shape[1]),
                          embedding.scale, embedding.dropout if embedding.training else 0.0,
                          copy_dtype=dtype)
    return Stream(*out) if dtype is not None else Stream(out)


def memory_projections(model: nn.Module, memory: Tensor) -> list[Tensor]:
    """Every decoder layer's cross-attention kv projection of memory (B, S, d_model),
    (B, S, h·(d_k + d_v)), keys then values: one product with the layers' kv weights side by
    side, whose backward sums the memory's gradient inside the product."""
    maps = [layer.cross_attention.kv for layer in model.decoder.layers]
    if len(maps) < 2:
        return [kv(memory) for kv in maps]
    weights, biases = torch.cat([m.weight for m in maps]), torch.cat([m.bias for m in maps])
    return list(F.linear(memory, weights, biases).split([m.out_features for m in maps], -1))


def _stack(stack: nn.Module, layer_form: Callable[..., Stream], x: Stream, *args,
           per_layer: list[Tensor] | None = None) -> Stream:
    for i, layer in enumerate(stack.layers):
        x = layer_form(layer, x, *((per_layer[i],) if per_layer else ()), *args)
    return x if stack.final_norm is None else Stream(stack.final_norm(x.x))


def _encoder_layer(layer: nn.Module, x: Stream, mask: Tensor) -> Stream:
    fold = not layer.self_attention_norm.pre_norm
    x = _add_norm(layer.self_attention_norm, x, lambda h: _self_attention(
        layer.self_attention, h, fold, mask))
    return _add_norm(layer.feed_forward_norm, x, lambda h: _feed_forward(layer.feed_forward, h,
                                                                          fold))


def _decoder_layer(layer: nn.Module, x: Stream, memory_kv: Tensor, memory_mask: Tensor
                   ) -> Stream:
    fold = not layer.self_attention_norm.pre_norm
    x = _add_norm(layer.self_attention_norm, x, lambda h: _self_attention(
        layer.self_attention, h, fold, None, causal=True))
    x = _add_norm(layer.cross_attention_norm, x, lambda h: _cross_attention(
        layer.cross_attention, h, memory_kv, memory_mask, fold))
    return _add_norm(layer.feed_forward_norm, x, lambda h: _feed_forward(layer.feed_forward, h,
                                                                          fold))


def _add_norm(add_norm: nn.Module, x: Stream, sublayer: Sublayer) -> Stream:
    """AddNorm.forward on a Stream; sublayer maps its input to its output and the bias of its
    last linear map if it left that to the LayerNorm (output_projection)."""
    norm = add_norm.norm
    if add_norm.pre_norm:
        h = x.x
        y, _ = sublayer(F.layer_norm(h, h.shape[-1:], norm.weight, norm.bias))
        return Stream(h + ops.dropout(y, norm.dropout, add_norm.training))
    dtype = autocast_copy_dtype(x.x)
    y, y_bias = sublayer(x.input)
    out = norm(y, x.x, copy_dtype=dtype, x_bias=y_bias)
    return Stream(*out) if dtype is not None else Stream(out)


def output_projection(linear: nn.Linear, x: Tensor, fold_bias: bool
                      ) -> tuple[Tensor, Tensor | None]:
    """A sub-layer's last linear map: (x W^T + b, None), or with fold_bias (post-norm) (x W^T, b)
    for the LayerNorm after it to add: its kernels sum b's gradient in their backward, sparing
    the map's bias-gradient launch."""
    if fold_bias:
        return F.linear(x, linear.weight), linear.bias
    return linear(x), None


def _dropout_p(module: nn.Module) -> float:
    return module.dropout if module.training else 0.0


def _self_attention(attention: nn.Module, x: Tensor, fold: bool, mask: Tensor | None,
                    causal: bool = False) -> tuple[Tensor, Tensor | None]:
    """SelfAttention.forward(x, mask, causal), on the packed projections where d_k = d_v."""
    if len(set(attention.split)) == 1:
        out = merge_heads(attention_packed(attention.qkv(x), heads=attention.heads,
                                           attn_mask=mask, causal=causal,
                                           dropout_p=_dropout_p(attention)))
    else:
        out = attention.concat(x, mask, causal)
    return output_projection(attention.out, out, fold)


def _cross_attention(attention: nn.Module, x: Tensor, memory_kv: Tensor, mask: Tensor | None,
                     fold: bool) -> tuple[Tensor, Tensor | None]:
    """CrossAttention.forward(x, memory_kv, mask), on the packed projections where d_k = d_v."""
    if len(set(attention.split)) == 1:
        out = merge_heads(attention_packed(attention.q(x), memory_kv, heads=attention.heads,
                                           attn_mask=mask, dropout_p=_dropout_p(attention)))
    else:
        out = attention.concat(x, memory_kv, mask)
    return output_projection(attention.out, out, fold)


def _feed_forward(ff: nn.Module, x: Tensor, fold: bool) -> tuple[Tensor, Tensor | None]:
    """FeedForward.forward(x), the ReLU in the first product's epilogue (weights and input of
    one dtype)."""
    if x.dtype == ff.w1.weight.dtype == ff.w1.bias.dtype:
        h = _LinearReLU.apply(x.flatten(0, -2), ff.w1.weight, ff.w1.bias).view(
            *x.shape[:-1], -1)
    else:
        h = F.relu(ff.w1(x))
    return output_projection(ff.w2, ops.dropout(h, ff.dropout, ff.training), fold)


class _LinearReLU(torch.autograd.Function):
    """relu(x W^T + b) for 2-D x as one product with the bias and the ReLU in its epilogue
    (cuBLASLt's on a GPU: one launch, not two; PyTorch gives _addmm_activation no autograd)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        h = torch._addmm_activation(bias, x, weight.t())
        ctx.save_for_backward(x, weight, h)
        return h

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x, weight, h = ctx.saved_tensors
        # F.relu's own backward and the bias gradient in one launch; the bias has weight's
        # dtype (the feed-forward takes this form only then).
        grad, bias_grad = relu_backward_bias(grad, h, weight.dtype)
        return grad @ weight, grad.t() @ x, bias_grad
