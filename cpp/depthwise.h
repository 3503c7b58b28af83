// Depthwise 2-D convolution (groups == in channels == out channels) on channels-last tensors.
//
// oneDNN's depthwise convolution, as torch's convolution op reaches it, allocates a fresh output
// that the runtime then copies into the engine's buffer, and only takes symmetric padding (the
// "same" padding of TF-style models, e.g. MobileNet's stride-2 blocks, needs a padded copy of the
// input first). A depthwise convolution is a few multiply-adds per output element, so those passes
// over memory cost as much as the arithmetic. Here each output pixel's channels are one vector
// loop over the taps, written straight into the engine's buffer with bias, residual and activation, and
// taps that fall into the padding are skipped, whatever the padding on each side.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "activation.h"

namespace blade {

struct DepthwiseShape {
  int64_t batch, in_h, in_w, channels;
  int64_t kernel_h, kernel_w, stride_h, stride_w, dilation_h, dilation_w;
  int64_t pad_top, pad_left;  // the bottom/right pads are implied by out_h/out_w
  int64_t out_h, out_w;
};

// weight [channels, 1, kernel_h, kernel_w] -> [kernel_h * kernel_w, channels]: each tap's weights
// contiguous over the channels, the order the kernel reads them in.
at::Tensor depthwise_tap_weight(const float* weight, int64_t channels, int64_t taps);

// output = act(depthwise(input) + bias + sum); input, sum and output are dense NHWC; bias and sum
// may be null. Parallel over output rows on ATen's pool.
void depthwise_conv2d(const DepthwiseShape& shape, const float* input, const float* tap_weight, const float* bias,
                      const float* sum, Activation act, float* output);

// Output rows [begin, end) of the flattened (batch, out_h) range, on the calling thread.
void depthwise_conv2d_rows(const DepthwiseShape& shape, const float* input, const float* tap_weight, const float* bias,
                           const float* sum, Activation act, float* output, int64_t begin, int64_t end);

}  // namespace blade
