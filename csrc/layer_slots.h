// The per-layer weights the native decoder (fastattn::decoder_step, transformer_beam_search) and
// encoder (fastattn::transformer_encode) take, in order: slot s of layer l is
// params[kDecoderLayerSlots * l + s] (kEncoderLayerSlots for the encoder). fastattn/decoding.py's
// DECODER_LAYER_SLOTS and ENCODER_LAYER_SLOTS name the same slots in the same order
// (tests/test_decode_attention.py reads these enums to check), so that Python builds the lists by
// name, not by position.
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

namespace encoder {  // the same names as the decoder's, for an encoder layer

enum EncoderLayerSlot : int64_t {
  kSelfQkvWeight,
  kSelfQkvBias,
  kSelfOutWeight,
  kSelfOutBias,
  kSelfNormWeight,
  kSelfNormBias,
  kFeedForwardW1Weight,
  kFeedForwardW1Bias,
  kFeedForwardW2Weight,
  kFeedForwardW2Bias,
  kFeedForwardNormWeight,
  kFeedForwardNormBias,
  kEncoderLayerSlots,  // the count, not a slot
};

}  // namespace encoder

}  // namespace fastattn
