#include "packed_linear.h"

#include "row_lse.h"
#include "cpu_isa.h"
#include "vector_math.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/_log_softmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace fastattn {

namespace {

// out[r, :width] = x[r] · panels + bias for rows [n, n + R) of x (N, D) and P adjacent panels
// (D, 16) each, the first at output column `column`, width <= 16·P, out (N, O); with rows, each
// row's values are added to its RowLse, and without out written nowhere else. R·P panels'
// accumulators in vectors V of the level's register width (v16 on AVX-512, v8 on AVX2, v4 on
// SSE), so that they stay in registers: enough independent multiply-adds to hide their latency.
// Each output sums over d in order whatever V and R are.
template <typename V, int R, int P>
FASTATTN_INLINE void panel_rows(const float *x, int64_t n, int64_t D, const float *panel,
                                const float *bias, float *out, int64_t O, int64_t column,
                                int64_t width, RowLse *rows) {
  x += n * D;
  if (out) out += n * O;
  if (rows) rows += n;
  constexpr int kWidth = sizeof(V) / sizeof(float), kSplit = kPanel / kWidth, kVectors = P * kSplit;
  V acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < kVectors; ++q) acc[r][q] = V{};
  for (int64_t d = 0; d < D; ++d) {
    V w[kVectors];
    for (int q = 0; q < kVectors; ++q)
      w[q] = load_as<V>(panel + ((q / kSplit) * D + d) * kPanel + (q % kSplit) * kWidth);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * D + d];
      for (int q = 0; q < kVectors; ++q) acc[r][q] += xv * w[q];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) {
      const int64_t columns = std::min(kPanel, width - p * kPanel), c = column + p * kPanel;
      const float *b = bias ? bias + p * kPanel : nullptr;
      float *o = out ? out + r * O + c : nullptr;
      if constexpr (kWidth == 8) {
        // Each half from its register: through a 16-float array on the stack, two 16-byte stores
        // read back as one 32-byte load stalled store forwarding (a fifth of the AVX2 kernel's
        // time in a batch-64 decode's output layer).
        if (columns == kPanel) {
          for (int h = 0; h < 2; ++h) {
            v8 y = acc[r][p * 2 + h];
            if (b) y += load8(b + 8 * h);
            if (o) store_as<v8>(o + 8 * h, y);
            if (rows) rows[r].add8(y, c + 8 * h);
          }
          continue;
        }
      }
      if constexpr (kWidth == 16) {  // AVX-512 code: a whole panel from its register
        if (columns == kPanel) {
          v16 y = acc[r][p];
          if (b) y += load16(b);
          if (o) store_as<v16>(o, y);
          if (rows) rows[r].add16<true>(y, c);
          continue;
        }
      }
      float sums[kPanel];
      std::memcpy(sums, &acc[r][p * kSplit], sizeof(sums));
      if (columns == kPanel) {
        v16 y = load16(sums);
        if (b) y += load16(b);
        if (o) std::memcpy(o, &y, sizeof(v16));
        if (rows) rows[r].add16(y, c);
      } else {  // the last panel
        for (int64_t i = 0; b && i < columns; ++i) sums[i] += b[i];
        if (o) std::memcpy(o, sums, columns * sizeof(float));
        if (rows) rows[r].add(sums, columns, c);
      }
    }
  }
}

// Panels [p, p + P) for all N rows, R rows at a time: the panels stay in L1 while the rows pass
// over them, and the weight is read once.
template <typename V, int R, int P>
FASTATTN_INLINE void panel_group(const float *x, int64_t N, int64_t D, const float *packed,
                                 const float *bias, int64_t O, int64_t p, float *out,
                                 RowLse *rows) {
  const float *panel = packed + p * D * kPanel;
  const float *b = bias ? bias + p * kPanel : nullptr;
  const int64_t width = std::min(P * kPanel, O - p * kPanel), column = p * kPanel;
  int64_t n = 0;
  for (; n + R <= N; n += R) panel_rows<V, R, P>(x, n, D, panel, b, out, O, column, width, rows);
  if constexpr (R > 6)
    for (; n + 6 <= N; n += 6) panel_rows<V, 6, P>(x, n, D, panel, b, out, O, column, width, rows);
  switch (N - n) {
    case 5: panel_rows<V, 5, P>(x, n, D, panel, b, out, O, column, width, rows); break;
    case 4: panel_rows<V, 4, P>(x, n, D, panel, b, out, O, column, width, rows); break;
    case 3: panel_rows<V, 3, P>(x, n, D, panel, b, out, O, column, width, rows); break;
    case 2: panel_rows<V, 2, P>(x, n, D, panel, b, out, O, column, width, rows); break;
    case 1: panel_rows<V, 1, P>(x, n, D, panel, b, out, O, column, width, rows); break;
  }
}

// Panels [p0, p1), P at a time, R rows at a time. rows: none, or N rows' RowLse.
template <typename V, int R, int P>
FASTATTN_INLINE void panel_range(const float *x, int64_t N, int64_t D, const float *packed,
                                 const float *bias, int64_t O, int64_t p0, int64_t p1, float *out,
                                 RowLse *lse) {
  int64_t p = p0;
  for (; p + P <= p1; p += P) panel_group<V, R, P>(x, N, D, packed, bias, O, p, out, lse);
  for (; p < p1; ++p) panel_group<V, R, 1>(x, N, D, packed, bias, O, p, out, lse);
}

// AVX-512's 32 registers hold 12 rows × 2 panels of v16 accumulators, AVX2's 16 six rows × one
// panel of v8 pairs, SSE's 16 two rows × one panel of four v4.
#ifdef FASTATTN_X86
FASTATTN_TARGET_AVX512 void panels_avx512(const float *x, int64_t N, int64_t D, const float *packed,
                                          const float *bias, int64_t O, int64_t p0, int64_t p1,
                                          float *out, RowLse *lse) {
  panel_range<v16, 12, 2>(x, N, D, packed, bias, O, p0, p1, out, lse);
}
FASTATTN_TARGET_AVX2 void panels_avx2(const float *x, int64_t N, int64_t D, const float *packed,
                                      const float *bias, int64_t O, int64_t p0, int64_t p1,
                                      float *out, RowLse *lse) {
  panel_range<v8, 6, 1>(x, N, D, packed, bias, O, p0, p1, out, lse);
}
#endif
void panels_scalar(const float *x, int64_t N, int64_t D, const float *packed, const float *bias,
                   int64_t O, int64_t p0, int64_t p1, float *out, RowLse *lse) {
  panel_range<v4, 2, 1>(x, N, D, packed, bias, O, p0, p1, out, lse);
}

void panels(const float *x, int64_t N, int64_t D, const float *packed, const float *bias,
            int64_t O, int64_t p0, int64_t p1, float *out, RowLse *lse) {
#ifdef FASTATTN_X86
  switch (cpu_isa()) {
    case CpuIsa::kAmx:
    case CpuIsa::kAvx512: return panels_avx512(x, N, D, packed, bias, O, p0, p1, out, lse);
    case CpuIsa::kAvx2: return panels_avx2(x, N, D, packed, bias, O, p0, p1, out, lse);
    default: break;
  }
#endif
  panels_scalar(x, N, D, packed, bias, O, p0, p1, out, lse);
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

// An _out variant's out: (N, O) for x (N, D) and weight (O, D), contiguous, in x's dtype.
void check_out(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &out,
               const char *op) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == weight.size(0) && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(),
              op, ": out must be a contiguous (", x.size(0), ", ", weight.size(0),
              ") tensor in x's dtype, got ", out.sizes(), " ", out.scalar_type());
}

// Threads only pay off with some work per task: about 64k multiply-adds.
int64_t panel_grain(int64_t N, int64_t D) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, N * D * kPanel));
}

// Whether linear_cpu takes x (N, D) through the panels (given them): float32 rows where they win.
bool uses_panels(const at::Tensor &x) {
  return x.dim() == 2 && x.scalar_type() == at::kFloat && packed_linear_wins(x.size(0), x.size(1));
}

}  // namespace

FASTATTN_INLINE void subtract_rows_body(float *x, int64_t O, const float *lse, int64_t begin,
                                        int64_t end) {
  for (int64_t r = begin; r < end; ++r)
    for (int64_t c = 0; c < O; ++c) x[r * O + c] -= lse[r];
}
FASTATTN_PER_ISA(subtract_rows_at_isa, subtract_rows_body)

void subtract_rows(float *x, int64_t O, const float *lse, int64_t begin, int64_t end) {
  subtract_rows_at_isa(x, O, lse, begin, end);
}

bool packed_linear_wins(int64_t rows, int64_t depth) {
  return cpu_isa() != CpuIsa::kScalar || rows <= 32 || depth >= 512;
}

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
  if (!(packed && uses_panels(x))) return at::linear(x, weight, bias);
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  linear_out_cpu(x, weight, packed, bias, out);
  return out;
}

void linear_out_cpu(const at::Tensor &x, const at::Tensor &weight,
                    const std::optional<at::Tensor> &packed,
                    const std::optional<at::Tensor> &bias, at::Tensor &out) {
  check_out(x, weight, out, "linear");
  if (!(packed && uses_panels(x))) {
    out.copy_(at::linear(x, weight, bias));
    return;
  }
  check_packed(x, weight, *packed, bias, "linear");
  const int64_t N = x.size(0), D = x.size(1), O = weight.size(0);
  const auto xc = x.contiguous();
  const float *xp = xc.data_ptr<float>(), *pp = packed->data_ptr<float>();
  const float *bp = bias ? bias->data_ptr<float>() : nullptr;
  float *op = out.data_ptr<float>();
  at::parallel_for(0, packed->size(0), panel_grain(N, D), [&](int64_t p0, int64_t p1) {
    panels(xp, N, D, pp, bp, O, p0, p1, op, nullptr);
  });
}

at::Tensor log_softmax_linear_cpu(const at::Tensor &x, const at::Tensor &weight,
                                  const std::optional<at::Tensor> &packed) {
  if (!packed || x.dim() != 2 || x.scalar_type() != at::kFloat)
    return at::log_softmax(at::linear(x, weight), -1);
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  log_softmax_linear_out_cpu(x, weight, packed, out);
  return out;
}

void log_softmax_linear_out_cpu(const at::Tensor &x, const at::Tensor &weight,
                                const std::optional<at::Tensor> &packed, at::Tensor &out) {
  check_out(x, weight, out, "log_softmax_linear");
  if (!packed || x.scalar_type() != at::kFloat) {
    at::_log_softmax_out(out, at::linear(x, weight), -1, false);
    return;
  }
  check_packed(x, weight, *packed, std::nullopt, "log_softmax_linear");
  const int64_t N = x.size(0), D = x.size(1), O = weight.size(0);
  const auto xc = x.contiguous();
  const float *xp = xc.data_ptr<float>(), *pp = packed->data_ptr<float>();
  float *op = out.data_ptr<float>();
  log_softmax_panels(N, O, packed->size(0), panel_grain(N, D), op,
                     [&](int64_t p0, int64_t p1, RowLse *lse) {
                       panels(xp, N, D, pp, nullptr, O, p0, p1, op, lse);
                     });
}

OutputRows output_rows_cpu(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &packed,
                           int top) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "output_rows: x must be a float32 (N, D) tensor, got ", x.sizes(), " ",
              x.scalar_type());
  check_packed(x, weight, packed, std::nullopt, "output_rows");
  const int64_t N = x.size(0), D = x.size(1), O = weight.size(0);
  const auto xc = x.contiguous();
  const float *xp = xc.data_ptr<float>(), *pp = packed.data_ptr<float>();
  const int64_t count = packed.size(0);
  return output_rows(
      N, O, count, panel_grain(N, D), top,
      [&](int64_t p0, int64_t p1, RowLse *rows) {
        panels(xp, N, D, pp, nullptr, O, p0, p1, nullptr, rows);
      },
      [xc, packed, D, O, count](int64_t r, float *out) {
        panels(xc.data_ptr<float>() + r * D, 1, D, packed.data_ptr<float>(), nullptr, O, 0,
               count, out, nullptr);
      });
}

}  // namespace fastattn
