// The output distribution of a decoding step, log_softmax(x · weightᵀ), in one pass over the
// weight: each thread keeps a running log-sum-exp of every row over the panels it computes
// (online softmax), the threads' sums are merged, and one pass subtracts them.
#pragma once

#include "vector_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

namespace fastattn {

constexpr int64_t kPanel = 16;  // output features per panel: one 16-float vector

// A row's running log-sum-exp, as in online softmax, kept per lane (column mod 16): each lane's
// largest value so far and its sum of e^(x - that max). Lane by lane there is no horizontal
// maximum per panel: adding 16 values is one vector exp per eight floats (one AVX register, two
// SSE ones), and a second only where a lane's maximum grew. The lanes meet once, in value(). A NaN makes the sum
// NaN; a lane that only sees -inf keeps max = -FLT_MAX and sum 0, so that it adds nothing
// (e^(-inf - -inf) would be NaN).
struct RowLse {
  float max[kPanel], sum[kPanel];

  RowLse() {
    std::fill(max, max + kPanel, -FLT_MAX);
    std::fill(sum, sum + kPanel, 0.0f);
  }

  // Always inlined: a call would pass the vector in a register only some callers' targets have.
  FASTATTN_INLINE void add16(v16 a) {
    add8(low8(a), 0);
    add8(high8(a), 8);
  }

  // Lanes [first, first + 8) (first 0 or 8): AVX2's products add each half of a panel as it
  // leaves its register, where a 16-float vector went through the stack.
  FASTATTN_INLINE void add8(v8 x, int64_t first) {
    const v8 m = load8(max + first);
    if (any(x > m)) {  // rare after the first panels: rescale the lanes whose maximum grew
      const v8 grown = x > m ? x : m;
      store8(sum + first, load8(sum + first) * exp_nonpositive(m - grown));
      store8(max + first, grown);
    }
    store8(sum + first, load8(sum + first) + exp_nonpositive(x - load8(max + first)));
  }

  // A last panel's `width` values.
  FASTATTN_INLINE void add(const float *x, int64_t width) {
    float padded[kPanel];
    std::fill(padded, padded + kPanel, -INFINITY);  // e^-inf adds 0
    std::copy(x, x + width, padded);
    add16(load16(padded));
  }

  void merge(const RowLse &other) {
    for (int64_t l = 0; l < kPanel; ++l) {
      const float m = std::max(max[l], other.max[l]);
      sum[l] = sum[l] * exp_nonpositive(max[l] - m) + other.sum[l] * exp_nonpositive(other.max[l] - m);
      max[l] = m;
    }
  }

  float value() const {
    const float m = *std::max_element(max, max + kPanel);
    float total = 0;
    for (int64_t l = 0; l < kPanel; ++l) total += sum[l] * exp_nonpositive(max[l] - m);
    return m + std::log(total);
  }
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
