#include "layer_norm.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "dropout.h"
#include "vector_math.h"

namespace fastattn {
namespace {

// out = residual + dropout(x) over one row of n; returns the row's sum.
template <bool kDropout, bool kResidual, typename X>
FASTATTN_INLINE float add_row(const X *x, const float *r, float *out, int64_t n,
                              const Dropout &d, uint32_t key) {
  v8 acc{};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    v8 v = load8(x + c);
    if constexpr (kDropout) v = d.apply8(v, key, c);
    if constexpr (kResidual) v += load8(r + c);
    store8(out + c, v);
    acc += v;
  }
  float total = sum8(acc);
  if (c == n) return total;
  // The last n % 8 through the same vector arithmetic, zero-padded: a scalar tail is contracted
  // to multiply-adds differently per instantiation, and bfloat16 x would not sum as its float32
  // copy does.
  float xt[8] = {}, rt[8] = {}, vt[8];
  for (int64_t i = 0; c + i < n; ++i) {
    xt[i] = static_cast<float>(x[c + i]);
    if constexpr (kResidual) rt[i] = r[c + i];
  }
  v8 v = load8(xt);
  if constexpr (kDropout) v = d.apply8(v, key, c);
  if constexpr (kResidual) v += load8(rt);
  store8(vt, v);
  for (int64_t i = 0; c + i < n; ++i) {
    out[c + i] = vt[i];
    total += vt[i];
  }
  return total;
}

FASTATTN_INLINE float centered_square_sum(const float *s, int64_t n, float mean) {
  v8 acc{};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const v8 v = load8(s + c) - mean;
    acc += v * v;
  }
  float total = sum8(acc);
  for (; c < n; ++c) total += (s[c] - mean) * (s[c] - mean);
  return total;
}

// x is float32 or (under CPU autocast, where it is a matmul's output) bfloat16: xb set, x null.
struct Rows {
  const float *x, *r, *w, *b;  // w and b are never null: ones and zeros stand in
  const c10::BFloat16 *xb;
  int64_t sx, sr, n;
  Dropout d;
};

struct Forward : Rows {
  float *y, *sum, *mean, *rstd;  // sum may be null
  int64_t sy, ss;
  float eps;
};

template <bool kDropout, bool kResidual, typename X>
FASTATTN_INLINE void forward_rows_impl(const Forward &a, const X *x, int64_t row0,
                                       int64_t row1) {
  const int64_t n = a.n;
  for (int64_t row = row0; row < row1; ++row) {
    float *y = a.y + row * a.sy;
    const float total = add_row<kDropout, kResidual>(x + row * a.sx, a.r + row * a.sr, y, n,
                                                     a.d, kDropout ? a.d.key(row) : 0);
    const float mean = total / n;
    const float rstd = 1.0f / std::sqrt(centered_square_sum(y, n, mean) / n + a.eps);
    if (a.sum != nullptr) std::memcpy(a.sum + row * a.ss, y, n * sizeof(float));
    int64_t c = 0;
    for (; c + 8 <= n; c += 8)
      store8(y + c, (load8(y + c) - mean) * rstd * load8(a.w + c) + load8(a.b + c));
    for (; c < n; ++c) y[c] = (y[c] - mean) * rstd * a.w[c] + a.b[c];
    a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
}

template <typename X>
FASTATTN_INLINE void forward_rows_of(const Forward &a, const X *x, int64_t row0, int64_t row1) {
  const bool residual = a.r != nullptr;
  if (a.d.on && residual) return forward_rows_impl<true, true>(a, x, row0, row1);
  if (a.d.on) return forward_rows_impl<true, false>(a, x, row0, row1);
  if (residual) return forward_rows_impl<false, true>(a, x, row0, row1);
  forward_rows_impl<false, false>(a, x, row0, row1);
}

FASTATTN_INLINE void forward_rows_body(const Forward &a, int64_t row0, int64_t row1) {
  if (a.xb != nullptr) return forward_rows_of(a, a.xb, row0, row1);
  forward_rows_of(a, a.x, row0, row1);
}
FASTATTN_PER_ISA(forward_rows, forward_rows_body)

struct Backward : Rows {
  const float *dy, *dsum, *mean, *rstd;  // dsum may be null
  float *dx, *dr, *dw, *db;  // dx, dr contiguous, dr null when it equals dx; dw, db: the block's
  c10::BFloat16 *dxb;        // dx in x's dtype: dxb for bfloat16 x, dx null
  int64_t sdy, sdsum;
};

// One block of rows: dx, dr, and the block's partial dweight, dbias (accumulated into a.dw, a.db).
// `work` holds a row: the recomputed sum, then x̂.
template <bool kDropout, bool kResidual, typename X>
FASTATTN_INLINE void backward_rows_impl(const Backward &a, const X *x, X *dx_rows, int64_t row0,
                                        int64_t row1, float *work) {
  const int64_t n = a.n;
  for (int64_t row = row0; row < row1; ++row) {
    const uint32_t key = kDropout ? a.d.key(row) : 0;
    add_row<kDropout, kResidual>(x + row * a.sx, a.r + row * a.sr, work, n, a.d, key);
    const float mean = a.mean[row], rstd = a.rstd[row];
    const float *dy = a.dy + row * a.sdy;
    // With g = dy · w and x̂ = (s - mean) · rstd: ds = rstd · (g - mean(g) - x̂ · mean(g · x̂)).
    v8 acc_g{}, acc_gx{};
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
      const v8 xhat = (load8(work + c) - mean) * rstd, g = load8(dy + c) * load8(a.w + c);
      store8(work + c, xhat);
      acc_g += g;
      acc_gx += g * xhat;
      store8(a.dw + c, load8(a.dw + c) + load8(dy + c) * xhat);
      store8(a.db + c, load8(a.db + c) + load8(dy + c));
    }
    float sum_g = sum8(acc_g), sum_gx = sum8(acc_gx);
    for (; c < n; ++c) {
      const float xhat = (work[c] - mean) * rstd, g = dy[c] * a.w[c];
      work[c] = xhat;
      sum_g += g;
      sum_gx += g * xhat;
      a.dw[c] += dy[c] * xhat;
      a.db[c] += dy[c];
    }
    const float mean_g = sum_g / n, mean_gx = sum_gx / n;
    const float *dsum = a.dsum == nullptr ? nullptr : a.dsum + row * a.sdsum;
    X *dx = dx_rows + row * n;
    float *dr = a.dr == nullptr ? nullptr : a.dr + row * n;
    for (c = 0; c + 8 <= n; c += 8) {
      v8 ds = (load8(dy + c) * load8(a.w + c) - mean_g - load8(work + c) * mean_gx) * rstd;
      if (dsum != nullptr) ds += load8(dsum + c);
      if (dr != nullptr) store8(dr + c, ds);
      store8(dx + c, kDropout ? a.d.apply8(ds, key, c) : ds);
    }
    for (; c < n; ++c) {
      float ds = (dy[c] * a.w[c] - mean_g - work[c] * mean_gx) * rstd;
      if (dsum != nullptr) ds += dsum[c];
      if (dr != nullptr) dr[c] = ds;
      dx[c] = static_cast<X>(kDropout ? a.d.apply1(ds, key, c) : ds);
    }
  }
}

template <typename X>
FASTATTN_INLINE void backward_rows_of(const Backward &a, const X *x, X *dx, int64_t row0,
                                      int64_t row1, float *work) {
  const bool residual = a.r != nullptr;
  if (a.d.on && residual) return backward_rows_impl<true, true>(a, x, dx, row0, row1, work);
  if (a.d.on) return backward_rows_impl<true, false>(a, x, dx, row0, row1, work);
  if (residual) return backward_rows_impl<false, true>(a, x, dx, row0, row1, work);
  backward_rows_impl<false, false>(a, x, dx, row0, row1, work);
}

FASTATTN_INLINE void backward_rows_body(const Backward &a, int64_t row0, int64_t row1, float *work) {
  if (a.xb != nullptr) return backward_rows_of(a, a.xb, a.dxb, row0, row1, work);
  backward_rows_of(a, a.x, a.dx, row0, row1, work);
}
FASTATTN_PER_ISA(backward_rows, backward_rows_body)

FASTATTN_INLINE void dropout_rows_body(const float *x, float *y, int64_t row0, int64_t row1, int64_t n,
                                  const Dropout &d) {
  for (int64_t row = row0; row < row1; ++row) {
    d.apply_row(x + row * n, y + row * n, n, d.key(row));
  }
}
FASTATTN_PER_ISA(dropout_rows, dropout_rows_body)

void check_shape(const char *name, const at::Tensor &t, int64_t m, int64_t n) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == m && t.size(1) == n && (n <= 1 || t.stride(1) == 1),
              "layer_norm_residual (CPU): ", name, " must be (", m, ", ", n,
              ") with unit column stride, got ", t.sizes(), " strides ", t.strides());
}

void check_rows(const char *name, const at::Tensor &t, int64_t m, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "layer_norm_residual (CPU): ",
              name, " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  check_shape(name, t, m, n);
}

// x: float32, or bfloat16 beside a float32 residual (the sum, and so y, are float32 then).
void check_x(const at::Tensor &x, const std::optional<at::Tensor> &residual, int64_t m,
             int64_t n) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || (bf16 && residual)),
              "layer_norm_residual (CPU): x must be a float32 CPU tensor, or bfloat16 beside a "
              "residual, got ", x.scalar_type(), residual ? "" : " without a residual", " on ",
              x.device());
  check_shape("x", x, m, n);
}

void check_vector(const char *name, const std::optional<at::Tensor> &t, int64_t n) {
  if (!t) return;
  TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 1 &&
                  t->size(0) == n && t->is_contiguous(),
              "layer_norm_residual (CPU): ", name, " must be a contiguous float32 (", n,
              ",) CPU tensor, got ", t->scalar_type(), " ", t->sizes());
}

// Row grain for at::parallel_for: about 16k elements per task.
int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

// weight or ones, bias or zeros: the loops always read both.
const float *or_fill(const std::optional<at::Tensor> &t, std::vector<float> &fill, float value,
                     int64_t n) {
  if (t) return t->data_ptr<float>();
  fill.assign(n, value);
  return fill.data();
}

// The inputs both passes read. `fill` keeps the ones standing in for an absent weight.
Rows input_rows(const at::Tensor &x, const std::optional<at::Tensor> &residual,
                const std::optional<at::Tensor> &weight, std::vector<float> &fill, int64_t seed,
                double dropout_p) {
  const int64_t n = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  return Rows{bf16 ? nullptr : x.data_ptr<float>(),
              residual ? residual->data_ptr<float>() : nullptr,
              or_fill(weight, fill, 1.0f, n),
              nullptr,
              bf16 ? x.data_ptr<c10::BFloat16>() : nullptr,
              x.stride(0),
              residual ? residual->stride(0) : 0,
              n,
              Dropout(seed, dropout_p)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_residual_fwd_cpu(
    const at::Tensor &x, const std::optional<at::Tensor> &residual,
    const std::optional<at::Tensor> &weight, const std::optional<at::Tensor> &bias,
    int64_t seed, double eps, double dropout_p, bool return_residual) {
  TORCH_CHECK(x.dim() == 2, "layer_norm_residual (CPU): x must be 2-D, got ", x.sizes());
  const int64_t m = x.size(0), n = x.size(1);
  if (residual) check_rows("residual", *residual, m, n);
  check_x(x, residual, m, n);
  check_vector("weight", weight, n);
  check_vector("bias", bias, n);
  check_dropout(dropout_p);
  const auto fp32 = x.options().dtype(at::kFloat);
  at::Tensor y = at::empty({m, n}, fp32);
  at::Tensor sum = return_residual ? at::empty({m, n}, fp32) : at::empty({0}, fp32);
  at::Tensor mean = at::empty({m}, fp32), rstd = at::empty({m}, fp32);
  std::vector<float> ones, zeros;
  Forward a{input_rows(x, residual, weight, ones, seed, dropout_p)};
  a.b = or_fill(bias, zeros, 0.0f, n);
  a.y = y.data_ptr<float>();
  a.sy = n;
  a.sum = return_residual ? sum.data_ptr<float>() : nullptr;
  a.ss = n;
  a.mean = mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  at::parallel_for(0, m, row_grain(n),
                   [&](int64_t row0, int64_t row1) { forward_rows(a, row0, row1); });
  return {y, sum, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_residual_bwd_cpu(
    const at::Tensor &dy, const std::optional<at::Tensor> &dsum, const at::Tensor &x,
    const std::optional<at::Tensor> &residual, const std::optional<at::Tensor> &weight,
    bool has_bias, int64_t seed, const at::Tensor &mean, const at::Tensor &rstd,
    double dropout_p) {
  TORCH_CHECK(x.dim() == 2, "layer_norm_residual (CPU): x must be 2-D, got ", x.sizes());
  const int64_t m = x.size(0), n = x.size(1);
  check_rows("dy", dy, m, n);
  if (dsum) check_rows("dsum", *dsum, m, n);
  if (residual) check_rows("residual", *residual, m, n);
  check_x(x, residual, m, n);
  check_vector("weight", weight, n);
  check_vector("mean", mean, m);
  check_vector("rstd", rstd, m);
  check_dropout(dropout_p);
  // dx takes x's dtype; dresidual (float32) equals dx unless dropout scales dx or x is bfloat16.
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const bool separate = residual.has_value() && (dropout_p > 0 || bf16);
  const auto fp32 = x.options().dtype(at::kFloat);
  at::Tensor dx = at::empty({m, n}, x.options());
  at::Tensor dr = separate ? at::empty({m, n}, fp32) : at::empty({0}, fp32);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), m));
  at::Tensor dw = at::zeros({blocks, n}, fp32), db = at::zeros({blocks, n}, fp32);
  std::vector<float> ones;
  Backward a{input_rows(x, residual, weight, ones, seed, dropout_p)};
  a.dy = dy.data_ptr<float>();
  a.sdy = dy.stride(0);
  a.dsum = dsum ? dsum->data_ptr<float>() : nullptr;
  a.sdsum = dsum ? dsum->stride(0) : 0;
  a.mean = mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.dx = bf16 ? nullptr : dx.data_ptr<float>();
  a.dxb = bf16 ? dx.data_ptr<c10::BFloat16>() : nullptr;
  a.dr = separate ? dr.data_ptr<float>() : nullptr;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> work(n);
    for (int64_t block = b0; block < b1; ++block) {
      Backward part = a;
      part.dw = dw.data_ptr<float>() + block * n;
      part.db = db.data_ptr<float>() + block * n;
      backward_rows(part, block * m / blocks, (block + 1) * m / blocks, work.data());
    }
  });
  // Absent gradients are distinct empty tensors: an op's outputs may not alias each other.
  return {dx, dr, weight ? dw.sum(0) : at::empty({0}, fp32),
          has_bias ? db.sum(0) : at::empty({0}, fp32)};
}

at::Tensor dropout_cpu(const at::Tensor &x, int64_t seed, double dropout_p) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "dropout (CPU): x must be a float32 CPU tensor, got ", x.scalar_type(), " on ",
              x.device());
  check_dropout(dropout_p);
  const at::Tensor input = x.contiguous();
  at::Tensor y = at::empty_like(input);
  const int64_t n = input.dim() == 0 ? 1 : input.size(-1);
  const int64_t m = n == 0 ? 0 : input.numel() / n;
  const Dropout d(seed, dropout_p);
  const float *xp = input.data_ptr<float>();
  float *yp = y.data_ptr<float>();
  at::parallel_for(0, m, row_grain(n),
                   [&](int64_t row0, int64_t row1) { dropout_rows(xp, yp, row0, row1, n, d); });
  return y;
}

}  // namespace fastattn
