// Label-smoothed cross-entropy and its gradient on a chunk of logits, for CPU training: the
// float32 and bfloat16 CPU implementation inside kernels/cross_entropy.py's linear_cross_entropy.
// PyTorch needs five passes over the chunk (log_softmax, sum, exp, scale, shift); here each row
// is read twice and written once while it sits in cache, and computed in float32.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace fastattn {

// logits (N, V) float32 or bfloat16 with unit column stride, target (N,) int64, row_weight (N,)
// float32.
// Overwrites logits with d(sum_r row_weight_r loss_r) / dlogits and returns fp32 per-row
// (loss, nll), where with ε = smoothing and lse the row's log-sum-exp
//   nll = lse - x_t,   loss = (1 - ε) nll + ε (lse - mean_j x_j),
//   grad_j = w (softmax_j - ε / V - (1 - ε) [j = t]).
// Rows whose target is ignore_index get zero loss, nll and gradient.
std::tuple<at::Tensor, at::Tensor> cross_entropy_grad_cpu(const at::Tensor &logits,
                                                         const at::Tensor &target,
                                                         const at::Tensor &row_weight,
                                                         double smoothing, int64_t ignore_index);

}  // namespace fastattn
