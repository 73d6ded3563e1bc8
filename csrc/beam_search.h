// One step of beam search bookkeeping: fastattn/search.py documents the algorithm and holds its
// PyTorch reference, beam_search_step_python, which these implementations match exactly.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace fastattn {

struct OutputRows;  // row_lse.h (not included: nvcc compiles this header too)

using StepResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// logprobs (N, V) float32, tokens (N, t) int64, scores (N,) float32 for the N = S * k live rows
// of the S unfinished `sentences` (int64); max_len (B,) int64 and penalty (max_len.max() + 1,)
// float64 over the whole batch. Appends finished hypotheses to finished_tokens (B, beam, L)
// int64, finished_scores (B, beam) float32, finished_lengths (B, beam) int64 and
// finished_count (B,) int64 in place. Returns (tokens (N', t + 1), scores, reorder, sentences).
#define FASTATTN_STEP_STATE_ARGS                                                               \
  const at::Tensor &tokens, const at::Tensor &scores, const at::Tensor &sentences,            \
      const at::Tensor &max_len, const at::Tensor &penalty, const at::Tensor &finished_tokens, \
      const at::Tensor &finished_scores, const at::Tensor &finished_lengths,                   \
      const at::Tensor &finished_count, int64_t eos_id, int64_t nbest
#define FASTATTN_STEP_ARGS const at::Tensor &logprobs, FASTATTN_STEP_STATE_ARGS

// Shapes, dtypes, devices and contiguity of the step's arguments; throws with the culprit's name.
void check_step_arguments(FASTATTN_STEP_ARGS);

StepResult beam_search_step_cpu(FASTATTN_STEP_ARGS);

// The same step reading each row's log-sum-exp and largest logits (the native search's output
// layer, row_lse.h), the rest of the arguments as above: bit for bit what the step returns on
// the rows' log-probabilities, each of which it computes only where the largest logits cannot
// settle the row's candidates (ties at their edge, a sentence's last position).
StepResult beam_search_step_rows_cpu(const OutputRows &output, FASTATTN_STEP_STATE_ARGS);
#ifdef FASTATTN_WITH_CUDA
StepResult beam_search_step_cuda(FASTATTN_STEP_ARGS);
#endif

}  // namespace fastattn
