// Counter-based dropout for the CPU training kernels: the keep mask of a call is a pure function
// of its seed and each element's (row, col), so a backward recomputes it instead of storing it,
// and torch.manual_seed (which draws the seed) reproduces it. layer_norm.cpp (residual dropout,
// cpu_dropout) and attention.cpp (attention weights) share it: element (row, col) of one seed is
// kept or dropped alike in both, so cpu_dropout on a tensor of ones shows any kernel's mask.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

#include "vector_math.h"

namespace fastattn {

// Wellons' lowbias32: a bijective 32-bit hash in which flipping any input bit flips each output
// bit with probability close to 1/2, so consecutive counters hash to independent-looking bits.
template <typename T>
FASTATTN_INLINE T mix32(T x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// One call's dropout: element (row, col) is kept when the top 24 bits of
// mix32(key(row) + col), as a fraction of 2^24, are >= p; kept elements are scaled by 1 / (1 - p).
struct Dropout {
  bool on = false;
  float p = 0, scale = 1;
  uint32_t seed_lo = 0, seed_hi = 0;

  Dropout() = default;
  Dropout(int64_t seed, double dropout_p)
      : on(dropout_p > 0),
        p(static_cast<float>(dropout_p)),
        scale(static_cast<float>(1.0 / (1.0 - dropout_p))),
        seed_lo(static_cast<uint32_t>(seed)),
        seed_hi(static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32)) {}

  uint32_t key(int64_t row) const {
    const uint64_t r = static_cast<uint64_t>(row);
    return mix32(mix32(seed_lo ^ mix32(static_cast<uint32_t>(r))) ^
                 (seed_hi + static_cast<uint32_t>(r >> 32)));
  }

  // x · keep / (1 - p) for columns col .. col + 7 (dropped elements are 0, even inf or NaN).
  FASTATTN_INLINE v8 apply8(v8 x, uint32_t key, int64_t col) const {
    const v8u bits = mix32(v8u{0, 1, 2, 3, 4, 5, 6, 7} + (key + static_cast<uint32_t>(col)));
    const v8 u = __builtin_convertvector((v8i)(bits >> 8), v8) * (1.0f / 16777216.0f);
    return u >= p ? x * scale : v8{};
  }

  FASTATTN_INLINE float apply1(float x, uint32_t key, int64_t col) const {
    const uint32_t bits = mix32(key + static_cast<uint32_t>(col));
    const float u = static_cast<float>(static_cast<int32_t>(bits >> 8)) * (1.0f / 16777216.0f);
    return u >= p ? x * scale : 0.0f;
  }

  // keep / (1 - p) of column col in the 16 rows keyed `keys`.
  FASTATTN_INLINE v16 scale16(v16u keys, int64_t col) const {
    const v16u bits = mix32(keys + static_cast<uint32_t>(col));
    const v16 u = __builtin_convertvector((v16i)(bits >> 8), v16) * (1.0f / 16777216.0f);
    return if_greater_equal(u, v16{} + p, v16{} + scale, v16{});
  }

  // y = x · keep / (1 - p) over columns 0 .. n - 1 of the row keyed `key`; y may be x.
  FASTATTN_INLINE void apply_row(const float *x, float *y, int64_t n, uint32_t key) const {
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) store8(y + c, apply8(load8(x + c), key, c));
    for (; c < n; ++c) y[c] = apply1(x[c], key, c);
  }
};

inline void check_dropout(double dropout_p) {
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, "dropout_p must be in [0, 1), got ", dropout_p);
}

}  // namespace fastattn
