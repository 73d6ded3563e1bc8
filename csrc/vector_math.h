// Small inline math that GCC vectorises, shared by the CPU loops (attention, decoding).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace fastattn {

// For helpers and kernel bodies: inlined into each instruction-set level's function
// (FASTATTN_PER_ISA, cpu_isa.h), they compile for that level; a call per element would also cost
// more than its arithmetic.
#define FASTATTN_INLINE inline __attribute__((always_inline))

// Eight floats as one value: GCC emits one AVX register per v8 (two SSE registers in the baseline
// clone), where plain loops over short rows were left scalar or wrapped in peeling code.
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));
// Sixteen floats: one AVX-512 register, two AVX ones, for the matrix products, where AVX-512's
// twice wider multiply-adds double the throughput on CPUs with two 512-bit FMA units.
typedef float v16 __attribute__((vector_size(64), aligned(4)));

FASTATTN_INLINE v8 load8(const float *p) { return *reinterpret_cast<const v8 *>(p); }
FASTATTN_INLINE void store8(float *p, v8 a) { *reinterpret_cast<v8 *>(p) = a; }

FASTATTN_INLINE v16 load16(const float *p) { return *reinterpret_cast<const v16 *>(p); }
FASTATTN_INLINE void store16(float *p, v16 a) { *reinterpret_cast<v16 *>(p) = a; }

// A vector V of floats read or written at any alignment, through a local copy: arrays of them then
// stay in registers, where GCC 12 kept an array filled by memcpy straight into its elements
// on the stack (AVX2's matrix-product accumulators: a load and a store per multiply-add).
template <typename V>
FASTATTN_INLINE V load_as(const float *p) {
  V x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
template <typename V>
FASTATTN_INLINE void store_as(float *p, V x) {
  std::memcpy(p, &x, sizeof x);
}

typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));

// bfloat16 is the upper half of a float32: widening is a shift, narrowing rounds to nearest
// even (a NaN whose payload sits only in the low half would become inf: both are caught by the
// trainer's non-finite guard).
FASTATTN_INLINE v8 load8(const c10::BFloat16 *p) {
  v8h h;
  std::memcpy(&h, p, sizeof h);
  const v8u bits = __builtin_convertvector(h, v8u) << 16;
  v8 out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

FASTATTN_INLINE void store8(c10::BFloat16 *p, v8 a) {
  v8u bits;
  std::memcpy(&bits, &a, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  const v8h h = __builtin_convertvector(bits >> 16, v8h);
  std::memcpy(p, &h, sizeof h);
}

FASTATTN_INLINE float sum8(v8 a) {
  v4 s = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  s += __builtin_shufflevector(s, s, 2, 3, 0, 1);
  s += __builtin_shufflevector(s, s, 1, 0, 3, 2);
  return s[0];
}

// q · k over n elements, in 16 independent partial sums so that the loop vectorises without
// reassociating one running sum (which -O3 alone may not do for floating point).
template <typename scalar_t>
FASTATTN_INLINE scalar_t dot_lanes(const scalar_t *q, const scalar_t *k, int64_t n) {
  constexpr int64_t kLanes = 16;
  scalar_t partial[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) partial[l] += q[d + l] * k[d + l];
  scalar_t s = 0;
  for (; d < n; ++d) s += q[d] * k[d];
  for (int64_t l = 0; l < kLanes; ++l) s += partial[l];
  return s;
}

template <typename scalar_t>
FASTATTN_INLINE scalar_t dot(const scalar_t *q, const scalar_t *k, int64_t n) {
  return dot_lanes(q, k, n);
}

// Head widths that are multiples of 8 (all the paper's): one vector accumulator, one reduction.
template <>
FASTATTN_INLINE float dot<float>(const float *q, const float *k, int64_t n) {
  if (n % 8 != 0 || n == 0) return dot_lanes(q, k, n);
  v8 acc = load8(q) * load8(k);
  for (int64_t d = 8; d < n; d += 8) acc += load8(q + d) * load8(k + d);
  return sum8(acc);
}

// e^x for x <= 0 (x minus a maximum), vectorisable where std::exp compiles to a scalar call:
// 2^k · e^r with k = round(x / ln 2), |r| <= ln(2) / 2 and e^r by its Taylor polynomial to r^7
// (relative error below 2^-23). Below -87 (e^-87 is near FLT_MIN), and for -inf, it is 0.
template <typename float_t>
FASTATTN_INLINE float_t exp_polynomial(float_t r) {
  float_t e = r * (1.0f / 5040) + 1.0f / 720;
  e = e * r + 1.0f / 120;
  e = e * r + 1.0f / 24;
  e = e * r + 1.0f / 6;
  e = e * r + 0.5f;
  e = e * r + 1.0f;
  return e * r + 1.0f;
}

FASTATTN_INLINE float exp_nonpositive(float x) {
  const float y = x < -87.0f ? -87.0f : x;  // keeps 2^k a normal float
  const int32_t k = -static_cast<int32_t>(y * -1.44269504f + 0.5f);  // round(y / ln 2), y <= 0
  const float r = (y - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
  const int32_t bits = (k + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return static_cast<float>(x >= -87.0f) * (exp_polynomial(r) * two_k);
}

// The same for eight or sixteen floats at once.
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));

template <typename V, typename VI>
FASTATTN_INLINE V exp_nonpositive_vector(V x) {
  const V floor = V{} - 87.0f;
  const V y = x < floor ? floor : x;
  const VI k = -__builtin_convertvector(y * -1.44269504f + 0.5f, VI);
  const V kf = __builtin_convertvector(k, V);
  const V r = (y - kf * 0.693145751953125f) - kf * 1.428606765330187e-06f;
  const VI bits = (k + 127) << 23;
  V two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return x < floor ? V{} : exp_polynomial(r) * two_k;  // NaN stays NaN
}

FASTATTN_INLINE v8 exp_nonpositive(v8 x) { return exp_nonpositive_vector<v8, v8i>(x); }

// a's two halves added.
FASTATTN_INLINE v4 fold8(v8 a) {
  return __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
}

// The sums of four vectors' lanes, as one vector.
FASTATTN_INLINE v4 sum4x8(v8 a, v8 b, v8 c, v8 d) {
  const v4 a4 = fold8(a), b4 = fold8(b), c4 = fold8(c), d4 = fold8(d);
  // [a0 + a2, b0 + b2, a1 + a3, b1 + b3], and the same for c and d
  const v4 ab =
      __builtin_shufflevector(a4, b4, 0, 4, 1, 5) + __builtin_shufflevector(a4, b4, 2, 6, 3, 7);
  const v4 cd =
      __builtin_shufflevector(c4, d4, 0, 4, 1, 5) + __builtin_shufflevector(c4, d4, 2, 6, 3, 7);
  return __builtin_shufflevector(ab, cd, 0, 1, 4, 5) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7);
}

// Whether any lane of a comparison's result is set.
FASTATTN_INLINE bool any(v8i mask) {
  uint64_t words[4];
  std::memcpy(words, &mask, sizeof words);
  return (words[0] | words[1] | words[2] | words[3]) != 0;
}

FASTATTN_INLINE bool any(v16i mask) {
  uint64_t words[8];
  std::memcpy(words, &mask, sizeof words);
  return (words[0] | words[1] | words[2] | words[3] | words[4] | words[5] | words[6] |
          words[7]) != 0;
}

FASTATTN_INLINE float max8(v8 a) {
  v4 m = __builtin_shufflevector(a, a, 0, 1, 2, 3);
  const v4 hi = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  m = m > hi ? m : hi;
  v4 s = __builtin_shufflevector(m, m, 2, 3, 0, 1);
  m = m > s ? m : s;
  s = __builtin_shufflevector(m, m, 1, 0, 3, 2);
  m = m > s ? m : s;
  return m[0];
}

FASTATTN_INLINE v8 low8(v16 a) {
  return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
}
FASTATTN_INLINE v8 high8(v16 a) {
  return __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}
// GCC 12 compiles comparisons and selects of 16-float vectors element by element, in scalar
// code, for levels without 512-bit registers (AVX2, SSE): 200 instructions for one exp. Done per
// 8-float half, a vector on every level, they stay vector code; lane by lane the same values.
FASTATTN_INLINE v16 join8(v8 low, v8 high) {
  return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
FASTATTN_INLINE v8i low8(v16i a) { return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7); }
FASTATTN_INLINE v8i high8(v16i a) {
  return __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}

// a > b ? x : y, a >= b ? x : y, a == b ? x : y and (integers) a < b ? x : y, lane by lane.
FASTATTN_INLINE v16 if_greater(v16 a, v16 b, v16 x, v16 y) {
  return join8(low8(a) > low8(b) ? low8(x) : low8(y), high8(a) > high8(b) ? high8(x) : high8(y));
}
FASTATTN_INLINE v16 if_greater_equal(v16 a, v16 b, v16 x, v16 y) {
  return join8(low8(a) >= low8(b) ? low8(x) : low8(y),
               high8(a) >= high8(b) ? high8(x) : high8(y));
}
FASTATTN_INLINE v16 if_equal(v16 a, v16 b, v16 x, v16 y) {
  return join8(low8(a) == low8(b) ? low8(x) : low8(y),
               high8(a) == high8(b) ? high8(x) : high8(y));
}
FASTATTN_INLINE v16 if_less(v16i a, v16i b, v16 x, v16 y) {
  return join8(low8(a) < low8(b) ? low8(x) : low8(y), high8(a) < high8(b) ? high8(x) : high8(y));
}

FASTATTN_INLINE v16 exp_nonpositive(v16 x) {
  return join8(exp_nonpositive(low8(x)), exp_nonpositive(high8(x)));
}
FASTATTN_INLINE float sum16(v16 a) { return sum8(low8(a) + high8(a)); }
FASTATTN_INLINE float max16(v16 a) {
  const v8 lo = low8(a), hi = high8(a);
  return max8(lo > hi ? lo : hi);
}

}  // namespace fastattn
