// The encoder of decoding on CPU: fastattn.model's encoder modules op for op (the same ATen ops
// and fastattn._C kernels, in the same order), without their Python glue.
#include "encoder.h"

#include "bf16_linear.h"
#include "int8_linear.h"
#include "layer_norm.h"
#include "layer_slots.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/pad.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/scaled_dot_product_attention.h>

#include <cmath>

namespace fastattn {

namespace {

constexpr int64_t kLinearsPerLayer = 4;  // qkv, out, W1, W2

// x (..., D) -> (..., O) by weight (O, D) and bias: nn.Linear's at::linear, or over x's rows the
// int8 (kInt8Parts) or bf16 (its panels) weights in `packed`, as fastattn.decoding did before
// this op.
at::Tensor project(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &bias,
                   at::TensorList packed) {
  if (packed.empty()) return at::linear(x, weight, bias);
  const auto rows = x.reshape({-1, x.size(-1)});
  const auto y = packed[0].scalar_type() == at::kChar
                     ? linear_int8_cpu(rows, packed[kInt8Panels], packed[kInt8Scales],
                                       packed[kInt8Sums], bias)
                     : linear_bf16_cpu(rows, packed[0], bias, weight.size(0));
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  return y.view(sizes);
}

// (B, S, H·D) -> (B, H, S, D), a view (fastattn.model.split_heads).
at::Tensor split_heads(const at::Tensor &x, int64_t heads) {
  return x.unflatten(-1, {heads, x.size(-1) / heads}).transpose(1, 2);
}

// LayerNorm(stream + sub) (fastattn.ops.layer_norm_residual without dropout): fastattn._C's
// kernel for float32, an add and at::layer_norm for float64.
at::Tensor add_norm(const at::Tensor &sub, const at::Tensor &stream, const at::Tensor &weight,
                    const at::Tensor &bias, double eps) {
  const int64_t N = sub.size(-1);
  if (sub.scalar_type() == at::kDouble) return at::layer_norm(stream + sub, {N}, weight, bias, eps);
  const auto rows = [N](const at::Tensor &t) {
    auto r = t.reshape({-1, N});
    return r.stride(1) == 1 ? r : r.contiguous();
  };
  return std::get<0>(layer_norm_residual_fwd_cpu(rows(sub), rows(stream), weight.contiguous(),
                                                 bias.contiguous(), 0, eps, 0.0, false))
      .view(sub.sizes());
}

}  // namespace

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor> transformer_encode_cpu(
    const at::Tensor &src, const at::Tensor &embedding, const at::Tensor &positions,
    double embedding_scale, int64_t pad_id, int64_t heads, int64_t key_dim,
    at::TensorList params, at::TensorList packed, at::TensorList memory_params,
    at::TensorList memory_packed, double eps) {
  TORCH_CHECK(src.dim() == 2 && src.scalar_type() == at::kLong && src.size(1) > 0,
              "transformer_encode: src must be a (B, S) int64 tensor with S > 0, got ",
              src.sizes(), " ", src.scalar_type());
  TORCH_CHECK(embedding.dim() == 2 && positions.dim() == 2 &&
                  positions.size(0) == src.size(1) && positions.size(1) == embedding.size(1),
              "transformer_encode: embedding (V, d) and positions (S, d) must share d, with S "
              "src's length, got ", embedding.sizes(), ", ", positions.sizes(), " and src ",
              src.sizes());
  const auto dtype = embedding.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
              "transformer_encode: the weights must be float32 or float64, got ", dtype);
  const int64_t count = static_cast<int64_t>(params.size());
  TORCH_CHECK(count % encoder::kEncoderLayerSlots == 0 && memory_params.size() % 2 == 0,
              "transformer_encode: need ", encoder::kEncoderLayerSlots,
              " parameters per encoder layer and 2 per memory projection, got ", count, " and ",
              memory_params.size());
  const int64_t layers = count / encoder::kEncoderLayerSlots;
  const int64_t projections = static_cast<int64_t>(memory_params.size()) / 2;
  const bool quantized = !packed.empty();
  const int64_t per_linear = quantized && packed[0].scalar_type() == at::kChar ? kInt8Parts : 1;
  TORCH_CHECK(quantized == !memory_packed.empty() &&
                  (!quantized ||
                   (static_cast<int64_t>(packed.size()) == kLinearsPerLayer * per_linear * layers &&
                    static_cast<int64_t>(memory_packed.size()) == per_linear * projections)),
              "transformer_encode: packed and memory_packed must both be empty or hold ",
              kLinearsPerLayer, " and 1 packed weights per layer (", kInt8Parts,
              " parts each for int8), got ", packed.size(), " and ", memory_packed.size());
  TORCH_CHECK(!quantized || dtype == at::kFloat,
              "transformer_encode: int8 and bf16 weights need a float32 model, got ", dtype);
  const auto linear = [&](at::TensorList list, int64_t index) {
    return quantized ? list.slice(index * per_linear, per_linear) : at::TensorList();
  };

  const int64_t S = src.size(1);
  const auto mask = src.ne(pad_id).view({src.size(0), 1, 1, S});
  // A sentence of padding only attends to nothing: its rows read zeros (fastattn.ops.attention).
  const auto empty = mask.logical_not().all(-1, true);
  const bool any_empty = empty.any().item<bool>();
  const auto allowed = any_empty ? mask.logical_or(empty) : mask;

  auto x = at::embedding(embedding, src).mul(embedding_scale).add(positions);
  for (int64_t l = 0; l < layers; ++l) {
    const auto p = params.slice(l * encoder::kEncoderLayerSlots, encoder::kEncoderLayerSlots);
    const int64_t first = l * kLinearsPerLayer;  // this layer's qkv, out, W1, W2 in packed
    // A linear map by its weight's slot (its bias is the next) and its index among the four.
    const auto map = [&](int64_t weight, int64_t linear_index, const at::Tensor &input) {
      return project(input, p[weight], p[weight + 1], linear(packed, first + linear_index));
    };
    const auto qkv = map(encoder::kSelfQkvWeight, 0, x);
    const int64_t value_dim = (qkv.size(-1) - 2 * heads * key_dim) / heads;
    const auto parts = qkv.split_with_sizes({heads * key_dim, heads * key_dim, heads * value_dim},
                                            -1);
    auto query = split_heads(parts[0], heads);
    auto key = split_heads(parts[1], heads);
    auto value = split_heads(parts[2], heads);
    const double scale = std::pow(static_cast<double>(key_dim), -0.5);
    if (key_dim != value_dim) {  // fastattn.model.attention: the narrower side zero-padded
      const int64_t width = std::max(key_dim, value_dim);
      query = at::pad(query, {0, width - key_dim});
      key = at::pad(key, {0, width - key_dim});
      value = at::pad(value, {0, width - value_dim});
    }
    auto attended = at::scaled_dot_product_attention(query, key, value, allowed, 0.0, false,
                                                     scale);
    if (any_empty) attended = attended.masked_fill(empty, 0.0);
    if (key_dim != value_dim) attended = attended.narrow(-1, 0, value_dim);
    const auto merged = attended.transpose(1, 2).flatten(2);
    x = add_norm(map(encoder::kSelfOutWeight, 1, merged), x, p[encoder::kSelfNormWeight],
                 p[encoder::kSelfNormBias], eps);
    const auto hidden = at::relu(map(encoder::kFeedForwardW1Weight, 2, x));
    x = add_norm(map(encoder::kFeedForwardW2Weight, 3, hidden), x,
                 p[encoder::kFeedForwardNormWeight], p[encoder::kFeedForwardNormBias], eps);
  }

  std::vector<at::Tensor> memory_k, memory_v;
  for (int64_t l = 0; l < projections; ++l) {
    const auto kv = project(x, memory_params[2 * l], memory_params[2 * l + 1],
                            linear(memory_packed, l));
    const auto parts = kv.split_with_sizes({heads * key_dim, kv.size(-1) - heads * key_dim}, -1);
    memory_k.push_back(split_heads(parts[0], heads));
    memory_v.push_back(split_heads(parts[1], heads));
  }
  return {memory_k, memory_v, mask};
}

}  // namespace fastattn
