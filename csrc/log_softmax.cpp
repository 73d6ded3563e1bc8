#include "log_softmax.h"

#include <algorithm>
#include <cmath>

#include "vector_math.h"

namespace fastattn {

// 16 independent lanes keep the max and the sum vectorised (one running value would forbid
// reassociation).
FASTATTN_CLONES void log_softmax_rows(float *x, int64_t V, int64_t begin, int64_t end) {
  constexpr int64_t kLanes = 16;
  for (int64_t i = begin; i < end; ++i) {
    float *row = x + i * V;
    float lane_max[kLanes];
    std::fill(lane_max, lane_max + kLanes, -INFINITY);
    bool nan = false;
    int64_t v = 0;
    for (; v + kLanes <= V; v += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) {
        lane_max[l] = row[v + l] > lane_max[l] ? row[v + l] : lane_max[l];
        nan |= row[v + l] != row[v + l];
      }
    float max = -INFINITY;
    for (; v < V; ++v) {
      max = std::max(max, row[v]);
      nan |= row[v] != row[v];
    }
    for (int64_t l = 0; l < kLanes; ++l) max = std::max(max, lane_max[l]);
    float lane_sum[kLanes] = {};
    for (v = 0; v + kLanes <= V; v += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) lane_sum[l] += exp_nonpositive(row[v + l] - max);
    float sum = 0;
    for (; v < V; ++v) sum += exp_nonpositive(row[v] - max);
    for (int64_t l = 0; l < kLanes; ++l) sum += lane_sum[l];
    const float lse = nan ? NAN : max + std::log(sum);
    for (v = 0; v < V; ++v) row[v] -= lse;
  }
}

}  // namespace fastattn
