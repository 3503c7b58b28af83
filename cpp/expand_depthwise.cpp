#include "expand_depthwise.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "timed_parallel.h"

namespace blade {
namespace {

// A thread's buffer of expanded rows: under half a Zen 3 core's L2 (512 KB), so the rows, the
// output rows being written and the 1x1 weight stay in it together. MobileNetV2's pairs at 80x80,
// 40x40 and 20x20, b1 and b8, 2 threads, together / apart: 1.03-1.61x with 192 KB; with 96 KB
// 0.98-1.41x, with 384 KB 0.91-1.46x (more rows a step, but fewer stay in L2).
constexpr int64_t kBufferBytes = int64_t{192} << 10;
// Together pays from an expanded tensor of a core's L2 (Zen 3: 512 KB): a smaller one stays in the
// caches between the two kernels apart, whose own parallel splits serve small images better
// (MobileNetV2 b1's 10x10 and 5x5 pairs, 150-230 KB: 0.60-0.67x together; its 20x20 ones, 307 KB:
// 1.00-1.14x alone, and the whole model read 1.01x apart/together with them, 1.03x without).
constexpr int64_t kMinExpandedBytes = int64_t{512} << 10;
// ... and up to this large a 1x1 weight: each step of a thread reads it whole (apart, the few-pixel
// path splits it between the threads): b8's 160 -> 960 at 5x5, 614 KB of weight: 0.97x together.
constexpr int64_t kMaxWeightBytes = int64_t{64} << 10;
constexpr int64_t kMinRowsPerThread = 4;

// The image rows one output row's taps span.
int64_t kernel_rows(const DepthwiseShape& s) { return (s.kernel_h - 1) * s.dilation_h + 1; }

// Image rows [lo, hi) output row oh of the depthwise convolution reads (clipped to the image).
struct RowSpan {
  int64_t lo, hi;
};
RowSpan rows_read(const DepthwiseShape& s, int64_t oh) {
  const int64_t top = oh * s.stride_h - s.pad_top;
  return {std::clamp<int64_t>(top, 0, s.in_h),
          std::clamp<int64_t>(top + kernel_rows(s), 0, s.in_h)};
}

// The expanded rows a thread holds: rows [lo, hi) of image n, computed during call `call`.
struct Held {
  int64_t call = -1, n = -1, lo = 0, hi = 0;
};

}  // namespace

bool expand_feeds_depthwise(const PatchConvShape& e, const DepthwiseShape& d) {
  return e.direct() && e.output_channels_last && d.channels == e.out_channels && d.batch == e.batch &&
         d.in_h == e.out_h && d.in_w == e.out_w;
}

bool expand_depthwise_pays(const PatchConvShape& e, const DepthwiseShape& d, int64_t threads) {
  const int64_t expanded_bytes = e.batch * e.out_h * e.out_w * e.out_channels * int64_t{sizeof(float)};
  const int64_t row_bytes = d.in_w * d.channels * int64_t{sizeof(float)};
  const int64_t weight_bytes = e.depth() * e.out_channels * int64_t{sizeof(float)};
  return expanded_bytes >= kMinExpandedBytes && weight_bytes <= kMaxWeightBytes &&
         kernel_rows(d) * row_bytes <= kBufferBytes && d.batch * d.out_h >= kMinRowsPerThread * threads;
}

void expand_depthwise_conv2d(const PatchConvShape& e, const float* input, const float* panels, const float* bias1,
                             Activation act1, const DepthwiseShape& d, const float* tap_weight, const float* bias2,
                             const float* sum, Activation act2, float* output) {
  TORCH_CHECK(expand_feeds_depthwise(e, d),
              "expand_depthwise_conv2d: the 1x1 convolution's output is not the depthwise one's input");
  const int64_t row_floats = d.in_w * d.channels, out_row_floats = d.out_w * d.channels;
  const int64_t capacity = std::max(kernel_rows(d), kBufferBytes / (row_floats * int64_t{sizeof(float)}));
  const int64_t in_pixels_per_image = e.in_h * e.in_w;
  static std::atomic<int64_t> calls{0};
  const int64_t call = calls.fetch_add(1, std::memory_order_relaxed);
  timed_parallel_for(0, d.batch * d.out_h, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffer;
    thread_local Held held;
    buffer.resize(capacity * row_floats);
    float* rows = buffer.data();
    for (int64_t row = begin; row < end;) {
      const int64_t n = row / d.out_h, oh = row % d.out_h;
      const int64_t oh_stop = std::min(end - n * d.out_h, d.out_h);
      const RowSpan first = rows_read(d, oh);
      // Keep what the last output rows computed (this thread's previous chunk, when it ends where
      // this one starts), moved to the buffer's front; else start empty.
      if (held.call != call || held.n != n || first.lo < held.lo || first.lo > held.hi) {
        held = Held{call, n, first.lo, first.lo};
      } else if (held.lo < first.lo) {
        std::memmove(rows, rows + (first.lo - held.lo) * row_floats, (held.hi - first.lo) * row_floats * sizeof(float));
        held.lo = first.lo;
      }
      // The output rows whose input rows fit in the buffer together (at least one).
      int64_t oh_end = oh + 1;
      while (oh_end < oh_stop && rows_read(d, oh_end).hi - held.lo <= capacity) ++oh_end;
      const int64_t need_hi = rows_read(d, oh_end - 1).hi;
      if (need_hi > held.hi) {
        PatchConvShape part = e;  // image n's rows [held.hi, need_hi) alone
        part.batch = 1;
        part.in_h = part.out_h = need_hi - held.hi;
        patch_conv_pixels(part, input + (n * in_pixels_per_image + held.hi * e.in_w) * e.in_channels, panels, bias1,
                          act1, rows + (held.hi - held.lo) * row_floats, 0, part.out_h * part.out_w);
        held.hi = need_hi;
      }
      // The depthwise rows from the buffer: image rows [held.lo, held.hi) as an image of their own
      // whose top padding grew by held.lo (taps outside it are the image's padding: rows_read).
      DepthwiseShape from_buffer = d;
      from_buffer.batch = 1;
      from_buffer.in_h = held.hi - held.lo;
      from_buffer.pad_top = d.pad_top + held.lo;
      const int64_t image_out = n * d.out_h * out_row_floats;
      depthwise_conv2d_rows(from_buffer, rows, tap_weight, bias2, sum != nullptr ? sum + image_out : nullptr, act2,
                            output + image_out, oh, oh_end);
      row = n * d.out_h + oh_end;
    }
  });
}

}  // namespace blade
