// One decoding step's attention on CPU: for each (group, head), every query row makes one pass
// over the cached keys (scores, running max) and one over the values (weights, weighted sum).
#include "decode_attention.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace fastattn {

namespace {

// Built for AVX-512, AVX2 and baseline x86-64, picked at load time: the extension is compiled
// without -march, so without clones these loops would use SSE only.
#if defined(__x86_64__) && defined(__GNUC__)
#define FASTATTN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FASTATTN_CLONES
#endif

// q · k over n elements, in 16 independent partial sums so that the loop vectorises without
// reassociating one running sum (which -O3 alone may not do for floating point).
template <typename scalar_t>
FASTATTN_CLONES scalar_t dot(const scalar_t *q, const scalar_t *k, int64_t n) {
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

// o += w · v over n elements.
template <typename scalar_t>
FASTATTN_CLONES void axpy(scalar_t w, const scalar_t *v, scalar_t *o, int64_t n) {
  for (int64_t d = 0; d < n; ++d) o[d] += w * v[d];
}

template <typename scalar_t>
void decode_attention_kernel(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                             const at::Tensor *bias, scalar_t scale, at::Tensor &out) {
  const int64_t G = q.size(0), H = q.size(1), R = q.size(2), Dk = q.size(3);
  const int64_t L = k.size(2), Dv = v.size(3);
  const scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>();
  const scalar_t *vp = v.data_ptr<scalar_t>();
  const scalar_t *bp = bias ? bias->data_ptr<scalar_t>() : nullptr;
  scalar_t *op = out.data_ptr<scalar_t>();
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides();
  const int64_t bs0 = bias ? bias->stride(0) : 0, bs1 = bias ? bias->stride(1) : 0;
  // Threads only pay off with some work per task: about 64k multiply-adds.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, R * L * (Dk + Dv)));
  at::parallel_for(0, G * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> p(L);
    for (int64_t gh = begin; gh < end; ++gh) {
      const int64_t g = gh / H, h = gh % H;
      const scalar_t *kg = kp + g * ks[0] + h * ks[1];
      const scalar_t *vg = vp + g * vs[0] + h * vs[1];
      for (int64_t r = 0; r < R; ++r) {
        const scalar_t *qr = qp + g * qs[0] + h * qs[1] + r * qs[2];
        scalar_t *o = op + ((g * H + h) * R + r) * Dv;
        scalar_t max = -std::numeric_limits<scalar_t>::infinity();
        for (int64_t j = 0; j < L; ++j) {
          const scalar_t *kj = kg + j * ks[2];
          scalar_t s = dot(qr, kj, Dk) * scale;
          if (bp) s += bp[g * bs0 + j * bs1];
          p[j] = s;
          max = std::max(max, s);
        }
        std::fill(o, o + Dv, scalar_t(0));
        if (max == -std::numeric_limits<scalar_t>::infinity()) continue;
        scalar_t sum = 0;
        for (int64_t j = 0; j < L; ++j) sum += (p[j] = std::exp(p[j] - max));
        const scalar_t inv = scalar_t(1) / sum;
        for (int64_t j = 0; j < L; ++j) {
          axpy(p[j] * inv, vg + j * vs[2], o, Dv);
        }
      }
    }
  });
}

}  // namespace

at::Tensor decode_attention_cpu(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                const std::optional<at::Tensor> &bias, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "decode_attention: q, k, v must be 4-D (G, H, R or L, D), got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3) &&
                  v.sizes().slice(0, 3) == k.sizes().slice(0, 3),
              "decode_attention: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
              " must be (G, H, R, Dk), (G, H, L, Dk) and (G, H, L, Dv)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
              "decode_attention: q, k, v must all be float32 or all float64");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: q, k, v need a unit stride in the last dimension");
  if (bias) {
    TORCH_CHECK(bias->dim() == 2 && bias->size(0) == k.size(0) && bias->size(1) == k.size(2) &&
                    bias->scalar_type() == q.scalar_type(),
                "decode_attention: bias must be (G, L) = (", k.size(0), ", ", k.size(2),
                ") in q's dtype, got ", bias->sizes(), " ", bias->scalar_type());
  }
  auto out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "decode_attention", [&] {
    decode_attention_kernel<scalar_t>(q, k, v, bias ? &*bias : nullptr,
                                      static_cast<scalar_t>(scale), out);
  });
  return out;
}

}  // namespace fastattn
