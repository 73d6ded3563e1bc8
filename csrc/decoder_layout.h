// The per-layer weights that fastattn::decoder_step and fastattn::transformer_beam_search take,
// in order: slot s of layer l is params[kDecoderLayerSlots * l + s]. fastattn/decoding.py's
// DECODER_LAYER_SLOTS names the same slots in the same order (tests/test_decode_attention.py
// reads this enum to check), so that Python builds the list by name, not by position.
#pragma once

#include <cstdint>

namespace fastattn {

enum DecoderLayerSlot : int64_t {
  kSelfQkvWeight,
  kSelfQkvBias,
  kSelfOutWeight,
  kSelfOutBias,
  kSelfNormWeight,
  kSelfNormBias,
  kCrossQWeight,
  kCrossQBias,
  kCrossOutWeight,
  kCrossOutBias,
  kCrossNormWeight,
  kCrossNormBias,
  kFeedForwardW1Weight,
  kFeedForwardW1Bias,
  kFeedForwardW2Weight,
  kFeedForwardW2Bias,
  kFeedForwardNormWeight,
  kFeedForwardNormBias,
  kDecoderLayerSlots,  // the count, not a slot
};

}  // namespace fastattn
