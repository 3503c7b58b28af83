// 1x1 convolutions (stride 1, no padding, any number of spatial dims) as GEMMs over the pixels,
// one per group.
//
// Such a convolution is a matrix product: channels-last, output[pixel, :] = W · input[pixel, :];
// NCHW, output[n] = W · input[n] with pixels as columns; with groups, each group's channels are
// their own product (a batch of GEMMs). SqueezeBERT's 4-group 1x1 Conv1d over [1, 256, 128] ran in
// oneDNN's grouped convolution at ~40 GFLOP/s. Through the runtime's sgemm it writes the
// engine's buffer directly and takes whichever GEMM kernel the runtime picked for that shape with
// the weight packed once per engine, where oneDNN's convolution (as torch's convolution op reaches
// it) returns a fresh tensor that is then copied into the buffer. Bias, residual and activation are
// one pass over the GEMM's output (no prefill the GEMM accumulates onto), in the order the unfused
// engine computes them: conv + bias, then + sum, then the clamp.
#pragma once

#include <cstdint>
#include <optional>

#include "activation.h"

namespace blade {

struct PointwiseShape {
  int64_t batch, pixels, in_channels, out_channels;  // pixels per image
  bool channels_last;  // input and output both, or one pixel an image (NCHW is that memory); else both NCHW
  int64_t groups;
};

// Groups narrower than this, in or out, stay oneDNN's (a depthwise 1x1 would be GEMMs of one row
// and depth one).
constexpr int64_t kPointwiseMinGroupChannels = 16;

// The shape when the convolution is 1x1, stride 1, unpadded, undilated, with input and
// output in the same layout (`layout` holds BLADE_CONV_*_CHANNELS_LAST bits); nullopt otherwise.
std::optional<PointwiseShape> pointwise_shape(int32_t spatial, const int64_t* input_shape, const int64_t* weight_shape,
                                              const int64_t* strides, const int64_t* pads, const int64_t* dilations,
                                              int64_t groups, int32_t layout);

// output = clamp(conv1x1(input) + bias + sum); weight is [out_channels, in_channels / groups] dense; bias and
// sum may be null; sum and output in the shape's layout.
void pointwise_conv(const PointwiseShape& shape, const float* input, const float* weight, const float* bias,
                    const float* sum, Clamp clamp, float* output);

}  // namespace blade
