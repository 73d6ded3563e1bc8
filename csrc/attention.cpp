// Attention with its backward on CPU. One task per (batch, head) pair: its q, k, v rows are
// copied into float32 buffers (converting bfloat16 once), worked on while they sit in cache, and
// the results written once. The backward recomputes the probabilities from lse and the dropout
// mask from its seed, as the Triton kernels do, so the forward keeps no (Lq, Lk) matrix.
#include "attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "dropout.h"
#include "vector_math.h"

namespace fastattn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// y += a x over n floats.
FASTATTN_INLINE void axpy(float a, const float *x, float *y, int64_t n) {
  if (n % 8 == 0) {
    for (int64_t d = 0; d < n; d += 8) store8(y + d, load8(y + d) + a * load8(x + d));
    return;
  }
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

// p[j] = e^(min(p[j] - shift, 0)) for j < n, returning their sum. The min guards the backward's
// recomputed scores, which may exceed their lse by a rounding error.
FASTATTN_INLINE float exp_shifted(float *p, int64_t n, float shift) {
  v8 partial{};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    v8 x = load8(p + j) - shift;
    x = x < 0.0f ? x : v8{};
    const v8 e = exp_nonpositive(x);
    store8(p + j, e);
    partial += e;
  }
  float sum = sum8(partial);
  for (; j < n; ++j) sum += (p[j] = exp_nonpositive(std::min(p[j] - shift, 0.0f)));
  return sum;
}

// One (batch, head) pair: float32 rows, contiguous, D wide. bias points at the pair's (0, 0)
// element with row stride si and column stride sj, or is null. Query i's dropout row is
// first_row + i: the pair's rows follow each other in (B, H, Lq) order.
struct Head {
  int64_t Lq, Lk, D;
  bool causal;
  int64_t shift;
  float scale;
  const float *bias;
  int64_t si, sj;
  Dropout dropout;
  int64_t first_row;

  // Keys row i may see: all, or those up to its causal limit.
  int64_t keys(int64_t i) const {
    return causal ? std::clamp<int64_t>(i + shift + 1, 0, Lk) : Lk;
  }

  // row[j] = s_ij for j < n, returning their maximum.
  FASTATTN_INLINE float scores(const float *q, const float *k, int64_t i, int64_t n,
                               float *row) const {
    const float *qi = q + i * D;
    float m = -kInf;
    for (int64_t j = 0; j < n; ++j) {
      float s = dot(qi, k + j * D, D) * scale;
      if (bias) s += bias[i * si + j * sj];
      row[j] = s;
      m = std::max(m, s);
    }
    return m;
  }

  // w[j] *= keep_ij / (1 - p) for j < n: dropout of row i's attention weights, in place.
  FASTATTN_INLINE void drop(int64_t i, int64_t n, float *w) const {
    dropout.apply_row(w, w, n, dropout.key(first_row + i));
  }

  // Row i of the backward with dropout, z_ij = keep_ij / (1 - p): dp[j] *= z_ij, and pz[j] =
  // p[j] z_ij, the weight v_j got in the forward.
  FASTATTN_INLINE void drop_backward(int64_t i, int64_t n, const float *p, float *dp,
                                     float *pz) const {
    std::fill(pz, pz + n, 1.0f);
    drop(i, n, pz);
    for (int64_t j = 0; j < n; ++j) {
      dp[j] *= pz[j];
      pz[j] *= p[j];
    }
  }
};

// out[j] = x · keys[j] for j < n, 4 keys at a time: one shared reduction for four dots.
template <int V8>
FASTATTN_INLINE void dots(const v8 (&x)[V8], const float *keys, int64_t n, float *out) {
  constexpr int64_t D = 8 * V8;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float *k0 = keys + j * D;
    v8 a0{}, a1{}, a2{}, a3{};
    for (int t = 0; t < V8; ++t) {
      a0 += x[t] * load8(k0 + 8 * t);
      a1 += x[t] * load8(k0 + D + 8 * t);
      a2 += x[t] * load8(k0 + 2 * D + 8 * t);
      a3 += x[t] * load8(k0 + 3 * D + 8 * t);
    }
    const v4 s = sum4x8(a0, a1, a2, a3);
    std::memcpy(out + j, &s, sizeof s);
  }
  for (; j < n; ++j) {
    v8 a{};
    for (int t = 0; t < V8; ++t) a += x[t] * load8(keys + j * D + 8 * t);
    out[j] = sum8(a);
  }
}

// Head widths 8 · V8 (8 to 64): a query's row, its output and gradient accumulators live in
// registers across all keys, and dot products share their reductions four at a time.
template <int V8>
FASTATTN_INLINE float scores_fixed(const Head &a, const v8 (&qi)[V8], const float *k, int64_t i,
                                   int64_t n, float *row) {
  dots<V8>(qi, k, n, row);
  float m = -kInf;
  for (int64_t j = 0; j < n; ++j) {
    float s = row[j] * a.scale;
    if (a.bias) s += a.bias[i * a.si + j * a.sj];
    row[j] = s;
    m = std::max(m, s);
  }
  return m;
}

template <int V8>
FASTATTN_INLINE void load_row(const float *x, v8 (&out)[V8]) {
  for (int t = 0; t < V8; ++t) out[t] = load8(x + 8 * t);
}

template <int V8>
FASTATTN_INLINE void forward_fixed(const Head &a, const float *q, const float *k, const float *v,
                                   float *row, float *o, float *lse) {
  constexpr int64_t D = 8 * V8;
  for (int64_t i = 0; i < a.Lq; ++i) {
    const int64_t n = a.keys(i);
    v8 qi[V8], acc[V8] = {};
    load_row(q + i * D, qi);
    const float m = scores_fixed<V8>(a, qi, k, i, n, row);
    float inv = 0;
    if (m > -kInf) {
      const float l = exp_shifted(row, n, m);  // the normaliser sums the weights before dropout
      if (a.dropout.on) a.drop(i, n, row);
      for (int64_t j = 0; j < n; ++j)
        for (int t = 0; t < V8; ++t) acc[t] += row[j] * load8(v + j * D + 8 * t);
      inv = 1.0f / l;
      lse[i] = m + std::log(l);
    } else {  // no key allowed (or n = 0): zeros, and zero gradients via lse = +inf
      lse[i] = kInf;
    }
    for (int t = 0; t < V8; ++t) store8(o + i * D + 8 * t, acc[t] * inv);
  }
}

template <int V8>
FASTATTN_INLINE void backward_fixed(const Head &a, const float *q, const float *k,
                                    const float *v, const float *o, const float *dout,
                                    const float *lse, float *row, float *dp, float *pz,
                                    float *dq, float *dk, float *dv) {
  constexpr int64_t D = 8 * V8;
  for (int64_t i = 0; i < a.Lq; ++i) {
    v8 dqi[V8] = {};
    if (lse[i] < kInf) {
      const int64_t n = a.keys(i);
      v8 qi[V8], doi[V8], delta{};
      load_row(q + i * D, qi);
      load_row(dout + i * D, doi);
      for (int t = 0; t < V8; ++t) delta += doi[t] * load8(o + i * D + 8 * t);
      scores_fixed<V8>(a, qi, k, i, n, row);
      exp_shifted(row, n, lse[i]);  // p_ij
      dots<V8>(doi, v, n, dp);   // do_i · v_j
      const float *pv = row;     // the weights v_j got
      if (a.dropout.on) {
        a.drop_backward(i, n, row, dp, pz);
        pv = pz;
      }
      const float d = sum8(delta);
      for (int64_t j = 0; j < n; ++j) {
        const float p = row[j], ds = p * (dp[j] - d) * a.scale;
        float *dvj = dv + j * D, *dkj = dk + j * D;
        const float *kj = k + j * D;
        for (int t = 0; t < V8; ++t) {
          store8(dvj + 8 * t, load8(dvj + 8 * t) + pv[j] * doi[t]);
          store8(dkj + 8 * t, load8(dkj + 8 * t) + ds * qi[t]);
          dqi[t] += ds * load8(kj + 8 * t);
        }
      }
    }
    for (int t = 0; t < V8; ++t) store8(dq + i * D + 8 * t, dqi[t]);
  }
}

// Any other head width: the same loops over D at run time.
FASTATTN_INLINE void forward_any(const Head &a, const float *q, const float *k, const float *v,
                                 float *row, float *o, float *lse) {
  const int64_t D = a.D;
  std::fill(o, o + a.Lq * D, 0.0f);
  for (int64_t i = 0; i < a.Lq; ++i) {
    const int64_t n = a.keys(i);
    const float m = a.scores(q, k, i, n, row);
    if (!(m > -kInf)) {
      lse[i] = kInf;
      continue;
    }
    const float l = exp_shifted(row, n, m);
    if (a.dropout.on) a.drop(i, n, row);
    float *oi = o + i * D;
    for (int64_t j = 0; j < n; ++j) axpy(row[j], v + j * D, oi, D);
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < D; ++d) oi[d] *= inv;
    lse[i] = m + std::log(l);
  }
}

FASTATTN_INLINE void backward_any(const Head &a, const float *q, const float *k, const float *v,
                                  const float *o, const float *dout, const float *lse,
                                  float *row, float *dp, float *pz, float *dq, float *dk,
                                  float *dv) {
  const int64_t D = a.D;
  std::fill(dq, dq + a.Lq * D, 0.0f);
  for (int64_t i = 0; i < a.Lq; ++i) {
    if (!(lse[i] < kInf)) continue;
    const int64_t n = a.keys(i);
    a.scores(q, k, i, n, row);
    exp_shifted(row, n, lse[i]);  // p_ij
    const float *qi = q + i * D, *doi = dout + i * D;
    float *dqi = dq + i * D;
    const float delta = dot(doi, o + i * D, D);
    for (int64_t j = 0; j < n; ++j) dp[j] = dot(doi, v + j * D, D);
    const float *pv = row;  // the weights v_j got
    if (a.dropout.on) {
      a.drop_backward(i, n, row, dp, pz);
      pv = pz;
    }
    for (int64_t j = 0; j < n; ++j) {
      const float p = row[j];
      axpy(pv[j], doi, dv + j * D, D);
      const float ds = p * (dp[j] - delta) * a.scale;
      axpy(ds, k + j * D, dqi, D);
      axpy(ds, qi, dk + j * D, D);
    }
  }
}

FASTATTN_CLONES void forward_head(const Head &a, const float *q, const float *k, const float *v,
                                  float *row, float *o, float *lse) {
  switch (a.D) {
    case 8: return forward_fixed<1>(a, q, k, v, row, o, lse);
    case 16: return forward_fixed<2>(a, q, k, v, row, o, lse);
    case 32: return forward_fixed<4>(a, q, k, v, row, o, lse);
    case 64: return forward_fixed<8>(a, q, k, v, row, o, lse);
  }
  forward_any(a, q, k, v, row, o, lse);
}

// row, dp and pz hold Lk floats each.
FASTATTN_CLONES void backward_head(const Head &a, const float *q, const float *k, const float *v,
                                   const float *o, const float *dout, const float *lse,
                                   float *row, float *dp, float *pz, float *dq, float *dk,
                                   float *dv) {
  std::fill(dk, dk + a.Lk * a.D, 0.0f);
  std::fill(dv, dv + a.Lk * a.D, 0.0f);
  switch (a.D) {
    case 8: return backward_fixed<1>(a, q, k, v, o, dout, lse, row, dp, pz, dq, dk, dv);
    case 16: return backward_fixed<2>(a, q, k, v, o, dout, lse, row, dp, pz, dq, dk, dv);
    case 32: return backward_fixed<4>(a, q, k, v, o, dout, lse, row, dp, pz, dq, dk, dv);
    case 64: return backward_fixed<8>(a, q, k, v, o, dout, lse, row, dp, pz, dq, dk, dv);
  }
  backward_any(a, q, k, v, o, dout, lse, row, dp, pz, dq, dk, dv);
}

// rows (L, D) of a head with row stride `stride`, as contiguous float32; and back.
FASTATTN_CLONES void load_rows(const float *src, int64_t stride, int64_t L, int64_t D,
                               float *dst) {
  for (int64_t l = 0; l < L; ++l) std::memcpy(dst + l * D, src + l * stride, D * sizeof(float));
}

FASTATTN_CLONES void load_rows(const c10::BFloat16 *src, int64_t stride, int64_t L, int64_t D,
                               float *dst) {
  for (int64_t l = 0; l < L; ++l) {
    const c10::BFloat16 *s = src + l * stride;
    float *d = dst + l * D;
    int64_t c = 0;
    for (; c + 8 <= D; c += 8) store8(d + c, load8(s + c));
    for (; c < D; ++c) d[c] = static_cast<float>(s[c]);
  }
}

// contiguous float32 rows (L, D) into a head's rows with row stride `stride`.
void store_rows(const float *src, int64_t L, int64_t D, float *dst, int64_t stride) {
  for (int64_t l = 0; l < L; ++l) std::memcpy(dst + l * stride, src + l * D, D * sizeof(float));
}

FASTATTN_CLONES void store_rows(const float *src, int64_t L, int64_t D, c10::BFloat16 *dst,
                                int64_t stride) {
  for (int64_t l = 0; l < L; ++l) {
    const float *s = src + l * D;
    c10::BFloat16 *d = dst + l * stride;
    int64_t c = 0;
    for (; c + 8 <= D; c += 8) store8(d + c, load8(s + c));
    for (; c < D; ++c) d[c] = static_cast<c10::BFloat16>(s[c]);
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

template <typename T>
void forward(const Problem &p, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
             at::Tensor &out, at::Tensor &lse) {
  const Rows<T> qr(q), kr(k), vr(v), outr(out);
  float *lse_data = lse.data_ptr<float>();
  const int64_t Lq = p.Lq, Lk = p.Lk, D = p.D;
  at::parallel_for(0, p.B * p.H, p.grain(), [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(2 * Lq * D + 2 * Lk * D + Lk);
    float *Q = buffer.data(), *K = Q + Lq * D, *V = K + Lk * D, *O = V + Lk * D, *row = O + Lq * D;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / p.H, h = bh % p.H;
      load_rows(qr.at(b, h), qr.sl, Lq, D, Q);
      load_rows(kr.at(b, h), kr.sl, Lk, D, K);
      load_rows(vr.at(b, h), vr.sl, Lk, D, V);
      forward_head(p.at(b, h), Q, K, V, row, O, lse_data + bh * Lq);
      store_rows(O, Lq, D, outr.at(b, h), outr.sl);
    }
  });
}

template <typename T>
void backward(const Problem &p, const at::Tensor &grad_out, const at::Tensor &q,
              const at::Tensor &k, const at::Tensor &v, const at::Tensor &out,
              const at::Tensor &lse, at::Tensor &dq, at::Tensor &dk, at::Tensor &dv) {
  const Rows<T> qr(q), kr(k), vr(v), dor(grad_out), outr(out), dqr(dq), dkr(dk), dvr(dv);
  const float *lse_data = lse.data_ptr<float>();
  const int64_t Lq = p.Lq, Lk = p.Lk, D = p.D;
  at::parallel_for(0, p.B * p.H, p.grain(), [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(4 * Lq * D + 4 * Lk * D + 3 * Lk);
    float *Q = buffer.data(), *O = Q + Lq * D, *dO = O + Lq * D, *dQ = dO + Lq * D;
    float *K = dQ + Lq * D, *V = K + Lk * D, *dK = V + Lk * D, *dV = dK + Lk * D;
    float *row = dV + Lk * D, *dp = row + Lk, *pz = dp + Lk;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / p.H, h = bh % p.H;
      load_rows(qr.at(b, h), qr.sl, Lq, D, Q);
      load_rows(kr.at(b, h), kr.sl, Lk, D, K);
      load_rows(vr.at(b, h), vr.sl, Lk, D, V);
      load_rows(outr.at(b, h), outr.sl, Lq, D, O);
      load_rows(dor.at(b, h), dor.sl, Lq, D, dO);
      backward_head(p.at(b, h), Q, K, V, O, dO, lse_data + bh * Lq, row, dp, pz, dQ, dK, dV);
      store_rows(dQ, Lq, D, dqr.at(b, h), dqr.sl);
      store_rows(dK, Lk, D, dkr.at(b, h), dkr.sl);
      store_rows(dV, Lk, D, dvr.at(b, h), dvr.sl);
    }
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
