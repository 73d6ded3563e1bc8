// bfloat16 linear maps for decoding (precision="bf16"): the weights rounded to bfloat16 once, each
// activation row rounded on the fly, products summed in float32 by AVX-512 BF16's vdpbf16ps (two
// pairs per lane and instruction), by AVX2 float32 multiply-adds or a scalar loop of the same
// sums in the same order elsewhere; at the amx level, from 16 rows, by AMX's tdpbf16ps:
//   y[n, o] = Σ_d bf16(x[n, d]) · bf16(w[o, d]) + bias[o].
#pragma once

#include "row_lse.h"

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace fastattn {

// weight (O, D) float32 -> panels bfloat16 (ceil(O / 16), ceil(D / 2), 16, 2):
// bf16(w[o, d]) = panels[o / 16, d / 2, o % 16, d % 2], zero past O and D (one 64-byte vector
// holds 2 inputs of 16 outputs, vdpbf16ps's operand).
at::Tensor pack_linear_weight_bf16_cpu(const at::Tensor &weight);

// Rows `rows` (N,) int64 of the packed weight as float32 (N, D): the bf16 embedding's lookup.
at::Tensor unpack_rows_bf16_cpu(const at::Tensor &panels, const at::Tensor &rows, int64_t D);

// x (N, D) float32 · wᵀ + bias -> (N, out_features) through the packed weight.
at::Tensor linear_bf16_cpu(const at::Tensor &x, const at::Tensor &panels,
                           const std::optional<at::Tensor> &bias, int64_t out_features);
// The same into out (N, out_features), float32 contiguous: a decoding step reuses its buffers.
void linear_bf16_out_cpu(const at::Tensor &x, const at::Tensor &panels,
                         const std::optional<at::Tensor> &bias, at::Tensor &out);

// log_softmax(x · wᵀ) into out (N, O), float32 contiguous, O = out.size(1) (row_lse.h).
void log_softmax_linear_bf16_out_cpu(const at::Tensor &x, const at::Tensor &panels,
                                     at::Tensor &out);

at::Tensor log_softmax_linear_bf16_cpu(const at::Tensor &x, const at::Tensor &panels,
                                       int64_t out_features);

// What a beam search reads of the same distribution over O outputs (row_lse.h's OutputRows):
// each row's log-sum-exp and `top` largest logits, which are written nowhere.
OutputRows output_rows_bf16_cpu(const at::Tensor &x, const at::Tensor &panels, int64_t O,
                                int top);

// The bf16 dot product run at the instruction-set level in use (cpu_isa.h): "amx-bf16" (AVX-512
// BF16's below 16 rows), "avx512-bf16", "avx2" or "scalar".
std::string bf16_kernel_cpu();

}  // namespace fastattn
