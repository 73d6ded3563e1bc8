// The output distribution of a decoding step, log_softmax(x · weightᵀ), in one pass over the
// weight: each thread keeps a running log-sum-exp of every row over the panels it computes
// (online softmax), the threads' sums are merged, and one pass subtracts them.
#pragma once

#include "vector_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace fastattn {

constexpr int64_t kPanel = 16;  // output features per panel: one 16-float vector

// A row's running log-sum-exp, as in online softmax: the largest value seen and, in 16 lanes,
// the sums of e^(x - max) over the values seen. The lanes are rescaled only when the maximum
// grows (rarely after the first panels), so adding 16 values costs one vector exp and no
// reduction. A NaN makes the sum NaN.
struct RowLse {
  float max = -INFINITY;
  v16 sum = {};

  // Always inlined: a call would pass the vector in a register only some callers' targets have.
  FASTATTN_INLINE void add16(v16 a) {
    const float m = max16(a);
    if (m > max) {
      sum *= exp_nonpositive(max - m);
      max = m;
    }
    if (max != -INFINITY) sum += exp_nonpositive(a - max);
  }

  // A last panel's `width` values.
  FASTATTN_INLINE void add(const float *x, int64_t width) {
    float padded[kPanel];
    std::fill(padded, padded + kPanel, -INFINITY);  // e^-inf adds 0
    std::copy(x, x + width, padded);
    add16(load16(padded));
  }

  void merge(const RowLse &other) {
    const float m = std::max(max, other.max);
    if (m == -INFINITY) return;
    sum = sum * exp_nonpositive(max - m) + other.sum * exp_nonpositive(other.max - m);
    max = m;
  }

  float value() const { return max + std::log(sum16(sum)); }
};

// x[r, :] -= lse[r] for rows [begin, end) of O floats (packed_linear.cpp).
void subtract_rows(float *x, int64_t O, const float *lse, int64_t begin, int64_t end);

// out (N, O) = log_softmax over each row, where panels(p0, p1, lse) writes the logits of panels
// [p0, p1) (16 columns each) of every row into out and adds them to lse[r] (N of them).
template <typename Panels>
void log_softmax_panels(int64_t N, int64_t O, int64_t panel_count, int64_t grain, float *out,
                        const Panels &panels) {
  std::vector<std::vector<RowLse>> partial(at::get_num_threads(), std::vector<RowLse>(N));
  at::parallel_for(0, panel_count, grain, [&](int64_t p0, int64_t p1) {
    panels(p0, p1, partial[at::get_thread_num()].data());
  });
  std::vector<float> lse(N);
  for (int64_t r = 0; r < N; ++r) {
    for (size_t t = 1; t < partial.size(); ++t) partial[0][r].merge(partial[t][r]);
    lse[r] = partial[0][r].value();
  }
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, O)),
                   [&](int64_t begin, int64_t end) { subtract_rows(out, O, lse.data(), begin, end); });
}

}  // namespace fastattn
