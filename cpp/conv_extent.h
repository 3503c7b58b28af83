// The output extent of a convolution (or pooling window) along one spatial dim, shared by the
// runtime's kernels' shape checks.
#pragma once

#include <cstdint>

namespace blade {

// Output positions along a dim of `in` values padded by pad_begin/pad_end, for a kernel of `kernel`
// taps `dilation` apart moved `stride` at a time (torch's formula; shapes are valid by then, so the
// numerator is not negative).
inline int64_t conv_output_extent(int64_t in, int64_t pad_begin, int64_t pad_end, int64_t kernel, int64_t stride,
                                  int64_t dilation) {
  return (in + pad_begin + pad_end - dilation * (kernel - 1) - 1) / stride + 1;
}

}  // namespace blade
