// The output distribution of a decoding step, log_softmax(x · weightᵀ), in one pass over the
// weight: each thread keeps a running log-sum-exp of every row over the panels it computes
// (online softmax), the threads' sums are merged, and one pass subtracts them. A beam search
// needs less: each row's log-sum-exp and its few largest logits (OutputRows), which skip the
// N x V writes and the passes over them.
#pragma once

#include "vector_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <functional>
#include <vector>

namespace fastattn {

constexpr int64_t kPanel = 16;  // output features per panel: one 16-float vector

// A row's `capacity` largest values and their columns, largest first, ties by lower column
// (whatever order the threads' panels come in). NaN and -inf never enter: the row's log-sum-exp
// tells of those.
struct RowTop {
  static constexpr int kMost = 32;
  int capacity = 0, count = 0;
  float value[kMost];
  int32_t column[kMost];

  // The least value a newcomer may have to enter: any while there is room.
  float worst() const { return count < capacity ? -INFINITY : value[capacity - 1]; }

  void offer(float v, int32_t c) {
    if (!(v > -INFINITY) || (count == capacity && !before(v, c, capacity - 1))) return;
    int i = count < capacity ? count++ : capacity - 1;
    for (; i > 0 && before(v, c, i - 1); --i) value[i] = value[i - 1], column[i] = column[i - 1];
    value[i] = v, column[i] = c;
  }

  // Another thread's values of the same row.
  void merge(const RowTop &other) {
    for (int j = 0; j < other.count; ++j) offer(other.value[j], other.column[j]);
  }

 private:
  // Whether (v, c) ranks before kept entry i.
  bool before(float v, int32_t c, int i) const {
    return v > value[i] || (v == value[i] && c < column[i]);
  }
};

// A row's running log-sum-exp, as in online softmax, kept per lane (column mod 16): each lane's
// largest value so far and its sum of e^(x - that max). Lane by lane there is no horizontal
// maximum per panel: adding 16 values is one vector exp per eight floats (one AVX register, two
// SSE ones), and a second only where a lane's maximum grew. The lanes meet once, in value(). A NaN makes the sum
// NaN; a lane that only sees -inf keeps max = -FLT_MAX and sum 0, so that it adds nothing
// (e^(-inf - -inf) would be NaN).
// With a top capacity, it also keeps the row's largest values (RowTop): one comparison per eight
// values, as almost none beat the worst kept once the first panels have passed.
struct RowLse {
  float max[kPanel], sum[kPanel];
  RowTop top;

  explicit RowLse(int top_capacity = 0) {
    std::fill(max, max + kPanel, -FLT_MAX);
    std::fill(sum, sum + kPanel, 0.0f);
    top.capacity = top_capacity;
  }

  // The 16 values of columns [column, column + 16). kAvx512 (callers compiled for AVX-512 only):
  // in one 16-lane pass, half the instructions of two 8-lane halves; below AVX-512 GCC makes
  // 16-lane comparisons scalar code, so halves. The same values either way. Always inlined: a
  // call would pass the vector in a register only some callers' targets have.
  template <bool kAvx512 = false>
  FASTATTN_INLINE void add16(v16 a, int64_t column) {
    if constexpr (kAvx512) {
      add_lanes<v16, v16i>(a, column);
    } else {
      add8(low8(a), column);
      add8(high8(a), column + 8);
    }
  }

  // Columns [column, column + 8), column a multiple of 8: AVX2's products add each half of a
  // panel as it leaves its register, where a 16-float vector went through the stack.
  FASTATTN_INLINE void add8(v8 x, int64_t column) { add_lanes<v8, v8i>(x, column); }

  // The lanes of x (8 or 16 floats), columns [column, ...), column a multiple of their count.
  template <typename V, typename VI>
  FASTATTN_INLINE void add_lanes(V x, int64_t column) {
    constexpr int kLanes = sizeof(V) / sizeof(float);
    if (top.capacity > 0 && any(x >= (V{} + top.worst())))
      for (int l = 0; l < kLanes; ++l) top.offer(x[l], static_cast<int32_t>(column + l));
    const int64_t first = kLanes == kPanel ? 0 : column % kPanel;
    float *lane_max = max + first, *lane_sum = sum + first;
    const V m = load_as<V>(lane_max);
    if (any(x > m)) {  // rare after the first panels: rescale the lanes whose maximum grew
      const V grown = x > m ? x : m;
      store_as<V>(lane_sum, load_as<V>(lane_sum) * exp_nonpositive_vector<V, VI>(m - grown));
      store_as<V>(lane_max, grown);
    }
    store_as<V>(lane_sum,
                load_as<V>(lane_sum) + exp_nonpositive_vector<V, VI>(x - load_as<V>(lane_max)));
  }

  // A last panel's `width` values, from column on.
  FASTATTN_INLINE void add(const float *x, int64_t width, int64_t column) {
    float padded[kPanel];
    std::fill(padded, padded + kPanel, -INFINITY);  // e^-inf adds 0, and never enters top
    std::copy(x, x + width, padded);
    add16(load16(padded), column);
  }

  void merge(const RowLse &other) {
    if (top.capacity > 0) top.merge(other.top);
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

// Each of N rows' log-sum-exp and, with top > 0, its `top` largest values, where panels(p0, p1,
// rows) adds the values of panels [p0, p1) (16 columns each) of every row to rows[r] (N of them)
// and writes them wherever it writes: each thread keeps rows of its own, merged here.
template <typename Panels>
std::vector<RowLse> row_stats(int64_t N, int64_t panel_count, int64_t grain, int top,
                              const Panels &panels) {
  std::vector<std::vector<RowLse>> partial(at::get_num_threads(),
                                           std::vector<RowLse>(N, RowLse(top)));
  at::parallel_for(0, panel_count, grain, [&](int64_t p0, int64_t p1) {
    panels(p0, p1, partial[at::get_thread_num()].data());
  });
  for (int64_t r = 0; r < N; ++r)
    for (size_t t = 1; t < partial.size(); ++t) partial[0][r].merge(partial[t][r]);
  return std::move(partial[0]);
}

// out (N, O) = log_softmax over each row, where panels(p0, p1, lse) writes the logits of panels
// [p0, p1) of every row into out and adds them to lse[r] (N of them).
template <typename Panels>
void log_softmax_panels(int64_t N, int64_t O, int64_t panel_count, int64_t grain, float *out,
                        const Panels &panels) {
  const auto rows = row_stats(N, panel_count, grain, 0, panels);
  std::vector<float> lse(N);
  for (int64_t r = 0; r < N; ++r) lse[r] = rows[r].value();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, O)),
                   [&](int64_t begin, int64_t end) { subtract_rows(out, O, lse.data(), begin, end); });
}

// A step's output distribution as a beam search reads it, without its N x V log-probabilities:
// each row's log-sum-exp and largest logits (rows[r].top), and for the rare row these do not
// settle, logits(r, out) writing the row's logits again (a row's do not depend on the others);
// less lse[r], as subtract_rows takes it, they are the row's log-probabilities.
struct OutputRows {
  std::vector<RowLse> rows;
  std::vector<float> lse;
  int64_t vocab;
  std::function<void(int64_t row, float *out)> logits;
};

// OutputRows from row_stats over panels that write nothing, and logits(r, out).
template <typename Panels>
OutputRows output_rows(int64_t N, int64_t O, int64_t panel_count, int64_t grain, int top,
                       const Panels &panels, std::function<void(int64_t, float *)> logits) {
  OutputRows output{row_stats(N, panel_count, grain, top, panels), std::vector<float>(N), O,
                    std::move(logits)};
  for (int64_t r = 0; r < N; ++r) output.lse[r] = output.rows[r].value();
  return output;
}

}  // namespace fastattn
