// Attention with its backward on CPU. One task per (batch, head) pair: its rows are copied into
// float32 buffers (converting bfloat16 once; q and grad_out also transposed), and each product
// is a small matrix product on them in 16-float vectors, one AVX-512 register. Scores are held
// transposed, (keys, queries), with up to kRows queries across the lanes, so the softmax over
// keys is lane-wise arithmetic with no sums across lanes: St = K Qᵀ and O = Pᵀ V forward; dPt =
// V dOᵀ, dV = Pt dO, dK = dSt Q and dQ = dStᵀ K backward. Causal blocks skip the keys none of
// their queries sees. The backward recomputes P from lse and the dropout mask from its seed, as
// the Triton kernels do; memory grows linearly with the lengths.
#include "attention.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_isa.h"
#include "dropout.h"
#include "vector_math.h"

namespace fastattn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kLanes = 16;  // floats per vector: rows in the buffers are padded to it
constexpr int64_t kRows = 64;   // queries whose scores are worked on at once

int64_t padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

FASTATTN_INLINE v16u load16u(const uint32_t *p) {
  v16u x;
  std::memcpy(&x, p, sizeof x);
  return x;
}


// C[r, :16 NV] (+)= sum_k A(r, k) B[k, :16 NV] for r < R, with A(r, k) = a[r · ai + k · ak]:
// each vector of B is loaded once for R rows of C, whose accumulators stay in registers as
// vectors V of the level's width (v16 AVX-512, v8 AVX2, v4 SSE: a wider V than the registers
// would be kept on the stack). Each element of C sums over k in order whatever V is.
template <typename V, int R, int NV>
FASTATTN_INLINE void tile(const float *a, int64_t ai, int64_t ak, const float *b, int64_t ldb,
                          int64_t K, float *c, int64_t ldc, bool accumulate) {
  constexpr int kWidth = sizeof(V) / sizeof(float), kVectors = NV * kLanes / kWidth;
  V acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) {
      acc[r][v] = accumulate ? load_as<V>(c + r * ldc + kWidth * v) : V{};
    }
  for (int64_t k = 0; k < K; ++k) {
    V bk[kVectors];
    for (int v = 0; v < kVectors; ++v) bk[v] = load_as<V>(b + k * ldb + kWidth * v);
    for (int r = 0; r < R; ++r) {
      const float x = a[r * ai + k * ak];
      for (int v = 0; v < kVectors; ++v) acc[r][v] += x * bk[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) store_as(c + r * ldc + kWidth * v, acc[r][v]);
}

// Rows of C R at a time, the remainder in halving tiles.
template <typename V, int R, int NV>
FASTATTN_INLINE void tile_rows(int64_t M, int64_t K, const float *a, int64_t ai, int64_t ak,
                               const float *b, int64_t ldb, float *c, int64_t ldc,
                               bool accumulate) {
  int64_t i = 0;
  for (; i + R <= M; i += R)
    tile<V, R, NV>(a + i * ai, ai, ak, b, ldb, K, c + i * ldc, ldc, accumulate);
  if constexpr (R > 1)
    if (i < M) tile_rows<V, R / 2, NV>(M - i, K, a + i * ai, ai, ak, b, ldb, c + i * ldc, ldc,
                                       accumulate);
}

// matmul's tiles: 32 columns R2 rows at a time (none if R2 is 0), then 16 columns R1 rows.
template <typename V, int R2, int R1>
FASTATTN_INLINE void matmul_tiles(int64_t M, int64_t N, int64_t K, const float *a, int64_t ai,
                                  int64_t ak, const float *b, int64_t ldb, float *c, int64_t ldc,
                                  bool accumulate) {
  int64_t j = 0;
  if constexpr (R2 > 0)
    for (; j + 2 * kLanes <= N; j += 2 * kLanes)
      tile_rows<V, R2, 2>(M, K, a, ai, ak, b + j, ldb, c + j, ldc, accumulate);
  for (; j < N; j += kLanes)
    tile_rows<V, R1, 1>(M, K, a, ai, ak, b + j, ldb, c + j, ldc, accumulate);
}

// C (M, N) (+)= A B, with A(i, k) = a[i · ai + k · ak] (M, K) (ai = 1 reads a transposed), B (K,
// N) and C (M, N) rows ldb and ldc apart, N a multiple of 16. Eight accumulators' worth of v16
// (16 of AVX-512's 32 registers, all of AVX2's 16 as v8 pairs... less B's) keep both
// multiply-add units busy through their latency; SSE's 16 registers hold two rows of four v4.
FASTATTN_INLINE void matmul(int64_t M, int64_t N, int64_t K, const float *a, int64_t ai,
                            int64_t ak, const float *b, int64_t ldb, float *c, int64_t ldc,
                            bool accumulate) {
  switch (cpu_isa()) {
    case CpuIsa::kAmx:
    case CpuIsa::kAvx512:
      return matmul_tiles<v16, 4, 8>(M, N, K, a, ai, ak, b, ldb, c, ldc, accumulate);
    case CpuIsa::kAvx2:
      return matmul_tiles<v8, 2, 4>(M, N, K, a, ai, ak, b, ldb, c, ldc, accumulate);
    default:
      return matmul_tiles<v4, 0, 2>(M, N, K, a, ai, ak, b, ldb, c, ldc, accumulate);
  }
}

// One (batch, head) pair. bias points at the pair's (0, 0) element with row stride si and column
// stride sj, or is null. Query i's dropout row is first_row + i: the pair's rows follow each
// other in (B, H, Lq) order.
struct Head {
  int64_t Lq, Lk, D;
  bool causal;
  int64_t shift;
  float scale;
  const float *bias;
  int64_t si, sj;
  Dropout dropout;
  int64_t first_row;

  // Keys query i may see: all, or those up to its causal limit (so a block of queries needs the
  // keys its last query sees).
  int64_t keys(int64_t i) const {
    return causal ? std::clamp<int64_t>(i + shift + 1, 0, Lk) : Lk;
  }

  // Key j's scores for queries i0 + c, c < wq (a multiple of 16; rows of them real), given their
  // products q_i · k_j: s_ij = scale · q_i · k_j + bias_ij, and -inf where causal hides j from i.
  FASTATTN_INLINE void scores(int64_t i0, int64_t rows, int64_t wq, int64_t j, float *s) const {
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const float key_bias = bias && si == 0 ? bias[j * sj] : 0.0f;
    for (int64_t c = 0; c < wq; c += kLanes) {
      v16 x = load16(s + c) * scale + key_bias;
      if (causal) {  // j <= i + shift
        x = if_less(lane, v16i{} + static_cast<int32_t>(j - shift - i0 - c), v16{} - kInf, x);
      }
      store16(s + c, x);
    }
    if (bias && si != 0)
      for (int64_t c = 0; c < rows; ++c) s[c] += bias[(i0 + c) * si + j * sj];
  }

  // The dropout keys of queries i0 .. i0 + wq.
  void dropout_keys(int64_t i0, int64_t wq, uint32_t *keys) const {
    for (int64_t c = 0; c < wq; ++c) keys[c] = dropout.key(first_row + i0 + c);
  }
};

// The forward of one pair: k and v (Lk, Dp) rows, zero-padded to Dp = padded(D) columns; qt =
// qᵀ (D, padded(Lq)), zero-padded; st (Lk, padded(min(Lq, kRows))) scores; o (Lq, Dp) the output.
FASTATTN_INLINE void forward_head(const Head a, const float *k, const float *v, const float *qt,
                                  float *st, float *o, float *lse) {
  const int64_t D = a.D, Dp = padded(D), Lqp = padded(a.Lq);
  constexpr int64_t V = kRows / kLanes;
  for (int64_t i0 = 0; i0 < a.Lq; i0 += kRows) {
    const int64_t rows = std::min(kRows, a.Lq - i0), wq = padded(rows), nv = wq / kLanes;
    const int64_t Lk = a.keys(i0 + rows - 1);
    matmul(Lk, wq, D, k, Dp, 1, qt + i0, Lqp, st, wq, false);  // q_i · k_j
    v16 m[V], l[V];
    for (int64_t c = 0; c < nv; ++c) m[c] = v16{} - kInf, l[c] = v16{};
    for (int64_t j = 0; j < Lk; ++j) {
      a.scores(i0, rows, wq, j, st + j * wq);
      for (int64_t c = 0; c < nv; ++c) {
        const v16 x = load16(st + j * wq + kLanes * c);
        m[c] = if_greater(x, m[c], x, m[c]);
      }
    }
    for (int64_t c = 0; c < nv; ++c) m[c] = if_greater(m[c], v16{} - kInf, m[c], v16{});  // rows with no key: 0s
    for (int64_t j = 0; j < Lk; ++j)
      for (int64_t c = 0; c < nv; ++c) {
        float *x = st + j * wq + kLanes * c;
        const v16 e = exp_nonpositive(load16(x) - m[c]);
        store16(x, e);
        l[c] += e;  // the normaliser sums the weights before dropout
      }
    // A row with no key (l = 0) reads zeros and gets lse = +inf: zero gradients. A NaN score
    // (a NaN in q, k or the bias) makes l NaN, and the row's output and lse NaN, as softmax's.
    v16 inv[V];
    for (int64_t c = 0; c < nv; ++c) {
      inv[c] = if_equal(l[c], v16{}, v16{}, 1.0f / l[c]);
      for (int64_t r = 0; r < kLanes && kLanes * c + r < rows; ++r)
        lse[i0 + kLanes * c + r] = l[c][r] == 0 ? kInf : m[c][r] + std::log(l[c][r]);
    }
    uint32_t keys[kRows];
    if (a.dropout.on) a.dropout_keys(i0, wq, keys);
    for (int64_t j = 0; j < Lk; ++j)
      for (int64_t c = 0; c < nv; ++c) {
        float *x = st + j * wq + kLanes * c;
        v16 y = load16(x) * inv[c];
        if (a.dropout.on) y *= a.dropout.scale16(load16u(keys + kLanes * c), j);
        store16(x, y);
      }
    matmul(rows, Dp, Lk, st, 1, wq, v, Dp, o + i0 * Dp, Dp, false);  // o_i = sum_j p_ij z_ij v_j
  }
}

// The backward of one pair: q and dout (Lq, Dp), k and v (Lk, Dp) rows, zero-padded; qt = qᵀ and
// doutt = doutᵀ (D, padded(Lq)), zero-padded; delta_i = do_i · out_i; pt, dst and pz (Lk,
// padded(min(Lq, kRows))) scratch; dq (Lq, Dp), dk and dv (Lk, Dp) the gradients.
FASTATTN_INLINE void backward_head(const Head a, const float *q, const float *k, const float *v,
                                   const float *dout, const float *qt, const float *doutt,
                                   const float *delta, const float *lse, float *pt, float *dst,
                                   float *pz, float *dq, float *dk, float *dv) {
  const int64_t D = a.D, Dp = padded(D), Lqp = padded(a.Lq);
  std::fill(dk, dk + a.Lk * Dp, 0.0f);
  std::fill(dv, dv + a.Lk * Dp, 0.0f);
  for (int64_t i0 = 0; i0 < a.Lq; i0 += kRows) {
    const int64_t rows = std::min(kRows, a.Lq - i0), wq = padded(rows), nv = wq / kLanes;
    const int64_t Lk = a.keys(i0 + rows - 1);
    matmul(Lk, wq, D, k, Dp, 1, qt + i0, Lqp, pt, wq, false);      // q_i · k_j
    matmul(Lk, wq, D, v, Dp, 1, doutt + i0, Lqp, dst, wq, false);  // do_i · v_j
    float lse_rows[kRows], delta_rows[kRows];  // +inf and 0 on the padding lanes
    std::fill(lse_rows, lse_rows + wq, kInf);
    std::fill(delta_rows, delta_rows + wq, 0.0f);
    std::copy(lse + i0, lse + i0 + rows, lse_rows);
    std::copy(delta + i0, delta + i0 + rows, delta_rows);
    uint32_t keys[kRows];
    if (a.dropout.on) a.dropout_keys(i0, wq, keys);
    for (int64_t j = 0; j < Lk; ++j) {
      a.scores(i0, rows, wq, j, pt + j * wq);
      for (int64_t c = 0; c < nv; ++c) {
        const int64_t at = j * wq + kLanes * c;
        v16 x = load16(pt + at) - load16(lse_rows + kLanes * c);
        // Recomputed scores may exceed lse by a rounding error; a NaN (NaN lse) stays NaN.
        x = if_greater(x, v16{}, v16{}, x);
        const v16 p = exp_nonpositive(x);
        v16 dp = load16(dst + at);
        if (a.dropout.on) {  // z_ij = keep_ij / (1 - p): dp_ij z_ij, and pz_ij = p_ij z_ij
          const v16 z = a.dropout.scale16(load16u(keys + kLanes * c), j);
          dp *= z;
          store16(pz + at, p * z);
        }
        store16(pt + at, p);
        store16(dst + at, p * (dp - load16(delta_rows + kLanes * c)) * a.scale);
      }
    }
    const float *pv = a.dropout.on ? pz : pt;  // the weights v_j got
    matmul(Lk, Dp, rows, pv, wq, 1, dout + i0 * Dp, Dp, dv, Dp, true);  // dv_j += p_ij z_ij do_i
    matmul(Lk, Dp, rows, dst, wq, 1, q + i0 * Dp, Dp, dk, Dp, true);    // dk_j += ds_ij q_i
    matmul(rows, Dp, Lk, dst, 1, wq, k, Dp, dq + i0 * Dp, Dp, false);   // dq_i = sum_j ds_ij k_j
  }
}

// One pair's loops at the level in use, compiled once per level for float32 and bfloat16 pairs
// alike (they work on float32 copies): inlined into each pair loop, they doubled the build. Each
// takes its Head by value, a copy that no row it writes can alias.
FASTATTN_PER_ISA(run_forward_head, forward_head)
FASTATTN_PER_ISA(run_backward_head, backward_head)

FASTATTN_INLINE float to_float(float x) { return x; }
FASTATTN_INLINE float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// A head's rows (L, D), `stride` apart, as float32 rows ld >= D apart, zero-padded to ld columns
// and to `rows` >= L rows.
template <typename T>
FASTATTN_INLINE void load_rows(const T *src, int64_t stride, int64_t L, int64_t D, float *dst,
                               int64_t ld, int64_t rows) {
  for (int64_t l = 0; l < L; ++l) {
    const T *s = src + l * stride;
    float *d = dst + l * ld;
    int64_t c = 0;
    for (; c + 8 <= D; c += 8) store8(d + c, load8(s + c));
    for (; c < D; ++c) d[c] = to_float(s[c]);
    std::fill(d + D, d + ld, 0.0f);
  }
  std::fill(dst + L * ld, dst + rows * ld, 0.0f);
}

// Asks for a head's rows (L, D) to be brought into cache: the next pair's rows, fetched while
// this pair is worked on, which otherwise stalls on each row's first touch.
template <typename T>
FASTATTN_INLINE void prefetch_rows(const T *src, int64_t stride, int64_t L, int64_t D) {
  for (int64_t l = 0; l < L; ++l)
    for (int64_t c = 0; c < D; c += 64 / sizeof(T)) __builtin_prefetch(src + l * stride + c);
}

// Float32 rows (L, D), ld apart, into a head's rows `stride` apart.
template <typename T>
FASTATTN_INLINE void store_rows(const float *src, int64_t ld, int64_t L, int64_t D, T *dst,
                                int64_t stride) {
  for (int64_t l = 0; l < L; ++l) {
    const float *s = src + l * ld;
    T *d = dst + l * stride;
    int64_t c = 0;
    for (; c + 8 <= D; c += 8) store8(d + c, load8(s + c));
    for (; c < D; ++c) d[c] = static_cast<T>(s[c]);
  }
}

// One step of a swap-blocks transpose of 16 rows: rows i and i + S (i & S = 0) trade, within
// each group of 2S lanes, i's second S lanes for (i + S)'s first S.
template <int S, int... L>
FASTATTN_INLINE v16 first_halves(v16 a, v16 b, std::integer_sequence<int, L...>) {
  return __builtin_shufflevector(
      a, b, (L % (2 * S) < S ? L : 16 + L - S)...);
}

template <int S, int... L>
FASTATTN_INLINE v16 second_halves(v16 a, v16 b, std::integer_sequence<int, L...>) {
  return __builtin_shufflevector(a, b, (L % (2 * S) < S ? L + S : 16 + L)...);
}

template <int S>
FASTATTN_INLINE void swap_blocks(v16 (&r)[16]) {
  constexpr auto lanes = std::make_integer_sequence<int, 16>{};
  for (int i = 0; i < 16; ++i) {
    if (i & S) continue;
    const v16 a = r[i], b = r[i + S];
    r[i] = first_halves<S>(a, b, lanes);
    r[i + S] = second_halves<S>(a, b, lanes);
  }
}

// dst (C, R) = src (R, C)ᵀ, for R and C multiples of 16, in 16 x 16 blocks held in registers.
FASTATTN_INLINE void transpose(const float *src, int64_t R, int64_t C, float *dst) {
  for (int64_t r0 = 0; r0 < R; r0 += kLanes)
    for (int64_t c0 = 0; c0 < C; c0 += kLanes) {
      v16 r[16];
      for (int i = 0; i < 16; ++i) r[i] = load16(src + (r0 + i) * C + c0);
      swap_blocks<8>(r);
      swap_blocks<4>(r);
      swap_blocks<2>(r);
      swap_blocks<1>(r);
      for (int i = 0; i < 16; ++i) store16(dst + (c0 + i) * R + r0, r[i]);
    }
}

// A (B, H, L, D) result laid out as (B, L, H, D): merging its heads back to (B, L, H·D), which
// the output projection reads (and, for gradients, the q/k/v projections' backward), is a view.
at::Tensor empty_heads_last(int64_t B, int64_t H, int64_t L, int64_t D,
                            const at::TensorOptions &options) {
  return at::empty({B, L, H, D}, options).transpose(1, 2);
}

// The pointer and strides of one (B, H, L, D) tensor's head rows.
template <typename T>
struct Rows {
  T *data;
  int64_t sb, sh, sl;
  explicit Rows(const at::Tensor &x)
      : data(x.data_ptr<T>()), sb(x.stride(0)), sh(x.stride(1)), sl(x.stride(2)) {}
  T *at(int64_t b, int64_t h) const { return data + b * sb + h * sh; }
};

struct Problem {
  int64_t B, H, Lq, Lk, D;
  Head head;
  const float *bias = nullptr;
  int64_t bias_sb = 0, bias_sh = 0;

  Problem(const at::Tensor &q, const at::Tensor &k, const std::optional<at::Tensor> &bias_,
          bool causal, int64_t shift, double scale, double dropout_p, int64_t seed)
      : B(q.size(0)), H(q.size(1)), Lq(q.size(2)), Lk(k.size(2)), D(q.size(3)) {
    head = Head{Lq, Lk, D, causal, shift, static_cast<float>(scale), nullptr, 0, 0,
                Dropout(seed, dropout_p), 0};
    if (bias_) {
      bias = bias_->data_ptr<float>();
      bias_sb = bias_->stride(0);
      bias_sh = bias_->stride(1);
      head.si = bias_->stride(2);
      head.sj = bias_->stride(3);
    }
  }

  // The pair's Head, with its bias pointer.
  Head at(int64_t b, int64_t h) const {
    Head a = head;
    if (bias) a.bias = bias + b * bias_sb + h * bias_sh;
    a.first_row = (b * H + h) * Lq;
    return a;
  }

  // Enough pairs per task to amortise its buffers and dispatch.
  int64_t grain() const { return std::max<int64_t>(1, 4096 / std::max<int64_t>(1, Lq * Lk)); }
};

void check(const char *name, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
           const std::optional<at::Tensor> &bias) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, name, ": q, k, v must be 4-D");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
                  q.size(3) == k.size(3),
              name, ": q (B, H, Lq, D), k and v (B, H, Lk, D) expected");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              name, ": q, k, v must all be float32 or all bfloat16");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, name,
              ": q, k, v need a unit last stride");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 4 &&
                    bias->size(0) == q.size(0) && bias->size(1) == q.size(1) &&
                    bias->size(2) == q.size(2) && bias->size(3) == k.size(2),
                name, ": bias must be float32 (B, H, Lq, Lk) (broadcast dims stride 0)");
  }
}

// The float32 working copies of a pair's rows: (L, Dp) row-major and, for the queries, also
// transposed (Dp, Lqp), zero-padded; the scores (Lk, Wq), Wq queries at a time; the results.
struct Buffers {
  int64_t Lq, Lk, Dp, Lqp, tile;
  explicit Buffers(const Problem &p)
      : Lq(p.Lq), Lk(p.Lk), Dp(padded(p.D)), Lqp(padded(p.Lq)),
        tile(p.Lk * padded(std::min(p.Lq, kRows))) {}
  int64_t forward_floats() const { return 2 * Lqp * Dp + 2 * Lk * Dp + tile + Lq * Dp; }
  int64_t backward_floats() const { return 4 * Lqp * Dp + Lq * Dp + Lq + 4 * Lk * Dp + 3 * tile + Dp; }
};

template <typename T>
FASTATTN_INLINE void forward_pairs(const Problem &p, const Rows<T> &q, const Rows<T> &k,
                                   const Rows<T> &v, const Rows<T> &out, float *lse,
                                   int64_t begin, int64_t end, float *buffer) {
  const Buffers n(p);
  float *Q = buffer, *Qt = Q + n.Lqp * n.Dp, *K = Qt + n.Dp * n.Lqp, *V = K + n.Lk * n.Dp;
  float *St = V + n.Lk * n.Dp, *O = St + n.tile;
  for (int64_t bh = begin; bh < end; ++bh) {
    const int64_t b = bh / p.H, h = bh % p.H;
    if (bh + 1 < end) {
      const int64_t b1 = (bh + 1) / p.H, h1 = (bh + 1) % p.H;
      prefetch_rows(q.at(b1, h1), q.sl, p.Lq, p.D);
      prefetch_rows(k.at(b1, h1), k.sl, p.Lk, p.D);
      prefetch_rows(v.at(b1, h1), v.sl, p.Lk, p.D);
    }
    load_rows(q.at(b, h), q.sl, p.Lq, p.D, Q, n.Dp, n.Lqp);
    transpose(Q, n.Lqp, n.Dp, Qt);
    load_rows(k.at(b, h), k.sl, p.Lk, p.D, K, n.Dp, p.Lk);
    load_rows(v.at(b, h), v.sl, p.Lk, p.D, V, n.Dp, p.Lk);
    run_forward_head(p.at(b, h), K, V, Qt, St, O, lse + bh * p.Lq);
    store_rows(O, n.Dp, p.Lq, p.D, out.at(b, h), out.sl);
  }
}

template <typename T>
FASTATTN_INLINE void backward_pairs(const Problem &p, const Rows<T> &dout, const Rows<T> &q,
                                    const Rows<T> &k, const Rows<T> &v, const Rows<T> &out,
                                    const float *lse, const Rows<T> &dq, const Rows<T> &dk,
                                    const Rows<T> &dv, int64_t begin, int64_t end,
                                    float *buffer) {
  const Buffers n(p);
  const int64_t rows = n.Lqp * n.Dp, keys = n.Lk * n.Dp;
  float *Q = buffer, *dO = Q + rows, *Qt = dO + rows, *dOt = Qt + rows, *dQ = dOt + rows;
  float *delta = dQ + n.Lq * n.Dp, *K = delta + n.Lq, *V = K + keys, *dK = V + keys;
  float *dV = dK + keys, *Pt = dV + keys, *dSt = Pt + n.tile, *Pz = dSt + n.tile;
  float *O = Pz + n.tile;
  for (int64_t bh = begin; bh < end; ++bh) {
    const int64_t b = bh / p.H, h = bh % p.H;
    if (bh + 1 < end) {
      const int64_t b1 = (bh + 1) / p.H, h1 = (bh + 1) % p.H;
      for (const Rows<T> *x : {&q, &dout, &out}) prefetch_rows(x->at(b1, h1), x->sl, p.Lq, p.D);
      for (const Rows<T> *x : {&k, &v}) prefetch_rows(x->at(b1, h1), x->sl, p.Lk, p.D);
    }
    load_rows(q.at(b, h), q.sl, p.Lq, p.D, Q, n.Dp, n.Lqp);
    load_rows(dout.at(b, h), dout.sl, p.Lq, p.D, dO, n.Dp, n.Lqp);
    transpose(Q, n.Lqp, n.Dp, Qt);
    transpose(dO, n.Lqp, n.Dp, dOt);
    load_rows(k.at(b, h), k.sl, p.Lk, p.D, K, n.Dp, p.Lk);
    load_rows(v.at(b, h), v.sl, p.Lk, p.D, V, n.Dp, p.Lk);
    for (int64_t i = 0; i < p.Lq; ++i) {  // delta_i = do_i · out_i, one row of out at a time
      load_rows(out.at(b, h) + i * out.sl, out.sl, 1, p.D, O, n.Dp, 1);
      delta[i] = dot(dO + i * n.Dp, O, n.Dp);
    }
    run_backward_head(p.at(b, h), Q, K, V, dO, Qt, dOt, delta, lse + bh * p.Lq, Pt, dSt, Pz, dQ, dK,
                  dV);
    store_rows(dQ, n.Dp, p.Lq, p.D, dq.at(b, h), dq.sl);
    store_rows(dK, n.Dp, p.Lk, p.D, dk.at(b, h), dk.sl);
    store_rows(dV, n.Dp, p.Lk, p.D, dv.at(b, h), dv.sl);
  }
}

// Pairs [begin, end) at the instruction-set level in use.
FASTATTN_PER_ISA(run_forward_pairs, forward_pairs)
FASTATTN_PER_ISA(run_backward_pairs, backward_pairs)

template <typename T>
void forward(const Problem &p, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
             at::Tensor &out, at::Tensor &lse) {
  const Rows<T> qr(q), kr(k), vr(v), outr(out);
  float *lse_data = lse.data_ptr<float>();
  at::parallel_for(0, p.B * p.H, p.grain(), [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(Buffers(p).forward_floats());
    run_forward_pairs(p, qr, kr, vr, outr, lse_data, begin, end, buffer.data());
  });
}

template <typename T>
void backward(const Problem &p, const at::Tensor &grad_out, const at::Tensor &q,
              const at::Tensor &k, const at::Tensor &v, const at::Tensor &out,
              const at::Tensor &lse, at::Tensor &dq, at::Tensor &dk, at::Tensor &dv) {
  const Rows<T> qr(q), kr(k), vr(v), dor(grad_out), outr(out), dqr(dq), dkr(dk), dvr(dv);
  const float *lse_data = lse.data_ptr<float>();
  at::parallel_for(0, p.B * p.H, p.grain(), [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(Buffers(p).backward_floats());
    run_backward_pairs(p, dor, qr, kr, vr, outr, lse_data, dqr, dkr, dvr, begin, end,
                       buffer.data());
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(const at::Tensor &q, const at::Tensor &k,
                                                     const at::Tensor &v,
                                                     const std::optional<at::Tensor> &bias,
                                                     bool causal, int64_t causal_shift,
                                                     double scale, double dropout_p,
                                                     int64_t seed) {
  check("attention_fwd_cpu", q, k, v, bias);
  check_dropout(dropout_p);
  const Problem p(q, k, bias, causal, causal_shift, scale, dropout_p, seed);
  auto out = empty_heads_last(p.B, p.H, p.Lq, p.D, q.options());
  auto lse = at::empty({p.B, p.H, p.Lq}, q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kFloat) {
    forward<float>(p, q, k, v, out, lse);
  } else {
    forward<c10::BFloat16>(p, q, k, v, out, lse);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(
    const at::Tensor &grad_out, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
    const at::Tensor &out, const at::Tensor &lse, const std::optional<at::Tensor> &bias,
    bool causal, int64_t causal_shift, double scale, double dropout_p, int64_t seed) {
  check("attention_bwd_cpu", q, k, v, bias);
  check_dropout(dropout_p);
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes() &&
                  grad_out.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type() && grad_out.stride(3) == 1 &&
                  out.stride(3) == 1,
              "attention_bwd_cpu: grad_out and out must match q");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.numel() == q.size(0) * q.size(1) * q.size(2),
              "attention_bwd_cpu: lse must be contiguous float32 (B, H, Lq)");
  const Problem p(q, k, bias, causal, causal_shift, scale, dropout_p, seed);
  auto dq = empty_heads_last(p.B, p.H, p.Lq, p.D, q.options());
  auto dk = empty_heads_last(p.B, p.H, p.Lk, p.D, k.options());
  auto dv = empty_heads_last(p.B, p.H, p.Lk, p.D, v.options());
  if (q.scalar_type() == at::kFloat) {
    backward<float>(p, grad_out, q, k, v, out, lse, dq, dk, dv);
  } else {
    backward<c10::BFloat16>(p, grad_out, q, k, v, out, lse, dq, dk, dv);
  }
  return {dq, dk, dv};
}

}  // namespace fastattn
