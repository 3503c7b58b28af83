// Grouped 2-D convolution (1 < groups, each group's output channels a multiple of 4) on
// channels-last tensors: RegNet's and ResNeXt's 3x3 convolutions, 4-64 channels a group.
//
// oneDNN's grouped convolution, as torch's convolution op reaches it, computed RegNet-Y's
// 8-channel groups at about half the multiply-add rate of ONNX Runtime's (which runs each group as
// an im2col GEMM), and returned a fresh output that the runtime then copied into the engine's
// buffer. Here a tile of adjacent output pixels x 4-24 of a group's output channels sums in
// registers over the taps and the group's input channels (one weight vector, a broadcast input
// value per pixel), reading the input in place (taps in the padding read a row of zeros), and is
// finished in registers (bias, residual, clamp) and stored once into the engine's buffer.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "activation.h"

namespace blade {

struct GroupedShape {
  int64_t batch, in_h, in_w, in_channels, out_channels, groups;
  int64_t kernel_h, kernel_w, stride_h, stride_w, dilation_h, dilation_w;
  int64_t pad_top, pad_left;  // the bottom/right pads are implied by out_h/out_w
  int64_t out_h, out_w;

  int64_t group_in() const { return in_channels / groups; }
  int64_t group_out() const { return out_channels / groups; }
};

// A group's output channels must be a multiple of this (a 4-float vector's; multiples of 8 take
// 8-float ones).
constexpr int64_t kGroupedLanes = 4;
// Input channels a group may have at most (the row of zeros padding taps read).
constexpr int64_t kGroupedMaxGroupIn = 512;

// weight [out, in / groups, kh, kw] -> [groups][kh * kw][in / groups][out / groups]: for each tap
// and input channel of a group, its output channels contiguous (the vectors the kernel loads).
at::Tensor grouped_conv_weight(const float* weight, const GroupedShape& shape);

// output = clamp(conv(input) + bias + sum); input, sum and output are dense NHWC; bias and sum may
// be null. Parallel over (output row, group) on ATen's pool.
void grouped_conv2d(const GroupedShape& shape, const float* input, const float* packed_weight, const float* bias,
                    const float* sum, Clamp clamp, float* output);

}  // namespace blade
