#include "packed_linear.h"

#include "vector_math.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace fastattn {

namespace {

constexpr int64_t kPanel = 16;  // output features per panel: two 8-float vectors

// A row's running log-sum-exp, as in online softmax: the largest value seen and, in 8 lanes, the
// sums of e^(x - max) over the values seen. The lanes are rescaled only when the maximum grows
// (rarely after the first panels), so adding 16 values costs two vector exps and no reduction.
// A NaN makes the sum NaN.
struct RowLse {
  float max = -INFINITY;
  v8 sum = {};

  void add16(v8 a, v8 b) {
    const float m = max8(a > b ? a : b);
    if (m > max) {
      sum *= exp_nonpositive(max - m);
      max = m;
    }
    if (max != -INFINITY) sum += exp_nonpositive(a - max) + exp_nonpositive(b - max);
  }

  // The last panel's `width` values.
  void add(const float *x, int64_t width) {
    float padded[16];
    std::fill(padded, padded + 16, -INFINITY);  // e^-inf adds 0
    std::copy(x, x + width, padded);
    add16(load8(padded), load8(padded + 8));
  }

  void merge(const RowLse &other) {
    const float m = std::max(max, other.max);
    if (m == -INFINITY) return;
    sum = sum * exp_nonpositive(max - m) + other.sum * exp_nonpositive(other.max - m);
    max = m;
  }

  float value() const { return max + std::log(sum8(sum)); }
};

// out[r, :width] = x[r] · panel + bias for R rows of x (rows D apart) and one panel (D, 16); with
// lse, each row's values are added to its running log-sum-exp lse[r].
template <int R>
FASTATTN_INLINE void panel_rows(const float *x, int64_t D, const float *panel, const float *bias,
                                float *out, int64_t out_stride, int64_t width, RowLse *lse) {
  v8 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = v8{};
  for (int64_t d = 0; d < D; ++d) {
    const v8 w0 = load8(panel + d * kPanel);
    const v8 w1 = load8(panel + d * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * D + d];
      acc[r][0] += xv * w0;
      acc[r][1] += xv * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    if (width == kPanel) {
      if (bias) {
        acc[r][0] += load8(bias);
        acc[r][1] += load8(bias + 8);
      }
      std::memcpy(out + r * out_stride, &acc[r][0], sizeof(v8));
      std::memcpy(out + r * out_stride + 8, &acc[r][1], sizeof(v8));
      if (lse) lse[r].add16(acc[r][0], acc[r][1]);
    } else {  // the last panel
      float sums[kPanel];
      std::memcpy(sums, &acc[r][0], sizeof(v8));
      std::memcpy(sums + 8, &acc[r][1], sizeof(v8));
      for (int64_t c = 0; bias && c < width; ++c) sums[c] += bias[c];
      std::memcpy(out + r * out_stride, sums, width * sizeof(float));
      if (lse) lse[r].add(sums, width);
    }
  }
}

// Panels [p0, p1) for all N rows, 6 rows at a time (12 accumulators of the 16 AVX registers): a
// panel stays in L1 while the rows pass over it, and the weight is read once. lse: none, or N
// running log-sum-exps.
FASTATTN_CLONES void panels(const float *x, int64_t N, int64_t D, const float *packed,
                            const float *bias, int64_t O, int64_t p0, int64_t p1, float *out,
                            RowLse *lse) {
  for (int64_t p = p0; p < p1; ++p) {
    const float *panel = packed + p * D * kPanel;
    const float *b = bias ? bias + p * kPanel : nullptr;
    const int64_t width = std::min(kPanel, O - p * kPanel);
    float *o = out + p * kPanel;
    const auto rows = [&](int64_t n) { return lse ? lse + n : nullptr; };
    int64_t n = 0;
    for (; n + 6 <= N; n += 6) panel_rows<6>(x + n * D, D, panel, b, o + n * O, O, width, rows(n));
    switch (N - n) {
      case 5: panel_rows<5>(x + n * D, D, panel, b, o + n * O, O, width, rows(n)); break;
      case 4: panel_rows<4>(x + n * D, D, panel, b, o + n * O, O, width, rows(n)); break;
      case 3: panel_rows<3>(x + n * D, D, panel, b, o + n * O, O, width, rows(n)); break;
      case 2: panel_rows<2>(x + n * D, D, panel, b, o + n * O, O, width, rows(n)); break;
      case 1: panel_rows<1>(x + n * D, D, panel, b, o + n * O, O, width, rows(n)); break;
    }
  }
}

// x[r, :] -= lse[r] for rows [begin, end) of O floats.
FASTATTN_CLONES void subtract_rows(float *x, int64_t O, const float *lse, int64_t begin,
                                   int64_t end) {
  for (int64_t r = begin; r < end; ++r)
    for (int64_t c = 0; c < O; ++c) x[r * O + c] -= lse[r];
}

void check_packed(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &packed,
                  const std::optional<at::Tensor> &bias, const char *op) {
  const int64_t D = x.size(1), O = weight.size(0), count = (O + kPanel - 1) / kPanel;
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == D, op, ": x ", x.sizes(), " and weight ",
              weight.sizes(), " do not match");
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == count && packed.size(1) == D &&
                  packed.size(2) == kPanel && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous(),
              op, ": packed must be pack_linear_weight(weight), (", count, ", ", D, ", ", kPanel,
              ") float32 contiguous, got ", packed.sizes());
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == O &&
                        bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              op, ": bias must be a contiguous float32 (", O, ") tensor");
}

// Threads only pay off with some work per task: about 64k multiply-adds.
int64_t panel_grain(int64_t N, int64_t D) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, N * D * kPanel));
}

}  // namespace

at::Tensor pack_linear_weight_cpu(const at::Tensor &weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_linear_weight: weight must be a float32 (out_features, in_features) tensor, "
              "got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t O = weight.size(0), D = weight.size(1), count = (O + kPanel - 1) / kPanel;
  auto padded = at::zeros({count * kPanel, D}, weight.options());
  padded.narrow(0, 0, O).copy_(weight);
  return padded.view({count, kPanel, D}).transpose(1, 2).contiguous();
}

at::Tensor linear_cpu(const at::Tensor &x, const at::Tensor &weight,
                      const std::optional<at::Tensor> &packed,
                      const std::optional<at::Tensor> &bias) {
  const bool use_packed = packed && x.dim() == 2 && x.size(0) <= kPackedLinearMaxRows &&
                          x.scalar_type() == at::kFloat;
  if (!use_packed) return at::linear(x, weight, bias);
  check_packed(x, weight, *packed, bias, "linear");
  const int64_t N = x.size(0), D = x.size(1), O = weight.size(0);
  const auto xc = x.contiguous();
  auto out = at::empty({N, O}, x.options());
  const float *xp = xc.data_ptr<float>(), *pp = packed->data_ptr<float>();
  const float *bp = bias ? bias->data_ptr<float>() : nullptr;
  float *op = out.data_ptr<float>();
  at::parallel_for(0, packed->size(0), panel_grain(N, D), [&](int64_t p0, int64_t p1) {
    panels(xp, N, D, pp, bp, O, p0, p1, op, nullptr);
  });
  return out;
}

at::Tensor log_softmax_linear_cpu(const at::Tensor &x, const at::Tensor &weight,
                                  const std::optional<at::Tensor> &packed) {
  if (!packed || x.dim() != 2 || x.scalar_type() != at::kFloat)
    return at::log_softmax(at::linear(x, weight), -1);
  check_packed(x, weight, *packed, std::nullopt, "log_softmax_linear");
  const int64_t N = x.size(0), D = x.size(1), O = weight.size(0);
  const auto xc = x.contiguous();
  auto out = at::empty({N, O}, x.options());
  const float *xp = xc.data_ptr<float>(), *pp = packed->data_ptr<float>();
  float *op = out.data_ptr<float>();
  // One pass over the weight writes the logits and each thread's running log-sum-exp of every
  // row; the threads' sums are merged, then one pass subtracts them.
  std::vector<std::vector<RowLse>> partial(at::get_num_threads(), std::vector<RowLse>(N));
  at::parallel_for(0, packed->size(0), panel_grain(N, D), [&](int64_t p0, int64_t p1) {
    panels(xp, N, D, pp, nullptr, O, p0, p1, op, partial[at::get_thread_num()].data());
  });
  std::vector<float> lse(N);
  for (int64_t r = 0; r < N; ++r) {
    for (size_t t = 1; t < partial.size(); ++t) partial[0][r].merge(partial[t][r]);
    lse[r] = partial[0][r].value();
  }
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / O), [&](int64_t begin, int64_t end) {
    subtract_rows(op, O, lse.data(), begin, end);
  });
  return out;
}

}  // namespace fastattn
