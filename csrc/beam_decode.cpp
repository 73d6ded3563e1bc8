#include "beam_decode.h"

#include "beam_search.h"
#include "bf16_linear.h"
#include "decode_attention.h"
#include "int8_linear.h"
#include "packed_linear.h"

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <cstring>
#include <vector>

namespace fastattn {

namespace {

// The search's large buffers (self-attention caches, logits, histories: ~20 MB for 64 sentences
// of the multi30k model) outlive a call, one set per calling thread. Allocated afresh, glibc
// hands buffers this size back to the OS when they are freed, and every search page-faulted
// them in again: 12,000 faults, about a tenth of a batch-64 search. Sets over kKeptBytes (big
// models, big batches: more arithmetic per page) are freed after the call instead.
struct Workspace {
  at::Tensor self_k, self_v, history, next_history, logits;

  int64_t bytes() const {
    int64_t total = 0;
    for (const auto *t : {&self_k, &self_v, &history, &next_history, &logits})
      total += t->defined() ? static_cast<int64_t>(t->nbytes()) : 0;
    return total;
  }
};

constexpr int64_t kKeptBytes = int64_t{256} << 20;

at::Tensor reuse(at::Tensor &buffer, at::IntArrayRef sizes, const at::TensorOptions &options) {
  const int64_t numel = c10::multiply_integers(sizes);
  if (!buffer.defined() || buffer.numel() < numel || buffer.dtype() != options.dtype() ||
      buffer.device() != options.device())
    buffer = at::empty({numel}, options);
  return buffer.narrow(0, 0, numel).view(sizes);
}

// x (N, d) = table[tokens[:, length]] · scale + positions[length] in place, the newest tokens'
// embeddings as the Embedding module computes them, op by op (a product rounded, then a sum
// rounded: the search and fastattn.inference.Decoder.step agree bit for bit), in plain loops:
// ATen's embedding, mul and add were a tenth of a few-row step. table (V, d) and positions are
// contiguous; no table: x holds the rows already (int8, bf16: dequantized).
template <typename scalar_t>
void embed_newest(at::Tensor &x, const at::Tensor *table, const at::Tensor &tokens, int64_t length,
                  double scale, const at::Tensor &positions) {
  const int64_t N = x.size(0), d = x.size(1);
  scalar_t *out = x.data_ptr<scalar_t>();
  if (table) {
    const scalar_t *rows = table->data_ptr<scalar_t>();
    const int64_t *token = tokens.data_ptr<int64_t>() + length;
    const int64_t V = table->size(0);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t t = token[n * tokens.stride(0)];
      TORCH_CHECK(0 <= t && t < V, "transformer_beam_search: token ", t, " is outside 0..",
                  V - 1);
      std::memcpy(out + n * d, rows + t * d, d * sizeof(scalar_t));
    }
  }
  // Two passes, as two ops: one loop would let a compiler fuse them into one rounding (FMA).
  const auto s = static_cast<scalar_t>(scale);
  for (int64_t i = 0; i < N * d; ++i) out[i] *= s;
  const scalar_t *position = positions.data_ptr<scalar_t>() + length * d;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < d; ++c) out[n * d + c] += position[c];
}

}  // namespace

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
                                 const at::Tensor &finished_count, int64_t eos_id, int64_t nbest) {
  TORCH_CHECK(!memory_k.empty() && memory_k.size() == memory_v.size(),
              "transformer_beam_search: need one memory_k and memory_v per decoder layer");
  TORCH_CHECK(memory_k[0].dim() == 4 && memory_v[0].dim() == 4,
              "transformer_beam_search: memory_k and memory_v must be (B, H, S, D), got ",
              memory_k[0].sizes(), " and ", memory_v[0].sizes());
  TORCH_CHECK(embedding.dim() == 2 && positions.dim() == 2 &&
                  positions.size(1) == embedding.size(1),
              "transformer_beam_search: embedding (V, d) and positions (P, d) must share d, got ",
              embedding.sizes(), " and ", positions.sizes());
  TORCH_CHECK(output.dim() == 2 && output.size(1) == embedding.size(1),
              "transformer_beam_search: output (V_out, d) and embedding (V, d) must share d, "
              "got ", output.sizes(), " and ", embedding.sizes());
  const int64_t B = memory_k[0].size(0), beam = finished_scores.size(1);
  const int64_t layers = static_cast<int64_t>(memory_k.size()), H = memory_k[0].size(1);
  const int64_t capacity = positions.size(0);
  const auto packed_type = packed.empty() ? at::kFloat : packed[0].scalar_type();
  const bool int8 = packed_type == at::kChar, bf16 = packed_type == at::kBFloat16;
  TORCH_CHECK(int8 ? output_packed.size() == kInt8Parts
                   : bf16 ? output_packed.size() == 1 : output_packed.size() <= 1,
              "transformer_beam_search: output_packed must hold ",
              int8 ? "the embedding's kInt8Parts int8 parts"
                   : bf16 ? "the embedding's bfloat16 panels" : "nothing or the output's panels",
              ", got ", output_packed.size(), " tensors");
  TORCH_CHECK(max_len.numel() == B && (B == 0 || max_len.max().item<int64_t>() <= capacity),
              "transformer_beam_search: positions has ", capacity,
              " rows, fewer than the longest max_len");
  TORCH_CHECK(positions.scalar_type() == embedding.scalar_type(),
              "transformer_beam_search: positions must be in the embedding's dtype ",
              embedding.scalar_type(), ", got ", positions.scalar_type());
  if (B == 0) return;
  const auto table = embedding.contiguous(), position_rows = positions.contiguous();
  const auto long_options = max_len.options();
  const auto cache_options = memory_k[0].options();
  thread_local Workspace workspace;
  auto self_k = reuse(workspace.self_k, {layers, B * beam, H, capacity, memory_k[0].size(3)},
                      cache_options);
  auto self_v = reuse(workspace.self_v, {layers, B * beam, H, capacity, memory_v[0].size(3)},
                      cache_options);
  // history[n, j]: the cache row holding row n's position j (rows are reordered, caches are not).
  auto history = reuse(workspace.history, {B * beam, capacity}, long_options);
  auto next_history = reuse(workspace.next_history, {B * beam, capacity}, long_options);
  // Each row's sentence (its encoder memory row) once some sentence has finished; until then
  // rows come grouped by sentence in memory order. Finished sentences stay in the memory: moving
  // the live ones down at every finish copied more than the cross-attention reads.
  std::optional<at::Tensor> row_sentences;

  // int8 and bf16: the output projection is the packed embedding's first output.size(0) rows.
  const int64_t O = output.size(0);
  at::Tensor output_panels, output_scales, output_sums;
  if (int8 || bf16) {
    output_panels = output_packed[0].narrow(0, 0, (O + 15) / 16);
    if (int8) {
      output_scales = output_packed[kInt8Scales].narrow(0, 0, O);
      output_sums = output_packed[kInt8Sums].narrow(0, 0, O);
    }
  }
  // Through panels the search reads each row's log-sum-exp and 2·beam + 8 largest logits, enough
  // to settle its candidates but at ties (row_lse.h's OutputRows): the N x O logits are never
  // written (at batch 64 the writes alone slowed the multi30k model's output layer by a fifth).
  // Other outputs (float64, no panels; very wide beams) give the search whole rows.
  const int top = static_cast<int>(2 * beam + 8);
  const bool by_top = (int8 || bf16 || !output_packed.empty()) && top <= RowTop::kMost && top <= O;
  at::Tensor logits;
  if (!by_top) logits = reuse(workspace.logits, {B * beam, O}, cache_options);
  auto tokens = at::full({B, 1}, bos_id, long_options);
  auto scores = at::zeros({B}, finished_scores.options());
  auto sentences = at::arange(B, long_options);
  for (int64_t length = 0; sentences.numel() > 0; ++length) {
    const int64_t N = tokens.size(0);
    int64_t *own_row = history.data_ptr<int64_t>() + length;
    for (int64_t n = 0; n < N; ++n) own_row[n * capacity] = n;
    const int64_t d = embedding.size(1);
    at::Tensor x;
    if (int8 || bf16) {
      const auto newest = tokens.select(1, length).contiguous();
      x = int8 ? dequantize_rows_cpu(output_packed[kInt8Panels], output_packed[kInt8Scales],
                                     newest, d)
               : unpack_rows_bf16_cpu(output_packed[0], newest, d);
    } else {
      x = at::empty({N, d}, embedding.options());
    }
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "transformer_beam_search", [&] {
      embed_newest<scalar_t>(x, int8 || bf16 ? nullptr : &table, tokens, length,
                             embedding_scale, position_rows);
    });
    x = decoder_step_cpu(x, params, self_k, self_v, history.narrow(0, 0, N), length, memory_k,
                         memory_v, memory_bias, row_sentences, packed, eps);
    StepResult step;
    if (by_top) {
      const auto rows = int8   ? output_rows_int8_cpu(x, output_panels, output_scales,
                                                      output_sums, top)
                        : bf16 ? output_rows_bf16_cpu(x, output_panels, O, top)
                               : output_rows_cpu(x, output, output_packed[0], top);
      step = beam_search_step_rows_cpu(rows, tokens, scores, sentences, max_len, penalty,
                                       finished_tokens, finished_scores, finished_lengths,
                                       finished_count, eos_id, nbest);
    } else {
      auto logprobs = logits.narrow(0, 0, N);
      if (int8)
        log_softmax_linear_int8_out_cpu(x, output_panels, output_scales, output_sums, logprobs);
      else if (bf16)
        log_softmax_linear_bf16_out_cpu(x, output_panels, logprobs);
      else
        log_softmax_linear_out_cpu(x, output, output_packed.empty()
                                                  ? std::nullopt
                                                  : std::optional<at::Tensor>(output_packed[0]),
                                   logprobs);
      step = beam_search_step_cpu(logprobs.to(at::kFloat), tokens, scores, sentences, max_len,
                                  penalty, finished_tokens, finished_scores, finished_lengths,
                                  finished_count, eos_id, nbest);
    }
    auto [next_tokens, next_scores, reorder, next_sentences] = step;
    const int64_t next_S = next_sentences.numel();
    if (next_S == 0) break;
    // Row n continues row reorder[n]: its positions are held where that row's are.
    const int64_t *from = reorder.data_ptr<int64_t>();
    const int64_t *held = history.data_ptr<int64_t>();
    int64_t *next_held = next_history.data_ptr<int64_t>();
    for (int64_t n = 0; n < reorder.size(0); ++n)
      std::memcpy(next_held + n * capacity, held + from[n] * capacity,
                  (length + 1) * sizeof(int64_t));
    std::swap(history, next_history);
    // The step's rows come grouped by sentence, beam per live sentence.
    if (next_S < B) row_sentences = next_sentences.repeat_interleave(beam);
    tokens = next_tokens, scores = next_scores, sentences = next_sentences;
  }
  if (workspace.bytes() > kKeptBytes) workspace = Workspace{};
}

}  // namespace fastattn
