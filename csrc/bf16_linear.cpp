#include "bf16_linear.h"

#include "amx_tiles.h"
#include "cpu_isa.h"
#include "row_lse.h"
#include "vector_math.h"

#include <ATen/TensorIndexing.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

namespace fastattn {

namespace {

constexpr int64_t kPair = 2;                 // inputs per float32 lane of vdpbf16ps
constexpr int64_t kVector = kPanel * kPair;  // bfloat16s of one panel row: 16 outputs × 2 inputs

// float32 -> bfloat16 bits, rounded to nearest even; a NaN stays a NaN.
FASTATTN_INLINE uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (std::isnan(x)) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

FASTATTN_INLINE float from_bf16(uint16_t h) {
  const uint32_t bits = uint32_t{h} << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// N rows of bfloat16 x (row stride xs, D2 pairs each) against the panels, into out (N, O).
struct Bf16Product {
  const uint16_t *x;
  int64_t xs, N, D2, O;
  const uint16_t *panels;
  const float *bias;
  float *out;
};

// out[n, 16p : 16p + 16] = acc + bias, the last panel's first columns only (no out: nowhere);
// with lse, the values join row n's RowLse (kAvx512: in one 16-lane pass, for AVX-512 kernels).
template <bool kAvx512 = false>
FASTATTN_INLINE void finish(const Bf16Product &a, int64_t n, int64_t p, const float *acc,
                            RowLse *lse) {
  const int64_t o = p * kPanel, columns = std::min(kPanel, a.O - o);
  float *out = a.out ? a.out + n * a.O + o : nullptr;
  if (columns == kPanel) {
    v16 y = load16(acc);
    if (a.bias) y += load16(a.bias + o);
    if (out) std::memcpy(out, &y, sizeof y);
    if (lse) lse->add16<kAvx512>(y, o);
    return;
  }
  float y[kPanel];
  for (int64_t c = 0; c < columns; ++c) y[c] = acc[c] + (a.bias ? a.bias[o + c] : 0.f);
  if (out) std::memcpy(out, y, columns * sizeof(float));
  if (lse) lse->add(y, columns, o);
}

// The fallback of CPUs without AVX2: vdpbf16ps's sums in its order (the odd input of a
// pair first; products of two bfloat16s are exact in float32). Not loop-vectorised: GCC 12.2's
// loop vectoriser miscompiles these sums at -O3 (six products of ones summed to 7), written
// with the loops either way round.
__attribute__((optimize("no-tree-loop-vectorize"))) void panels_scalar(const Bf16Product &a, int64_t p0, int64_t p1, RowLse *lse) {
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t *panel = a.panels + p * a.D2 * kVector;
    for (int64_t n = 0; n < a.N; ++n) {
      const uint16_t *x = a.x + n * a.xs;
      float acc[kPanel];
      for (int64_t c = 0; c < kPanel; ++c) {
        float sum = 0;
        for (int64_t k = 0; k < a.D2; ++k) {
          const uint16_t *w = panel + k * kVector + c * kPair;
          sum += from_bf16(x[k * kPair + 1]) * from_bf16(w[1]);
          sum += from_bf16(x[k * kPair]) * from_bf16(w[0]);
        }
        acc[c] = sum;
      }
      finish(a, n, p, acc, lse ? lse + n : nullptr);
    }
  }
}

#ifdef FASTATTN_X86
// The eight columns [o, o + 8) of row n from their sums in one AVX2 register: through an array
// on the stack, the halves' stores and the whole-vector load stall store forwarding
// (csrc/packed_linear.cpp).
FASTATTN_AVX2_INLINE void finish_half(const Bf16Product &a, int64_t n, int64_t o, v8 y,
                                      RowLse *lse) {
  if (a.bias) y += load8(a.bias + o);
  if (a.out) store_as<v8>(a.out + n * a.O + o, y);
  if (lse) lse->add8(y, o);
}

// Rows [n, n + R) against panel p on AVX2, which has no vdpbf16ps: the same sums in the same
// order from float32 multiply-adds. A bfloat16 is the upper half of a float32, so a pair's
// 32-bit lane (even input low, odd input high) gives the odd input masked and the even one
// shifted up; a product of two bfloat16s is exact in float32, so each fma rounds once, as
// vdpbf16ps's additions do (bit for bit with panels_scalar). R · 2 accumulators (outputs 0-7,
// 8-15), four weight vectors and a row's two inputs: 15 of the 16 registers at R = 4.
template <int R>
FASTATTN_AVX2_INLINE void block_avx2(const Bf16Product &a, int64_t n, int64_t p, RowLse *lse) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const uint16_t *panel = a.panels + p * a.D2 * kVector;
  const uint16_t *x = a.x + n * a.xs;
  for (int64_t k = 0; k < a.D2; ++k) {
    const auto *w = reinterpret_cast<const __m256i *>(panel + k * kVector);
    const __m256i w0 = _mm256_loadu_si256(w), w1 = _mm256_loadu_si256(w + 1);
    const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(w0, high));
    const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
    const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(w1, high));
    const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * a.xs + k * kPair, sizeof pair);
      const __m256i xr = _mm256_set1_epi32(pair);
      const __m256 xo = _mm256_castsi256_ps(_mm256_and_si256(xr, high));
      const __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(xr, 16));
      acc[r][0] = _mm256_fmadd_ps(xe, even0, _mm256_fmadd_ps(xo, odd0, acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(xe, even1, _mm256_fmadd_ps(xo, odd1, acc[r][1]));
    }
  }
  const bool whole = (p + 1) * kPanel <= a.O;
  for (int r = 0; r < R; ++r) {
    RowLse *row_lse = lse ? lse + n + r : nullptr;
    if (whole) {
      finish_half(a, n + r, p * kPanel, reinterpret_cast<v8>(acc[r][0]), row_lse);
      finish_half(a, n + r, p * kPanel + 8, reinterpret_cast<v8>(acc[r][1]), row_lse);
      continue;
    }
    float sums[kPanel];
    _mm256_storeu_ps(sums, acc[r][0]);
    _mm256_storeu_ps(sums + 8, acc[r][1]);
    finish(a, n + r, p, sums, row_lse);
  }
}

FASTATTN_TARGET_AVX2 void panels_avx2(const Bf16Product &a, int64_t p0, int64_t p1, RowLse *lse) {
  for (int64_t p = p0; p < p1; ++p) {
    int64_t n = 0;
    for (; n + 4 <= a.N; n += 4) block_avx2<4>(a, n, p, lse);
    switch (a.N - n) {
      case 3: block_avx2<3>(a, n, p, lse); break;
      case 2: block_avx2<2>(a, n, p, lse); break;
      case 1: block_avx2<1>(a, n, p, lse); break;
    }
  }
}

#define FASTATTN_BF16 __attribute__((target("arch=x86-64-v4,avx512bf16")))
#define FASTATTN_BF16_INLINE FASTATTN_BF16 inline __attribute__((always_inline))

// acc += the pairwise products of x and w in each float32 lane. As asm for the reason
// int8_linear.cpp's dpbusd gives: GCC 12 moves the intrinsic's accumulator around each one.
FASTATTN_BF16_INLINE __m512 dpbf16(__m512 acc, __m512 x, __m512 w) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

// Rows [n, n + R) against panels [p, p + P): R·P accumulators, one broadcast of a row's pair
// and one vdpbf16ps per panel (32 multiply-adds) per step, each weight vector loaded once.
template <int R, int P>
FASTATTN_BF16_INLINE void block_bf16(const Bf16Product &a, int64_t n, int64_t p, RowLse *lse) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) acc[r][q] = _mm512_setzero_ps();
  const uint16_t *panel = a.panels + p * a.D2 * kVector;
  const uint16_t *x = a.x + n * a.xs;
  for (int64_t k = 0; k < a.D2; ++k) {
    __m512 w[P];
    for (int q = 0; q < P; ++q) w[q] = _mm512_loadu_ps(panel + (q * a.D2 + k) * kVector);
    for (int r = 0; r < R; ++r) {
      float pair;
      std::memcpy(&pair, x + r * a.xs + k * kPair, sizeof pair);
      const __m512 xr = _mm512_set1_ps(pair);
      for (int q = 0; q < P; ++q) acc[r][q] = dpbf16(acc[r][q], xr, w[q]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < P; ++q) {
      float sums[kPanel];
      _mm512_storeu_ps(sums, acc[r][q]);
      finish<true>(a, n + r, p + q, sums, lse ? lse + n + r : nullptr);
    }
  }
}

template <int P>
FASTATTN_BF16_INLINE void rows_bf16(const Bf16Product &a, int64_t p, RowLse *lse) {
  int64_t n = 0;
  for (; n + 12 <= a.N; n += 12) block_bf16<12, P>(a, n, p, lse);
  for (; n + 6 <= a.N; n += 6) block_bf16<6, P>(a, n, p, lse);
  switch (a.N - n) {
    case 5: block_bf16<5, P>(a, n, p, lse); break;
    case 4: block_bf16<4, P>(a, n, p, lse); break;
    case 3: block_bf16<3, P>(a, n, p, lse); break;
    case 2: block_bf16<2, P>(a, n, p, lse); break;
    case 1: block_bf16<1, P>(a, n, p, lse); break;
  }
}

FASTATTN_BF16 void panels_bf16(const Bf16Product &a, int64_t p0, int64_t p1, RowLse *lse) {
  int64_t p = p0;
  for (; p + 2 <= p1; p += 2) rows_bf16<2>(a, p, lse);
  for (; p < p1; ++p) rows_bf16<1>(a, p, lse);
}

// From 16 rows, AMX's tdpbf16ps on the panels as they lie (amx_tiles.h): float32 sums of the same
// products, added in the tile's own order.
FASTATTN_AMX void panels_amx(const Bf16Product &a, int64_t p0, int64_t p1, RowLse *lse) {
  // always_inline: a lambda does not take the function's target, and inlined it is built with it.
  const auto finish_row = [&](int64_t n, int64_t p, const float *sums)
                              __attribute__((always_inline)) {
    finish<true>(a, n, p, sums, lse ? lse + n : nullptr);
  };
  amx_panels<true, float>(a.x, a.xs * sizeof(uint16_t), a.N, a.D2, a.panels, p0, p1, finish_row);
}
#endif

enum class Bf16Kernel { kAmx, kAvx512Bf16, kAvx2, kScalar };

Bf16Kernel bf16_kernel() {
#ifdef FASTATTN_X86
  if (cpu_isa() == CpuIsa::kAmx) return Bf16Kernel::kAmx;
  if (use_avx512_bf16()) return Bf16Kernel::kAvx512Bf16;
  if (cpu_isa() >= CpuIsa::kAvx2) return Bf16Kernel::kAvx2;
#endif
  return Bf16Kernel::kScalar;
}

void run_panels(const Bf16Product &a, int64_t p0, int64_t p1, RowLse *lse) {
  switch (bf16_kernel()) {
#ifdef FASTATTN_X86
    case Bf16Kernel::kAmx:
      return a.N >= kAmxRows ? panels_amx(a, p0, p1, lse) : panels_bf16(a, p0, p1, lse);
    case Bf16Kernel::kAvx512Bf16: return panels_bf16(a, p0, p1, lse);
    case Bf16Kernel::kAvx2: return panels_avx2(a, p0, p1, lse);
#endif
    default: return panels_scalar(a, p0, p1, lse);
  }
}

void check_packed(const at::Tensor &x, const at::Tensor &panels, int64_t O, const char *op) {
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kBFloat16 &&
                  panels.is_contiguous() && panels.size(0) == (O + kPanel - 1) / kPanel &&
                  panels.size(2) == kPanel && panels.size(3) == kPair,
              op, ": panels must be pack_linear_weight_bf16's (ceil(O / 16), ceil(D / 2), 16, 2) "
              "bfloat16 for O = ", O, ", got ", panels.sizes(), " ", panels.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat &&
                  (x.size(1) + kPair - 1) / kPair == panels.size(1),
              op, ": x must be float32 (N, D) with ceil(D / 2) = ", panels.size(1), ", got ",
              x.sizes(), " ", x.scalar_type());
}

// x rounded row by row to bfloat16 pairs into `rows` (N rows of D2 · 2, zero past D, and zero
// rows up to amx_padded_rows(N)).
Bf16Product round_input(const at::Tensor &x, const at::Tensor &panels, int64_t O,
                        std::vector<uint16_t> &rows) {
  const int64_t N = x.size(0), D = x.size(1), D2 = panels.size(1);
  const auto xc = x.contiguous();
  const float *xp = xc.data_ptr<float>();
  rows.assign(amx_padded_rows(N) * D2 * kPair, 0);  // the tiles read whole blocks of rows
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) rows[n * D2 * kPair + d] = to_bf16(xp[n * D + d]);
  const auto *pp = reinterpret_cast<const uint16_t *>(panels.data_ptr<at::BFloat16>());
  return Bf16Product{rows.data(), D2 * kPair, N, D2, O, pp, nullptr, nullptr};
}

// Threads only pay off with some work per task: about 128k multiply-adds.
int64_t panel_grain(int64_t N, int64_t D2) {
  return std::max<int64_t>(1, 131072 / std::max<int64_t>(1, N * D2 * kVector));
}

}  // namespace

at::Tensor pack_linear_weight_bf16_cpu(const at::Tensor &weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_linear_weight_bf16: weight must be a float32 (out_features, in_features) "
              "tensor, got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t O = weight.size(0), D = weight.size(1), D2 = (D + kPair - 1) / kPair;
  const int64_t count = (O + kPanel - 1) / kPanel;
  auto padded = at::zeros({count * kPanel, D2 * kPair}, weight.options());
  padded.narrow(0, 0, O).narrow(1, 0, D).copy_(weight);
  // (count, 16, D2, 2) -> (count, D2, 16, 2); ATen's float -> bfloat16 rounds to nearest even.
  return padded.view({count, kPanel, D2, kPair}).transpose(1, 2).contiguous().to(at::kBFloat16);
}

at::Tensor unpack_rows_bf16_cpu(const at::Tensor &panels, const at::Tensor &rows, int64_t D) {
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kBFloat16 &&
                  panels.size(2) == kPanel && panels.size(3) == kPair && 0 < D &&
                  D <= panels.size(1) * kPair,
              "unpack_rows_bf16: need pack_linear_weight_bf16's panels and 0 < D <= ",
              panels.size(1) * kPair, ", got ", panels.sizes(), ", D ", D);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong,
              "unpack_rows_bf16: rows must be an int64 (N) tensor, got ", rows.sizes(), " ",
              rows.scalar_type());
  const int64_t O = panels.size(0) * kPanel;
  const auto rc = rows.contiguous();
  const int64_t *rp = rc.data_ptr<int64_t>();
  for (int64_t n = 0; n < rows.size(0); ++n)
    TORCH_CHECK(0 <= rp[n] && rp[n] < O, "unpack_rows_bf16: row ", rp[n], " is outside 0..",
                O - 1);
  // panels[row / 16, :, row % 16, :] is the row's D2 pairs, in order.
  const auto chunk = rc.div(kPanel, "floor"), lane = rc.remainder(kPanel);
  using at::indexing::Slice;
  return panels.index({chunk, Slice(), lane}).flatten(1).narrow(1, 0, D).to(at::kFloat);
}

at::Tensor linear_bf16_cpu(const at::Tensor &x, const at::Tensor &panels,
                           const std::optional<at::Tensor> &bias, int64_t out_features) {
  check_packed(x, panels, out_features, "linear_bf16");
  auto out = at::empty({x.size(0), out_features}, x.options());
  linear_bf16_out_cpu(x, panels, bias, out);
  return out;
}

void linear_bf16_out_cpu(const at::Tensor &x, const at::Tensor &panels,
                         const std::optional<at::Tensor> &bias, at::Tensor &out) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.is_contiguous() &&
                  out.scalar_type() == at::kFloat,
              "linear_bf16: out must be a contiguous float32 (", x.size(0), ", O) tensor, got ",
              out.sizes(), " ", out.scalar_type());
  const int64_t out_features = out.size(1);
  check_packed(x, panels, out_features, "linear_bf16");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == out_features &&
                        bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              "linear_bf16: bias must be a contiguous float32 (", out_features, ") tensor");
  // Per thread, kept between calls: a decoding step makes several products of a few rows.
  thread_local std::vector<uint16_t> rows;
  auto product = round_input(x, panels, out_features, rows);
  product.bias = bias ? bias->data_ptr<float>() : nullptr;
  product.out = out.data_ptr<float>();
  at::parallel_for(0, panels.size(0), panel_grain(product.N, product.D2),
                   [&](int64_t p0, int64_t p1) { run_panels(product, p0, p1, nullptr); });
}

void log_softmax_linear_bf16_out_cpu(const at::Tensor &x, const at::Tensor &panels,
                                     at::Tensor &out) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.is_contiguous() &&
                  out.scalar_type() == at::kFloat,
              "log_softmax_linear_bf16: out must be a contiguous float32 (", x.size(0),
              ", O) tensor, got ", out.sizes(), " ", out.scalar_type());
  check_packed(x, panels, out.size(1), "log_softmax_linear_bf16");
  std::vector<uint16_t> rows;
  auto product = round_input(x, panels, out.size(1), rows);
  product.out = out.data_ptr<float>();
  log_softmax_panels(product.N, product.O, panels.size(0), panel_grain(product.N, product.D2),
                     product.out, [&](int64_t p0, int64_t p1, RowLse *lse) {
                       run_panels(product, p0, p1, lse);
                     });
}

at::Tensor log_softmax_linear_bf16_cpu(const at::Tensor &x, const at::Tensor &panels,
                                       int64_t out_features) {
  auto out = at::empty({x.size(0), out_features}, x.options());
  log_softmax_linear_bf16_out_cpu(x, panels, out);
  return out;
}

OutputRows output_rows_bf16_cpu(const at::Tensor &x, const at::Tensor &panels, int64_t O,
                                int top) {
  check_packed(x, panels, O, "output_rows_bf16");
  auto rows = std::make_shared<std::vector<uint16_t>>();  // kept for recomputing one
  const auto product = round_input(x, panels, O, *rows);
  return output_rows(
      product.N, O, panels.size(0), panel_grain(product.N, product.D2), top,
      [&](int64_t p0, int64_t p1, RowLse *lse) { run_panels(product, p0, p1, lse); },
      [product, rows, panels](int64_t r, float *out) {
        Bf16Product row = product;
        row.x += r * row.xs, row.N = 1, row.out = out;
        run_panels(row, 0, panels.size(0), nullptr);
      });
}

std::string bf16_kernel_cpu() {
  switch (bf16_kernel()) {
    case Bf16Kernel::kAmx: return "amx-bf16";
    case Bf16Kernel::kAvx512Bf16: return "avx512-bf16";
    case Bf16Kernel::kAvx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace fastattn
