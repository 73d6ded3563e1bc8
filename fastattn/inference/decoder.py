"""Incremental decoding of a fastattn.model.Transformer: fastattn.Decoder.

    decoder = Decoder(model, precision="fp32")
    hypotheses = decoder.beam_search(src, beam_size=4, bos_id=BOS, eos_id=EOS, max_len=60)
    state = decoder.start(src)                      # or step by step: the encoder once,
    logprobs = decoder.step(tokens, state)          # then one position of every row per call
    state.reorder(rows)                             # between steps (DecodingState)

Two engines step a decoder, to the same result: the native engine (fastattn.inference.native,
fastattn._C on CPU: the whole stack in one call per step, or the whole search in one call),
which a converter builds from the model's weights by name and the Decoder keeps; and the Python
layers' steps below, which read the model's modules (a model or device the native engine does
not cover, native.supports). The model itself knows nothing of decoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fastattn.inference import native
from fastattn.inference.native import NativeEngine, check_precision, convert, weights_key
from fastattn.inference.search import (
    BeamSearchSetup,
    Hypothesis,
    LengthPenalty,
    StepFn,
    beam_search,
    check_special_ids,
    greedy_search,
)
from fastattn.inference.state import DecodingState, gather_prefixes
from fastattn.model import CrossAttention, DecoderLayer, SelfAttention, Transformer
from fastattn.ops.attention import attention_probabilities
from fastattn.tokens import check_token_range, check_tokens, range_checked

__all__ = ["Decoder", "encode", "step_attention"]


class Decoder:
    """Decodes a Transformer in one of fastattn.inference.native.PRECISIONS: "int8" and "bf16"
    need the native CPU engine (a model or device it does not cover raises ValueError at
    start). The native engine's packed or quantized weights are built once per Decoder, and
    again when a weight changed in place (its version); a weight written without a version bump
    (fused optimisers do) needs a new Decoder. Decoding is inference: no dropout, no
    gradients."""

    def __init__(self, model: Transformer, precision: str = "fp32") -> None:
        check_precision(precision)
        self.model, self.precision = model, precision
        self._engine: tuple[tuple, NativeEngine] | None = None

    def engine(self) -> NativeEngine | None:
        """The native engine for the model's weights as they are now, or None where the Python
        layers decode (fp32 only; other precisions raise ValueError)."""
        reason = native.supports(self.model, self.model.embedding.weight, self.precision)
        if reason is not None:
            if self.precision != "fp32":
                raise ValueError(f"precision {self.precision} needs fastattn._C's CPU decoder: "
                                 f"{reason}")
            return None
        key = weights_key(self.model)
        if self._engine is None or self._engine[0] != key:
            self._engine = key, convert(self.model, self.precision)
        return self._engine[1]

    @torch.inference_mode()
    def start(self, src: Tensor, capacity: int | None = None) -> DecodingState:
        """Encodes src (B, S) once and returns the state for step (DecodingState says how its
        rows map to sentences and reorder). The encoder keys and values of every decoder layer
        are computed here, once per sentence (not per beam). `capacity` is the number of
        positions preallocated per row (default S + 50, the paper's maximum output length); the
        caches grow when a longer output needs it."""
        model = self.model
        if model.training:
            raise RuntimeError("decoding is inference: call model.eval() first")
        engine = self.engine()
        if not range_checked(src):  # GPUs check here, once per search, not in training steps
            check_tokens("src", src, model.cfg.vocab_size)
            check_token_range("src", src, model.cfg.vocab_size)
        if engine is not None and native.NATIVE_ENCODE:
            memory_k, memory_v, mask = engine.encode(src)
        else:
            memory_k, memory_v, mask = encode(model, src)
        state = DecodingState(memory_k=memory_k, memory_v=memory_v, memory_mask=mask,
                              capacity=capacity or src.shape[1] + 50, precision=self.precision)
        state.engine = engine
        return state

    @torch.inference_mode()
    def step(self, tokens: Tensor, state: DecodingState) -> Tensor:
        """tokens (N,): the newest token of every row (BOS on the first call), at position
        state.length -> log-probabilities (N, cfg.output_size) of the next token. Costs
        O(length): earlier positions are read from the caches, not recomputed."""
        model = self.model
        if range_checked(tokens):
            check_token_range("tokens", tokens, model.cfg.vocab_size)
        state.start_position(tokens.shape[0], model.cfg, model.embedding.weight)
        if state.precision == "fp32":
            x = model.embedding(tokens.unsqueeze(1), start=state.length).squeeze(1)
        else:
            x = state.engine.embed(tokens, state.length)
        if state.engine is not None and native.NATIVE_DECODER_STEP:
            return state.engine.step(x, state)
        for i, layer in enumerate(model.decoder.layers):
            x = decoder_layer_step(layer, x, state, i)
        if model.decoder.final_norm is not None:
            x = model.decoder.final_norm(x)
        state.length += 1
        return torch.log_softmax(F.linear(x, model.output_weight).float(), dim=-1)

    def step_fn(self, state: DecodingState) -> StepFn:
        """The step_fn of fastattn.inference.search over this decoder from `state`: it applies
        the search's reorder to the state, then steps the prefixes' newest tokens."""
        def step(tokens: Tensor, reorder: Tensor | None) -> Tensor:
            if reorder is not None:
                state.reorder(reorder)
            return self.step(tokens[:, -1], state)
        return step

    @torch.inference_mode()
    def beam_search(self, src: Tensor, *, beam_size: int = 4, bos_id: int, eos_id: int,
                    max_len: int | Tensor, alpha: float = 0.6,
                    length_penalty: LengthPenalty = "gnmt", nbest: int = 1
                    ) -> list[list[Hypothesis]]:
        """fastattn.beam_search of src (B, S) over the cached decoder: each sentence's nbest
        hypotheses, best first. With the native engine the whole search is one call
        (fastattn::transformer_beam_search), else beam_search over step; both give the same
        tokens and scores."""
        cfg = self.model.cfg
        check_special_ids(bos_id, eos_id, cfg.vocab_size, cfg.output_size)
        setup = BeamSearchSetup.create(src.shape[0], beam_size, nbest, max_len, alpha,
                                       length_penalty, src.device)
        if src.shape[0] == 0:
            return []
        state = self.start(src, capacity=int(setup.limits.max()))
        if state.engine is not None and native.NATIVE_BEAM_SEARCH:
            state.engine.beam_search(state, setup, bos_id, eos_id, nbest)
            return setup.best(nbest)
        return beam_search(self.step_fn(state), src.shape[0], beam_size=beam_size, bos_id=bos_id,
                           eos_id=eos_id, max_len=setup.limits, alpha=alpha,
                           length_penalty=length_penalty, nbest=nbest)

    @torch.inference_mode()
    def greedy_search(self, src: Tensor, *, bos_id: int, eos_id: int, max_len: int | Tensor,
                      alpha: float = 0.6, length_penalty: LengthPenalty = "gnmt"
                      ) -> list[Hypothesis | None]:
        """fastattn.greedy_search of src (B, S) over step (beam_search with beam_size 1 gives
        the same tokens and scores)."""
        limits = max_len if isinstance(max_len, Tensor) else torch.full(
            (src.shape[0],), max_len, dtype=torch.long, device=src.device)
        state = self.start(src, capacity=int(limits.max()) if len(limits) else None)
        return greedy_search(self.step_fn(state), src.shape[0], bos_id=bos_id, eos_id=eos_id,
                             max_len=limits, alpha=alpha, length_penalty=length_penalty)


# -- the Python layers' steps ---------------------------------------------------------------------


def encode(model: Transformer, src: Tensor) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """Decoding's start in the Python modules: src (B, S) -> each decoder layer's keys and
    values of the encoder output, (B, h, S, d), and the padding mask (B, 1, 1, S), as
    NativeEngine.encode computes them."""
    memory, mask = model.encode(src)
    pairs = [layer.cross_attention.split_kv(layer.cross_attention.kv(memory))
             for layer in model.decoder.layers]
    return [k for k, _ in pairs], [v for _, v in pairs], mask


def decoder_layer_step(layer: DecoderLayer, x: Tensor, state: DecodingState, i: int) -> Tensor:
    """Decoder layer i's step: x (N, d_model), the newest position of every row ->
    (N, d_model), as DecoderLayer.forward computes that position."""
    k, v = state.self_k[i], state.self_v[i]
    history = state.history[:, : state.length + 1]
    x = layer.self_attention_norm(x, lambda h: self_attention_step(
        layer.self_attention, h, k, v, history))
    x = layer.cross_attention_norm(x, lambda h: cross_attention_step(
        layer.cross_attention, h, state.memory_k[i], state.memory_v[i], state.memory_bias,
        state.sentences))
    return layer.feed_forward_norm(x, layer.feed_forward)


def self_attention_step(attention: SelfAttention, x: Tensor, cache_k: Tensor, cache_v: Tensor,
                        history: Tensor) -> Tensor:
    """x (N, d_model) at position t = history.shape[1] - 1; stores its key and value in cache
    row n (caches (rows, h, capacity, d)) at t and attends to row n's positions j <= t, held by
    cache rows history[n, j] -> (N, d_model), as SelfAttention.forward."""
    q, k, v = F.linear(x, attention.qkv.weight, attention.qkv.bias).split(attention.split, dim=-1)
    n, t, heads = x.shape[0], history.shape[1] - 1, attention.heads
    cache_k[:n, :, t] = k.view(n, heads, -1)
    cache_v[:n, :, t] = v.view(n, heads, -1)
    out = step_attention(q.view(n, heads, 1, -1), gather_prefixes(cache_k, history),
                         gather_prefixes(cache_v, history))
    return attention.out(out.view(n, -1))


def cross_attention_step(attention: CrossAttention, x: Tensor, k: Tensor, v: Tensor,
                         bias: Tensor | None, sentences: Tensor | None) -> Tensor:
    """x (N, d_model) over per-sentence keys k (B, h, S, d_k), values and additive padding bias
    (B, 1, 1, S). Rows grouped by sentence (sentences=None, N = B·r) attend as r queries of
    their sentence, with no copy of k and v; otherwise row i reads sentence sentences[i]."""
    n, heads = x.shape[0], attention.heads
    q = F.linear(x, attention.q.weight, attention.q.bias)
    if sentences is None:
        q = q.view(k.shape[0], -1, heads, k.shape[-1]).transpose(1, 2)  # (B, h, r, d_k)
    else:
        q = q.view(n, heads, 1, -1)
        k, v = k[sentences], v[sentences]
        bias = None if bias is None else bias[sentences]
    out = step_attention(q, k, v, bias)
    return attention.out(out.transpose(1, 2).reshape(n, -1))


def step_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None) -> Tensor:
    """Attention (eq. 1) for a decoding step: q (G, h, R, d_k), the R query rows of group g over
    its keys k (G, h, L, d_k) and values v (G, h, L, d_v), bias (G, 1, 1, L) additive (0 or -inf)
    or None. Its scores are a handful of rows, where the fused training op's checks and dispatch
    cost more than the arithmetic: on CPU it is one call into fastattn._C (float32, float64),
    elsewhere the explicit product (ops.attention.attention_probabilities: a row with no key
    reads zeros, as in the native op)."""
    if native.NATIVE_STEP_ATTENTION and q.device.type == "cpu" and q.dtype in (torch.float32,
                                                                                torch.float64):
        flat_bias = None if bias is None else bias.view(bias.shape[0], -1)
        return torch.ops.fastattn.decode_attention(q, k, v, flat_bias, q.shape[-1] ** -0.5)
    return attention_probabilities(q, k, attn_mask=bias) @ v
