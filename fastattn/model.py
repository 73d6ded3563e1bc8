"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), on fastattn's fused ops.

Read top to bottom: the configuration and its presets (the paper's base and big models, every
row of Table 3, small models for CPU), then one small module per piece of section 3, then the
encoder-decoder with its fused training loss. Decoding (search, translation) lives in the
inference wing, fastattn.inference, which this module never imports.

Token ids are (B, L) LongTensors padded with `pad_id` at the end; everything inside is batch
first (fastattn.tokens checks them). Section numbers refer to the paper.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastattn import fused_model, ops
from fastattn.autocast import batched_weight_casts
from fastattn.modules import ResidualLayerNorm
from fastattn.ops.attention import attention_probabilities, merge_heads, split_heads
from fastattn.tokens import check_loss_args, check_tokens, non_padding, rows

__all__ = ["PRESETS", "Transformer", "TransformerConfig"]


# -- Configuration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 37000  # one vocabulary shared by source and target (section 5.1)
    # Not the paper's: the softmax ranges over the first output_vocab_size pieces only (the
    # target language's, which the trainer numbers first); None: over the whole vocabulary.
    output_vocab_size: int | None = None
    encoder_layers: int = 6  # N
    decoder_layers: int = 6  # N
    d_model: int = 512
    d_ff: int = 2048
    heads: int = 8  # h
    d_k: int | None = None  # per head; None: d_model / h
    d_v: int | None = None  # per head; None: d_model / h
    dropout: float = 0.1  # P_drop, on sub-layer outputs and on embeddings + positions (5.4)
    label_smoothing: float = 0.1  # ε_ls (5.4)
    positions: str = "sinusoidal"  # or "learned" (Table 3 row E)
    max_len: int = 1024  # rows of the position table (sinusoids extend beyond it)
    pad_id: int = 0
    pre_norm: bool = False  # not the paper's: x + Dropout(Sublayer(LayerNorm(x)))
    attention_dropout: float = 0.0  # not in the paper: dropout on attention weights
    activation_dropout: float = 0.0  # not in the paper: dropout after the ReLU

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "encoder_layers", "decoder_layers", "d_model", "d_ff", "heads",
                 "max_len")
        for name in sizes + ("d_k", "d_v"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"TransformerConfig.{name} must be positive, got "
                                 f"{getattr(self, name)}")
        if (self.d_k is None or self.d_v is None) and self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by heads {self.heads}; "
                             "set d_k and d_v explicitly")
        if self.positions not in ("sinusoidal", "learned"):
            raise ValueError(f"positions must be 'sinusoidal' or 'learned', got {self.positions!r}")
        for name in ("dropout", "label_smoothing", "attention_dropout", "activation_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        output = self.output_vocab_size
        if output is not None and not 0 < output <= self.vocab_size:
            raise ValueError(f"output_vocab_size must be in [1, vocab_size {self.vocab_size}], "
                             f"got {self.output_vocab_size}")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id {self.pad_id} is outside the vocabulary "
                             f"[0, {self.vocab_size})")

    @property
    def output_size(self) -> int:
        """The number of pieces the output softmax ranges over: ids [0, output_size)."""
        return self.output_vocab_size or self.vocab_size

    @property
    def key_dim(self) -> int:
        return self.d_k or self.d_model // self.heads

    @property
    def value_dim(self) -> int:
        return self.d_v or self.d_model // self.heads


BASE = TransformerConfig()

# A plain dict: edit or add entries freely. Table 3 rows keep base's other values; in rows A and
# C d_k = d_v = d_model / h follows from the others, in row B d_v stays 64.
PRESETS: dict[str, TransformerConfig] = {
    "base": BASE,  # 65M parameters in Table 3
    "big": replace(BASE, d_model=1024, d_ff=4096, heads=16, dropout=0.3),  # 213M (0.1 for en-fr)
    "table3-A1": replace(BASE, heads=1),  # d_k = d_v = 512
    "table3-A2": replace(BASE, heads=4),  # 128
    "table3-A3": replace(BASE, heads=16),  # 32
    "table3-A4": replace(BASE, heads=32),  # 16
    "table3-B1": replace(BASE, d_k=16, d_v=64),
    "table3-B2": replace(BASE, d_k=32, d_v=64),
    "table3-C1": replace(BASE, encoder_layers=2, decoder_layers=2),
    "table3-C2": replace(BASE, encoder_layers=4, decoder_layers=4),
    "table3-C3": replace(BASE, encoder_layers=8, decoder_layers=8),
    "table3-C4": replace(BASE, d_model=256),  # d_k = d_v = 32
    "table3-C5": replace(BASE, d_model=1024),  # d_k = d_v = 128
    "table3-C6": replace(BASE, d_ff=1024),
    "table3-C7": replace(BASE, d_ff=4096),
    "table3-D1": replace(BASE, dropout=0.0),
    "table3-D2": replace(BASE, dropout=0.2),
    "table3-D3": replace(BASE, label_smoothing=0.0),
    "table3-D4": replace(BASE, label_smoothing=0.2),
    "table3-E": replace(BASE, positions="learned"),
    # CPU scale, not in the paper: the shape of the tiny Transformer published for Multi30k en-de
    # (4+4 layers, d_model 128, d_ff 256, 4 heads), with the dropout our CPU runs use (0.3).
    # vocab_size is set from the SentencePiece model.
    "multi30k": TransformerConfig(vocab_size=8000, encoder_layers=4, decoder_layers=4,
                                  d_model=128, d_ff=256, heads=4, dropout=0.3),
    "tiny": TransformerConfig(vocab_size=1000, encoder_layers=2, decoder_layers=2, d_model=64,
                              d_ff=128, heads=4, dropout=0.1),
}


# -- Building blocks, one per piece of section 3 ------------------------------------------------


def sinusoids(length: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i / d_model)), PE(pos, 2i + 1) = cos(...) (3.5)."""
    position = torch.arange(length, dtype=torch.float64).unsqueeze(1)
    frequency = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: d_model // 2])
    return table.float()


class Embedding(nn.Module):
    """Token embedding · √d_model + position, then dropout (3.4, 3.5, 5.4). The one matrix is
    shared by source, target and the pre-softmax projection (3.4); with an output vocabulary,
    the projection is its first output_vocab_size rows (Transformer.output_weight)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.dropout = cfg.dropout
        self.scale = math.sqrt(cfg.d_model)
        # Unit variance after scaling, as in tensor2tensor.
        self.weight = nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model) * cfg.d_model**-0.5)
        if cfg.positions == "learned":
            self.learned_positions = nn.Parameter(
                torch.randn(cfg.max_len, cfg.d_model) * cfg.d_model**-0.5
            )
        else:
            self.register_buffer("sinusoids", sinusoids(cfg.max_len, cfg.d_model),
                                 persistent=False)

    def positions(self, start: int, length: int) -> Tensor:
        """Rows start .. start + length - 1 of the position table, (length, d_model)."""
        table = getattr(self, "learned_positions", None)
        if table is None:
            table = self.sinusoids
            if start + length > len(table):  # sinusoids extrapolate (3.5)
                table = sinusoids(start + length, table.shape[1]).to(table.device)
        elif start + length > len(table):
            raise ValueError(f"position {start + length - 1} is beyond the {len(table)} learned "
                             "positions (TransformerConfig.max_len)")
        return table[start : start + length]

    def forward(self, tokens: Tensor, start: int = 0) -> Tensor:
        """tokens (B, L) -> (B, L, d_model), the first token at position `start`."""
        x = F.embedding(tokens, self.weight) * self.scale + self.positions(start, tokens.shape[1])
        return ops.dropout(x, self.dropout, self.training)


def attention(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """Attention(Q, K, V) = softmax(Q K^T / √d_k) V (eq. 1) through ops.attention, which takes
    d_k = d_v only: for Table 3 row B the narrower side is zero-padded, which changes neither the
    scores (the scale stays d_k^-0.5) nor the output (its padded columns are cut off)."""
    d_k, d_v = q.shape[-1], v.shape[-1]
    if d_k == d_v:
        return ops.attention(q, k, v, **kwargs)
    width = max(d_k, d_v)
    q, k, v = (F.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))
    return ops.attention(q, k, v, scale=d_k**-0.5, **kwargs)[..., :d_v]


class SelfAttention(nn.Module):
    """MultiHead(x, x, x) = Concat(head_1, ..., head_h) W^O with
    head_i = Attention(x W_i^Q, x W_i^K, x W_i^V) (3.2.2); the three projections are one matrix."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.heads, self.dropout = cfg.heads, cfg.attention_dropout
        self.split = (cfg.heads * cfg.key_dim, cfg.heads * cfg.key_dim, cfg.heads * cfg.value_dim)
        self.qkv = nn.Linear(cfg.d_model, sum(self.split))
        self.out = nn.Linear(cfg.heads * cfg.value_dim, cfg.d_model)

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """x (B, L, d_model), mask (B, 1, 1, L) bool True = attend -> (B, L, d_model)."""
        return self.out(self.concat(x, mask, causal))

    def concat(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """Concat(head_1, ..., head_h) (B, L, h·d_v)."""
        q, k, v = (split_heads(t, self.heads) for t in self.qkv(x).split(self.split, dim=-1))
        return merge_heads(attention(q, k, v, attn_mask=mask, causal=causal,
                                     dropout_p=self.dropout if self.training else 0.0))

    def weights(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """softmax(Q K^T / √d_k) of forward(x, mask, causal) explicitly: (B, h, L, L)."""
        q, k, _ = (split_heads(t, self.heads) for t in self.qkv(x).split(self.split, dim=-1))
        return attention_probabilities(q, k, attn_mask=mask, causal=causal)


class CrossAttention(nn.Module):
    """MultiHead(x, memory, memory) (3.2.3): decoder queries over the encoder output."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.heads, self.dropout = cfg.heads, cfg.attention_dropout
        self.split = (cfg.heads * cfg.key_dim, cfg.heads * cfg.value_dim)
        self.q = nn.Linear(cfg.d_model, cfg.heads * cfg.key_dim)
        self.kv = nn.Linear(cfg.d_model, sum(self.split))
        self.out = nn.Linear(cfg.heads * cfg.value_dim, cfg.d_model)

    def split_kv(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """The kv projection's output (B, S, h·(d_k + d_v)) -> keys (B, h, S, d_k) and values
        (B, h, S, d_v), as views."""
        k, v = kv.split(self.split, dim=-1)
        return split_heads(k, self.heads), split_heads(v, self.heads)

    def forward(self, x: Tensor, memory_kv: Tensor, memory_mask: Tensor | None) -> Tensor:
        """x (B, T, d_model), memory_kv the kv projection of the memory (B, S, h·(d_k + d_v)),
        keys then values, mask (B, 1, 1, S) -> (B, T, d_model)."""
        return self.out(self.concat(x, memory_kv, memory_mask))

    def concat(self, x: Tensor, memory_kv: Tensor, memory_mask: Tensor | None) -> Tensor:
        """Concat(head_1, ..., head_h) (B, T, h·d_v)."""
        return merge_heads(attention(split_heads(self.q(x), self.heads), *self.split_kv(memory_kv),
                                     attn_mask=memory_mask,
                                     dropout_p=self.dropout if self.training else 0.0))

    def weights(self, x: Tensor, memory_kv: Tensor, memory_mask: Tensor | None) -> Tensor:
        """softmax(Q K^T / √d_k) of forward(x, memory_kv, memory_mask) explicitly:
        (B, h, T, S)."""
        return attention_probabilities(split_heads(self.q(x), self.heads),
                                       self.split_kv(memory_kv)[0], attn_mask=memory_mask)


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 (eq. 2)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.dropout = cfg.activation_dropout
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(ops.dropout(F.relu(self.w1(x)), self.dropout, self.training))


class AddNorm(nn.Module):
    """"Add & Norm" around a sub-layer: LayerNorm(x + Dropout(Sublayer(x))) (3.1, 5.4), in one
    fused op. With pre_norm (not the paper's): x + Dropout(Sublayer(LayerNorm(x)))."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.pre_norm = cfg.pre_norm
        self.norm = ResidualLayerNorm(cfg.d_model, cfg.dropout)

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        if self.pre_norm:
            y = sublayer(F.layer_norm(x, x.shape[-1:], self.norm.weight, self.norm.bias))
            return x + ops.dropout(y, self.norm.dropout, self.training)
        return self.norm(sublayer(x), x)


class EncoderLayer(nn.Module):
    """Self-attention, then the feed-forward network, each inside Add & Norm (3.1)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attention = SelfAttention(cfg)
        self.self_attention_norm = AddNorm(cfg)
        self.feed_forward = FeedForward(cfg)
        self.feed_forward_norm = AddNorm(cfg)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = self.self_attention_norm(x, lambda h: self.self_attention(h, mask))
        return self.feed_forward_norm(x, self.feed_forward)


class DecoderLayer(nn.Module):
    """Masked self-attention, attention over the encoder output, then the feed-forward network,
    each inside Add & Norm (3.1)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attention = SelfAttention(cfg)
        self.self_attention_norm = AddNorm(cfg)
        self.cross_attention = CrossAttention(cfg)
        self.cross_attention_norm = AddNorm(cfg)
        self.feed_forward = FeedForward(cfg)
        self.feed_forward_norm = AddNorm(cfg)

    def forward(self, x: Tensor, memory_kv: Tensor, memory_mask: Tensor) -> Tensor:
        # Causal: position i sees positions <= i only (3.2.3). Target padding sits at the end,
        # so no real position ever sees it.
        x = self.self_attention_norm(x, lambda h: self.self_attention(h, causal=True))
        x = self.cross_attention_norm(x, lambda h: self.cross_attention(h, memory_kv,
                                                                        memory_mask))
        return self.feed_forward_norm(x, self.feed_forward)


class Stack(nn.Module):
    """N identical layers; pre-norm stacks end with one more LayerNorm."""

    def __init__(self, cfg: TransformerConfig, layer: type[nn.Module], n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer(cfg) for _ in range(n))
        self.final_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else None

    def forward(self, x: Tensor, *args, per_layer: Sequence = ()) -> Tensor:
        """x (B, L, d_model) -> the last layer's output; layer i is called with per_layer[i]
        (if given), then args."""
        for i, layer in enumerate(self.layers):
            x = layer(x, *((per_layer[i],) if per_layer else ()), *args)
        return x if self.final_norm is None else self.final_norm(x)


# -- The model --------------------------------------------------------------------------------


class Transformer(nn.Module):
    """The encoder-decoder of Figure 1 with tied embeddings (3.4).

    Training: ``model.loss(src, tgt_in, tgt_out)`` (the fused projection + label-smoothed loss,
    full logits never exist). Inference: ``model(src, tgt_in)`` gives logits; search and
    incremental decoding: ``fastattn.Decoder(model).beam_search(src, ...)`` (fastattn.inference).
    On a GPU, loss and logits run the same computation in fewer launches (hidden)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding = Embedding(cfg)
        self.encoder = Stack(cfg, EncoderLayer, cfg.encoder_layers)
        self.decoder = Stack(cfg, DecoderLayer, cfg.decoder_layers)
        for name, p in self.named_parameters():
            if name.endswith(".weight") and p.dim() == 2 and not name.startswith("embedding"):
                nn.init.xavier_uniform_(p)
            elif name.endswith(".bias") and not name.endswith("norm.bias"):
                nn.init.zeros_(p)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> Transformer:
        """A model from PRESETS[name] with fields replaced, e.g. vocab_size=8000."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls(replace(PRESETS[name], **overrides))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def padding_mask(self, src: Tensor) -> Tensor:
        """src (B, S) -> (B, 1, 1, S) bool, True at real tokens (the attention op's convention)."""
        return (src != self.cfg.pad_id)[:, None, None, :]

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) -> memory (B, S, d_model) and its padding mask (B, 1, 1, S)."""
        check_tokens("src", src, self.cfg.vocab_size)
        mask = self.padding_mask(src)
        return self.encoder(self.embedding(src), mask), mask

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_mask: Tensor) -> Tensor:
        """tgt_in (B, T), BOS first -> the decoder output (B, T, d_model)."""
        check_tokens("tgt_in", tgt_in, self.cfg.vocab_size)
        memory_kv = [layer.cross_attention.kv(memory) for layer in self.decoder.layers]
        return self.decoder(self.embedding(tgt_in), memory_mask, per_layer=memory_kv)

    def hidden(self, src: Tensor, tgt_in: Tensor, copy: bool = True) -> Tensor:
        """src (B, S), tgt_in (B, T) -> the decoder output (B, T, d_model): encode, then decode,
        with autocast's weight casts batched (fastattn.autocast). On a device where a launch
        costs, in fastattn.fused_model's launch-saving forms; there `copy` gives the output's
        copy in autocast's dtype where one exists, which the output projection reads."""
        groups = fused_model.weight_cast_groups(self)
        with batched_weight_casts(groups, src.device.type):
            if fused_model.applies(src):
                stream = fused_model.hidden(self, src, tgt_in)
                return stream.input if copy else stream.x
            return self.decode(tgt_in, *self.encode(src))

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, cfg.output_size) for the next tokens."""
        return F.linear(self.hidden(src, tgt_in), self.output_weight)

    @property
    def output_weight(self) -> Tensor:
        """The pre-softmax projection (output_size, d_model): the tied embedding's first rows."""
        weight = self.embedding.weight
        return weight if self.cfg.output_size == len(weight) else weight[:self.cfg.output_size]

    def loss(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, *, reduction: str = "mean",
             return_nll: bool = False, tokens: int | None = None, every_position: bool = False
             ) -> Tensor | tuple[Tensor, Tensor]:
        """The label-smoothed cross-entropy (ε_ls) of tgt_out (B, T), tgt_in shifted by one, over
        its non-padding tokens ("mean" per token or "sum"), projection and loss in one fused op:
        the logits never exist. return_nll: also the unsmoothed NLL (no gradient). `tokens`:
        tgt_out's non-padding count if known (spares a GPU a host sync). every_position: project
        padding too, which the loss ignores: shapes fixed by the batch's (CUDA graphs)."""
        check_loss_args(tgt_in, tgt_out, reduction, self.cfg.output_size, self.cfg.pad_id)
        hidden = self.hidden(src, tgt_in)
        if every_position:
            hidden, targets = hidden.flatten(0, 1), tgt_out.flatten()
        else:
            real = non_padding(tgt_out, self.cfg.pad_id, tokens)
            hidden, targets = rows(hidden, real), rows(tgt_out, real)
        return ops.linear_cross_entropy(hidden, self.output_weight, targets,
                                        smoothing=self.cfg.label_smoothing,
                                        ignore_index=self.cfg.pad_id, reduction=reduction,
                                        return_nll=return_nll)

    @torch.no_grad()
    def attention_weights(self, src: Tensor, tgt_in: Tensor) -> dict[str, list[Tensor]]:
        """The attention weights of every layer and head, for plots like the paper's Figures 3-5:
        {"encoder": encoder self-attention (B, h, S, S), "decoder": decoder self-attention
        (B, h, T, T), "cross": decoder over encoder (B, h, T, S)}, one tensor per layer."""
        captured: dict[str, list[Tensor]] = {"encoder": [], "decoder": [], "cross": []}

        def capture(kind: str) -> Callable:
            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                captured[kind].append(module.weights(*args, **kwargs))
            return hook

        modules = [("encoder", layer.self_attention) for layer in self.encoder.layers]
        for layer in self.decoder.layers:
            modules += [("decoder", layer.self_attention), ("cross", layer.cross_attention)]
        hooks = [m.register_forward_pre_hook(capture(k), with_kwargs=True) for k, m in modules]
        try:
            self.decode(tgt_in, *self.encode(src))  # the modules' own forward, on every device
        finally:
            for h in hooks:
                h.remove()
        return captured
