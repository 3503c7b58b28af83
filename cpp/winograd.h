// Winograd F(2x2, 3x3) convolution (Lavin & Gray, "Fast Algorithms for Convolutional Neural
// Networks", 2015) for 3x3, stride-1, dilation-1, ungrouped 2-D convolutions on channels-last
// tensors. Each 2x2 output tile is computed from a 4x4 input tile with 16 multiplies per
// (input channel, output channel) instead of 36: the multiplies become 16 GEMMs
// [tiles, c_in] @ [c_in, c_out] in the transformed domain, and the input and output transforms
// are adds only. With the weight transformed once per engine, that is 2.25x fewer FLOPs than
// oneDNN's direct convolution on the same shapes, and the GEMMs run at MKL's speed. F(4x4, 3x3)
// (winograd.cpp) takes 6x6 input tiles to 4x4 output tiles: 36 GEMMs, 4x fewer multiplies than a
// direct convolution, at ~15x F(2x2)'s rounding (the runtime picks it by shape, runtime.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "activation.h"
#include "runtime.h"

namespace blade {

struct Conv3x3Shape {
  int64_t batch, in_h, in_w, in_channels, out_channels;
  int64_t pad_top, pad_left;  // the bottom/right pads are implied by out_h/out_w
  int64_t out_h, out_w;
};

// The number of tile x tile output tiles (the M of its GEMMs); tile is 2 (F(2x2, 3x3)) or 4 (F(4x4, 3x3)).
int64_t winograd_tiles(const Conv3x3Shape& shape, int64_t tile);

// weight [out_channels, in_channels, 3, 3] -> G w G^T as [(tile + 2)^2, in_channels, out_channels].
at::Tensor winograd_weight(const float* weight, int64_t out_channels, int64_t in_channels, int64_t tile);

// output = clamp(conv3x3(input) + bias + sum) in output tiles of tile x tile pixels; input, sum and
// output are dense NHWC, `transformed_weight` comes from winograd_weight (the same tile) and lies in
// `weights`' constants (its GEMMs pack it there once); bias and sum may be null. False (output
// untouched) when tile is 4 and the input holds an infinity or NaN: F(4x4)'s transforms would spread
// it to outputs whose window does not hold it, so the caller runs F(2x2) instead.
bool winograd_conv3x3(const Conv3x3Shape& shape, int64_t tile, const float* input, const float* transformed_weight,
                      const float* bias, const float* sum, Clamp clamp, float* output, PackedWeights* weights);

}  // namespace blade
