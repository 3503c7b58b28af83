// A 1x1 convolution whose only reader is a depthwise one (MobileNet's inverted residual block:
// expand the channels 6x, activation, depthwise 3x3), computed together a few rows at a time.
//
// Apart, the 1x1 convolution writes the expanded tensor (MobileNetV2 b1's 16 -> 96 channels at
// 80x80: 2.4 MB, 20 MB at b8) and the depthwise one reads it back, past the caches both ways; the
// 1x1 one has so few input channels (16, 24) that writing its output is most of its time. Here
// each thread computes the expanded rows its output rows read into a buffer that stays in its L2
// (rows already there for the previous output rows are kept), then those output rows from it: the
// expanded tensor never reaches memory. Bitwise the same as the two convolutions apart: each
// expanded value and each output value is computed by the same kernel with the same order of sums.
#pragma once

#include <cstdint>

#include "activation.h"
#include "conv_patch.h"
#include "depthwise.h"

namespace blade {

// Whether the 1x1 convolution runs in place (direct(), channels-last output) and its output is the
// depthwise convolution's input image.
bool expand_feeds_depthwise(const PatchConvShape& expand, const DepthwiseShape& depthwise);

// Whether the pair is worth computing together: an expanded tensor larger than a core's L2 holds
// (a smaller one stays in the caches between the two kernels anyway, and their own parallel
// splits serve small images better), with an output of at least a few rows a thread.
bool expand_depthwise_pays(const PatchConvShape& expand, const DepthwiseShape& depthwise, int64_t threads);

// output = act2(depthwise(act1(conv1x1(input) + bias1)) + bias2 + sum), channels-last
// throughout, where expand_feeds_depthwise. bias1, bias2 and sum may be null.
void expand_depthwise_conv2d(const PatchConvShape& expand, const float* input, const float* panels, const float* bias1,
                             Activation act1, const DepthwiseShape& depthwise, const float* tap_weight,
                             const float* bias2, const float* sum, Activation act2, float* output);

}  // namespace blade
