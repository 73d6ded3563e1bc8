// Linear layers for the few rows of a decoding step. ATen's GEMM (MKL) is built for many rows: for
// 1-16 rows it spends more time than reading the weight takes. Here the weight is stored once as
// panels of 16 output features, each panel (D, 16) contiguous, so a step streams it exactly once
// through 8-float vector multiply-adds.
#pragma once

#include "row_lse.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace fastattn {

// Whether the panel kernel beats ATen's GEMM (MKL) for x (rows, depth), which packs its weight at
// every call. Measured on one thread of a Zen 4 (the panels forced at every shape): with AVX-512
// and AVX2 the panels win at every decoder shape (1-256 rows, depth 128-2048; held to AVX2, since
// its halves leave their registers directly, 90-114 GFLOP/s against MKL's 80-102 from 64 rows,
// 42-107 against 19-75 below). The baseline level's 4-float panels (35 GFLOP/s) keep the rule
// measured before for AVX2: up to 32 rows and at depth 512 and more.
bool packed_linear_wins(int64_t rows, int64_t depth);

// weight (O, D) float32 -> panels (ceil(O / 16), D, 16), zero-padded past O.
at::Tensor pack_linear_weight_cpu(const at::Tensor &weight);

// x (N, D) @ weight.T + bias -> (N, O). Through `packed` (pack_linear_weight(weight)) when given,
// float32 and packed_linear_wins(N, D); otherwise at::linear.
at::Tensor linear_cpu(const at::Tensor &x, const at::Tensor &weight,
                      const std::optional<at::Tensor> &packed,
                      const std::optional<at::Tensor> &bias);

// The same into out (N, O), contiguous in x's dtype: a decoding step reuses its buffers.
void linear_out_cpu(const at::Tensor &x, const at::Tensor &weight,
                    const std::optional<at::Tensor> &packed,
                    const std::optional<at::Tensor> &bias, at::Tensor &out);

// log_softmax(x (N, D) @ weight.T) over the last dimension: the decoding step's output
// distribution. With `packed` and float32 the panels' pass keeps a running log-sum-exp per row
// (online softmax), so the N x vocabulary logits take one more pass, not three; otherwise ATen.
at::Tensor log_softmax_linear_cpu(const at::Tensor &x, const at::Tensor &weight,
                                  const std::optional<at::Tensor> &packed);

// The same into out (N, O), contiguous in x's dtype: a search reuses one buffer for every step,
// where a fresh N x vocabulary tensor each step costs page faults on every one of its pages.
void log_softmax_linear_out_cpu(const at::Tensor &x, const at::Tensor &weight,
                                const std::optional<at::Tensor> &packed, at::Tensor &out);

// What a beam search reads of log_softmax(x (N, D) @ weight.T), x float32, through `packed`:
// each row's log-sum-exp and its `top` largest logits (top <= RowTop::kMost), the logits written
// nowhere; a row's logits recomputed on request.
OutputRows output_rows_cpu(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &packed,
                           int top);

}  // namespace fastattn
