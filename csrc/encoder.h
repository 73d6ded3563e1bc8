// The encoder of decoding on CPU, in one call: at batch 1 the Python modules' glue cost more
// than the encoder's arithmetic, and it held the GIL that parallel decoding workers share.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

namespace fastattn {

// The post-norm encoder stack of fastattn.model.Transformer (Vaswani et al. 3.1) for src (B, S)
// int64 token ids, then each decoder layer's projection of its output into keys and values.
// x = embedding[src] · embedding_scale + positions (S, d); per layer l, with the
// kEncoderLayerSlots tensors of layer_slots.h in params, x = LayerNorm(x + SelfAttention(x))
// (heads of key_dim; the value width is what the qkv weight leaves) over the keys that are not
// pad_id, then x = LayerNorm(x + W2 relu(W1 x + b1) + b2). memory_params holds each decoder
// layer's memory projection (weight (H·Dk + H·Dv, d), bias).
// The same ATen ops in the same order as the Python modules, so float32 and float64 results
// equal theirs bit for bit. packed and memory_packed: empty (float32, float64), or the linear
// maps' int8 weights (quantize_linear_weight's kInt8Parts each: per layer qkv, out, W1, W2; per
// decoder layer its memory projection) or bf16 panels (pack_linear_weight_bf16's, one each):
// int8 and bf16 decoding, float32 only.
// Returns memory_k[l] (B, H, S, Dk) and memory_v[l] (B, H, S, Dv), views into one projection
// each, and the padding mask (B, 1, 1, S), true at real tokens.
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor> transformer_encode_cpu(
    const at::Tensor &src, const at::Tensor &embedding, const at::Tensor &positions,
    double embedding_scale, int64_t pad_id, int64_t heads, int64_t key_dim,
    at::TensorList params, at::TensorList packed, at::TensorList memory_params,
    at::TensorList memory_packed, double eps);

}  // namespace fastattn
