#include "packed_linear.h"

#include "log_softmax.h"
#include "vector_math.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

namespace fastattn {

namespace {

constexpr int64_t kPanel = 16;  // output features per panel: two 8-float vectors

// out[r, :width] = x[r] · panel + bias for R rows of x (rows D apart) and one panel (D, 16).
template <int R>
FASTATTN_INLINE void panel_rows(const float *x, int64_t D, const float *panel, const float *bias,
                                float *out, int64_t out_stride, int64_t width) {
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
    float sums[kPanel];
    *reinterpret_cast<v8 *>(sums) = acc[r][0];
    *reinterpret_cast<v8 *>(sums + 8) = acc[r][1];
    for (int64_t c = 0; c < width; ++c) out[r * out_stride + c] = sums[c] + (bias ? bias[c] : 0.f);
  }
}

// Panels [p0, p1) for all N rows: a panel stays in L1 while the rows pass over it.
FASTATTN_CLONES void panels(const float *x, int64_t N, int64_t D, const float *packed,
                            const float *bias, int64_t O, int64_t p0, int64_t p1, float *out) {
  for (int64_t p = p0; p < p1; ++p) {
    const float *panel = packed + p * D * kPanel;
    const float *b = bias ? bias + p * kPanel : nullptr;
    const int64_t width = std::min(kPanel, O - p * kPanel);
    float *o = out + p * kPanel;
    int64_t n = 0;
    for (; n + 4 <= N; n += 4) panel_rows<4>(x + n * D, D, panel, b, o + n * O, O, width);
    switch (N - n) {
      case 3: panel_rows<3>(x + n * D, D, panel, b, o + n * O, O, width); break;
      case 2: panel_rows<2>(x + n * D, D, panel, b, o + n * O, O, width); break;
      case 1: panel_rows<1>(x + n * D, D, panel, b, o + n * O, O, width); break;
    }
  }
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

namespace {

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

}  // namespace

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
  // Threads only pay off with some work per task: about 64k multiply-adds.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, N * D * kPanel));
  at::parallel_for(0, packed->size(0), grain, [&](int64_t p0, int64_t p1) {
    panels(xp, N, D, pp, bp, O, p0, p1, op);
  });
  return out;
}

at::Tensor log_softmax_linear_cpu(const at::Tensor &x, const at::Tensor &weight,
                                  const std::optional<at::Tensor> &packed) {
  if (!packed || x.dim() != 2 || x.scalar_type() != at::kFloat)
    return at::log_softmax(at::linear(x, weight), -1);
  check_packed(x, weight, *packed, std::nullopt, "log_softmax_linear");
  constexpr int64_t kBlock = 16;  // 16 rows of a 16k vocabulary are 1 MB: they stay in L2
  const int64_t N = x.size(0), D = x.size(1), O = weight.size(0), count = packed->size(0);
  const auto xc = x.contiguous();
  auto out = at::empty({N, O}, x.options());
  const float *xp = xc.data_ptr<float>(), *pp = packed->data_ptr<float>();
  float *op = out.data_ptr<float>();
  if (N <= kBlock) {  // one block: the threads share its panels, then its rows
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, N * D * kPanel));
    at::parallel_for(0, count, grain, [&](int64_t p0, int64_t p1) {
      panels(xp, N, D, pp, nullptr, O, p0, p1, op);
    });
    at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) { log_softmax_rows(op, O, r0, r1); });
    return out;
  }
  at::parallel_for(0, (N + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t first = b * kBlock, rows = std::min(kBlock, N - first);
      panels(xp + first * D, rows, D, pp, nullptr, O, 0, count, op + first * O);
      log_softmax_rows(op + first * O, O, 0, rows);
    }
  });
  return out;
}

}  // namespace fastattn
