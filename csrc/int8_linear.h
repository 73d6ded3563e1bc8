// int8 linear maps for decoding (precision="int8"), quantized as CTranslate2 does on CPU: each
// weight row (output feature) symmetric int8 with its own float32 scale, each activation row
// quantized the same way on the fly, the products summed exactly in int32 and scaled back:
//   y[n, o] = (Σ_d qx[n, d] · qw[o, d]) · (sx[n] · sw[o]) + bias[o],
//   sw[o] = max_d |w[o, d]| / 127, qw[o, d] = round(w[o, d] / sw[o]) in -127..127; sx alike.
// AVX-512 VNNI's vpdpbusd multiplies unsigned by signed bytes, so the activations are stored as
// qx + 128 (1..255) and 128 · Σ_d qw[o, d] is taken off each sum; AMX's tdpbusd (16 rows or more
// at the amx level) sums the same bytes, and AVX2's vpmaddubsw and a scalar loop the same
// integers.
#pragma once

#include "row_lse.h"

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace fastattn {

// The parts of a quantized weight, in this order in every list that holds them (quantize's
// result, the decoder's `packed`, the beam search's `output_packed`).
enum Int8Part : int64_t { kInt8Panels, kInt8Scales, kInt8Sums, kInt8Parts };

// weight (O, D) float32 -> (panels int8 (ceil(O / 16), ceil(D / 4), 16, 4), scales float32 (O),
// sums int32 (O)): qw[o, d] = panels[o / 16, d / 4, o % 16, d % 4], zero past O and D (one
// 64-byte vector holds 4 inputs of 16 outputs, vpdpbusd's operand); sums[o] = Σ_d qw[o, d].
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_linear_weight_cpu(
    const at::Tensor &weight);

// Rows `rows` (N,) int64 of the quantized weight as float32 (N, D): qw[row, :D] · sw[row], the
// int8 embedding's lookup.
at::Tensor dequantize_rows_cpu(const at::Tensor &panels, const at::Tensor &scales,
                               const at::Tensor &rows, int64_t D);

// x (N, D) float32 · wᵀ + bias -> (N, O) through the quantized weight (O = scales.size(0)).
at::Tensor linear_int8_cpu(const at::Tensor &x, const at::Tensor &panels,
                           const at::Tensor &scales, const at::Tensor &sums,
                           const std::optional<at::Tensor> &bias);
// The same into out (N, O), float32 contiguous: a decoding step reuses its buffers.
void linear_int8_out_cpu(const at::Tensor &x, const at::Tensor &panels, const at::Tensor &scales,
                         const at::Tensor &sums, const std::optional<at::Tensor> &bias,
                         at::Tensor &out);

// log_softmax(x · wᵀ) over the last dimension through the quantized weight: the int8 decoding
// step's output distribution; the softmax pass is float32 (row_lse.h).
at::Tensor log_softmax_linear_int8_cpu(const at::Tensor &x, const at::Tensor &panels,
                                       const at::Tensor &scales, const at::Tensor &sums);

// The same into out (N, O), float32 contiguous (a search reuses one buffer for every step).
void log_softmax_linear_int8_out_cpu(const at::Tensor &x, const at::Tensor &panels,
                                     const at::Tensor &scales, const at::Tensor &sums,
                                     at::Tensor &out);

// What a beam search reads of the same distribution (row_lse.h's OutputRows): each row's
// log-sum-exp and `top` largest logits, which are written nowhere.
OutputRows output_rows_int8_cpu(const at::Tensor &x, const at::Tensor &panels,
                                const at::Tensor &scales, const at::Tensor &sums, int top);

// The int8 dot product run at the instruction-set level in use (cpu_isa.h): "amx-int8" (AVX-512
// VNNI's below 16 rows), "avx512-vnni", "avx2" or "scalar".
std::string int8_kernel_cpu();

}  // namespace fastattn
