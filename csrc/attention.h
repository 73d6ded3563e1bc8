// Scaled dot-product attention with its backward on CPU, for training: the float32 and bfloat16
// CPU implementation behind kernels/attention.py's attention when a gradient is needed. PyTorch
// runs it as about ten batched ops, each a pass over memory and a dispatch; here each (batch,
// head) pair is worked on whole, its rows in cache and in float32, one pair per task.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace fastattn {

// For q (B, H, Lq, D), k and v (B, H, Lk, D), all float32 or all bfloat16 with unit last stride:
//   s_ij = q_i · k_j * scale + bias_ij, with s_ij = -inf where causal and j > i + causal_shift,
//   out_i = sum_j softmax_j(s_i) z_ij v_j,   lse_i = log sum_j e^(s_ij),
// z_ij = keep_ij / (1 - dropout_p), keep drawn by dropout.h's Dropout(seed, dropout_p) at row
// (b H + h) Lq + i, column j (z = 1 without dropout). bias: float32, any strides (0 for broadcast
// dims) over (B, H, Lq, Lk), or none. A row whose every score is -inf gets out_i = 0 and lse_i =
// +inf, so its gradients are 0. Returns out (B, H, Lq, D) in q's dtype, laid out as (B, Lq, H, D)
// so that merging the heads is a view, and lse (B, H, Lq) float32, contiguous.
std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(const at::Tensor &q, const at::Tensor &k,
                                                     const at::Tensor &v,
                                                     const std::optional<at::Tensor> &bias,
                                                     bool causal, int64_t causal_shift,
                                                     double scale, double dropout_p,
                                                     int64_t seed);

// The gradients (dq, dk, dv) of sum(out * grad_out), from the forward's out and lse and the same
// dropout mask, redrawn from the seed:
//   p_ij = e^(s_ij - lse_i),  dv_j = sum_i p_ij z_ij do_i,
//   ds_ij = p_ij (z_ij do_i · v_j - do_i · out_i),
//   dq_i = scale sum_j ds_ij k_j,  dk_j = scale sum_i ds_ij q_i.
// Each (batch, head) pair owns its dq, dk, dv rows: no atomics, no reduction across tasks.
// Returns them in q's dtype, laid out as (B, L, H, D) like out.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(
    const at::Tensor &grad_out, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
    const at::Tensor &out, const at::Tensor &lse, const std::optional<at::Tensor> &bias,
    bool causal, int64_t causal_shift, double scale, double dropout_p, int64_t seed);

}  // namespace fastattn
