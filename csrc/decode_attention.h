// Attention for one decoding step on CPU, fused: the scores, softmax and weighted sum of a few
// query rows over cached keys in one pass, without the per-call overhead of batched matmuls.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace fastattn {

// out[g, h, r] = softmax_j(q[g, h, r] · k[g, h, j] * scale + bias[g, j]) v[g, h, j] over the keys
// j < L of group g. q (G, H, R, Dk), k (G, H, L, Dk), v (G, H, L, Dv), all float32 or all
// float64, any strides with a unit last stride; bias (G, L) of the same dtype or none.
// A row whose every score is -inf reads zeros. Returns (G, H, R, Dv), contiguous.
at::Tensor decode_attention_cpu(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                const std::optional<at::Tensor> &bias, double scale);

}  // namespace fastattn
