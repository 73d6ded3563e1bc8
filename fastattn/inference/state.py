"""Decoding state: what fastattn.inference.Decoder keeps between positions of a search (the
encoder memory of each live sentence, the self-attention caches and which cache rows hold each
row's history), and how beam search's reordering of rows moves it.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["DecodingState", "gather_prefixes"]


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
    """What Decoder.step keeps between positions: per decoder layer the encoder keys and values
    (B, h, S, d) of each live sentence, their padding as an additive bias (B, 1, 1, S) (None
    without padding), and the self-attention caches self_k (layers, rows, h, capacity, d_k) and
    self_v. Cache rows never move: step t writes row n's key and value into cache row n at
    position t, and history (N, capacity) records for each row n and position j <= t the cache
    row history[n, j] that holds it, so that beam search's reordering copies N·t indices instead
    of the caches.
    `sentences` is None while the rows are grouped by sentence in memory order, r rows each
    (N = B·r, beam search's layout); otherwise the (N,) sentence of every row. `precision`
    (PRECISIONS) is what the native decoder computes in.

    The rows Decoder.step sees (N of them, any multiple of B on the first call, e.g. B·beam) map
    to sentences: row i of the first call belongs to sentence i // (N / B). ``reorder(rows)``
    (rows (N',) LongTensor: new row j continues old row rows[j]) reorders, duplicates or drops
    rows: the self-attention caches follow, and sentences no row refers to any more are dropped
    from the encoder memory. Decoder.step_fn(state), the step_fn of fastattn.beam_search,
    reorders the state before each step.
    """

    def __init__(self, memory_k: list[Tensor], memory_v: list[Tensor], memory_mask: Tensor,
                 capacity: int, precision: str = "fp32") -> None:
        self.precision = precision
        self.memory_k, self.memory_v = memory_k, memory_v
        self.memory_bias = _padding_bias(memory_mask, memory_k[0].dtype if memory_k else None)
        self.capacity = capacity
        self.self_k: Tensor | None = None
        self.self_v: Tensor | None = None
        self.history: Tensor | None = None
        self.sentences: Tensor | None = None
        self.length = 0
        # The NativeEngine that decodes these rows (fastattn.inference.native, which reads
        # this state), or None where the Python layers do.
        self.engine: Any = None

    def flat_memory_bias(self) -> Tensor | None:
        """The padding bias as the native ops take it, (B, S); None without padding."""
        return None if self.memory_bias is None else self.memory_bias.flatten(1)

    @property
    def num_sentences(self) -> int:
        return self.memory_k[0].shape[0]

    def start_position(self, rows: int, cfg: CacheShape, like: Tensor) -> None:
        """Readies position `length` for `rows` rows: the caches exist (allocated like `like` on
        the first call) and hold it, and history says each row writes its own cache row."""
        if self.self_k is None:
            self.allocate(rows, cfg, like)
        elif rows != self.history.shape[0]:
            raise ValueError(f"Decoder.step got {rows} tokens for {self.history.shape[0]} rows; "
                             "call state.reorder(rows) first")
        self.ensure_capacity(self.length + 1)
        self.history[:, self.length] = torch.arange(rows, device=self.history.device)

    def allocate(self, rows: int, cfg: CacheShape, like: Tensor) -> None:
        """Creates the caches for the first call: `rows` rows split evenly over the sentences."""
        if rows % self.num_sentences:
            raise ValueError(f"the first Decoder.step needs a multiple of the {self.num_sentences} "
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
            raise RuntimeError("reorder before the first Decoder.step: there are no rows yet")
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

