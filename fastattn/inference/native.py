"""The native decoding engine: fastattn._C's encoder, decoder step and whole beam search (CPU), run
on weights a converter takes from a fastattn.model.Transformer by name, as CTranslate2's
converters do. `convert(model, precision)` maps each parameter name of the slots below to its
place in the engine's weight lists (csrc/layer_slots.h names the same slots) and packs or
quantizes the linear maps; the NativeEngine it returns owns those weights.

The engine computes in one of PRECISIONS: "fp32"; "int8", where the decoder's linear maps, the
target embedding and the output projection use int8 weights (one scale per output feature) and
int8 activations (one scale per row), with int32 sums (csrc/int8_linear.h); or "bf16", the same
maps with bfloat16 weights and activations and float32 sums (csrc/bf16_linear.h). Where the
native decoder runs, the encoder does too (NativeEngine.encode: one call of
fastattn::transformer_encode, op for op the Python modules' computation, which releases the GIL
for parallel workers); in int8 and bf16 its linear maps and the decoder's projections of its
output into keys and values run in that precision too. The embeddings' lookups for the source,
attention, LayerNorm and the log-softmax stay float32. `supports` is the one rule for where the
engine runs; a model it refuses is decoded by the Python layers (fastattn.inference.decoder), to
the same result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor, nn

from fastattn._native import native
from fastattn.tokens import check_tokens

if TYPE_CHECKING:
    from fastattn.inference.search import BeamSearchSetup
    from fastattn.inference.state import DecodingState
    from fastattn.model import Transformer

__all__ = ["DECODER_LAYER_SLOTS", "ENCODER_LAYER_SLOTS", "PRECISIONS", "NativeEngine",
           "NativeWeights", "check_precision", "convert", "supports", "weights_key"]

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


def supports(model: Transformer, like: Tensor, precision: str = "fp32") -> str | None:
    """None when the engine computes `model`'s decoder for tensors like `like` (its device and
    dtype) exactly as the Python layers do (fp32), or in int8 or bf16; otherwise the reason it
    does not, and the caller decodes in Python (fp32) or refuses (int8 and bf16, which only the
    engine computes). The engine's decoder is the paper's: post-norm layers, ReLU, on CPU in
    float32 or float64; int8 and bf16 for float32 models."""
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


def convert(model: Transformer, precision: str = "fp32") -> NativeEngine:
    """The engine of `model` in `precision`, its weights mapped by name from the model's
    parameters: float32 linear maps as few-row panels (fastattn::pack_linear_weight; the
    encoder's run through at::linear as they are), int8 ones quantized
    (fastattn::quantize_linear_weight), bf16 ones as bfloat16 panels
    (fastattn::pack_linear_weight_bf16). The engine holds copies where it packs and the model's
    own tensors elsewhere (detached): a change of the model's weights needs a new engine
    (fastattn.inference.Decoder builds one when weights_key changes)."""
    check_precision(precision)
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
    cfg = model.cfg
    return NativeEngine(
        weights, precision, embedding=model.embedding.weight.detach(),
        output_weight=model.output_weight.detach(), positions=model.embedding.positions,
        scale=model.embedding.scale, eps=model.decoder.layers[0].feed_forward_norm.norm.eps,
        pad_id=cfg.pad_id, heads=cfg.heads, key_dim=cfg.key_dim, d_model=cfg.d_model,
        output_size=cfg.output_size)


def weights_key(model: nn.Module) -> tuple:
    """Changes when any weight does: in-place updates bump a tensor's _version. A walk of the
    modules' own parameter dicts: Module.parameters() cost a tenth of a batch-1 search."""
    key, modules = [], [model]
    while modules:
        module = modules.pop()
        key += [(p.data_ptr(), p._version) for p in module._parameters.values() if p is not None]
        modules += module._modules.values()
    return tuple(key)


class NativeEngine:
    """A Transformer's encoder and decoder in fastattn._C, on the weights `convert` gave it, in
    one of PRECISIONS. Its methods are the native forms of fastattn.inference.Decoder's: encode
    (the source once), embed (the newest tokens), step (the whole decoder stack and the output
    projection in one call: a few-row step is dominated by per-op overhead) and beam_search (the
    whole search in one call)."""

    def __init__(self, weights: NativeWeights, precision: str, *, embedding: Tensor,
                 output_weight: Tensor, positions: Callable[[int, int], Tensor], scale: float,
                 eps: float, pad_id: int, heads: int, key_dim: int, d_model: int,
                 output_size: int) -> None:
        self.weights, self.precision = weights, precision
        self.embedding, self.output_weight, self.positions = embedding, output_weight, positions
        self.scale, self.eps, self.pad_id = scale, eps, pad_id
        self.heads, self.key_dim, self.d_model, self.output_size = heads, key_dim, d_model, \
            output_size

    def encode(self, src: Tensor) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """src (B, S) -> each decoder layer's keys and values of the encoder output,
        (B, h, S, d), and the padding mask (B, 1, 1, S): one call of
        fastattn::transformer_encode, in the engine's precision."""
        check_tokens("src", src, len(self.embedding))
        w = self.weights
        memory_k, memory_v, mask = torch.ops.fastattn.transformer_encode(
            src, self.embedding, self.positions(0, src.shape[1]), self.scale, self.pad_id,
            self.heads, self.key_dim, w.encoder, w.encoder_packed, w.memory, w.memory_packed,
            self.eps)
        return memory_k, memory_v, mask

    def embed(self, tokens: Tensor, position: int) -> Tensor:
        """The newest tokens (N,) embedded at `position` from the packed embedding (int8, bf16):
        transformer_beam_search's op sequence."""
        output = self.weights.output
        if self.precision == "int8":
            x = torch.ops.fastattn.dequantize_rows(output[0], output[1], tokens, self.d_model)
        else:
            x = torch.ops.fastattn.unpack_rows_bf16(output[0], tokens, self.d_model)
        return x.mul(self.scale).add(self.positions(position, 1)[0])

    def step(self, x: Tensor, state: DecodingState) -> Tensor:
        """The decoder stack and output projection for x (N, d_model), the embedded newest
        position -> log-probabilities (N, output_size); advances state.length."""
        w = self.weights
        x = torch.ops.fastattn.decoder_step(
            x, w.decoder, state.self_k, state.self_v, state.history, state.length,
            state.memory_k, state.memory_v, state.flat_memory_bias(), state.sentences, w.packed,
            self.eps)
        state.length += 1
        # int8, bf16: the output projection is the packed embedding's first `rows` rows.
        rows, output = self.output_size, w.output
        if self.precision == "int8":
            panels, scales, sums = output
            return torch.ops.fastattn.log_softmax_linear_int8(
                x, panels[: -(-rows // 16)], scales[:rows], sums[:rows])
        if self.precision == "bf16":
            return torch.ops.fastattn.log_softmax_linear_bf16(x, output[0][: -(-rows // 16)],
                                                              rows)
        return torch.ops.fastattn.log_softmax_linear(x, self.output_weight,
                                                     output[0] if output else None).float()

    def beam_search(self, state: DecodingState, setup: BeamSearchSetup, bos_id: int,
                    eos_id: int, nbest: int) -> None:
        """The whole beam search as one call of fastattn::transformer_beam_search from a fresh
        `state`; the hypotheses land in `setup` (setup.best(nbest) reads them). The native search
        keeps its largest buffers (caches and logits, about 20 MB for 64 sentences of the
        multi30k model; sets over 256 MB are freed) for the next call on the same thread:
        allocating them afresh cost a tenth of a batch-64 search in page faults."""
        w = self.weights
        torch.ops.fastattn.transformer_beam_search(
            self.embedding, self.output_weight, self.positions(0, state.capacity), self.scale,
            w.decoder, w.packed, w.output, self.eps, state.memory_k, state.memory_v,
            state.flat_memory_bias(), bos_id, setup.limits, setup.penalty, *setup.finished,
            eos_id, nbest)
