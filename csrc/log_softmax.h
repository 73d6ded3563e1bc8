// The decoding step's output distribution on CPU: log_softmax over the vocabulary, in place.
#pragma once

#include <ATen/core/Tensor.h>

namespace fastattn {

// x (..., V) <- x - logsumexp(x) over the last dimension, in place; returns x. float32 rows take
// three vectorised passes (max, sum of exp_nonpositive, subtract), other dtypes at::log_softmax.
at::Tensor &log_softmax_cpu_(at::Tensor &x);

}  // namespace fastattn
