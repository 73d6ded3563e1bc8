// Decoding on CPU. Attention: for each (group, head), every query row makes one pass over the
// cached keys (scores, running max) and one over the values (weights, weighted sum). The decoder
// step chains the post-norm layers with packed_linear.h's linear maps and these loops, in one call.
#include "decode_attention.h"

#include "bf16_linear.h"
#include "layer_slots.h"
#include "int8_linear.h"
#include "packed_linear.h"
#include "cpu_isa.h"
#include "vector_math.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace fastattn {

namespace {

// o = scale · sum_j w[j] values[j] over L rows of n elements.
template <typename scalar_t>
FASTATTN_INLINE void weighted_sum_rows(const scalar_t *w, scalar_t scale,
                                       const scalar_t *const *values, int64_t L, int64_t n,
                                       scalar_t *o) {
  for (int64_t d = 0; d < n; ++d) o[d] = 0;
  for (int64_t j = 0; j < L; ++j)
    for (int64_t d = 0; d < n; ++d) o[d] += w[j] * scale * values[j][d];
}

template <typename scalar_t>
FASTATTN_INLINE void weighted_sum(const scalar_t *w, scalar_t scale,
                                  const scalar_t *const *values, int64_t L, int64_t n,
                                  scalar_t *o) {
  weighted_sum_rows(w, scale, values, L, n, o);
}

// The same with the n = 8 · V8 outputs held in registers across all L rows.
template <int V8>
FASTATTN_INLINE void weighted_sum8(const float *w, float scale, const float *const *values,
                                   int64_t L, float *o) {
  v8 acc[V8] = {};
  for (int64_t j = 0; j < L; ++j)
    for (int i = 0; i < V8; ++i) acc[i] += w[j] * load8(values[j] + 8 * i);
  for (int i = 0; i < V8; ++i) {
    const v8 out = acc[i] * scale;
    std::memcpy(o + 8 * i, &out, sizeof out);
  }
}

template <>
FASTATTN_INLINE void weighted_sum<float>(const float *w, float scale, const float *const *values,
                                         int64_t L, int64_t n, float *o) {
  switch (n) {
    case 8: return weighted_sum8<1>(w, scale, values, L, o);
    case 16: return weighted_sum8<2>(w, scale, values, L, o);
    case 32: return weighted_sum8<4>(w, scale, values, L, o);
    case 64: return weighted_sum8<8>(w, scale, values, L, o);
  }
  weighted_sum_rows(w, scale, values, L, n, o);
}

// x = LayerNorm(x + y) · weight + bias over each of the n rows of width d (all contiguous).
template <typename scalar_t>
FASTATTN_INLINE void add_layer_norm_rows_body(scalar_t *x, const scalar_t *y, const scalar_t *weight,
                                         const scalar_t *bias, int64_t n, int64_t d,
                                         scalar_t eps) {
  for (int64_t i = 0; i < n; ++i) {
    scalar_t *xi = x + i * d;
    const scalar_t *yi = y + i * d;
    scalar_t mean = 0;
    for (int64_t c = 0; c < d; ++c) mean += (xi[c] += yi[c]);
    mean /= d;
    scalar_t var = 0;
    for (int64_t c = 0; c < d; ++c) var += (xi[c] - mean) * (xi[c] - mean);
    const scalar_t rstd = scalar_t(1) / std::sqrt(var / d + eps);
    for (int64_t c = 0; c < d; ++c) xi[c] = (xi[c] - mean) * rstd * weight[c] + bias[c];
  }
}
FASTATTN_PER_ISA(add_layer_norm_rows, add_layer_norm_rows_body)

// The same for float rows whose width is a multiple of 8, with 8-lane partial sums: a scalar sum
// is a chain of d dependent adds, which cost more than all the rest of the row.
FASTATTN_INLINE void add_layer_norm_rows8_body(float *x, const float *y, const float *weight,
                                          const float *bias, int64_t n, int64_t d, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    float *xi = x + i * d;
    const float *yi = y + i * d;
    v8 sum = {};
    for (int64_t c = 0; c < d; c += 8) {
      const v8 s = load8(xi + c) + load8(yi + c);
      store8(xi + c, s);
      sum += s;
    }
    const float mean = sum8(sum) / d;
    v8 squares = {};
    for (int64_t c = 0; c < d; c += 8) {
      const v8 centred = load8(xi + c) - mean;
      squares += centred * centred;
    }
    const float rstd = 1.f / std::sqrt(sum8(squares) / d + eps);
    for (int64_t c = 0; c < d; c += 8)
      store8(xi + c, (load8(xi + c) - mean) * rstd * load8(weight + c) + load8(bias + c));
  }
}
FASTATTN_PER_ISA(add_layer_norm_rows8, add_layer_norm_rows8_body)

void add_layer_norm_(at::Tensor &x, const at::Tensor &y, const at::Tensor &weight,
                     const at::Tensor &bias, double eps) {
  const auto yc = y.contiguous();
  if (x.scalar_type() == at::kFloat && x.size(1) % 8 == 0) {
    add_layer_norm_rows8(x.data_ptr<float>(), yc.data_ptr<float>(), weight.data_ptr<float>(),
                         bias.data_ptr<float>(), x.size(0), x.size(1), static_cast<float>(eps));
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "add_layer_norm", [&] {
    add_layer_norm_rows(x.data_ptr<scalar_t>(), yc.data_ptr<scalar_t>(),
                                  weight.data_ptr<scalar_t>(), bias.data_ptr<scalar_t>(),
                                  x.size(0), x.size(1), static_cast<scalar_t>(eps));
  });
}

// p[j] = exp(p[j]) for p[j] <= 0 (scores minus their maximum), returning the sum. float uses the
// vectorisable exp_nonpositive: std::exp compiles to a scalar call per score, which costs more
// than the dot products of a short decoding prefix.
template <typename scalar_t>
FASTATTN_INLINE scalar_t exp_and_sum(scalar_t *p, int64_t n) {
  scalar_t sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j]));
  return sum;
}

template <>
FASTATTN_INLINE float exp_and_sum<float>(float *p, int64_t n) {
  v8 partial = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 e = exp_nonpositive(load8(p + j));
    store8(p + j, e);
    partial += e;
  }
  float sum = 0;
  for (; j < n; ++j) sum += (p[j] = exp_nonpositive(p[j]));
  return sum + sum8(partial);
}

// p[j] = q · keys[j] * scale + biases[j] for j < L.
template <typename scalar_t>
FASTATTN_INLINE void scores(const scalar_t *q, const scalar_t *const *keys,
                            const scalar_t *biases, int64_t L, int64_t Dk, scalar_t scale,
                            scalar_t *p) {
  for (int64_t j = 0; j < L; ++j)
    p[j] = dot(q, keys[j], Dk) * scale + (biases ? biases[j] : scalar_t(0));
}

// Head widths that are multiples of 8: four keys per pass, four independent accumulators and
// one shared reduction, where one key at a time waits on its own chain of adds.
template <>
FASTATTN_INLINE void scores<float>(const float *q, const float *const *keys, const float *biases,
                                   int64_t L, int64_t Dk, float scale, float *p) {
  int64_t j = 0;
  if (Dk % 8 == 0) {
    for (; j + 4 <= L; j += 4) {
      v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t d = 0; d < Dk; d += 8) {
        const v8 qd = load8(q + d);
        a0 += qd * load8(keys[j] + d);
        a1 += qd * load8(keys[j + 1] + d);
        a2 += qd * load8(keys[j + 2] + d);
        a3 += qd * load8(keys[j + 3] + d);
      }
      const v4 s = sum4x8(a0, a1, a2, a3);
      for (int i = 0; i < 4; ++i) p[j + i] = s[i] * scale + (biases ? biases[j + i] : 0.f);
    }
  }
  for (; j < L; ++j) p[j] = dot(q, keys[j], Dk) * scale + (biases ? biases[j] : 0.f);
}

// o = softmax_j(q · keys[j] * scale + biases[j]) values[j] for one query row; p is scratch for
// the L scores. A row whose every score is -inf reads zeros; a NaN score makes the row NaN, as
// softmax does (the running max skips NaNs: where it stays -inf, the row is checked for them).
template <typename scalar_t>
FASTATTN_INLINE void attend_query_body(const scalar_t *q, const scalar_t *const *keys,
                                  const scalar_t *const *values, const scalar_t *biases,
                                  int64_t L, int64_t Dk, int64_t Dv, scalar_t scale, scalar_t *p,
                                  scalar_t *o) {
  scores(q, keys, biases, L, Dk, scale, p);
  scalar_t max = -std::numeric_limits<scalar_t>::infinity();
  for (int64_t j = 0; j < L; ++j) max = std::max(max, p[j]);
  if (max == -std::numeric_limits<scalar_t>::infinity()) {
    scalar_t fill = 0;
    for (int64_t j = 0; j < L; ++j)
      if (std::isnan(p[j])) fill = std::numeric_limits<scalar_t>::quiet_NaN();
    for (int64_t d = 0; d < Dv; ++d) o[d] = fill;
    return;
  }
  for (int64_t j = 0; j < L; ++j) p[j] -= max;
  weighted_sum(p, scalar_t(1) / exp_and_sum(p, L), values, L, Dv, o);
}
// Requests a row's cache lines before the loops read it: a decoding cache's rows are scattered
// (each position may sit in another row), and loading them only as the loops reach them waits
// on one miss after another (self-attention over 15 positions of 256 rows: 25% faster).
template <typename scalar_t>
FASTATTN_INLINE void prefetch_row(const scalar_t *row, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  for (int64_t i = 0; i < n; i += kLine) __builtin_prefetch(row + i);
}

// An attention's operands as pointers and strides, so that a decoder step points it at its
// buffers and caches without making views of them (a view is a tensor allocated and freed).
// q and out (G, H, R, D), k and v (P, H, >= L, D), each given by its first element and the
// strides of its first three dimensions, the last being unit; bias (P, >= L) and rows (G, L) as
// decode_attention_cpu takes them, or null.
template <typename scalar_t>
struct Attention {
  struct Array {
    const scalar_t *data;
    int64_t s0, s1, s2;

    static Array of(const at::Tensor &t) {
      return {t.data_ptr<scalar_t>(), t.stride(0), t.stride(1), t.stride(2)};
    }
  };
  Array q, k, v;
  scalar_t *out;
  int64_t os0, os1, os2;
  const scalar_t *bias = nullptr;
  int64_t bs0 = 0, bs1 = 0;
  const int64_t *rows = nullptr;
  int64_t rs0 = 0, rs1 = 0;
  int64_t G, H, R, L, Dk, Dv;
  scalar_t scale;
};

// Pairs (group g, head h) [begin, end) of `a`: the rows of each pair's keys and values, then its
// query rows. One kernel per level around the whole loop: per query, a call chosen by level
// cost more than a short prefix's arithmetic.
template <typename scalar_t>
FASTATTN_INLINE void attend_pairs_body(const Attention<scalar_t> &a, int64_t begin, int64_t end,
                                       scalar_t *p, scalar_t *biases, const scalar_t **keys,
                                       const scalar_t **values) {
  const int64_t H = a.H, L = a.L, Dk = a.Dk, Dv = a.Dv;
  for (int64_t gh = begin; gh < end; ++gh) {
    const int64_t g = gh / H, h = gh % H;
    for (int64_t j = 0; j < L; ++j) {
      const int64_t source = a.rows ? a.rows[g * a.rs0 + j * a.rs1] : g;
      keys[j] = a.k.data + source * a.k.s0 + h * a.k.s1 + j * a.k.s2;
      values[j] = a.v.data + source * a.v.s0 + h * a.v.s1 + j * a.v.s2;
      prefetch_row(keys[j], Dk), prefetch_row(values[j], Dv);
      if (a.bias) biases[j] = a.bias[source * a.bs0 + j * a.bs1];
    }
    for (int64_t r = 0; r < a.R; ++r) {
      attend_query_body(a.q.data + g * a.q.s0 + h * a.q.s1 + r * a.q.s2, keys,
                        const_cast<const scalar_t *const *>(values), a.bias ? biases : nullptr,
                        L, Dk, Dv, a.scale, p, a.out + g * a.os0 + h * a.os1 + r * a.os2);
    }
  }
}
FASTATTN_PER_ISA(attend_pairs, attend_pairs_body)

template <typename scalar_t>
void attend_kernel(const Attention<scalar_t> &a) {
  const int64_t L = a.L;
  // Threads only pay off with some work per task: about 64k multiply-adds.
  const int64_t grain =
      std::max<int64_t>(1, 65536 / std::max<int64_t>(1, a.R * L * (a.Dk + a.Dv)));
  at::parallel_for(0, a.G * a.H, grain, [&](int64_t begin, int64_t end) {
    // Per thread, kept between calls (a step attends once per layer and kind).
    thread_local std::vector<scalar_t> p, biases;
    thread_local std::vector<const scalar_t *> keys, values;
    p.resize(L), biases.resize(a.bias ? L : 0), keys.resize(L), values.resize(L);
    attend_pairs(a, begin, end, p.data(), biases.data(), keys.data(), values.data());
  });
}

// decode_attention without the checks, into out (G, H, R, Dv), any strides with a unit last one.
void attend(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor *bias,
            double scale, const at::Tensor *rows, at::Tensor out) {
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "decode_attention", [&] {
    using Array = typename Attention<scalar_t>::Array;
    Attention<scalar_t> a{Array::of(q), Array::of(k), Array::of(v), out.data_ptr<scalar_t>(),
                          out.stride(0), out.stride(1), out.stride(2)};
    if (bias) a.bias = bias->data_ptr<scalar_t>(), a.bs0 = bias->stride(0), a.bs1 = bias->stride(1);
    if (rows) a.rows = rows->data_ptr<int64_t>(), a.rs0 = rows->stride(0), a.rs1 = rows->stride(1);
    a.G = q.size(0), a.H = q.size(1), a.R = q.size(2), a.L = rows ? rows->size(1) : k.size(2);
    a.Dk = q.size(3), a.Dv = v.size(3), a.scale = static_cast<scalar_t>(scale);
    attend_kernel(a);
  });
}

// Writes the position's keys or values, columns [first, first + H·D) of x (N, >= first + H·D)
// contiguous, into cache (rows >= N, H, capacity, D) at `position`.
template <typename scalar_t>
void store_position(const at::Tensor &x, int64_t first, scalar_t *cache,
                    at::IntArrayRef cache_strides, int64_t H, int64_t D, int64_t position) {
  const scalar_t *xp = x.data_ptr<scalar_t>();
  const int64_t width = x.size(1);
  for (int64_t n = 0; n < x.size(0); ++n)
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(cache + n * cache_strides[0] + h * cache_strides[1] + position * cache_strides[2],
                  xp + n * width + first + h * D, D * sizeof(scalar_t));
}

// The largest run length R such that sentences (N,) is constant on each run of R rows.
int64_t same_runs(const at::Tensor &sentences) {
  const auto contiguous = sentences.contiguous();
  const int64_t *s = contiguous.data_ptr<int64_t>(), N = sentences.numel();
  int64_t first = 1;
  while (first < N && s[first] == s[0]) ++first;
  for (int64_t R = first; R > 1; --R) {
    if (N % R != 0) continue;
    bool runs = true;
    for (int64_t n = 0; n < N && runs; ++n) runs = s[n] == s[n - n % R];
    if (runs) return R;
  }
  return 1;
}

void check_rows(const at::Tensor &rows, int64_t groups, int64_t keys, int64_t cache_rows,
                const char *what) {
  TORCH_CHECK(rows.dim() == 2 && rows.size(0) == groups && rows.size(1) <= keys &&
                  rows.scalar_type() == at::kLong,
              what, " must be an int64 (", groups, ", <= ", keys, ") tensor, got ", rows.sizes(),
              " ", rows.scalar_type());
  const auto index = rows.accessor<int64_t, 2>();  // a loop: at::aminmax costs more per step
  bool inside = true;
  for (int64_t g = 0; g < index.size(0); ++g)
    for (int64_t j = 0; j < index.size(1); ++j)
      inside &= index[g][j] >= 0 && index[g][j] < cache_rows;
  TORCH_CHECK(inside, what, " holds rows outside 0..", cache_rows - 1);
}

// x = max(x, 0) in place, NaN kept, as relu_ computes it for a contiguous x: a plain loop, where
// relu_ built a TensorIterator for each few-row step.
void relu_rows_(at::Tensor &x) {
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "relu_rows_", [&] {
    scalar_t *xp = x.data_ptr<scalar_t>();
    for (int64_t i = 0, n = x.numel(); i < n; ++i) xp[i] = xp[i] < 0 ? scalar_t(0) : xp[i];
  });
}

// A decoder step's intermediates (qkv, the heads' outputs, a sub-layer's output, the
// feed-forward's hidden rows), one set per calling thread, kept while the rows and widths stay
// (a search's steps): allocated afresh, with the views made of them, they were about 40 tensors
// a step and a fifth of a few-row step's time. Sets over kKeptStepBytes are freed after a step.
struct StepBuffers {
  at::Tensor qkv, heads, out, cross_q, cross_heads, hidden;

  int64_t bytes() const {
    int64_t total = 0;
    for (const auto *t : {&qkv, &heads, &out, &cross_q, &cross_heads, &hidden})
      total += t->defined() ? static_cast<int64_t>(t->nbytes()) : 0;
    return total;
  }
};

constexpr int64_t kKeptStepBytes = int64_t{64} << 20;

at::Tensor &buffer(at::Tensor &held, int64_t rows, int64_t width,
                   const at::TensorOptions &options) {
  if (!held.defined() || held.size(0) != rows || held.size(1) != width ||
      held.dtype() != options.dtype())
    held = at::empty({rows, width}, options);
  return held;
}

}  // namespace

at::Tensor decode_attention_cpu(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                const std::optional<at::Tensor> &bias, double scale,
                                const std::optional<at::Tensor> &rows) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "decode_attention: q, k, v must be 4-D (G, H, R or L, D), got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK((rows || k.size(0) == q.size(0)) && k.size(1) == q.size(1) &&
                  k.size(3) == q.size(3) && v.sizes().slice(0, 3) == k.sizes().slice(0, 3),
              "decode_attention: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
              " must be (G, H, R, Dk), (G, H, L, Dk) and (G, H, L, Dv)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
              "decode_attention: q, k, v must all be float32 or all float64");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: q, k, v need a unit stride in the last dimension");
  if (rows) check_rows(*rows, q.size(0), k.size(2), k.size(0), "decode_attention: rows");
  const int64_t L = rows ? rows->size(1) : k.size(2);
  if (bias) {
    TORCH_CHECK(bias->dim() == 2 && bias->size(0) == k.size(0) && bias->size(1) >= L &&
                    bias->scalar_type() == q.scalar_type(),
                "decode_attention: bias must be (P, L) = (", k.size(0), ", ", L,
                ") in q's dtype, got ", bias->sizes(), " ", bias->scalar_type());
  }
  auto out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  attend(q, k, v, bias ? &*bias : nullptr, scale, rows ? &*rows : nullptr, out);
  return out;
}

at::Tensor decoder_step_cpu(const at::Tensor &x, at::TensorList params, const at::Tensor &self_k,
                            const at::Tensor &self_v, const at::Tensor &history, int64_t length,
                            at::TensorList memory_k, at::TensorList memory_v,
                            const std::optional<at::Tensor> &memory_bias,
                            const std::optional<at::Tensor> &sentences, at::TensorList packed,
                            double eps) {
  constexpr int64_t kLinearsPerLayer = 6;
  TORCH_CHECK(self_k.dim() == 5 && self_v.dim() == 5 &&
                  self_v.sizes().slice(0, 4) == self_k.sizes().slice(0, 4),
              "decoder_step: self_k and self_v must be (layers, rows, H, capacity, D), got ",
              self_k.sizes(), " and ", self_v.sizes());
  const int64_t layers = self_k.size(0), H = self_k.size(2), Dk = self_k.size(4);
  const int64_t Dv = self_v.size(4);
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= self_k.size(1),
              "decoder_step: x must be (N, d) with N <= the caches' ", self_k.size(1),
              " rows, got ", x.sizes());
  const int64_t N = x.size(0);
  TORCH_CHECK(static_cast<int64_t>(params.size()) == kDecoderLayerSlots * layers &&
                  static_cast<int64_t>(memory_k.size()) == layers &&
                  static_cast<int64_t>(memory_v.size()) == layers,
              "decoder_step: need ", kDecoderLayerSlots,
              " parameters and one memory_k, memory_v per layer for ", layers, " layers, got ",
              params.size(), ", ", memory_k.size(), ", ", memory_v.size());
  // packed: nothing, float32 or bfloat16 panels (one per linear map) or int8 (kInt8Parts per
  // linear map).
  const auto packed_type = packed.empty() ? at::kFloat : packed[0].scalar_type();
  const bool int8 = packed_type == at::kChar, bf16 = packed_type == at::kBFloat16;
  const int64_t per_linear = int8 ? kInt8Parts : 1;
  TORCH_CHECK(packed.empty() ||
                  static_cast<int64_t>(packed.size()) == kLinearsPerLayer * per_linear * layers,
              "decoder_step: packed must be empty or hold ", kLinearsPerLayer,
              " packed weights per layer (", kInt8Parts, " parts each for int8), got ",
              packed.size());
  TORCH_CHECK(!(int8 || bf16) || x.scalar_type() == at::kFloat,
              "decoder_step: ", packed_type, " weights need float32 x, got ", x.scalar_type());
  TORCH_CHECK(0 <= length && length < self_k.size(3), "decoder_step: position ", length,
              " is outside the caches' capacity ", self_k.size(3));
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble) &&
                  x.scalar_type() == self_k.scalar_type() &&
                  x.scalar_type() == self_v.scalar_type(),
              "decoder_step: x and the caches must all be float32 or all float64");
  TORCH_CHECK(history.dim() == 2 && history.size(1) > length,
              "decoder_step: history must be (N, > ", length, "), got ", history.sizes());
  check_rows(history.narrow(1, 0, length + 1), N, length + 1, self_k.size(1),
             "decoder_step: history");
  const int64_t B = memory_k[0].size(0), S = memory_k[0].size(2);
  TORCH_CHECK(sentences || (B > 0 && N % B == 0), "decoder_step: ", N,
              " rows are not grouped evenly over ", B, " sentences; pass sentences");
  if (sentences) check_rows(sentences->unsqueeze(1), N, 1, B, "decoder_step: sentences");
  if (memory_bias) {
    TORCH_CHECK(memory_bias->dim() == 2 && memory_bias->size(0) == B &&
                    memory_bias->size(1) == S,
                "decoder_step: memory_bias must be (", B, ", ", S, "), got ",
                memory_bias->sizes());
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(Dk));
  // Cross-attention groups: rows that come in runs of one sentence (a beam per sentence) are
  // one group of queries over that sentence's keys and values, read once for all of them.
  int64_t group = std::max<int64_t>(1, N / B);
  at::Tensor row_sentences;
  if (sentences) group = same_runs(*sentences), row_sentences = sentences->contiguous();

  at::Tensor y = x.contiguous().clone();
  const auto options = y.options();
  thread_local StepBuffers buffers;
  auto &qkv = buffer(buffers.qkv, N, params[kSelfQkvWeight].size(0), options);
  auto &heads = buffer(buffers.heads, N, H * Dv, options);
  auto &out = buffer(buffers.out, N, y.size(1), options);
  auto &cross_q = buffer(buffers.cross_q, N, H * Dk, options);
  auto &cross_heads = buffer(buffers.cross_heads, N, H * Dv, options);
  auto &hidden = buffer(buffers.hidden, N, params[kFeedForwardW1Weight].size(0), options);
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "decoder_step", [&] {
    using Array = typename Attention<scalar_t>::Array;
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor *p = &params[kDecoderLayerSlots * l];
      // The layer's i-th linear map into `into`: 0 qkv, 1 self-attention out, 2 cross q, 3
      // cross out, 4 W1, 5 W2 (weight p[kWeight[i]], bias the slot after it), the order of
      // `packed`'s panels.
      const auto linear = [&](const at::Tensor &in, int64_t i, at::Tensor &into) {
        constexpr int64_t kWeight[kLinearsPerLayer] = {
            kSelfQkvWeight,  kSelfOutWeight,       kCrossQWeight,
            kCrossOutWeight, kFeedForwardW1Weight, kFeedForwardW2Weight};
        const at::Tensor *weights = packed.data() + (kLinearsPerLayer * l + i) * per_linear;
        const at::Tensor &weight = p[kWeight[i]], &bias = p[kWeight[i] + 1];
        if (int8)
          linear_int8_out_cpu(in, weights[kInt8Panels], weights[kInt8Scales], weights[kInt8Sums],
                              bias, into);
        else if (bf16)
          linear_bf16_out_cpu(in, *weights, bias, into);
        else
          linear_out_cpu(in, weight, packed.empty() ? std::nullopt
                                                    : std::optional<at::Tensor>(*weights),
                         bias, into);
      };
      linear(y, 0, qkv);
      auto *k = self_k.data_ptr<scalar_t>() + l * self_k.stride(0);
      auto *v = self_v.data_ptr<scalar_t>() + l * self_v.stride(0);
      store_position<scalar_t>(qkv, H * Dk, k, self_k.strides().slice(1), H, Dk, length);
      store_position<scalar_t>(qkv, 2 * H * Dk, v, self_v.strides().slice(1), H, Dv, length);
      // Row n's query (the first H·Dk columns of qkv) over its positions, held by the cache
      // rows history[n, :length + 1].
      Attention<scalar_t> self{Array{qkv.data_ptr<scalar_t>(), qkv.stride(0), Dk, 0},
                               Array{k, self_k.stride(1), self_k.stride(2), self_k.stride(3)},
                               Array{v, self_v.stride(1), self_v.stride(2), self_v.stride(3)},
                               heads.data_ptr<scalar_t>(), H * Dv, Dv, 0};
      self.rows = history.data_ptr<int64_t>(), self.rs0 = history.stride(0);
      self.rs1 = history.stride(1);
      self.G = N, self.H = H, self.R = 1, self.L = length + 1, self.Dk = Dk, self.Dv = Dv;
      self.scale = static_cast<scalar_t>(scale);
      attend_kernel(self);
      linear(heads, 1, out);
      add_layer_norm_(y, out, p[kSelfNormWeight], p[kSelfNormBias], eps);
      // Attention over the encoder output: group g's queries (rows g·group ..) over sentence g's
      // keys and values, or over those of the sentence row_sentences gives its first row.
      linear(y, 2, cross_q);
      Attention<scalar_t> cross{Array{cross_q.data_ptr<scalar_t>(), group * H * Dk, Dk, H * Dk},
                                Array::of(memory_k[l]), Array::of(memory_v[l]),
                                cross_heads.data_ptr<scalar_t>(), group * H * Dv, Dv, H * Dv};
      if (memory_bias) {
        cross.bias = memory_bias->data_ptr<scalar_t>();
        cross.bs0 = memory_bias->stride(0), cross.bs1 = memory_bias->stride(1);
      }
      if (sentences) cross.rows = row_sentences.data_ptr<int64_t>(), cross.rs0 = group;
      cross.G = N / group, cross.H = H, cross.R = group, cross.L = S, cross.Dk = Dk;
      cross.Dv = Dv, cross.scale = static_cast<scalar_t>(scale);
      attend_kernel(cross);
      linear(cross_heads, 3, out);
      add_layer_norm_(y, out, p[kCrossNormWeight], p[kCrossNormBias], eps);
      // Feed-forward network.
      linear(y, 4, hidden);
      relu_rows_(hidden);
      linear(hidden, 5, out);
      add_layer_norm_(y, out, p[kFeedForwardNormWeight], p[kFeedForwardNormBias], eps);
    }
  });
  if (buffers.bytes() > kKeptStepBytes) buffers = StepBuffers{};
  return y;
}

}  // namespace fastattn
