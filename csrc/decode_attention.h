// Decoding on CPU: one step's attention, and one step of the whole post-norm decoder stack, each
// in one call, without the per-op overhead of a few-row step in Python.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace fastattn {

// out[g, h, r] = softmax_j(q[g, h, r] · k[i, h, j] * scale + bias[i, j]) v[i, h, j] over the keys
// j < L, where i = rows[g, j] when `rows` (G, L) int64 is given (the cache row that holds key j
// of group g: beam search's rows share prefixes without copying them), else i = g.
// q (G, H, R, Dk), k (P, H, >= L, Dk), v (P, H, >= L, Dv), all float32 or all float64, any
// strides with a unit last stride (P = G without rows); bias (P, >= L) or none; L is q's key
// count: k.size(2) without rows, rows.size(1) with. A row whose every score is -inf reads zeros.
// Returns (G, H, R, Dv), contiguous.
at::Tensor decode_attention_cpu(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                const std::optional<at::Tensor> &bias, double scale,
                                const std::optional<at::Tensor> &rows);

// One step of a post-norm decoder stack (Vaswani et al. 3.1) for x (N, d), the newest position
// `length` of N rows. Per layer l, `params` holds the kDecoderLayerSlots tensors of
// layer_slots.h in its order. Writes the position's self-attention keys and values into
// self_k[l][:, :, length] (layers, N', H, capacity, Dk) and self_v, and reads row n's earlier
// positions j from cache row history[n, j] (history (N, > length) int64, history[:, length] = n).
// memory_k[l] (B, H, S, Dk), memory_v[l] the encoder keys and values; memory_bias (B, S) additive
// or none; sentences (N,) the sentence of each row, or none when rows come grouped by sentence,
// N / B each. packed: empty, or per layer the 6 linear weights (qkv, out, cross q, cross out, W1,
// W2) as pack_linear_weight panels, used while N is small, or as quantize_linear_weight's
// kInt8Parts each (int8_linear.h) or pack_linear_weight_bf16's panels (bf16_linear.h): int8 and
// bf16 decoding, float32 x only. Returns the new x (N, d).
at::Tensor decoder_step_cpu(const at::Tensor &x, at::TensorList params, const at::Tensor &self_k,
                            const at::Tensor &self_v, const at::Tensor &history, int64_t length,
                            at::TensorList memory_k, at::TensorList memory_v,
                            const std::optional<at::Tensor> &memory_bias,
                            const std::optional<at::Tensor> &sentences, at::TensorList packed,
                            double eps);

}  // namespace fastattn
