// One step of beam search on CPU in a single pass per sentence: masking, score update, partial
// top-k, finishing, back-filling, the stopping bound, then compaction of the surviving rows.
#include "beam_search.h"

#include "cpu_isa.h"
#include "row_lse.h"
#include "vector_math.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

namespace fastattn {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Candidate {
  float score;
  int64_t index;  // beam * V + token within the sentence
};

// Keeps the best `capacity` candidates ordered by score, ties by lower index. Candidates arrive in
// increasing index order, so a newcomer goes after every kept one with an equal score.
class TopCandidates {
 public:
  explicit TopCandidates(int64_t capacity) : capacity_(capacity) { items_.reserve(capacity); }

  void offer(float score, int64_t index) {
    const int64_t n = static_cast<int64_t>(items_.size());
    if (n == capacity_) {
      if (!(score > items_.back().score)) return;
      items_.pop_back();
    }
    auto at = std::upper_bound(items_.begin(), items_.end(), score,
                               [](float s, const Candidate &c) { return s > c.score; });
    items_.insert(at, Candidate{score, index});
  }

  const std::vector<Candidate> &items() const { return items_; }
  int64_t capacity() const { return capacity_; }

  // The score a newcomer must beat, -inf while there is room (then every candidate enters).
  bool full() const { return static_cast<int64_t>(items_.size()) == capacity_; }
  float worst() const { return full() ? items_.back().score : kNegInf; }

 private:
  int64_t capacity_;
  std::vector<Candidate> items_;
};

// Offers base + row[v] with index offset + v for every v < vocab to top, and returns whether every
// row[v] <= 0 (a log-probability). Most of a row cannot enter a full top: a chunk of 64 is
// screened with 16-float vectors and offered element by element only if base + its maximum beats
// the worst kept score (float addition is monotonic, so this is the comparison offer makes for
// the chunk's best element). A NaN makes the chunk's sum NaN, a positive value its maximum > 0.
FASTATTN_INLINE bool offer_row_body(const float *row, int64_t vocab, float base, int64_t offset,
                               TopCandidates &top) {
  constexpr int64_t kChunk = 64;
  bool valid = true;
  int64_t v0 = 0;
  for (; v0 + kChunk <= vocab; v0 += kChunk) {
    v16 most = v16{} - INFINITY, sum = {};
    for (int64_t v = v0; v < v0 + kChunk; v += 16) {
      const v16 x = load16(row + v);
      most = if_greater(x, most, x, most);
      sum += x;
    }
    const float chunk_max = max16(most), chunk_sum = sum16(sum);
    valid &= chunk_max <= 0.f && chunk_sum == chunk_sum;
    if (!top.full() || base + chunk_max > top.worst())
      for (int64_t v = v0; v < v0 + kChunk; ++v) top.offer(base + row[v], offset + v);
  }
  for (int64_t v = v0; v < vocab; ++v) {  // the tail
    valid &= row[v] <= 0.f;
    top.offer(base + row[v], offset + v);
  }
  return valid;
}
FASTATTN_PER_ISA(offer_row, offer_row_body)

// Offers a row of log-probabilities as offer_row does, or at a sentence's last position only its
// EOS; returns whether every value is a log-probability.
bool offer_full_row(const float *row, int64_t vocab, float base, int64_t offset, bool last,
                    int64_t eos_id, TopCandidates &top) {
  if (!last) return offer_row(row, vocab, base, offset, top);
  bool valid = true;
  for (int64_t v = 0; v < vocab; ++v) valid &= row[v] <= 0.f;
  top.offer(base + row[eos_id], offset + eos_id);
  return valid;
}

// Whether a row's largest logits hold every candidate of the row that can enter a top of
// `wanted`: the wanted-th one's score (base + (logit - lse), as the full row gives it) beats the
// last kept one's, which is at least any left-out one's (rounding is monotonic). Ties at the
// edge, a dead row (base -inf) or too few kept logits leave it to the full row.
bool settles(const RowTop &best, float base, float lse, int64_t wanted) {
  return best.count == best.capacity && wanted < best.capacity &&
         base + (best.value[wanted - 1] - lse) > base + (best.value[best.capacity - 1] - lse);
}

struct LiveBeam {
  int64_t row;  // the row of this step it continues
  int64_t token;
  float score;
};

}  // namespace

void check_step_arguments(FASTATTN_STEP_ARGS) {
  const auto check = [&](const at::Tensor &x, const char *name, at::ScalarType dtype, int64_t dim) {
    TORCH_CHECK(x.scalar_type() == dtype, "beam_search_step: ", name, " must be ", dtype, ", got ",
                x.scalar_type());
    TORCH_CHECK(x.dim() == dim, "beam_search_step: ", name, " must have ", dim, " dimensions, got ",
                x.sizes());
    TORCH_CHECK(x.is_contiguous(), "beam_search_step: ", name, " must be contiguous");
    TORCH_CHECK(x.device() == logprobs.device(), "beam_search_step: ", name, " is on ",
                x.device(), " but logprobs on ", logprobs.device());
  };
  check(logprobs, "logprobs", at::kFloat, 2);
  check(tokens, "tokens", at::kLong, 2);
  check(scores, "scores", at::kFloat, 1);
  check(sentences, "sentences", at::kLong, 1);
  check(max_len, "max_len", at::kLong, 1);
  check(penalty, "penalty", at::kDouble, 1);
  check(finished_tokens, "finished_tokens", at::kLong, 3);
  check(finished_scores, "finished_scores", at::kFloat, 2);
  check(finished_lengths, "finished_lengths", at::kLong, 2);
  check(finished_count, "finished_count", at::kLong, 1);
  const int64_t n = logprobs.size(0), s = sentences.size(0), batch = max_len.size(0);
  const int64_t beam = finished_scores.size(1);
  TORCH_CHECK(s > 0 && n % s == 0 && (n == s || n == s * beam),
              "beam_search_step: ", n, " rows for ", s, " sentences and beam ", beam);
  TORCH_CHECK(tokens.size(0) == n && scores.size(0) == n,
              "beam_search_step: tokens and scores need one row per logprobs row");
  TORCH_CHECK(logprobs.size(1) >= 2 && eos_id >= 0 && eos_id < logprobs.size(1),
              "beam_search_step: eos_id ", eos_id, " outside the vocabulary of ", logprobs.size(1));
  TORCH_CHECK(nbest >= 1 && nbest <= beam, "beam_search_step: nbest must be in [1, ", beam, "]");
  TORCH_CHECK(finished_tokens.size(0) == batch && finished_tokens.size(1) == beam &&
                  finished_scores.size(0) == batch && finished_lengths.sizes() == finished_scores.sizes() &&
                  finished_count.size(0) == batch,
              "beam_search_step: finished_* must cover the batch of ", batch, " with beam ", beam);
  TORCH_CHECK(tokens.size(1) <= finished_tokens.size(2) && penalty.size(0) > finished_tokens.size(2),
              "beam_search_step: prefixes of ", tokens.size(1), " tokens exceed max_len's storage");
}

namespace {

// The step over the rows of `vocab` tokens each, read through offer_rows(first, k_in, last,
// top): it offers rows [first, first + k_in) (one sentence's; row first + k as indices k · vocab
// + token) to top, in increasing index order, and returns whether they held log-probabilities.
template <typename OfferRows>
StepResult search_step(int64_t vocab, const OfferRows &offer_rows, const at::Tensor &tokens,
                       const at::Tensor &scores, const at::Tensor &sentences,
                       const at::Tensor &max_len, const at::Tensor &penalty,
                       const at::Tensor &finished_tokens, const at::Tensor &finished_scores,
                       const at::Tensor &finished_lengths, const at::Tensor &finished_count,
                       int64_t eos_id, int64_t nbest) {
  const int64_t n = tokens.size(0), t = tokens.size(1);
  const int64_t s = sentences.size(0), k_in = n / s, beam = finished_scores.size(1);
  const int64_t max_tokens = finished_tokens.size(2);
  const int64_t num_candidates = std::min(2 * beam, k_in * vocab);

  const int64_t *prefix = tokens.data_ptr<int64_t>();
  const int64_t *sentence = sentences.data_ptr<int64_t>();
  const int64_t *limit_of = max_len.data_ptr<int64_t>();
  const double *lp_penalty = penalty.data_ptr<double>();
  int64_t *fin_tokens = finished_tokens.data_ptr<int64_t>();
  float *fin_scores = finished_scores.data_ptr<float>();
  int64_t *fin_lengths = finished_lengths.data_ptr<int64_t>();
  int64_t *fin_count = finished_count.data_ptr<int64_t>();

  std::vector<LiveBeam> live(s * beam);
  std::vector<char> done(s), invalid(s);

  at::parallel_for(0, s, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = sentence[i], limit = limit_of[b], first = i * k_in;
      const bool last = limit == t;

      // Score update and partial top-k in one pass; at the last position only EOS may follow.
      TopCandidates top(num_candidates);
      invalid[i] = !offer_rows(first, k_in, last, top);

      // Finish EOS among the top beam; back-fill the live beams with the best other candidates.
      int64_t count = fin_count[b], num_live = 0;
      const auto &candidates = top.items();
      for (int64_t j = 0; j < static_cast<int64_t>(candidates.size()); ++j) {
        const Candidate &c = candidates[j];
        const int64_t token = c.index % vocab, row = first + c.index / vocab;
        if (token == eos_id) {
          if (j < beam && c.score > kNegInf && count < beam) {
            int64_t *out = fin_tokens + (b * beam + count) * max_tokens;
            std::copy(prefix + row * t + 1, prefix + (row + 1) * t, out);
            out[t - 1] = eos_id;
            fin_scores[b * beam + count] = static_cast<float>(c.score / lp_penalty[t]);
            fin_lengths[b * beam + count] = t;
            ++count;
          }
        } else if (num_live < beam) {
          live[i * beam + num_live++] = LiveBeam{row, token, c.score};
        }
      }
      for (; num_live < beam; ++num_live) live[i * beam + num_live] = LiveBeam{first, eos_id, kNegInf};
      fin_count[b] = count;

      // Done: beam hypotheses, max_len reached, no live prefix, or the bound of search.py.
      float best_live = kNegInf;
      for (int64_t k = 0; k < beam; ++k) best_live = std::max(best_live, live[i * beam + k].score);
      bool hopeless = false;
      if (count >= nbest) {
        std::vector<float> finished(fin_scores + b * beam, fin_scores + b * beam + count);
        std::nth_element(finished.begin(), finished.begin() + nbest - 1, finished.end(),
                         std::greater<float>());
        const double most_penalty = std::max(lp_penalty[std::min(limit, t + 1)], lp_penalty[limit]);
        hopeless = finished[nbest - 1] >= static_cast<float>(best_live / most_penalty);
      }
      done[i] = count >= beam || last || best_live == kNegInf || hopeless;
    }
  });
  TORCH_CHECK_VALUE(std::none_of(invalid.begin(), invalid.end(), [](char x) { return x; }),
              "step_fn returned NaN or positive values, not log-probabilities");

  // Compaction: the live beams of unfinished sentences, in order, become the next rows.
  std::vector<int64_t> kept;
  for (int64_t i = 0; i < s; ++i)
    if (!done[i]) kept.push_back(i);
  const int64_t s_next = static_cast<int64_t>(kept.size()), n_next = s_next * beam;
  const auto long_options = tokens.options();
  at::Tensor next_tokens = at::empty({n_next, t + 1}, long_options);
  at::Tensor next_scores = at::empty({n_next}, scores.options());
  at::Tensor reorder = at::empty({n_next}, long_options);
  at::Tensor next_sentences = at::empty({s_next}, long_options);
  int64_t *out_tokens = next_tokens.data_ptr<int64_t>(), *out_reorder = reorder.data_ptr<int64_t>();
  float *out_scores = next_scores.data_ptr<float>();
  int64_t *out_sentences = next_sentences.data_ptr<int64_t>();
  at::parallel_for(0, s_next, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      out_sentences[i] = sentence[kept[i]];
      for (int64_t k = 0; k < beam; ++k) {
        const LiveBeam &l = live[kept[i] * beam + k];
        const int64_t r = i * beam + k;
        std::copy(prefix + l.row * t, prefix + (l.row + 1) * t, out_tokens + r * (t + 1));
        out_tokens[r * (t + 1) + t] = l.token;
        out_scores[r] = l.score;
        out_reorder[r] = l.row;
      }
    }
  });
  return {next_tokens, next_scores, reorder, next_sentences};
}

}  // namespace

StepResult beam_search_step_cpu(FASTATTN_STEP_ARGS) {
  check_step_arguments(logprobs, tokens, scores, sentences, max_len, penalty, finished_tokens,
                       finished_scores, finished_lengths, finished_count, eos_id, nbest);
  const int64_t vocab = logprobs.size(1);
  const float *lp = logprobs.data_ptr<float>();
  const float *prefix_score = scores.data_ptr<float>();
  const auto offer_rows = [&](int64_t first, int64_t k_in, bool last, TopCandidates &top) {
    bool valid = true;
    for (int64_t k = 0; k < k_in; ++k)
      valid &= offer_full_row(lp + (first + k) * vocab, vocab, prefix_score[first + k],
                              k * vocab, last, eos_id, top);
    return valid;
  };
  return search_step(vocab, offer_rows, tokens, scores, sentences, max_len, penalty,
                     finished_tokens, finished_scores, finished_lengths, finished_count, eos_id,
                     nbest);
}

StepResult beam_search_step_rows_cpu(const OutputRows &output, FASTATTN_STEP_STATE_ARGS) {
  TORCH_CHECK(static_cast<int64_t>(output.rows.size()) == tokens.size(0),
              "beam_search_step: ", output.rows.size(), " output rows for ", tokens.size(0),
              " prefixes");
  const int64_t vocab = output.vocab;
  const float *prefix_score = scores.data_ptr<float>();
  const auto offer_rows = [&](int64_t first, int64_t k_in, bool last, TopCandidates &top) {
    bool valid = true;
    std::vector<float> full;  // a row the largest logits do not settle
    for (int64_t k = 0; k < k_in; ++k) {
      const int64_t r = first + k;
      const float base = prefix_score[r], lse = output.lse[r];
      const RowTop &best = output.rows[r].top;
      if (!std::isfinite(lse)) {  // a NaN or +inf logit, or all -inf: not log-probabilities
        valid = false;
        continue;
      }
      if (last || !settles(best, base, lse, top.capacity())) {
        full.resize(vocab);
        output.logits(r, full.data());
        subtract_rows(full.data(), vocab, &lse, 0, 1);
        valid &= offer_full_row(full.data(), vocab, base, k * vocab, last, eos_id, top);
        continue;
      }
      // Every logit <= lse, so each is a log-probability; offered in column order.
      int order[RowTop::kMost];
      std::iota(order, order + best.count, 0);
      std::sort(order, order + best.count,
                [&](int a, int b) { return best.column[a] < best.column[b]; });
      for (int j = 0; j < best.count; ++j)
        top.offer(base + (best.value[order[j]] - lse), k * vocab + best.column[order[j]]);
    }
    return valid;
  };
  return search_step(vocab, offer_rows, tokens, scores, sentences, max_len, penalty,
                     finished_tokens, finished_scores, finished_lengths, finished_count, eos_id,
                     nbest);
}

}  // namespace fastattn
