// Beam search over the native decoder step, the whole search in one call: at batch 1 the Python
// glue between a step's few-row ops (embedding, reordering, the search loop) cost about as much
// as the decoder stack itself.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace fastattn {

// fastattn.search.beam_search over the post-norm decoder of fastattn.model.Transformer, with the
// step function built in: per step the newest tokens are embedded (embedding[token] ·
// embedding_scale + positions[position]), run through decoder_step_cpu (params, packed, eps as
// there) and projected by log_softmax_linear_cpu (output: the tied embedding's first rows, the
// pieces the softmax ranges over; output_packed: nothing, or their panels), and
// int8 decoding (packed int8): output_packed is quantize_linear_weight(embedding)'s kInt8Parts,
// which give the embedding rows (dequantize_rows) and the projection (its first rows); bf16
// decoding (packed bfloat16) likewise with pack_linear_weight_bf16(embedding)'s panels; and
// beam_search_step_cpu does the bookkeeping; the self-attention caches follow the surviving rows
// through a history of cache rows.
// memory_k[l] (B, H, S, Dk), memory_v[l] (B, H, S, Dv) and memory_bias (B, S) or none come from
// the encoder; positions (P, d) covers every position decoded (P >= max_len.max()).
// max_len, penalty and finished_* are beam_search_step_cpu's (finished_* are filled in place).
void transformer_beam_search_cpu(const at::Tensor &embedding, const at::Tensor &output,
                                 const at::Tensor &positions,
                                 double embedding_scale, at::TensorList params,
                                 at::TensorList packed,
                                 at::TensorList output_packed, double eps,
                                 at::TensorList memory_k, at::TensorList memory_v,
                                 const std::optional<at::Tensor> &memory_bias, int64_t bos_id,
                                 const at::Tensor &max_len, const at::Tensor &penalty,
                                 const at::Tensor &finished_tokens,
                                 const at::Tensor &finished_scores,
                                 const at::Tensor &finished_lengths,
                                 const at::Tensor &finished_count, int64_t eos_id, int64_t nbest);

}  // namespace fastattn
