// Registers fastattn._C's ops in the "fastattn" torch.library namespace (a fragment: the Python
// side of fastattn registers ops there too). Importing fastattn._C is what loads them.
#include <Python.h>
#include <torch/library.h>

#include "attention.h"
#include "beam_decode.h"
#include "beam_search.h"
#include "cpu_isa.h"
#include "bf16_linear.h"
#include "cross_entropy.h"
#include "decode_attention.h"
#include "encoder.h"
#include "int8_linear.h"
#include "layer_norm.h"
#include "packed_linear.h"

TORCH_LIBRARY_FRAGMENT(fastattn, m) {
  m.def(
      "beam_search_step(Tensor logprobs, Tensor tokens, Tensor scores, Tensor sentences, "
      "Tensor max_len, Tensor penalty, Tensor(a!) finished_tokens, Tensor(b!) finished_scores, "
      "Tensor(c!) finished_lengths, Tensor(d!) finished_count, int eos_id, int nbest) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale, "
      "Tensor? rows=None) -> Tensor");
  m.def(
      "decoder_step(Tensor x, Tensor[] params, Tensor(a!) self_k, Tensor(b!) self_v, "
      "Tensor history, int length, Tensor[] memory_k, Tensor[] memory_v, Tensor? memory_bias, "
      "Tensor? sentences, Tensor[] packed, float eps) -> Tensor");
  m.def(
      "transformer_beam_search(Tensor embedding, Tensor output, Tensor positions, "
      "float embedding_scale, Tensor[] params, Tensor[] packed, Tensor[] output_packed, "
      "float eps, Tensor[] memory_k, Tensor[] memory_v, Tensor? memory_bias, int bos_id, "
      "Tensor max_len, Tensor penalty, "
      "Tensor(a!) finished_tokens, Tensor(b!) finished_scores, Tensor(c!) finished_lengths, "
      "Tensor(d!) finished_count, int eos_id, int nbest) -> ()");
  m.def(
      "transformer_encode(Tensor src, Tensor embedding, Tensor positions, float embedding_scale, "
      "int pad_id, int heads, int key_dim, Tensor[] params, Tensor[] packed, "
      "Tensor[] memory_params, Tensor[] memory_packed, float eps) -> (Tensor[], Tensor[], Tensor)");
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("quantize_linear_weight(Tensor weight) -> (Tensor, Tensor, Tensor)");
  m.def("dequantize_rows(Tensor panels, Tensor scales, Tensor rows, int dim) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor panels, Tensor scales, Tensor sums, Tensor? bias) -> Tensor");
  m.def(
      "log_softmax_linear_int8(Tensor x, Tensor panels, Tensor scales, Tensor sums) -> Tensor");
  m.def("int8_kernel() -> str", &fastattn::int8_kernel_cpu);
  m.def("cpu_isa() -> str", [] { return fastattn::cpu_isa_name(fastattn::cpu_isa()); });
  m.def("supported_cpu_isa() -> str",
        [] { return fastattn::cpu_isa_name(fastattn::supported_cpu_isa()); });
  m.def("cpu_isa_limit() -> str", [] { return fastattn::cpu_isa_name(fastattn::cpu_isa_limit()); });
  m.def("set_cpu_isa(str level) -> str", &fastattn::set_cpu_isa);
  m.def("pack_linear_weight_bf16(Tensor weight) -> Tensor");
  m.def("unpack_rows_bf16(Tensor panels, Tensor rows, int dim) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("log_softmax_linear_bf16(Tensor x, Tensor panels, int out_features) -> Tensor");
  m.def("bf16_kernel() -> str", &fastattn::bf16_kernel_cpu);
  m.def("linear(Tensor x, Tensor weight, Tensor? packed, Tensor? bias) -> Tensor");
  m.def("log_softmax_linear(Tensor x, Tensor weight, Tensor? packed) -> Tensor");
  m.def(
      "cpu_layer_norm_residual_fwd(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, "
      "int seed, float eps, float dropout_p, bool return_residual) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "cpu_layer_norm_residual_bwd(Tensor dy, Tensor? dsum, Tensor x, Tensor? residual, "
      "Tensor? weight, bool has_bias, int seed, Tensor mean, Tensor rstd, float dropout_p) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("cpu_dropout(Tensor x, int seed, float dropout_p) -> Tensor");
  m.def(
      "cpu_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? bias, bool causal, "
      "int causal_shift, float scale, float dropout_p, int seed) -> (Tensor, Tensor)");
  m.def(
      "cpu_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? bias, bool causal, int causal_shift, float scale, float dropout_p, int seed) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "cpu_cross_entropy_grad(Tensor(a!) logits, Tensor target, Tensor row_weight, "
      "float smoothing, int ignore_index) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("beam_search_step", &fastattn::beam_search_step_cpu);
  m.impl("decode_attention", &fastattn::decode_attention_cpu);
  m.impl("decoder_step", &fastattn::decoder_step_cpu);
  m.impl("transformer_beam_search", &fastattn::transformer_beam_search_cpu);
  m.impl("transformer_encode", &fastattn::transformer_encode_cpu);
  m.impl("pack_linear_weight", &fastattn::pack_linear_weight_cpu);
  m.impl("quantize_linear_weight", &fastattn::quantize_linear_weight_cpu);
  m.impl("dequantize_rows", &fastattn::dequantize_rows_cpu);
  m.impl("linear_int8", &fastattn::linear_int8_cpu);
  m.impl("log_softmax_linear_int8", &fastattn::log_softmax_linear_int8_cpu);
  m.impl("pack_linear_weight_bf16", &fastattn::pack_linear_weight_bf16_cpu);
  m.impl("unpack_rows_bf16", &fastattn::unpack_rows_bf16_cpu);
  m.impl("linear_bf16", &fastattn::linear_bf16_cpu);
  m.impl("log_softmax_linear_bf16", &fastattn::log_softmax_linear_bf16_cpu);
  m.impl("linear", &fastattn::linear_cpu);
  m.impl("log_softmax_linear", &fastattn::log_softmax_linear_cpu);
  m.impl("cpu_layer_norm_residual_fwd", &fastattn::layer_norm_residual_fwd_cpu);
  m.impl("cpu_layer_norm_residual_bwd", &fastattn::layer_norm_residual_bwd_cpu);
  m.impl("cpu_dropout", &fastattn::dropout_cpu);
  m.impl("cpu_attention_fwd", &fastattn::attention_fwd_cpu);
  m.impl("cpu_attention_bwd", &fastattn::attention_bwd_cpu);
  m.impl("cpu_cross_entropy_grad", &fastattn::cross_entropy_grad_cpu);
}

#ifdef FASTATTN_WITH_CUDA
TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("beam_search_step", &fastattn::beam_search_step_cuda);
}
#endif

// An empty Python module: importing it runs the registrations above. Plain CPython rather than
// pybind11 (torch/extension.h), whose headers took most of this file's build.
PyMODINIT_FUNC PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C",
                               "fastattn native ops, registered as torch.ops.fastattn.*", -1,
                               nullptr};
  return PyModule_Create(&module);
}
