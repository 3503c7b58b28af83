#include "conv_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "blade_abi.h"
#include "isa_clones.h"
#include "runtime.h"

namespace blade {
namespace {

// Rows [begin, end) of the output seen as [rows, width]: the bias broadcast along a row (channels
// last: one bias per column) or down it (NCHW: one bias per row), plus the residual. Each case is
// its own loop: with `residual ? residual[j] : 0` inside one, GCC emits a masked load through the
// null pointer, which AMD cores execute ~50x slower than a plain load (seen: 3 ms for 600K floats).
BLADE_ISA_CLONES void prefill_rows(float* out, const float* bias, const float* sum, int64_t width, bool bias_per_column,
                                   int64_t bias_rows, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    float* row = out + r * width;
    const float* residual = sum != nullptr ? sum + r * width : nullptr;
    if (bias == nullptr) {
      std::memcpy(row, residual, width * sizeof(float));
    } else if (bias_per_column && residual != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) row[j] = bias[j] + residual[j];
    } else if (bias_per_column) {
      std::memcpy(row, bias, width * sizeof(float));
    } else if (residual != nullptr) {
      const float b = bias[r % bias_rows];
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) row[j] = b + residual[j];
    } else {
      std::fill(row, row + width, bias[r % bias_rows]);
    }
  }
}

BLADE_ISA_CLONES void relu_range(float* out, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) out[i] = out[i] < 0.0f ? 0.0f : out[i];  // NaN stays NaN
}

}  // namespace

std::optional<PointwiseShape> pointwise_shape(int32_t spatial, const int64_t* input_shape, const int64_t* weight_shape,
                                              const int64_t* strides, const int64_t* pads, const int64_t* dilations,
                                              int64_t groups, int32_t layout) {
  const int32_t channels_last = BLADE_CONV_INPUT_CHANNELS_LAST | BLADE_CONV_OUTPUT_CHANNELS_LAST;
  if (groups != 1 || (layout != 0 && layout != channels_last)) return std::nullopt;
  int64_t pixels = 1;
  for (int32_t d = 0; d < spatial; ++d) {
    if (weight_shape[2 + d] != 1 || strides[d] != 1 || dilations[d] != 1 || pads[d] != 0 || pads[spatial + d] != 0) {
      return std::nullopt;
    }
    pixels *= input_shape[2 + d];
  }
  return PointwiseShape{input_shape[0], pixels, input_shape[1], weight_shape[0], layout == channels_last};
}

void pointwise_conv(const PointwiseShape& s, const float* input, const float* weight, const float* bias,
                    const float* sum, bool relu, float* output) {
  const int64_t total = s.batch * s.pixels * s.out_channels;
  if (total == 0) return;
  // Channels last: [batch * pixels, out] rows; NCHW: [batch * out, pixels] rows.
  const int64_t rows = s.channels_last ? s.batch * s.pixels : s.batch * s.out_channels;
  const int64_t width = total / rows;
  const bool accumulate = bias != nullptr || sum != nullptr;
  if (accumulate) {
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / width), [&](int64_t begin, int64_t end) {
      prefill_rows(output, bias, sum, width, s.channels_last, s.out_channels, begin, end);
    });
  }
  const float beta = accumulate ? 1.0f : 0.0f;
  const BladeRuntime* rt = runtime();
  if (s.channels_last) {  // [P, out] = [P, in] · W^T
    rt->sgemm(1, s.batch * s.pixels, s.out_channels, s.in_channels, 1.0f, input, s.in_channels, 0, 0, weight,
              s.in_channels, 0, 1, beta, output, s.out_channels, 0);
  } else {  // per image [out, P] = W · [in, P]
    rt->sgemm(s.batch, s.out_channels, s.pixels, s.in_channels, 1.0f, weight, s.in_channels, 0, 0, input, s.pixels,
              s.in_channels * s.pixels, 0, beta, output, s.pixels, s.out_channels * s.pixels);
  }
  if (relu) {
    at::parallel_for(0, total, 16384, [&](int64_t begin, int64_t end) { relu_range(output, begin, end); });
  }
}

}  // namespace blade
