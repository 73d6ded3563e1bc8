"""Incremental decoding of fastattn.model.Transformer: the state kept between positions (the
encoder memory, the self-attention caches), and the choice between the two engines that step a
decoder, the Python layers' step() and fastattn._C's decoder (fastattn::decoder_step and
fastattn::transformer_beam_search, CPU only). native_decoder_supports is the one rule for that
choice; a model it refuses is decoded in Python, to the same result.

The native decoder computes in one of PRECISIONS: "fp32"; "int8", where the decoder's linear
maps, the target embedding and the output projection use int8 weights (one scale per output
feature) and int8 activations (one scale per row), with int32 sums (csrc/int8_linear.h); or
"bf16", the same maps with bfloat16 weights and activations and float32 sums
(csrc/bf16_linear.h). Where the native decoder runs, the encoder does too (encode: one call of
fastattn::transformer_encode, op for op the Python modules' computation, which releases the GIL
for parallel workers); in int8 and bf16 its linear maps and the decoder's projections of its
output into keys and values run in that precision too. The embeddings' lookups for the source,
attention, LayerNorm and the log-softmax stay float32.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from fastattn._native import native
from fastattn.tokens import check_tokens

if TYPE_CHECKING:
    from fastattn.search import BeamSearchSetup

# fastattn.model imports this module, so this one names no type of it, not even for annotations:
# a `model` here is a fastattn.model.Transformer, annotated as the nn.Module it is.

__all__ = ["DECODER_LAYER_SLOTS", "ENCODER_LAYER_SLOTS", "PRECISIONS", "DecodingState",
           "NativeWeights", "check_precision", "encode", "gather_prefixes", "native_beam_search",
           "native_decode_step", "native_decoder_supports", "native_embedding", "native_weights",
           "step_attention"]

# The per-layer weights of fastattn::decoder_step in its order: csrc/layer_slots.h's
# DecoderLayerSlot, named alike (tests/test_decode_attention.py checks the two agree). Each is
# "<module>.<parameter>" of a fastattn.model.DecoderLayer.
DECODER_LAYER_SLOTS = (
    "self_attention.qkv.weight", "self_attention.qkv.bias",
    "self_attention.out.weight", "self_attention.out.bias",
    "self_attention_norm.norm.weight", "self_attention_norm.norm.bias",
    "cross_attention.q.weight", "cross_attention.q.bias",
    "cross_attention.out.weight", "cross_attention.out.bias",
    "cross_attention_norm.norm.weight", "cross_attention_norm.norm.bias",
    "feed_forward.w1.weight", "feed_forward.w1.bias",
    "feed_forward.w2.weight", "feed_forward.w2.bias",
    "feed_forward_norm.norm.weight", "feed_forward_norm.norm.bias",
)
# fastattn::transformer_encode's per-layer weights, the same way: csrc/layer_slots.h's
# encoder::EncoderLayerSlot, of a fastattn.model.EncoderLayer.
ENCODER_LAYER_SLOTS = (
    "self_attention.qkv.weight", "self_attention.qkv.bias",
    "self_attention.out.weight", "self_attention.out.bias",
    "self_attention_norm.norm.weight", "self_attention_norm.norm.bias",
    "feed_forward.w1.weight", "feed_forward.w1.bias",
    "feed_forward.w2.weight", "feed_forward.w2.bias",
    "feed_forward_norm.norm.weight", "feed_forward_norm.norm.bias",
)
# The linear maps whose weights the native decoder and encoder take packed, in their order.
_PACKED_LINEARS = ("self_attention.qkv", "self_attention.out", "cross_attention.q",
                   "cross_attention.out", "feed_forward.w1", "feed_forward.w2")
_ENCODER_LINEARS = ("self_attention.qkv", "self_attention.out", "feed_forward.w1",
                    "feed_forward.w2")

PRECISIONS = ("fp32", "int8", "bf16")


class NativeWeights(NamedTuple):
    """A model's weights as fastattn._C's decoding ops take them, for one precision."""

    decoder: list[Tensor]  # DECODER_LAYER_SLOTS per decoder layer
    # The decoder's linear maps (_PACKED_LINEARS per layer): float32 few-row panels (empty for
    # float64), int8 kInt8Parts each, or bfloat16 panels.
    packed: list[Tensor]
    # The output projection's: its float32 panels, or the packed embedding's int8 parts or
    # bfloat16 panels (which the target embedding reads too).
    output: list[Tensor]
    encoder: list[Tensor]  # ENCODER_LAYER_SLOTS per encoder layer
    encoder_packed: list[Tensor]  # int8 and bf16: _ENCODER_LINEARS per layer; else empty
    memory: list[Tensor]  # each decoder layer's cross_attention.kv weight and bias
    memory_packed: list[Tensor]  # int8 and bf16: those maps packed; else empty


def _has_native_cpu_op(name: str) -> bool:
    return native is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"fastattn::{name}", "CPU")


NATIVE_STEP_ATTENTION = _has_native_cpu_op("decode_attention")
NATIVE_DECODER_STEP = _has_native_cpu_op("decoder_step")
NATIVE_BEAM_SEARCH = _has_native_cpu_op("transformer_beam_search")
NATIVE_ENCODE = _has_native_cpu_op("transformer_encode")
NATIVE_INT8 = _has_native_cpu_op("linear_int8")
NATIVE_BF16 = _has_native_cpu_op("linear_bf16")


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def native_decoder_supports(model: nn.Module, like: Tensor, precision: str = "fp32"
                            ) -> str | None:
    """None when fastattn._C's decoder computes `model`'s decoder for tensors like `like` (its
    device and dtype) exactly as the Python layers do (fp32), or in int8 or bf16; otherwise the
    reason it does not, and the caller decodes in Python (fp32) or refuses (int8 and bf16, which
    only the native decoder computes). The native decoder is the paper's: post-norm layers,
    ReLU, on CPU in float32 or float64; int8 and bf16 for float32 models."""
    if precision != "fp32":
        if not (NATIVE_INT8 if precision == "int8" else NATIVE_BF16):
            return f"fastattn._C's {precision} kernels are not built"
        if like.dtype != torch.float32:
            return f"dtype {like.dtype}: {precision} decoding computes in float32"
    if not NATIVE_DECODER_STEP:
        return "fastattn._C's decoder_step is not built"
    if model.cfg.pre_norm:
        return "pre-norm layers: the native decoder is post-norm"
    if like.device.type != "cpu":
        return f"device {like.device.type}: the native decoder runs on CPU"
    if like.dtype not in (torch.float32, torch.float64):
        return f"dtype {like.dtype}: the native decoder computes in float32 or float64"
    return None


def native_weights(model: nn.Module, precision: str = "fp32") -> NativeWeights:
    """The model's weights for fastattn._C's encoder and decoder in `precision`: float32 linear
    maps as few-row panels (fastattn::pack_linear_weight; the encoder's run through at::linear
    as they are), int8 ones quantized (fastattn::quantize_linear_weight), bf16 ones as bfloat16
    panels (fastattn::pack_linear_weight_bf16). Built once per precision and again only after a
    weight changed: in-place updates bump a tensor's _version, and Transformer.train() drops
    the copies for the updates that do not (fused optimisers)."""
    key = _weights_key(model)
    cached = model._native_weights.get(precision)
    if cached is not None and cached[0] == key:
        return cached[1]
    decoder = [dict(layer.named_parameters()) for layer in model.decoder.layers]
    encoder = [dict(layer.named_parameters()) for layer in model.encoder.layers]
    memory = [layer[f"cross_attention.kv.{name}"].detach()
              for layer in decoder for name in ("weight", "bias")]
    linears = [layer[f"{name}.weight"].detach() for layer in decoder for name in _PACKED_LINEARS]
    encoder_linears = [layer[f"{name}.weight"].detach()
                       for layer in encoder for name in _ENCODER_LINEARS]
    if precision == "fp32":
        pack = torch.ops.fastattn.pack_linear_weight
        floats = model.embedding.weight.dtype == torch.float32
        packed = [pack(weight) for weight in linears] if floats else []
        output = [pack(model.output_weight.detach())] if floats else []
        encoder_packed, memory_packed = [], []
    else:
        if precision == "int8":
            def pack(weight: Tensor) -> list[Tensor]:
                return list(torch.ops.fastattn.quantize_linear_weight(weight))
        else:
            def pack(weight: Tensor) -> list[Tensor]:
                return [torch.ops.fastattn.pack_linear_weight_bf16(weight)]
        packed, encoder_packed, memory_packed = (
            [part for weight in weights for part in pack(weight)]
            for weights in (linears, encoder_linears, memory[::2]))
        output = pack(model.embedding.weight.detach())
    weights = NativeWeights(
        decoder=[layer[name].detach() for layer in decoder for name in DECODER_LAYER_SLOTS],
        packed=packed, output=output,
        encoder=[layer[name].detach() for layer in encoder for name in ENCODER_LAYER_SLOTS],
        encoder_packed=encoder_packed, memory=memory, memory_packed=memory_packed)
    model._native_weights[precision] = key, weights
    return weights


def _weights_key(model: nn.Module) -> tuple:
    """Changes when any weight does: in-place updates bump a tensor's _version. A walk of the
    modules' own parameter dicts: Module.parameters() cost a tenth of a batch-1 search."""
    key, modules = [], [model]
    while modules:
        module = modules.pop()
        key += [(p.data_ptr(), p._version) for p in module._parameters.values() if p is not None]
        modules += module._modules.values()
    return tuple(key)


def encode(model: nn.Module, src: Tensor, weights: NativeWeights | None = None,
           ) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """Decoding's start: src (B, S) -> each decoder layer's keys and values of the encoder
    output, (B, h, S, d), and the padding mask (B, 1, 1, S). With `weights` (native_weights:
    the model is one native_decoder_supports accepts) one call of fastattn::transformer_encode,
    in their precision; else the Python modules."""
    if weights is not None and NATIVE_ENCODE:
        check_tokens("src", src, model.cfg.vocab_size)  # model.encode checks them otherwise
        embedding = model.embedding
        memory_k, memory_v, mask = torch.ops.fastattn.transformer_encode(
            src, embedding.weight.detach(), embedding.positions(0, src.shape[1]),
            embedding.scale, model.cfg.pad_id, model.cfg.heads, model.cfg.key_dim,
            weights.encoder, weights.encoder_packed, weights.memory, weights.memory_packed,
            model.encoder.layers[0].feed_forward_norm.norm.eps)
        return memory_k, memory_v, mask
    memory, mask = model.encode(src)
    pairs = model.memory_kv(memory)
    return [k for k, _ in pairs], [v for _, v in pairs], mask


def native_embedding(model: nn.Module, tokens: Tensor, state: DecodingState) -> Tensor:
    """The embedded newest tokens (N,) at position state.length, as model.embedding computes
    them (fp32) or from the packed embedding (int8, bf16): transformer_beam_search's op
    sequence."""
    if state.precision == "fp32":
        return model.embedding(tokens.unsqueeze(1), start=state.length).squeeze(1)
    if state.native_weights is None:
        state.native_weights = native_weights(model, state.precision)
    output = state.native_weights.output
    if state.precision == "int8":
        x = torch.ops.fastattn.dequantize_rows(output[0], output[1], tokens, model.cfg.d_model)
    else:
        x = torch.ops.fastattn.unpack_rows_bf16(output[0], tokens, model.cfg.d_model)
    return x.mul(model.embedding.scale).add(model.embedding.positions(state.length, 1)[0])


def native_decode_step(model: nn.Module, x: Tensor, state: DecodingState) -> Tensor:
    """Transformer.decode_step's stack and output projection in fastattn._C for x (N, d_model),
    the embedded newest position (native_decoder_supports(model, x) must be None): the whole
    stack in one call, since a few-row step is dominated by per-op overhead."""
    if state.native_weights is None:  # once per decoding: weights do not change within
        state.native_weights = native_weights(model, state.precision)
    weights = state.native_weights
    x = torch.ops.fastattn.decoder_step(
        x, weights.decoder, state.self_k, state.self_v, state.history, state.length,
        state.memory_k, state.memory_v, _flat_memory_bias(state), state.sentences, weights.packed,
        model.decoder.layers[0].feed_forward_norm.norm.eps)
    state.length += 1
    # int8, bf16: the output projection is the packed embedding's first `rows` rows.
    rows, output = model.cfg.output_size, weights.output
    if state.precision == "int8":
        panels, scales, sums = output
        return torch.ops.fastattn.log_softmax_linear_int8(
            x, panels[: -(-rows // 16)], scales[:rows], sums[:rows])
    if state.precision == "bf16":
        return torch.ops.fastattn.log_softmax_linear_bf16(x, output[0][: -(-rows // 16)], rows)
    return torch.ops.fastattn.log_softmax_linear(x, model.output_weight.detach(),
                                                 output[0] if output else None).float()


def native_beam_search(model: nn.Module, state: DecodingState, setup: BeamSearchSetup,
                       bos_id: int, eos_id: int, nbest: int) -> None:
    """Transformer.beam_search as one call of fastattn::transformer_beam_search from a fresh
    `state`; the hypotheses land in `setup` (setup.best(nbest) reads them). The native search
    keeps its largest buffers (caches and logits, about 20 MB for 64 sentences of the multi30k
    model; sets over 256 MB are freed) for the next call on the same thread: allocating them
    afresh cost a tenth of a batch-64 search in page faults."""
    if state.native_weights is None:
        state.native_weights = native_weights(model, state.precision)
    weights = state.native_weights
    torch.ops.fastattn.transformer_beam_search(
        model.embedding.weight.detach(), model.output_weight.detach(),
        model.embedding.positions(0, state.capacity), model.embedding.scale, weights.decoder,
        weights.packed, weights.output, model.decoder.layers[0].feed_forward_norm.norm.eps,
        state.memory_k, state.memory_v, _flat_memory_bias(state), bos_id, setup.limits,
        setup.penalty, *setup.finished, eos_id, nbest)


def _flat_memory_bias(state: DecodingState) -> Tensor | None:
    return None if state.memory_bias is None else state.memory_bias.flatten(1)


def step_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None) -> Tensor:
    """Attention (eq. 1) for a decoding step: q (G, h, R, d_k), the R query rows of group g over
    its keys k (G, h, L, d_k) and values v (G, h, L, d_v), bias (G, 1, 1, L) additive (0 or -inf)
    or None. Its scores are a handful of rows, where the fused training op's checks and dispatch
    cost more than the arithmetic: on CPU it is one call into fastattn._C (float32, float64),
    elsewhere the explicit product."""
    scale = q.shape[-1] ** -0.5
    if NATIVE_STEP_ATTENTION and q.device.type == "cpu" and q.dtype in (torch.float32,
                                                                         torch.float64):
        flat_bias = None if bias is None else bias.view(bias.shape[0], -1)
        return torch.ops.fastattn.decode_attention(q, k, v, flat_bias, scale)
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    if bias is not None:
        scores = scores + bias
    return torch.matmul(scores.softmax(dim=-1), v)



class CacheShape(Protocol):
    """What the self-attention caches' shape takes from a fastattn.model.TransformerConfig."""

    @property
    def decoder_layers(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def key_dim(self) -> int: ...
    @property
    def value_dim(self) -> int: ...


class DecodingState:
    """What decode_step keeps between positions: per decoder layer the encoder keys and values
    (B, h, S, d) of each live sentence, their padding as an additive bias (B, 1, 1, S) (None
    without padding), and the self-attention caches self_k (layers, rows, h, capacity, d_k) and
    self_v. Cache rows never move: step t writes row n's key and value into cache row n at
    position t, and history (N, capacity) records for each row n and position j <= t the cache
    row history[n, j] that holds it, so that beam search's reordering copies N·t indices instead
    of the caches.
    `sentences` is None while the rows are grouped by sentence in memory order, r rows each
    (N = B·r, beam search's layout); otherwise the (N,) sentence of every row. `precision`
    (PRECISIONS) is what the native decoder computes in.

    The rows decode_step sees (N of them, any multiple of B on the first call, e.g. B·beam) map
    to sentences: row i of the first call belongs to sentence i // (N / B). ``reorder(rows)``
    (rows (N',) LongTensor: new row j continues old row rows[j]) reorders, duplicates or drops
    rows: the self-attention caches follow, and sentences no row refers to any more are dropped
    from the encoder memory. This is the step_fn of fastattn.beam_search::

        state = model.start_decoding(src)
        def step_fn(tokens, reorder):  # tokens (N, t), BOS first
            if reorder is not None:
                state.reorder(reorder)
            return model.decode_step(tokens[:, -1], state)
    """

    def __init__(self, memory_k: list[Tensor], memory_v: list[Tensor], memory_mask: Tensor,
                 capacity: int, precision: str = "fp32") -> None:
        check_precision(precision)
        self.precision = precision
        self.memory_k, self.memory_v = memory_k, memory_v
        self.memory_bias = _padding_bias(memory_mask, memory_k[0].dtype if memory_k else None)
        self.capacity = capacity
        self.self_k: Tensor | None = None
        self.self_v: Tensor | None = None
        self.history: Tensor | None = None
        self.sentences: Tensor | None = None
        self.length = 0
        self.native_weights: NativeWeights | None = None

    @property
    def num_sentences(self) -> int:
        return self.memory_k[0].shape[0]

    def start_position(self, rows: int, cfg: CacheShape, like: Tensor) -> None:
        """Readies position `length` for `rows` rows: the caches exist (allocated like `like` on
        the first call) and hold it, and history says each row writes its own cache row."""
        if self.self_k is None:
            self.allocate(rows, cfg, like)
        elif rows != self.history.shape[0]:
            raise ValueError(f"decode_step got {rows} tokens for {self.history.shape[0]} rows; "
                             "call state.reorder(rows) first")
        self.ensure_capacity(self.length + 1)
        self.history[:, self.length] = torch.arange(rows, device=self.history.device)

    def allocate(self, rows: int, cfg: CacheShape, like: Tensor) -> None:
        """Creates the caches for the first call: `rows` rows split evenly over the sentences."""
        if rows % self.num_sentences:
            raise ValueError(f"the first decode_step needs a multiple of the {self.num_sentences} "
                             f"sentences as rows, got {rows}")
        dtype = self.memory_k[0].dtype if self.memory_k else like.dtype
        shape = (cfg.decoder_layers, rows, cfg.heads, self.capacity)
        self.self_k = like.new_empty((*shape, cfg.key_dim), dtype=dtype)
        self.self_v = like.new_empty((*shape, cfg.value_dim), dtype=dtype)
        self.history = torch.empty(rows, self.capacity, dtype=torch.long, device=like.device)

    def ensure_capacity(self, length: int) -> None:
        if length <= self.capacity:
            return
        self.capacity = max(length, 2 * self.capacity)
        self.self_k, self.self_v = (_resized(c, self.capacity, self.length)
                                    for c in (self.self_k, self.self_v))
        history = self.history.new_empty((self.history.shape[0], self.capacity))
        history[:, : self.length] = self.history[:, : self.length]
        self.history = history

    @torch.inference_mode()
    def reorder(self, rows: Tensor) -> None:
        """rows (N',) LongTensor: new row j continues the current row rows[j]. Copies the
        history of cache rows, not the caches; drops the encoder memory of sentences left
        without rows."""
        if self.self_k is None:
            raise RuntimeError("reorder before the first decode_step: there are no rows yet")
        rows = rows.to(self.history.device)
        if len(rows) > self.self_k.shape[1]:  # more rows than cache rows: add some
            self.self_k, self.self_v = (_with_rows(c, len(rows), self.length)
                                        for c in (self.self_k, self.self_v))
        sentences = self._sentence_of_rows().index_select(0, rows)  # checks rows' range too
        history = self.history.new_empty((len(rows), self.capacity))
        torch.index_select(self.history[:, : self.length], 0, rows,
                           out=history[:, : self.length])
        self.history = history
        if self.num_sentences == 1 and len(rows) > 0:  # batch 1: every row reads sentence 0
            return
        live, sentences = torch.unique(sentences, return_inverse=True)
        if len(live) < self.num_sentences:  # finished sentences leave the batch
            self.memory_k = [k.index_select(0, live) for k in self.memory_k]
            self.memory_v = [v.index_select(0, live) for v in self.memory_v]
            if self.memory_bias is not None:
                self.memory_bias = self.memory_bias.index_select(0, live)
        per_sentence = len(rows) // len(live)
        grouped = torch.arange(len(live), device=rows.device).repeat_interleave(per_sentence)
        is_grouped = len(grouped) == len(rows) and torch.equal(grouped, sentences)
        self.sentences = None if is_grouped else sentences

    def _sentence_of_rows(self) -> Tensor:
        if self.sentences is not None:
            return self.sentences
        per_sentence = self.history.shape[0] // self.num_sentences
        device = self.memory_k[0].device
        return torch.arange(self.num_sentences, device=device).repeat_interleave(per_sentence)


def _padding_bias(mask: Tensor, dtype: torch.dtype | None) -> Tensor | None:
    """A bool padding mask (True = attend) as 0 / -inf to add to the scores; None without
    padding, so that attention skips masking altogether."""
    if bool(mask.all()):
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)


def gather_prefixes(cache: Tensor, history: Tensor) -> Tensor:
    """cache (rows, h, capacity, d), history (N, t) -> (N, h, t, d): row n's positions j < t,
    read from cache rows history[n, j]."""
    positions = torch.arange(history.shape[1], device=history.device)
    return cache[history, :, positions].transpose(1, 2)


def _with_rows(cache: Tensor, rows: int, length: int) -> Tensor:
    out = cache.new_empty((cache.shape[0], rows, *cache.shape[2:]))
    out[:, : cache.shape[1], :, :length] = cache[:, :, :, :length]
    return out


def _resized(cache: Tensor, capacity: int, length: int) -> Tensor:
    out = cache.new_empty((*cache.shape[:3], capacity, cache.shape[4]))
    out[:, :, :, :length] = cache[:, :, :, :length]
    return out

