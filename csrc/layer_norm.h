// Residual + dropout + LayerNorm and plain dropout for CPU training: the CPU implementations of
// kernels/layer_norm.py's ops. Unfused, PyTorch on a CPU spends more time drawing dropout masks
// (a serial Mersenne Twister) and passing over memory than the small model's matmuls take; here
// each row is read once, normalised in cache and written once, on all threads.
//
// Dropout's keep mask is counter-based: keep(row, col) = u(row, col) >= p, u being 24 bits of a
// 32-bit integer hash of (seed, row, col), so the backward recomputes the mask from the seed
// instead of storing it, and torch.manual_seed (which draws the seed) reproduces it.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace fastattn {

// x, residual (M, N) float32 with unit column stride, or x bfloat16 (a matmul's output under
// CPU autocast) beside a float32 residual; weight, bias (N,) float32 or absent.
// Returns float32 (y, sum or empty, mean, rstd): y = LayerNorm(residual + dropout(x)) · weight +
// bias, sum = residual + dropout(x) when return_residual, row mean and 1 / sqrt(var + eps).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_residual_fwd_cpu(
    const at::Tensor &x, const std::optional<at::Tensor> &residual,
    const std::optional<at::Tensor> &weight, const std::optional<at::Tensor> &bias,
    int64_t seed, double eps, double dropout_p, bool return_residual);

// The backward of the above given dy (and dsum, the gradient reaching the returned sum):
// (dx in x's dtype, float32 dresidual or empty when it equals dx, dweight or empty, dbias or
// empty). Deterministic: dweight and dbias are summed from per-block partials in a fixed order.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_residual_bwd_cpu(
    const at::Tensor &dy, const std::optional<at::Tensor> &dsum, const at::Tensor &x,
    const std::optional<at::Tensor> &residual, const std::optional<at::Tensor> &weight,
    bool has_bias, int64_t seed, const at::Tensor &mean, const at::Tensor &rstd,
    double dropout_p);

// x float32 viewed as rows of its last dimension -> keep(row, col) ? x / (1 - p) : 0, with the
// same mask as layer_norm_residual for the same seed and shape. Its own backward: the gradient
// is dropout(grad, seed, p).
at::Tensor dropout_cpu(const at::Tensor &x, int64_t seed, double dropout_p);

}  // namespace fastattn
