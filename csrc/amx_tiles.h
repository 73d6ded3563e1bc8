// The amx level's products (cpu_isa.h): int8 and bfloat16 panels multiplied in AMX tiles.
//
// A tile register holds up to 16 rows of 64 bytes. The decoding weights' panels (int8_linear.h,
// bf16_linear.h) are already in the layout tdpbusd and tdpbf16ps take for their second operand:
// 16 outputs × 4 bytes (four int8 or two bfloat16 inputs, one "group") per 64-byte panel row, a
// panel's next 16 groups one tile as they lie. A block of 16 activation rows × 16 groups is the
// first operand, with the rows' own stride. The sums land in a tile of 16 rows × 16 outputs
// (int32 or float32), stored and handed to the kernel's finish.
#pragma once

#include "cpu_isa.h"

#include <algorithm>
#include <cstdint>

#ifdef FASTATTN_X86
#include <immintrin.h>

#define FASTATTN_AMX \
  __attribute__((target("arch=x86-64-v4,avx512vnni,avx512bf16,amx-tile,amx-int8,amx-bf16")))
#define FASTATTN_AMX_INLINE FASTATTN_AMX inline __attribute__((always_inline))

namespace fastattn {

// Below this many activation rows a tile's 16 rows are mostly padding: the AVX-512 kernels run.
constexpr int64_t kAmxRows = 16;

// The rows an activation buffer holds for the tiles: whole blocks of 16 (the padding's sums are
// dropped, so what it holds does not matter).
inline int64_t amx_padded_rows(int64_t N) { return (N + 15) / 16 * 16; }

// AMX's tile registers as ldtilecfg reads them (palette 1): tile t is rows[t] rows of colsb[t]
// bytes.
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int64_t tile_rows, int64_t bytes) {
    rows[tile] = static_cast<uint8_t>(tile_rows);
    colsb[tile] = static_cast<uint16_t>(bytes);
  }
};

// Panels [p0, p1), two at a time, against N rows of x (`groups` 4-byte groups each, row stride
// x_stride bytes, padded to amx_padded_rows(N)), 16 rows at a time: Acc sums[16][16] per panel
// and block, then finish(n, p, sums[r]) for each real row n = block + r, panel p then p + 1
// (each row meets its panels in ascending order, as the AVX-512 kernels' rows do). kBf16:
// tdpbf16ps (bfloat16 pairs into float32), else tdpbusd (u8 × s8 quads into int32).
// Tiles: 0-1 the sums against panels p and p + 1; 2 the rows' next 16 groups, 3-4 the panels';
// 5-7 the same for the last groups % 16.
template <bool kBf16, typename Acc, typename Finish>
FASTATTN_AMX_INLINE void amx_panels(const void *x, int64_t x_stride, int64_t N, int64_t groups,
                                    const void *panels, int64_t p0, int64_t p1,
                                    const Finish &finish) {
  constexpr int64_t kRow = 64, kGroups = 16;  // bytes of a panel row; groups per tile
  const int64_t tail = groups % kGroups, full = groups - tail;
  TileConfig config;
  for (int tile = 0; tile < 5; ++tile) config.set(tile, 16, kRow);
  if (tail) {
    config.set(5, 16, tail * 4);
    config.set(6, tail, kRow);
    config.set(7, tail, kRow);
  }
  _tile_loadconfig(&config);
  // One step at group k: tile X <- the rows' groups, W0 and (with pair) W1 <- the panels', sums
  // 0 and 1 += their products. A macro: the intrinsics take tile numbers as literal tokens.
#define FASTATTN_AMX_STEP(X, W0, W1, k)                                             \
  do {                                                                              \
    _tile_loadd(X, rows + (k) * 4, x_stride);                                       \
    _tile_loadd(W0, w0 + (k) * kRow, kRow);                                         \
    if constexpr (kBf16) _tile_dpbf16ps(0, X, W0); else _tile_dpbusd(0, X, W0);     \
    if (pair) {                                                                     \
      _tile_loadd(W1, w1 + (k) * kRow, kRow);                                       \
      if constexpr (kBf16) _tile_dpbf16ps(1, X, W1); else _tile_dpbusd(1, X, W1);   \
    }                                                                               \
  } while (false)
  alignas(64) Acc sums[2][16][16];
  const auto *x_bytes = static_cast<const uint8_t *>(x);
  const auto *panel_bytes = static_cast<const uint8_t *>(panels);
  for (int64_t p = p0; p < p1; p += 2) {
    const bool pair = p + 1 < p1;
    const uint8_t *w0 = panel_bytes + p * groups * kRow, *w1 = w0 + groups * kRow;
    for (int64_t n = 0; n < N; n += 16) {
      const uint8_t *rows = x_bytes + n * x_stride;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t k = 0; k < full; k += kGroups) FASTATTN_AMX_STEP(2, 3, 4, k);
      if (tail) FASTATTN_AMX_STEP(5, 6, 7, full);
      _tile_stored(0, sums[0], kRow);
      _tile_stored(1, sums[1], kRow);
      for (int64_t r = 0; r < std::min<int64_t>(16, N - n); ++r)
        for (int q = 0; q < 1 + pair; ++q) finish(n + r, p + q, sums[q][r]);
    }
  }
#undef FASTATTN_AMX_STEP
  _tile_release();
}

}  // namespace fastattn
#endif
