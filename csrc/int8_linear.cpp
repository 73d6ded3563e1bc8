#include "int8_linear.h"

#include "amx_tiles.h"
#include "cpu_isa.h"
#include "row_lse.h"
#include "vector_math.h"

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

constexpr int64_t kQuad = 4;                 // inputs per int32 lane of vpdpbusd
constexpr int64_t kVector = kPanel * kQuad;  // bytes of one panel row: 16 outputs × 4 inputs
constexpr int32_t kLevels = 127;             // weights, and rows on VNNI and the scalar loop
constexpr int32_t kAvx2Levels = 63;          // rows on AVX2 (block_avx2)

// One row quantized to `levels` on each side of zero: u[d] = round(x[d] / scale) + levels + 1 for
// d < D, levels + 1 (a zero) up to D4 · 4. Returns scale = max |x| / levels: 0 for a zero row,
// NaN for a row holding an inf or a NaN (its outputs are then NaN, as float32's would be).
FASTATTN_INLINE float quantize_row_body(const float *x, int64_t D, uint8_t *u, int64_t D4,
                                        int32_t levels) {
  // Sixteen lanes of max |x| and of x · 0 (NaN once any value is inf or NaN), in two v8 of each
  // (registers at AVX2 as at AVX-512): the loop over an array of lanes went element by element,
  // the row's whole cost at 128 inputs. A max is exact and x · 0 only 0 or NaN, so the order
  // does not show in the result.
  v8 max_low = {}, max_high = {}, finite_low = {}, finite_high = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const v8 low = load8(x + d), high = load8(x + d + 8);
    const v8 low_magnitude = (v8)((v8u)low & 0x7fffffffu);
    const v8 high_magnitude = (v8)((v8u)high & 0x7fffffffu);
    max_low = low_magnitude > max_low ? low_magnitude : max_low;
    max_high = high_magnitude > max_high ? high_magnitude : max_high;
    finite_low += low * 0.f;
    finite_high += high * 0.f;
  }
  float amax = max8(max_low > max_high ? max_low : max_high);
  float finite = sum8(finite_low + finite_high);
  for (; d < D; ++d) {
    amax = std::max(amax, std::fabs(x[d]));
    finite += x[d] * 0.f;
  }
  const float top = static_cast<float>(levels);
  std::fill(u, u + D4 * kQuad, static_cast<uint8_t>(levels + 1));
  if (std::isnan(finite)) return NAN;
  if (amax == 0.f) return 0.f;
  const float inverse = top / amax;
  for (int64_t d = 0; d < D; ++d) {
    const float q = std::min(top, std::max(-top, std::nearbyint(x[d] * inverse)));
    u[d] = static_cast<uint8_t>(static_cast<int32_t>(q) + levels + 1);
  }
  return amax / top;
}
FASTATTN_PER_ISA(quantize_row, quantize_row_body)

// The arguments of one product: N rows of quantized x (row stride xs bytes, scales xscale)
// against the panels, into out (N, O).
struct Int8Product {
  const uint8_t *x;
  int64_t xs;
  const float *xscale;
  int64_t N, D4, O;
  const int8_t *panels;
  const float *scales;
  const int32_t *sums;
  const float *bias;
  float *out;
};

// out[n, 16p : 16p + 16] = (acc - offset · sums) · (sx[n] · sw) + bias, the last panel's first
// columns only (no out: nowhere); with lse, the values join row n's RowLse. offset is 128 where acc
// summed the stored bytes qx + 128, 0 where it summed qx. The last panel's columns go through the
// same 16-lane arithmetic, padded: every kernel that inlines this rounds them alike. kAvx512: for
// kernels compiled for AVX-512, whose RowLse takes a panel in one 16-lane pass (the same values).
template <bool kAvx512 = false>
FASTATTN_INLINE void finish(const Int8Product &a, int64_t n, int64_t p, const int32_t *acc,
                            RowLse *lse, int32_t offset = 128) {
  const int64_t o = p * kPanel, columns = std::min(kPanel, a.O - o);
  float *out = a.out ? a.out + n * a.O + o : nullptr;
  const int32_t *sums_at = a.sums + o;
  const float *scales_at = a.scales + o, *bias_at = a.bias ? a.bias + o : nullptr;
  int32_t sums_padded[kPanel] = {};
  float scales_padded[kPanel] = {}, bias_padded[kPanel] = {};
  if (columns < kPanel) {
    std::copy(sums_at, sums_at + columns, sums_padded);
    std::copy(scales_at, scales_at + columns, scales_padded);
    if (bias_at) std::copy(bias_at, bias_at + columns, bias_padded);
    sums_at = sums_padded, scales_at = scales_padded, bias_at = bias_at ? bias_padded : nullptr;
  }
  v16i sum, sums;
  std::memcpy(&sum, acc, sizeof sum);
  std::memcpy(&sums, sums_at, sizeof sums);
  v16 y = __builtin_convertvector(sum - offset * sums, v16) * (a.xscale[n] * load16(scales_at));
  if (bias_at) y += load16(bias_at);
  if (out && columns == kPanel) std::memcpy(out, &y, sizeof y);
  else if (out) std::memcpy(out, &y, columns * sizeof(float));
  if (!lse) return;
  if (columns == kPanel) return lse->add16<kAvx512>(y, o);
  float part[kPanel];
  std::memcpy(part, &y, sizeof part);
  lse->add(part, columns, o);
}

// Panels [p0, p1) for all rows, one row and one panel at a time: the fallback of CPUs without
// AVX2, the same integers by plain multiply-adds.
FASTATTN_INLINE void panels_scalar_body(const Int8Product &a, int64_t p0, int64_t p1, RowLse *lse) {
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t *panel = a.panels + p * a.D4 * kVector;
    for (int64_t n = 0; n < a.N; ++n) {
      const uint8_t *x = a.x + n * a.xs;
      int32_t acc[kPanel] = {};
      for (int64_t k = 0; k < a.D4; ++k)
        for (int64_t c = 0; c < kPanel; ++c)
          for (int64_t b = 0; b < kQuad; ++b)
            acc[c] += int32_t{x[k * kQuad + b]} * int32_t{panel[k * kVector + c * kQuad + b]};
      finish(a, n, p, acc, lse ? lse + n : nullptr);
    }
  }
}
FASTATTN_PER_ISA(panels_scalar, panels_scalar_body)

#ifdef FASTATTN_X86

// finish for the eight columns [o, o + 8) of row n, all in the output, from their sums in one
// AVX2 register, offset 64: the sums stay in
// registers, where finish's 16-int array went through the stack (as much time as the products
// at the multi30k model's width of 128).
FASTATTN_AVX2_INLINE void finish_half(const Int8Product &a, int64_t n, int64_t o, v8i acc,
                                      RowLse *lse) {
  v8i sums;
  std::memcpy(&sums, a.sums + o, sizeof sums);
  v8 y = __builtin_convertvector(acc - (kAvx2Levels + 1) * sums, v8) *
         (a.xscale[n] * load8(a.scales + o));
  if (a.bias) y += load8(a.bias + o);
  if (a.out) store8(a.out + n * a.O + o, y);
  if (lse) lse->add8(y, o);
}

// Rows [n, n + R) against panel p on AVX2, which has no u8 × s8 dot product into int32:
// vpmaddubsw multiplies u8 by s8 and adds pairs into int16, saturating above 32767. So the rows
// are quantized to 7 bits on AVX2 (kAvx2Levels: stored bytes qx + 64 <= 127, as fbgemm's
// reduce_range does): a pair is at most 2 · 127 · 127 = 32258, exact; vpmaddwd by ones adds the
// pairs of pairs into int32. R · 2 accumulators (outputs 0-7 and 8-15).
template <int R>
FASTATTN_AVX2_INLINE void block_avx2(const Int8Product &a, int64_t n, int64_t p, RowLse *lse) {
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t *panel = a.panels + p * a.D4 * kVector;
  const uint8_t *x = a.x + n * a.xs;
  for (int64_t k = 0; k < a.D4; ++k) {
    const auto *w = reinterpret_cast<const __m256i *>(panel + k * kVector);
    const __m256i w0 = _mm256_loadu_si256(w), w1 = _mm256_loadu_si256(w + 1);
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, x + r * a.xs + k * kQuad, sizeof quad);
      const __m256i xr = _mm256_set1_epi32(quad);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(xr, w0), ones));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(xr, w1), ones));
    }
  }
  const bool whole = (p + 1) * kPanel <= a.O;
  for (int r = 0; r < R; ++r) {
    RowLse *row_lse = lse ? lse + n + r : nullptr;
    if (whole) {
      finish_half(a, n + r, p * kPanel, reinterpret_cast<v8i>(acc[r][0]), row_lse);
      finish_half(a, n + r, p * kPanel + 8, reinterpret_cast<v8i>(acc[r][1]), row_lse);
      continue;
    }
    int32_t sums[kPanel];
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(sums), acc[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(sums + 8), acc[r][1]);
    finish(a, n + r, p, sums, row_lse, kAvx2Levels + 1);
  }
}

FASTATTN_TARGET_AVX2 void panels_avx2(const Int8Product &a, int64_t p0, int64_t p1, RowLse *lse) {
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

#define FASTATTN_VNNI __attribute__((target("arch=x86-64-v4,avx512vnni")))
#define FASTATTN_VNNI_INLINE FASTATTN_VNNI inline __attribute__((always_inline))

// acc += the 4-byte dot products of u8 x and s8 w in each int32 lane. As asm: GCC 12 copies the
// intrinsic's accumulator to another register and back around every vpdpbusd (two moves per
// multiply-add), which spilled the 24 accumulators of a 12-row block to the stack.
FASTATTN_VNNI_INLINE __m512i dpbusd(__m512i acc, __m512i x, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

// Rows [n, n + R) against panels [p, p + P): R·P accumulators of 16 int32 lanes, each step one
// 4-byte broadcast of a row and one vpdpbusd per panel (64 multiply-adds), the weight vectors
// loaded once for all R rows.
template <int R, int P>
FASTATTN_VNNI_INLINE void block_vnni(const Int8Product &a, int64_t n, int64_t p, RowLse *lse) {
  __m512i acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) acc[r][q] = _mm512_setzero_si512();
  const int8_t *panel = a.panels + p * a.D4 * kVector;
  const uint8_t *x = a.x + n * a.xs;
  for (int64_t k = 0; k < a.D4; ++k) {
    __m512i w[P];
    for (int q = 0; q < P; ++q) w[q] = _mm512_loadu_si512(panel + (q * a.D4 + k) * kVector);
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, x + r * a.xs + k * kQuad, sizeof quad);
      const __m512i xr = _mm512_set1_epi32(quad);
      for (int q = 0; q < P; ++q) acc[r][q] = dpbusd(acc[r][q], xr, w[q]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < P; ++q) {
      int32_t sums[kPanel];
      _mm512_storeu_si512(sums, acc[r][q]);
      finish<true>(a, n + r, p + q, sums, lse ? lse + n + r : nullptr);
    }
  }
}

// All rows against panels [p, p + P), 12 at a time (24 accumulators, 2 weight vectors and a
// broadcast of AVX-512's 32 registers), then the rest.
template <int P>
FASTATTN_VNNI_INLINE void rows_vnni(const Int8Product &a, int64_t p, RowLse *lse) {
  int64_t n = 0;
  for (; n + 12 <= a.N; n += 12) block_vnni<12, P>(a, n, p, lse);
  for (; n + 6 <= a.N; n += 6) block_vnni<6, P>(a, n, p, lse);
  switch (a.N - n) {
    case 5: block_vnni<5, P>(a, n, p, lse); break;
    case 4: block_vnni<4, P>(a, n, p, lse); break;
    case 3: block_vnni<3, P>(a, n, p, lse); break;
    case 2: block_vnni<2, P>(a, n, p, lse); break;
    case 1: block_vnni<1, P>(a, n, p, lse); break;
  }
}

// At most four rows (one sentence's beam) against four panels at a time: the few rows leave
// the weights' loads the bottleneck, and four weight vectors per broadcast halve the broadcasts.
FASTATTN_VNNI_INLINE void few_rows_vnni(const Int8Product &a, int64_t p, RowLse *lse) {
  switch (a.N) {
    case 4: block_vnni<4, 4>(a, 0, p, lse); break;
    case 3: block_vnni<3, 4>(a, 0, p, lse); break;
    case 2: block_vnni<2, 4>(a, 0, p, lse); break;
    case 1: block_vnni<1, 4>(a, 0, p, lse); break;
  }
}

FASTATTN_VNNI void panels_vnni(const Int8Product &a, int64_t p0, int64_t p1, RowLse *lse) {
  int64_t p = p0;
  if (a.N <= 4)
    for (; p + 4 <= p1; p += 4) few_rows_vnni(a, p, lse);
  for (; p + 2 <= p1; p += 2) rows_vnni<2>(a, p, lse);
  for (; p < p1; ++p) rows_vnni<1>(a, p, lse);
}

// From 16 rows, AMX's tdpbusd on the panels as they lie (amx_tiles.h): the same bytes and sums as
// vpdpbusd, scaled back by the same finish. Products only: the log-softmax stays on VNNI
// (run_panels).
FASTATTN_AMX void panels_amx(const Int8Product &a, int64_t p0, int64_t p1) {
  // always_inline: a lambda does not take the function's target, and inlined it is built with it.
  const auto finish_row = [&](int64_t n, int64_t p, const int32_t *sums)
                              __attribute__((always_inline)) { finish<true>(a, n, p, sums, nullptr); };
  amx_panels<false, int32_t>(a.x, a.xs, a.N, a.D4, a.panels, p0, p1, finish_row);
}
#endif

enum class Int8Kernel { kAmx, kVnni, kAvx2, kScalar };

Int8Kernel int8_kernel() {
#ifdef FASTATTN_X86
  if (cpu_isa() == CpuIsa::kAmx) return Int8Kernel::kAmx;
  if (use_avx512_vnni()) return Int8Kernel::kVnni;
  if (cpu_isa() >= CpuIsa::kAvx2) return Int8Kernel::kAvx2;
#endif
  return Int8Kernel::kScalar;
}

void run_panels(const Int8Product &a, int64_t p0, int64_t p1, RowLse *lse) {
  switch (int8_kernel()) {
#ifdef FASTATTN_X86
    // The output layer's log-softmax (lse) stays on VNNI: its exponentials ran slower beside
    // the tiles than the tiles saved (a whole decoder, multi30k int8 batch 16/64: 6-8% faster so).
    case Int8Kernel::kAmx:
      return a.N >= kAmxRows && !lse ? panels_amx(a, p0, p1) : panels_vnni(a, p0, p1, lse);
    case Int8Kernel::kVnni: return panels_vnni(a, p0, p1, lse);
    case Int8Kernel::kAvx2: return panels_avx2(a, p0, p1, lse);
#endif
    default: return panels_scalar(a, p0, p1, lse);
  }
}

void check_quantized(const at::Tensor &x, const at::Tensor &panels, const at::Tensor &scales,
                     const at::Tensor &sums, const char *op) {
  const int64_t O = scales.size(0);
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kChar &&
                  panels.is_contiguous() && panels.size(0) == (O + kPanel - 1) / kPanel &&
                  panels.size(2) == kPanel && panels.size(3) == kQuad,
              op, ": panels must be quantize_linear_weight's int8 (ceil(O / 16), ceil(D / 4), 16, "
              "4) for O = ", O, ", got ", panels.sizes(), " ", panels.scalar_type());
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  sums.dim() == 1 && sums.size(0) == O && sums.scalar_type() == at::kInt &&
                  sums.is_contiguous(),
              op, ": scales must be float32 (O) and sums int32 (O), contiguous");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat &&
                  (x.size(1) + kQuad - 1) / kQuad == panels.size(1),
              op, ": x must be float32 (N, D) with ceil(D / 4) = ", panels.size(1), ", got ",
              x.sizes(), " ", x.scalar_type());
}

// x quantized row by row into `bytes` (N rows of D4 · 4) and `xscale` (N), to the levels the
// kernel in use takes (7 bits on AVX2).
Int8Product quantize_input(const at::Tensor &x, const at::Tensor &panels,
                           const at::Tensor &scales, const at::Tensor &sums,
                           std::vector<uint8_t> &bytes, std::vector<float> &xscale) {
  const int64_t N = x.size(0), D = x.size(1), D4 = panels.size(1);
  const auto xc = x.contiguous();
  bytes.resize(amx_padded_rows(N) * D4 * kQuad);  // the tiles read whole blocks of rows
  xscale.resize(N);
  const float *xp = xc.data_ptr<float>();
  const int32_t levels = int8_kernel() == Int8Kernel::kAvx2 ? kAvx2Levels : kLevels;
  for (int64_t n = 0; n < N; ++n)
    xscale[n] = quantize_row(xp + n * D, D, bytes.data() + n * D4 * kQuad, D4, levels);
  return Int8Product{bytes.data(), D4 * kQuad, xscale.data(), N, D4, scales.size(0),
                     panels.data_ptr<int8_t>(), scales.data_ptr<float>(),
                     sums.data_ptr<int32_t>(), nullptr, nullptr};
}

// Threads only pay off with some work per task: about 256k multiply-adds (4 per byte of a
// vpdpbusd, four times the float32 panels' 64k).
int64_t panel_grain(int64_t N, int64_t D4) {
  return std::max<int64_t>(1, 262144 / std::max<int64_t>(1, N * D4 * kVector));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_linear_weight_cpu(
    const at::Tensor &weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "quantize_linear_weight: weight must be a float32 (out_features, in_features) "
              "tensor, got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t O = weight.size(0), D = weight.size(1), D4 = (D + kQuad - 1) / kQuad;
  const int64_t count = (O + kPanel - 1) / kPanel;
  auto panels = at::zeros({count, D4, kPanel, kQuad}, weight.options().dtype(at::kChar));
  auto scales = at::empty({O}, weight.options());
  auto sums = at::empty({O}, weight.options().dtype(at::kInt));
  const auto wc = weight.contiguous();
  const float *wp = wc.data_ptr<float>();
  int8_t *pp = panels.data_ptr<int8_t>();
  float *sp = scales.data_ptr<float>();
  int32_t *sump = sums.data_ptr<int32_t>();
  at::parallel_for(0, O, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> row(D4 * kQuad);
    for (int64_t o = begin; o < end; ++o) {
      sp[o] = quantize_row(wp + o * D, D, row.data(), D4, kLevels);
      int32_t sum = 0;
      int8_t *panel = pp + (o / kPanel) * D4 * kVector + (o % kPanel) * kQuad;
      for (int64_t d = 0; d < D4 * kQuad; ++d) {
        const int8_t q = static_cast<int8_t>(int32_t{row[d]} - 128);
        panel[(d / kQuad) * kVector + d % kQuad] = q;
        sum += q;
      }
      sump[o] = sum;
    }
  });
  return {panels, scales, sums};
}

at::Tensor dequantize_rows_cpu(const at::Tensor &panels, const at::Tensor &scales,
                               const at::Tensor &rows, int64_t D) {
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kChar && panels.is_contiguous() &&
                  scales.dim() == 1 && scales.scalar_type() == at::kFloat &&
                  0 < D && D <= panels.size(1) * kQuad,
              "dequantize_rows: need quantize_linear_weight's panels and scales and 0 < D <= ",
              panels.size(1) * kQuad, ", got ", panels.sizes(), ", ", scales.sizes(), ", D ", D);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong,
              "dequantize_rows: rows must be an int64 (N) tensor, got ", rows.sizes(), " ",
              rows.scalar_type());
  const int64_t N = rows.size(0), O = scales.size(0), D4 = panels.size(1);
  const auto rc = rows.contiguous();
  const int64_t *rp = rc.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(0 <= rp[n] && rp[n] < O, "dequantize_rows: row ", rp[n], " is outside 0..",
                O - 1);
  auto out = at::empty({N, D}, scales.options());
  const int8_t *pp = panels.data_ptr<int8_t>();
  const float *sp = scales.contiguous().data_ptr<float>();
  float *op = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const int8_t *panel = pp + (rp[n] / kPanel) * D4 * kVector + (rp[n] % kPanel) * kQuad;
    for (int64_t d = 0; d < D; ++d)
      op[n * D + d] = static_cast<float>(panel[(d / kQuad) * kVector + d % kQuad]) * sp[rp[n]];
  }
  return out;
}

at::Tensor linear_int8_cpu(const at::Tensor &x, const at::Tensor &panels,
                           const at::Tensor &scales, const at::Tensor &sums,
                           const std::optional<at::Tensor> &bias) {
  check_quantized(x, panels, scales, sums, "linear_int8");
  auto out = at::empty({x.size(0), scales.size(0)}, x.options());
  linear_int8_out_cpu(x, panels, scales, sums, bias, out);
  return out;
}

void linear_int8_out_cpu(const at::Tensor &x, const at::Tensor &panels, const at::Tensor &scales,
                         const at::Tensor &sums, const std::optional<at::Tensor> &bias,
                         at::Tensor &out) {
  check_quantized(x, panels, scales, sums, "linear_int8");
  const int64_t O = scales.size(0);
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == O &&
                        bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              "linear_int8: bias must be a contiguous float32 (", O, ") tensor");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == O &&
                  out.is_contiguous() && out.scalar_type() == at::kFloat,
              "linear_int8: out must be a contiguous float32 (", x.size(0), ", ", O,
              ") tensor, got ", out.sizes(), " ", out.scalar_type());
  // Per thread, kept between calls: a decoding step makes several products of a few rows.
  thread_local std::vector<uint8_t> bytes;
  thread_local std::vector<float> xscale;
  auto product = quantize_input(x, panels, scales, sums, bytes, xscale);
  product.bias = bias ? bias->data_ptr<float>() : nullptr;
  product.out = out.data_ptr<float>();
  at::parallel_for(0, panels.size(0), panel_grain(product.N, product.D4),
                   [&](int64_t p0, int64_t p1) { run_panels(product, p0, p1, nullptr); });
}

at::Tensor log_softmax_linear_int8_cpu(const at::Tensor &x, const at::Tensor &panels,
                                       const at::Tensor &scales, const at::Tensor &sums) {
  auto out = at::empty({x.size(0), scales.size(0)}, x.options());
  log_softmax_linear_int8_out_cpu(x, panels, scales, sums, out);
  return out;
}

void log_softmax_linear_int8_out_cpu(const at::Tensor &x, const at::Tensor &panels,
                                     const at::Tensor &scales, const at::Tensor &sums,
                                     at::Tensor &out) {
  check_quantized(x, panels, scales, sums, "log_softmax_linear_int8");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == scales.size(0) &&
                  out.is_contiguous() && out.scalar_type() == at::kFloat,
              "log_softmax_linear_int8: out must be a contiguous float32 (", x.size(0), ", ",
              scales.size(0), ") tensor, got ", out.sizes(), " ", out.scalar_type());
  // Per thread, kept between calls: a decoding step makes several products of a few rows.
  thread_local std::vector<uint8_t> bytes;
  thread_local std::vector<float> xscale;
  auto product = quantize_input(x, panels, scales, sums, bytes, xscale);
  product.out = out.data_ptr<float>();
  log_softmax_panels(product.N, product.O, panels.size(0), panel_grain(product.N, product.D4),
                     product.out, [&](int64_t p0, int64_t p1, RowLse *lse) {
                       run_panels(product, p0, p1, lse);
                     });
}

OutputRows output_rows_int8_cpu(const at::Tensor &x, const at::Tensor &panels,
                                const at::Tensor &scales, const at::Tensor &sums, int top) {
  check_quantized(x, panels, scales, sums, "output_rows_int8");
  // The quantized rows kept for recomputing one: the thread's buffers serve the next product.
  auto bytes = std::make_shared<std::vector<uint8_t>>();
  auto xscale = std::make_shared<std::vector<float>>();
  const auto product = quantize_input(x, panels, scales, sums, *bytes, *xscale);
  return output_rows(
      product.N, product.O, panels.size(0), panel_grain(product.N, product.D4), top,
      [&](int64_t p0, int64_t p1, RowLse *rows) { run_panels(product, p0, p1, rows); },
      [product, bytes, xscale, panels, scales, sums](int64_t r, float *out) {
        Int8Product row = product;
        row.x += r * row.xs, row.xscale += r, row.N = 1, row.out = out;
        run_panels(row, 0, panels.size(0), nullptr);
      });
}

std::string int8_kernel_cpu() {
  switch (int8_kernel()) {
    case Int8Kernel::kAmx: return "amx-int8";
    case Int8Kernel::kVnni: return "avx512-vnni";
    case Int8Kernel::kAvx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace fastattn
