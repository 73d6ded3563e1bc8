#include "cross_entropy.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"
#include "vector_math.h"

namespace fastattn {
namespace {

template <typename T>
struct Rows {
  T *logits;
  const int64_t *target;
  const float *row_weight;
  float *loss, *nll;
  int64_t stride, V, ignore_index;
  float smoothing;
};

// Rows of float32 logits are worked on in place; rows of bfloat16 ones in a float32 copy of the
// row, so that e^(x - max) keeps full precision until the gradient is rounded once.
template <typename T>
FASTATTN_INLINE void cross_entropy_rows(const Rows<T> &a, int64_t row0, int64_t row1) {
  constexpr bool in_place = std::is_same_v<T, float>;
  const int64_t V = a.V;
  std::vector<float> copy(in_place ? 0 : V);
  for (int64_t row = row0; row < row1; ++row) {
    T *out = a.logits + row * a.stride;
    float *x = in_place ? reinterpret_cast<float *>(out) : copy.data();
    const int64_t t = a.target[row];
    if (t == a.ignore_index) {
      std::fill(out, out + V, T(0));
      a.loss[row] = a.nll[row] = 0.0f;
      continue;
    }
    // Pass 1: the maximum and the sum of the logits.
    v8 lane_max = v8{} - INFINITY, lane_sum{};
    int64_t c = 0;
    for (; c + 8 <= V; c += 8) {
      const v8 v = load8(out + c);
      if constexpr (!in_place) store8(x + c, v);
      lane_max = v > lane_max ? v : lane_max;
      lane_sum += v;
    }
    float max = max8(lane_max), total = sum8(lane_sum);
    for (int64_t j = c; j < V; ++j) {
      x[j] = static_cast<float>(out[j]);
      max = std::max(max, x[j]);
      total += x[j];
    }
    const float x_t = x[t];
    // Pass 2: e^(x - max) in place, and its sum: the only exp of each logit, 16 at a time.
    v16 lane_exp{};
    for (c = 0; c + 16 <= V; c += 16) {
      const v16 e = exp_nonpositive(load16(x + c) - max);
      store16(x + c, e);
      lane_exp += e;
    }
    float sum_exp = sum16(lane_exp);
    for (int64_t j = c; j < V; ++j) sum_exp += x[j] = exp_nonpositive(x[j] - max);
    const float lse = max + std::log(sum_exp), logp_t = x_t - lse;
    a.nll[row] = -logp_t;
    a.loss[row] = (1 - a.smoothing) * -logp_t + a.smoothing * (lse - total / V);
    // Pass 3: the gradient w (softmax - ε / V), the row still in cache; at the true class,
    // where p_t - 1 cancels, it is formed as expm1(log p_t).
    const float w = a.row_weight[row], scale = w / sum_exp, shift = w * a.smoothing / V;
    for (c = 0; c + 8 <= V; c += 8) store8(out + c, load8(x + c) * scale - shift);
    for (; c < V; ++c) out[c] = static_cast<T>(x[c] * scale - shift);
    out[t] = static_cast<T>(w * (std::expm1(logp_t) + a.smoothing * (1 - 1.0f / V)));
  }
}

FASTATTN_PER_ISA(cross_entropy_rows_at_isa, cross_entropy_rows)

template <typename T>
void cross_entropy_grad(const at::Tensor &logits, const int64_t *target,
                        const at::Tensor &row_weight, const at::Tensor &loss,
                        const at::Tensor &nll, double smoothing, int64_t ignore_index) {
  const int64_t N = logits.size(0), V = logits.size(1);
  const Rows<T> a{logits.data_ptr<T>(),   target,           row_weight.data_ptr<float>(),
                  loss.data_ptr<float>(), nll.data_ptr<float>(), logits.stride(0),
                  V,                      ignore_index,     static_cast<float>(smoothing)};
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1)),
                   [&](int64_t row0, int64_t row1) {
                     cross_entropy_rows_at_isa(a, row0, row1);
                   });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_entropy_grad_cpu(const at::Tensor &logits,
                                                         const at::Tensor &target,
                                                         const at::Tensor &row_weight,
                                                         double smoothing, int64_t ignore_index) {
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(logits.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) &&
                  logits.dim() == 2 && (logits.size(1) <= 1 || logits.stride(1) == 1),
              "cross_entropy_grad (CPU): logits must be a 2-D float32 or bfloat16 CPU tensor "
              "with unit column stride, got ", logits.scalar_type(), " ", logits.sizes(), " on ",
              logits.device());
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 && target.size(0) == N &&
                  target.is_contiguous(),
              "cross_entropy_grad (CPU): target must be a contiguous int64 (", N, ",) tensor");
  TORCH_CHECK(row_weight.scalar_type() == at::kFloat && row_weight.dim() == 1 &&
                  row_weight.size(0) == N && row_weight.is_contiguous(),
              "cross_entropy_grad (CPU): row_weight must be a contiguous float32 (", N,
              ",) tensor");
  const int64_t *t = target.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r)
    TORCH_CHECK(t[r] == ignore_index || (0 <= t[r] && t[r] < V), "cross_entropy_grad (CPU): ",
                "target ", t[r], " at row ", r, " is outside [0, ", V, ") and not ignore_index");
  const auto fp32 = logits.options().dtype(at::kFloat);
  at::Tensor loss = at::empty({N}, fp32), nll = at::empty({N}, fp32);
  if (dtype == at::kFloat)
    cross_entropy_grad<float>(logits, t, row_weight, loss, nll, smoothing, ignore_index);
  else
    cross_entropy_grad<c10::BFloat16>(logits, t, row_weight, loss, nll, smoothing, ignore_index);
  return {loss, nll};
}

}  // namespace fastattn
