// One step of beam search on CUDA tensors: one block per sentence scans its beam x vocabulary
// candidates (each thread keeping its own sorted top list over a strided slice), merges the
// threads' lists into the sentence's top 2*beam, then finishes, back-fills and decides whether the
// sentence is done exactly as beam_search.cpp and search.py's reference do. Compaction of the
// surviving rows uses ATen's index_select.
#include "beam_search.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

namespace fastattn {

namespace {

constexpr int kThreads = 256;

struct Candidate {
  float score;
  int64_t index;  // beam * V + token within the sentence
};

// The order of every implementation: higher score first, ties by lower index.
__device__ __forceinline__ bool better(const Candidate &a, const Candidate &b) {
  return a.score > b.score || (a.score == b.score && a.index < b.index);
}

struct StepPointers {
  const float *logprobs;
  const int64_t *prefix;
  const float *prefix_score;
  const int64_t *sentence;
  const int64_t *limit_of;
  const double *penalty;
  int64_t *fin_tokens;
  float *fin_scores;
  int64_t *fin_lengths;
  int64_t *fin_count;
  int64_t *live_rows;
  int64_t *live_tokens;
  float *live_scores;
  bool *done;
  int *invalid;
};

struct StepSizes {
  int64_t vocab, t, k_in, beam, max_tokens, num_candidates, eos_id, nbest;
};

template <int kMaxCandidates>
__global__ void __launch_bounds__(kThreads) beam_search_step_kernel(StepPointers p, StepSizes n) {
  const int64_t i = blockIdx.x, first = i * n.k_in;
  const int64_t b = p.sentence[i], limit = p.limit_of[b];
  const bool last = limit == n.t;
  const Candidate none{-INFINITY, INT64_MAX};  // loses to every real candidate, even a -inf one

  // Score update and this thread's top list; at the last position only EOS may follow.
  Candidate mine[kMaxCandidates];
  int held = 0;
  bool valid = true;
  const float *lp = p.logprobs + first * n.vocab;
  for (int64_t j = threadIdx.x; j < n.k_in * n.vocab; j += kThreads) {
    const int64_t k = j / n.vocab, v = j - k * n.vocab;
    valid &= lp[j] <= 0.f;
    if (last && v != n.eos_id) continue;
    const float score = p.prefix_score[first + k] + lp[j];
    if (held == n.num_candidates && !(score > mine[held - 1].score)) continue;
    int at = held < n.num_candidates ? held++ : held - 1;
    for (; at > 0 && mine[at - 1].score < score; --at) mine[at] = mine[at - 1];
    mine[at] = Candidate{score, j};  // j grows along the scan: equal scores stay in index order
  }
  if (!valid) *p.invalid = 1;

  // Merge: each round the block's best head is the next candidate of the sentence.
  __shared__ Candidate top[kMaxCandidates];
  __shared__ Candidate best[kThreads];
  __shared__ int owner[kThreads];
  const int64_t num_real = min(n.num_candidates, last ? n.k_in : n.k_in * n.vocab);
  int head = 0;
  for (int r = 0; r < num_real; ++r) {
    best[threadIdx.x] = head < held ? mine[head] : none;
    owner[threadIdx.x] = threadIdx.x;
    __syncthreads();
    for (int stride = kThreads / 2; stride > 0; stride /= 2) {
      if (threadIdx.x < stride && better(best[threadIdx.x + stride], best[threadIdx.x])) {
        best[threadIdx.x] = best[threadIdx.x + stride];
        owner[threadIdx.x] = owner[threadIdx.x + stride];
      }
      __syncthreads();
    }
    if (threadIdx.x == owner[0]) ++head;
    if (threadIdx.x == 0) top[r] = best[0];
    __syncthreads();
  }

  // Finish EOS among the top beam, back-fill the live beams, decide whether the sentence is done.
  __shared__ int64_t finishing_row[kMaxCandidates], finishing_slot[kMaxCandidates];
  __shared__ int num_finishing;
  if (threadIdx.x == 0) {
    int64_t count = p.fin_count[b], num_live = 0;
    int finishing = 0;
    for (int j = 0; j < num_real; ++j) {
      const Candidate c = top[j];
      const int64_t token = c.index % n.vocab, row = first + c.index / n.vocab;
      if (token == n.eos_id) {
        if (j < n.beam && c.score > -INFINITY && count < n.beam) {
          finishing_row[finishing] = row;
          finishing_slot[finishing++] = count;
          p.fin_scores[b * n.beam + count] = static_cast<float>(c.score / p.penalty[n.t]);
          p.fin_lengths[b * n.beam + count] = n.t;
          ++count;
        }
      } else if (num_live < n.beam) {
        p.live_rows[i * n.beam + num_live] = row;
        p.live_tokens[i * n.beam + num_live] = token;
        p.live_scores[i * n.beam + num_live++] = c.score;
      }
    }
    for (; num_live < n.beam; ++num_live) {
      p.live_rows[i * n.beam + num_live] = first;
      p.live_tokens[i * n.beam + num_live] = n.eos_id;
      p.live_scores[i * n.beam + num_live] = -INFINITY;
    }
    p.fin_count[b] = count;
    num_finishing = finishing;

    float best_live = -INFINITY;
    for (int64_t k = 0; k < n.beam; ++k) best_live = fmaxf(best_live, p.live_scores[i * n.beam + k]);
    bool hopeless = false;
    if (count >= n.nbest) {
      float finished[kMaxCandidates];  // count <= beam <= kMaxCandidates / 2, sorted descending
      for (int64_t a = 0; a < count; ++a) {
        const float f = p.fin_scores[b * n.beam + a];
        int64_t at = a;
        for (; at > 0 && finished[at - 1] < f; --at) finished[at] = finished[at - 1];
        finished[at] = f;
      }
      const double most_penalty = fmax(p.penalty[min(limit, n.t + 1)], p.penalty[limit]);
      hopeless = finished[n.nbest - 1] >= static_cast<float>(best_live / most_penalty);
    }
    p.done[i] = count >= n.beam || last || best_live == -INFINITY || hopeless;
  }
  __syncthreads();

  for (int f = 0; f < num_finishing; ++f) {
    int64_t *out = p.fin_tokens + (b * n.beam + finishing_slot[f]) * n.max_tokens;
    const int64_t *in = p.prefix + finishing_row[f] * n.t;
    for (int64_t a = threadIdx.x; a < n.t - 1; a += kThreads) out[a] = in[a + 1];
    if (threadIdx.x == 0) out[n.t - 1] = n.eos_id;
  }
}

}  // namespace

StepResult beam_search_step_cuda(FASTATTN_STEP_ARGS) {
  check_step_arguments(logprobs, tokens, scores, sentences, max_len, penalty, finished_tokens,
                       finished_scores, finished_lengths, finished_count, eos_id, nbest);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const int64_t n = logprobs.size(0), vocab = logprobs.size(1), s = sentences.size(0);
  const int64_t beam = finished_scores.size(1), k_in = n / s;
  const StepSizes sizes{vocab,        tokens.size(1),  k_in, beam, finished_tokens.size(2),
                        std::min(2 * beam, k_in * vocab), eos_id, nbest};
  // Each thread's list holds up to 2 * beam candidates; the sentence's finished list up to beam.
  TORCH_CHECK(beam <= 32, "beam_search_step on CUDA supports beam_size <= 32, got ", beam);

  const auto long_options = tokens.options();
  at::Tensor live_rows = at::empty({s, beam}, long_options);
  at::Tensor live_tokens = at::empty({s, beam}, long_options);
  at::Tensor live_scores = at::empty({s, beam}, scores.options());
  at::Tensor done = at::empty({s}, long_options.dtype(at::kBool));
  at::Tensor invalid = at::zeros({1}, long_options.dtype(at::kInt));
  const StepPointers pointers{
      logprobs.data_ptr<float>(),         tokens.data_ptr<int64_t>(),
      scores.data_ptr<float>(),           sentences.data_ptr<int64_t>(),
      max_len.data_ptr<int64_t>(),        penalty.data_ptr<double>(),
      finished_tokens.data_ptr<int64_t>(), finished_scores.data_ptr<float>(),
      finished_lengths.data_ptr<int64_t>(), finished_count.data_ptr<int64_t>(),
      live_rows.data_ptr<int64_t>(),      live_tokens.data_ptr<int64_t>(),
      live_scores.data_ptr<float>(),      done.data_ptr<bool>(),
      invalid.data_ptr<int>()};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto launch = [&](auto kernel) { kernel<<<s, kThreads, 0, stream>>>(pointers, sizes); };
  if (beam <= 4) {
    launch(beam_search_step_kernel<8>);
  } else if (beam <= 8) {
    launch(beam_search_step_kernel<16>);
  } else if (beam <= 16) {
    launch(beam_search_step_kernel<32>);
  } else {
    launch(beam_search_step_kernel<64>);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  TORCH_CHECK_VALUE(invalid.item<int>() == 0,
                    "step_fn returned NaN or positive values, not log-probabilities");

  // Compaction: the live beams of unfinished sentences, in order, become the next rows.
  const at::Tensor kept = at::nonzero(done.logical_not()).flatten();
  const at::Tensor reorder = live_rows.index_select(0, kept).flatten();
  const at::Tensor next_tokens =
      at::cat({tokens.index_select(0, reorder), live_tokens.index_select(0, kept).view({-1, 1})}, 1);
  return {next_tokens, live_scores.index_select(0, kept).flatten(), reorder,
          sentences.index_select(0, kept)};
}

}  // namespace fastattn
