"""FLOP and bytes moved by one training step (forward, backward, Adam) of the Transformer, op by
op, as fastattn runs it: flash attention, fused residual LayerNorm with dropout, the output
projection fused with the loss. It gives the model FLOPs behind MFU and the roofline projection
of the step time on GPUs this machine does not have.

Counting rules (e = activation element size: 4 in fp32, 2 in mixed precision; gradients and Adam
state are fp32):
  linear T x in -> out   6 T in out FLOP (forward, dX, dW); bytes e(3 T in + 3 T out + 2 in out)
                         + 4 in out (fp32 dW)
  attention              4 B H Lq Lk Dh FLOP forward (half the pairs when causal), 2.5x that
                         backward; reads q, k, v, writes o (and the backward reads q, k, v, o, dO,
                         writes dq, dk, dv): e B (6 Lq d + 6 Lk d); never an (Lq, Lk) buffer
  residual LayerNorm     8 e per element forward + backward, dropout fused (bench_layer_norm)
  ReLU                   5 e per element of the d_ff hidden forward + backward
  embeddings             8 e per element (gather, scale, positions, dropout and their backward)
                         + 4 V d for the dense embedding gradient
  projection + loss      6 T d V_out FLOP (V_out: the output vocabulary); the weight read twice
                         and its fp32 gradient written; logits exist only chunk by chunk, but
                         each chunk goes through memory about 4 times (written, normalised in
                         place, read by the two matmuls)
  Adam                   28 bytes per parameter (read p, g, m, v; write p, m, v in fp32)
Data-parallel communication is not counted: one device's compute and memory traffic only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastattn.model import PRESETS, Transformer, TransformerConfig

# The paper's batch, 25k source + 25k target tokens over 8 GPUs, per GPU: 3125 + 3125 tokens,
# laid out as 125 sentences of 25 tokens each side (no padding).
SENTENCES, SRC_LEN, TGT_LEN = 125, 25, 25
PAPER_BATCH = f"{SENTENCES} sentences x ({SRC_LEN} source + {TGT_LEN} target) tokens"
# Seconds per training step on 8 P100 GPUs, the paper's section 5.2.
PAPER_STEP_SECONDS = {"base": 0.4, "big": 1.0}


@dataclass(frozen=True)
class Shape:
    """What the cost depends on: the model's widths and depths and the batch's lengths."""

    d_model: int
    d_ff: int
    heads: int
    encoder_layers: int
    decoder_layers: int
    vocab: int
    output_vocab: int
    parameters: int
    sentences: int
    src_len: int
    tgt_len: int


def preset_shape(preset: str, sentences: int, src_len: int, tgt_len: int) -> Shape:
    return config_shape(PRESETS[preset], sentences, src_len, tgt_len)


def config_shape(cfg: TransformerConfig, sentences: int, src_len: int, tgt_len: int) -> Shape:
    with torch.device("meta"):  # counts parameters without allocating them
        parameters = Transformer(cfg).num_parameters()
    return Shape(
        cfg.d_model,
        cfg.d_ff,
        cfg.heads,
        cfg.encoder_layers,
        cfg.decoder_layers,
        cfg.vocab_size,
        cfg.output_size,
        parameters,
        sentences,
        src_len,
        tgt_len,
    )


def paper_shape(preset: str) -> Shape:
    return preset_shape(preset, SENTENCES, SRC_LEN, TGT_LEN)


@dataclass(frozen=True)
class Op:
    name: str
    flop: float
    bytes: float
    matmul: bool  # runs on tensor cores in mixed precision


def _linear(name: str, tokens: int, d_in: int, d_out: int, e: int) -> Op:
    return Op(
        name,
        6 * tokens * d_in * d_out,
        e * (3 * tokens * d_in + 3 * tokens * d_out + 2 * d_in * d_out) + 4 * d_in * d_out,
        True,
    )


def _attention(name: str, s: Shape, lq: int, lk: int, causal: bool, e: int) -> Op:
    pairs = sum(min(i + 1, lk) for i in range(lq)) if causal else lq * lk
    flop = 3.5 * 4 * s.sentences * pairs * s.d_model  # heads x head dim = d_model
    return Op(name, flop, e * s.sentences * s.d_model * (6 * lq + 6 * lk), True)


def training_step(s: Shape, e: int) -> list[Op]:
    """The ops of one training step, summed over layers."""
    src, tgt = s.sentences * s.src_len, s.sentences * s.tgt_len
    d, f = s.d_model, s.d_ff
    per_encoder_layer = [
        _linear("q, k, v, out projections", src, d, 4 * d, e),
        _attention("self-attention", s, s.src_len, s.src_len, False, e),
        _linear("feed-forward", src, d, 2 * f, e),
        Op("ReLU", 0, 5 * e * src * f, False),
        Op("residual LayerNorm", 0, 2 * 8 * e * src * d, False),
    ]
    per_decoder_layer = [
        _linear("q, k, v, out projections", tgt, d, 4 * d, e),
        _attention("self-attention (causal)", s, s.tgt_len, s.tgt_len, True, e),
        _linear("cross-attention q, out", tgt, d, 2 * d, e),
        _linear("cross-attention k, v", src, d, 2 * d, e),
        _attention("cross-attention", s, s.tgt_len, s.src_len, False, e),
        _linear("feed-forward", tgt, d, 2 * f, e),
        Op("ReLU", 0, 5 * e * tgt * f, False),
        Op("residual LayerNorm", 0, 3 * 8 * e * tgt * d, False),
    ]
    ops = [Op("embeddings", 0, 8 * e * (src + tgt) * d + 4 * s.vocab * d, False)]
    for op in per_encoder_layer:
        ops.append(
            Op(
                f"encoder {op.name}",
                s.encoder_layers * op.flop,
                s.encoder_layers * op.bytes,
                op.matmul,
            )
        )
    for op in per_decoder_layer:
        ops.append(
            Op(
                f"decoder {op.name}",
                s.decoder_layers * op.flop,
                s.decoder_layers * op.bytes,
                op.matmul,
            )
        )
    ops.append(
        Op(
            "output projection + loss",
            6 * tgt * d * s.output_vocab,
            e * (2 * s.output_vocab * d + 2 * tgt * d + 4 * tgt * s.output_vocab)
            + 4 * s.output_vocab * d,
            True,
        )
    )
    ops.append(Op("Adam", 12 * s.parameters, 28 * s.parameters, False))
    return ops


def model_flop(s: Shape) -> float:
    """FLOP of one training step (no recomputation counted): the numerator of MFU."""
    return sum(op.flop for op in training_step(s, 4))


def roofline_seconds(
    s: Shape, *, matmul_flop_per_s: float, other_flop_per_s: float, bytes_per_s: float, e: int
) -> float:
    """Lower bound on the step time: each op takes the longer of its compute at peak and its
    memory traffic at peak bandwidth; ops run one after another."""
    return sum(
        max(
            op.flop / (matmul_flop_per_s if op.matmul else other_flop_per_s), op.bytes / bytes_per_s
        )
        for op in training_step(s, e)
    )
