// log_softmax over rows of floats, for the decoding step's output distribution.
#pragma once

#include <cstdint>

namespace fastattn {

// row <- row - logsumexp(row) for rows [begin, end) of x (rows V apart), in three vectorised
// passes (max, sum of exp_nonpositive, subtract). A NaN anywhere makes its row NaN, as in ATen.
void log_softmax_rows(float *x, int64_t V, int64_t begin, int64_t end);

}  // namespace fastattn
