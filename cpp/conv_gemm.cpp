#include "conv_gemm.h"

#include <algorithm>

#include "activation.h"
#include "blade_abi.h"
#include "isa_clones.h"
#include "runtime.h"
#include "timed_parallel.h"

namespace blade {
namespace {

// The epilogue on rows [begin, end) of the output seen as [rows, width], after the GEMM wrote it:
// out = clamp(out + bias + sum), the bias broadcast along a row (channels last: one bias per
// column) or down it (NCHW: one bias per row). Each combination is its own loop: with
// `residual ? residual[j] : 0` inside one, GCC emits a masked load through the null pointer, which
// AMD cores execute ~50x slower than a plain load (seen: 3 ms for 600K floats). A missing bias is
// not added as 0 either: -0 + 0 is +0.
enum Bias { kNoBias, kBiasPerColumn, kBiasPerRow };

template <int kBias, bool kSum, bool kClamp>
BLADE_ISA_CLONES void epilogue_rows(float* out, const float* bias, const float* sum, int64_t width, int64_t bias_rows,
                                    Clamp clamp, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    float* row = out + r * width;
    const float* residual = kSum ? sum + r * width : nullptr;
    const float row_bias = kBias == kBiasPerRow ? bias[r % bias_rows] : 0.0f;
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) {
      float v = row[j];
      if (kBias == kBiasPerColumn) v += bias[j];
      if (kBias == kBiasPerRow) v += row_bias;
      if (kSum) v += residual[j];
      if (kClamp) v = clamp_value(v, clamp.lo, clamp.hi);
      row[j] = v;
    }
  }
}

using EpilogueRows = void (*)(float*, const float*, const float*, int64_t, int64_t, Clamp, int64_t, int64_t);
#define BLADE_EPILOGUE_ROWS(bias)                                                  \
  {{epilogue_rows<bias, false, false>, epilogue_rows<bias, false, true>},          \
   {epilogue_rows<bias, true, false>, epilogue_rows<bias, true, true>}}
const EpilogueRows kEpilogueRows[3][2][2] = {BLADE_EPILOGUE_ROWS(kNoBias), BLADE_EPILOGUE_ROWS(kBiasPerColumn),
                                             BLADE_EPILOGUE_ROWS(kBiasPerRow)};
#undef BLADE_EPILOGUE_ROWS

}  // namespace

std::optional<PointwiseShape> pointwise_shape(int32_t spatial, const int64_t* input_shape, const int64_t* weight_shape,
                                              const int64_t* strides, const int64_t* pads, const int64_t* dilations,
                                              int64_t groups, int32_t layout) {
  const int32_t channels_last = BLADE_CONV_INPUT_CHANNELS_LAST | BLADE_CONV_OUTPUT_CHANNELS_LAST;
  if (groups < 1 || (layout != 0 && layout != channels_last)) return std::nullopt;
  if (groups > 1 && (input_shape[1] / groups < kPointwiseMinGroupChannels ||
                     weight_shape[0] / groups < kPointwiseMinGroupChannels)) {
    return std::nullopt;
  }
  int64_t pixels = 1;
  for (int32_t d = 0; d < spatial; ++d) {
    if (weight_shape[2 + d] != 1 || strides[d] != 1 || dilations[d] != 1 || pads[d] != 0 || pads[spatial + d] != 0) {
      return std::nullopt;
    }
    pixels *= input_shape[2 + d];
  }
  // One pixel an image (a squeeze-and-excitation's pooled [N, C, 1, 1]): NCHW is channels-last in
  // memory, and its rows make one GEMM over the images, where per image it was a matrix-vector
  // product reading the whole weight (EfficientNet at batch 8: 8 x [96, 2304] @ [2304, 1], 124 us).
  return PointwiseShape{input_shape[0], pixels, input_shape[1], weight_shape[0], layout == channels_last || pixels == 1,
                        groups};
}

void pointwise_conv(const PointwiseShape& s, const float* input, const float* weight, const float* bias,
                    const float* sum, Clamp clamp, float* output) {
  const int64_t total = s.batch * s.pixels * s.out_channels;
  if (total == 0) return;
  const BladeRuntime* rt = runtime();
  const int64_t g = s.groups, group_in = s.in_channels / g, group_out = s.out_channels / g;
  if (s.channels_last) {  // per group [P, group out] = [P, group in] · W_g^T, P = all images' pixels
    const bool one = g == 1;  // strides of a batch of one are 0, as the other single GEMMs'
    rt->sgemm(g, s.batch * s.pixels, group_out, group_in, 1.0f, input, s.in_channels, one ? 0 : group_in, 0, weight,
              group_in, one ? 0 : group_out * group_in, 1, 0.0f, output, s.out_channels, one ? 0 : group_out);
  } else if (g == 1) {  // per image [out, P] = W · [in, P]
    rt->sgemm(s.batch, s.out_channels, s.pixels, s.in_channels, 1.0f, weight, s.in_channels, 0, 0, input, s.pixels,
              s.in_channels * s.pixels, 0, 0.0f, output, s.pixels, s.out_channels * s.pixels);
  } else {  // per image and group [group out, P] = W_g · [group in, P]
    for (int64_t n = 0; n < s.batch; ++n) {
      rt->sgemm(g, group_out, s.pixels, group_in, 1.0f, weight, group_in, group_out * group_in, 0,
                input + n * s.in_channels * s.pixels, s.pixels, group_in * s.pixels, 0, 0.0f,
                output + n * s.out_channels * s.pixels, s.pixels, group_out * s.pixels);
    }
  }
  // Channels last: [batch * pixels, out] rows; NCHW: [batch * out, pixels] rows.
  const int64_t rows = s.channels_last ? s.batch * s.pixels : s.batch * s.out_channels;
  const int64_t width = total / rows;
  const int bias_kind = bias == nullptr ? kNoBias : s.channels_last ? kBiasPerColumn : kBiasPerRow;
  if (bias_kind == kNoBias && sum == nullptr && !clamp.on) return;
  const EpilogueRows epilogue = kEpilogueRows[bias_kind][sum != nullptr][clamp.on];
  timed_parallel_for(0, rows, std::max<int64_t>(1, 16384 / width), [&](int64_t begin, int64_t end) {
    epilogue(output, bias, sum, width, s.out_channels, clamp, begin, end);
  });
}

}  // namespace blade
