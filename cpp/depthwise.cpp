#include "depthwise.h"
#include "activation.h"
#include "conv_patch.h"
#include "float_vectors.h"
#include "timed_parallel.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <vector>

namespace blade {
namespace {

// The kernels are templates on the vector type V, one AVX-512 register (16 floats) in the
// x86-64-v4 version of depthwise_rows and one AVX2 register (8 floats) in the others: g++ keeps a
// block's sums in registers across the taps (an array with `omp simd` went through the stack on
// every tap). A 16-float vector in an AVX2 function is no register pair to g++: it went through
// the stack (MobileNetV2's 32-channel 3x3 at 80x80: 509 us on an AVX2-only EPYC, one core).
using namespace float_vectors;
constexpr int64_t kVectors = 4;  // accumulators per block of pixel_vectors
constexpr int64_t kMaxLanes = 16;

// Calls tap(x, w) for each tap of output pixel (oh, ow) that falls inside the image, with the
// input pixel's and the tap's weights' channels from c0.
template <typename Tap>
__attribute__((always_inline)) inline void for_each_tap(const DepthwiseShape& s, const float* image, const float* taps,
                                                         int64_t oh, int64_t ow, int64_t c0, Tap tap) {
  for (int64_t kh = 0; kh < s.kernel_h; ++kh) {
    const int64_t ih = oh * s.stride_h - s.pad_top + kh * s.dilation_h;
    if (ih < 0 || ih >= s.in_h) continue;
    for (int64_t kw = 0; kw < s.kernel_w; ++kw) {
      const int64_t iw = ow * s.stride_w - s.pad_left + kw * s.dilation_w;
      if (iw < 0 || iw >= s.in_w) continue;
      tap(image + (ih * s.in_w + iw) * s.channels + c0, taps + (kh * s.kernel_w + kw) * s.channels + c0);
    }
  }
}

// One output pixel's channels [c0, c0 + kLanes<V> * Vectors): the taps inside the image, then the
// epilogue.
template <typename V, int64_t Vectors>
__attribute__((always_inline)) inline void pixel_vectors(const DepthwiseShape& s, const float* image,
                                                          const float* taps, const float* bias, const float* sum,
                                                          Clamp clamp, int64_t oh, int64_t ow, int64_t c0, float* out) {
  constexpr int64_t lanes = kLanes<V>;
  V acc[Vectors];
#pragma GCC unroll 4
  for (int64_t v = 0; v < Vectors; ++v) acc[v] = bias != nullptr ? load<V>(bias + c0 + lanes * v) : V{};
  for_each_tap(s, image, taps, oh, ow, c0, [&](const float* x, const float* w) {
#pragma GCC unroll 4
    for (int64_t v = 0; v < Vectors; ++v) acc[v] += load<V>(x + lanes * v) * load<V>(w + lanes * v);
  });
#pragma GCC unroll 4
  for (int64_t v = 0; v < Vectors; ++v) {
    if (sum != nullptr) acc[v] += load<V>(sum + lanes * v);
    if (clamp.on) acc[v] = clamp_value(acc[v], clamp.lo, clamp.hi);
    store<V>(out + lanes * v, acc[v]);
  }
}

// The last `width` (< kMaxLanes) channels from c0, the same way with a short array.
__attribute__((always_inline)) inline void pixel_remainder(const DepthwiseShape& s, const float* image,
                                                            const float* taps, const float* bias, const float* sum,
                                                            Clamp clamp, int64_t oh, int64_t ow, int64_t c0,
                                                            int64_t width, float* out) {
  float acc[kMaxLanes];
  // The bias branch outside the loop too (a masked load through the null pointer otherwise).
  if (bias != nullptr) {
    for (int64_t c = 0; c < width; ++c) acc[c] = bias[c0 + c];
  } else {
    for (int64_t c = 0; c < width; ++c) acc[c] = 0.0f;
  }
  for_each_tap(s, image, taps, oh, ow, c0, [&](const float* x, const float* w) {
    for (int64_t c = 0; c < width; ++c) acc[c] += x[c] * w[c];
  });
  // The residual branch outside the loop: a `sum ? sum[c] : 0` inside may become a masked load
  // through the null pointer, which AMD cores execute many times slower (see conv_gemm.cpp).
  if (sum != nullptr) {
    for (int64_t c = 0; c < width; ++c) acc[c] += sum[c];
  }
  if (clamp.on) {
    for (int64_t c = 0; c < width; ++c) acc[c] = clamp_value(acc[c], clamp.lo, clamp.hi);
  }
  for (int64_t c = 0; c < width; ++c) out[c] = acc[c];
}

// Runs of 8 pixels where the row has them (8 independent accumulator chains keep both FMA pipes
// busy: MobileNetV2's stride-1 3x3 ones ran 20-30% faster than with runs of 4, one core), then
// runs of 4 (a 10x10 image with a 7x7 kernel has 4 pixels between its borders).
constexpr int64_t kPixels = 4;      // the shorter run: rows are cut into runs of this many
constexpr int64_t kLongPixels = 8;  // the longer run, taken first

// kPixels adjacent output pixels of an undilated row of stride Stride whose taps all lie inside the
// image width, for one vector of channels: along a kernel row, input pixel Stride * ow0 + i
// serves output pixel ow0 + p through tap i - Stride * p, so each input vector is loaded once for
// up to Width taps (stride 1; ceil(Width / 2) at stride 2) instead of once per tap, and a kernel
// row's weights stay in registers (a depthwise convolution is otherwise bound by loads, two per
// multiply-add).
template <typename V, int64_t Width, int64_t Stride, int64_t kPixels>
__attribute__((always_inline)) inline void pixel_run(const DepthwiseShape& s, const float* image, const float* taps,
                                                      const float* bias, const float* sum, Clamp clamp, int64_t oh,
                                                      int64_t ow0, int64_t c0, float* out) {
  V acc[kPixels];
  const V initial = bias != nullptr ? load<V>(bias + c0) : V{};
#pragma GCC unroll 8
  for (int64_t p = 0; p < kPixels; ++p) acc[p] = initial;
  for (int64_t kh = 0; kh < s.kernel_h; ++kh) {
    const int64_t ih = oh * s.stride_h - s.pad_top + kh * s.dilation_h;
    if (ih < 0 || ih >= s.in_h) continue;
    const float* x = image + (ih * s.in_w + ow0 * Stride - s.pad_left) * s.channels + c0;
    const float* w = taps + kh * Width * s.channels + c0;
    V weight[Width];
#pragma GCC unroll 8
    for (int64_t kw = 0; kw < Width; ++kw) weight[kw] = load<V>(w + kw * s.channels);
#pragma GCC unroll 16
    for (int64_t i = 0; i < Stride * (kPixels - 1) + Width; ++i) {
      const V xi = load<V>(x + i * s.channels);
#pragma GCC unroll 8
      for (int64_t p = 0; p < kPixels; ++p) {
        const int64_t tap = i - Stride * p;
        if (tap >= 0 && tap < Width) acc[p] += xi * weight[tap];
      }
    }
  }
#pragma GCC unroll 8
  for (int64_t p = 0; p < kPixels; ++p) {
    const int64_t at = p * s.channels;
    if (sum != nullptr) acc[p] += load<V>(sum + at);
    if (clamp.on) acc[p] = clamp_value(acc[p], clamp.lo, clamp.hi);
    store<V>(out + at, acc[p]);
  }
}

// The next patch convolution's weight lines this thread reads first (upcoming_patch_weights),
// prefetched a few lines per output pixel while this convolution computes from the caches: the
// 1x1 convolutions around a small depthwise one (MobileNetV2 b1's 10x10 and 5x5 stages) stream
// 0.2-1.6 MB of cold weight each at the memory's pace, and memory idles during the depthwise
// one. A few lines a pixel, not all at once: a burst of prefetches waits behind itself and stalls
// this thread's own loads (conv_patch_kernels.h, panel_rows). One line per kWeightPrefetchChannels
// channels of an output pixel: MobileNetV2 b1 at 2 threads (one process, alternating, medians),
// the 1x1 convolutions after its 10x10 depthwise ones 0.82-0.89 of before, its 5x5 ones 0.96-0.98,
// model 0.977; one line per 16 or 8 channels gained less (0.986), per 64 or 128 too (0.99, 1.0).
constexpr int64_t kWeightPrefetchChannels = 32;
struct WeightPrefetch {
  const char* next = nullptr;  // null: nothing to prefetch
  const char* end = nullptr;
  int64_t lines_per_pixel = 0;

  __attribute__((always_inline)) inline void pixels(int64_t count) {
    if (next == nullptr) return;
    const char* stop = std::min(end, next + count * lines_per_pixel * 64);
    for (; next < stop; next += 64) __builtin_prefetch(next);
  }
};

// Output pixels [ow_begin, ow_end) of row `oh` one at a time, every channel.
template <typename V>
__attribute__((always_inline)) inline void pixels(const DepthwiseShape& s, const float* image, const float* taps,
                                                   const float* bias, const float* sum_row, Clamp clamp, int64_t oh,
                                                   int64_t ow_begin, int64_t ow_end, float* out_row,
                                                   WeightPrefetch& weights) {
  for (int64_t ow = ow_begin; ow < ow_end; ++ow) {
    weights.pixels(1);
    const int64_t at = ow * s.channels;
    const auto sum_from = [&](int64_t c0) { return sum_row != nullptr ? sum_row + at + c0 : nullptr; };
    int64_t c0 = 0;
    constexpr int64_t lanes = kLanes<V>, block = lanes * kVectors;
    for (; c0 + block <= s.channels; c0 += block) {
      pixel_vectors<V, kVectors>(s, image, taps, bias, sum_from(c0), clamp, oh, ow, c0, out_row + at + c0);
    }
    for (; c0 + lanes <= s.channels; c0 += lanes) {
      pixel_vectors<V, 1>(s, image, taps, bias, sum_from(c0), clamp, oh, ow, c0, out_row + at + c0);
    }
    if (c0 < s.channels) {
      pixel_remainder(s, image, taps, bias, sum_from(c0), clamp, oh, ow, c0, s.channels - c0, out_row + at + c0);
    }
  }
}

// The input rows the next output row reads and this one does not (its last stride_h kernel rows),
// prefetched piece by piece while this row computes: a depthwise convolution does few multiply-adds
// per byte, and at batch 8 its tensors exceed the caches (MobileNetV2's 144-channel 3x3 at 40x40:
// 7.4 MB in, 7.4 MB out), so without this each row waited for its new input row from memory.
// prefetch(s, a, b) covers the input columns output columns [a, b) start at (the last call, b ==
// out_w, through the row's end). Only for inputs larger than kPrefetchInputBytes: a smaller one is
// still in the caches from the convolution that wrote it, and the prefetches only cost time (batch
// 1's 10x10 and 5x5 ones, 7-14 us at 2 threads, ran 10-30% slower with them).
constexpr int64_t kPrefetchInputBytes = int64_t{4} << 20;
struct RowsAhead {
  const float* rows[2] = {nullptr, nullptr};  // column 0 of each row ahead (null: none)

  __attribute__((always_inline)) inline void prefetch(const DepthwiseShape& s, int64_t ow_a, int64_t ow_b) const {
    if (rows[0] == nullptr) return;
    const int64_t from = std::max<int64_t>(0, ow_a * s.stride_w - s.pad_left) * s.channels;
    const int64_t to = (ow_b >= s.out_w ? s.in_w : std::clamp<int64_t>(ow_b * s.stride_w - s.pad_left, 0, s.in_w)) *
                       s.channels;
    for (const float* row : rows) {
      if (row == nullptr) continue;
      for (int64_t i = from; i < to; i += 16) __builtin_prefetch(row + i);
    }
  }
};

// Output pixels [ow_begin, ow_end) (a multiple of kPixels, all taps inside the width) of a row of
// stride Stride with kernel width Width: runs of kPixels per vector of channels, the last channels
// (fewer than a vector) pixel by pixel.
template <typename V, int64_t Width, int64_t Stride>
__attribute__((always_inline)) inline void pixel_runs(const DepthwiseShape& s, const float* image, const float* taps,
                                                       const float* bias, const float* sum_row, Clamp clamp,
                                                       int64_t oh, int64_t ow_begin, int64_t ow_end, float* out_row,
                                                       const RowsAhead& ahead, WeightPrefetch& weights) {
  constexpr int64_t lanes = kLanes<V>;
  const int64_t vector_channels = s.channels / lanes * lanes;
  for (int64_t ow0 = ow_begin, run = kLongPixels; ow0 < ow_end; ow0 += run) {
    run = ow0 + kLongPixels <= ow_end ? kLongPixels : kPixels;
    ahead.prefetch(s, ow0, ow0 + run);
    weights.pixels(run);
    const int64_t at = ow0 * s.channels;
    for (int64_t c0 = 0; c0 < vector_channels; c0 += lanes) {
      const float* sum_at = sum_row != nullptr ? sum_row + at + c0 : nullptr;
      if (run == kLongPixels) {
        pixel_run<V, Width, Stride, kLongPixels>(s, image, taps, bias, sum_at, clamp, oh, ow0, c0, out_row + at + c0);
      } else {
        pixel_run<V, Width, Stride, kPixels>(s, image, taps, bias, sum_at, clamp, oh, ow0, c0, out_row + at + c0);
      }
    }
    if (vector_channels < s.channels) {
      for (int64_t ow = ow0; ow < ow0 + run; ++ow) {
        const int64_t pixel_at = ow * s.channels + vector_channels;
        pixel_remainder(s, image, taps, bias, sum_row != nullptr ? sum_row + pixel_at : nullptr, clamp, oh, ow,
                        vector_channels, s.channels - vector_channels, out_row + pixel_at);
      }
    }
  }
}

// Output rows [begin, end) of the flattened (batch, out_h) range. Undilated rows of stride 1 with a
// 3, 5 or 7 wide kernel, or of stride 2 with a 3 or 5 wide one, take the runs of pixel_run between
// their borders (MobileNetV2's stride-2 3x3 ones ran pixel by pixel, 96 channels at 80x80: 59 us
// against ONNX Runtime's 44, one core).
template <typename V>
__attribute__((always_inline)) inline void depthwise_rows_for(const DepthwiseShape& s, const float* input,
                                                              const float* taps, const float* bias, const float* sum,
                                                              Clamp clamp, float* output, int64_t begin, int64_t end,
                                                              WeightPrefetch& weights) {
  const int64_t row_floats = s.out_w * s.channels;
  const int64_t kind = s.dilation_w == 1 ? s.stride_w * 10 + s.kernel_w : 0;  // stride and width, as in the switch
  const bool runs = kind == 13 || kind == 15 || kind == 17 || kind == 23 || kind == 25;
  // Output pixels whose taps all fall inside the image width: [first, last).
  const int64_t first = std::min((s.pad_left + s.stride_w - 1) / s.stride_w, s.out_w);
  const int64_t last_start = s.in_w - s.kernel_w + s.pad_left;  // the largest ow * stride_w inside
  const int64_t last = last_start < 0 ? first : std::max(first, std::min(s.out_w, last_start / s.stride_w + 1));
  const int64_t run_end = runs ? first + (last - first) / kPixels * kPixels : first;
  const int64_t image_floats = s.in_h * s.in_w * s.channels;
  const bool prefetch_rows = s.batch * image_floats * int64_t{sizeof(float)} > kPrefetchInputBytes;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t n = row / s.out_h, oh = row % s.out_h;
    const float* image = input + n * image_floats;
    const float* sum_row = sum != nullptr ? sum + row * row_floats : nullptr;
    float* out_row = output + row * row_floats;
    // The rows ahead: the next output row's last min(stride_h, 2) kernel rows inside the image.
    RowsAhead ahead;
    if (row + 1 < end && runs && prefetch_rows) {
      const int64_t next_n = (row + 1) / s.out_h, next_oh = (row + 1) % s.out_h;
      for (int64_t i = 0; i < std::min<int64_t>(s.stride_h, 2); ++i) {
        const int64_t kh = s.kernel_h - 1 - i;
        const int64_t ih = next_oh * s.stride_h - s.pad_top + kh * s.dilation_h;
        if (kh >= 0 && ih >= 0 && ih < s.in_h) ahead.rows[i] = input + next_n * image_floats + ih * s.in_w * s.channels;
      }
    }
    ahead.prefetch(s, 0, first);
    pixels<V>(s, image, taps, bias, sum_row, clamp, oh, 0, first, out_row, weights);
    switch (runs ? kind : 0) {
      case 13: pixel_runs<V, 3, 1>(s, image, taps, bias, sum_row, clamp, oh, first, run_end, out_row, ahead, weights); break;
      case 15: pixel_runs<V, 5, 1>(s, image, taps, bias, sum_row, clamp, oh, first, run_end, out_row, ahead, weights); break;
      case 17: pixel_runs<V, 7, 1>(s, image, taps, bias, sum_row, clamp, oh, first, run_end, out_row, ahead, weights); break;
      case 23: pixel_runs<V, 3, 2>(s, image, taps, bias, sum_row, clamp, oh, first, run_end, out_row, ahead, weights); break;
      case 25: pixel_runs<V, 5, 2>(s, image, taps, bias, sum_row, clamp, oh, first, run_end, out_row, ahead, weights); break;
      default: break;
    }
    ahead.prefetch(s, run_end, s.out_w);
    pixels<V>(s, image, taps, bias, sum_row, clamp, oh, run_end, s.out_w, out_row, weights);
  }
}

// depthwise_rows per ISA, picked when the extension loads (g++'s function multiversioning).
#define BLADE_DEPTHWISE_PARAMS                                                                          \
  const DepthwiseShape &s, const float *input, const float *taps, const float *bias, const float *sum, \
      Clamp clamp, float *output, int64_t begin, int64_t end, WeightPrefetch &weights
#define BLADE_DEPTHWISE_ARGS s, input, taps, bias, sum, clamp, output, begin, end, weights
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("arch=x86-64-v4"))) void depthwise_rows(BLADE_DEPTHWISE_PARAMS) {
  depthwise_rows_for<Floats16>(BLADE_DEPTHWISE_ARGS);
}
__attribute__((target("arch=x86-64-v3"))) void depthwise_rows(BLADE_DEPTHWISE_PARAMS) {
  depthwise_rows_for<Floats8>(BLADE_DEPTHWISE_ARGS);
}
__attribute__((target("default"))) void depthwise_rows(BLADE_DEPTHWISE_PARAMS) {
  depthwise_rows_for<Floats8>(BLADE_DEPTHWISE_ARGS);
}
#else
void depthwise_rows(BLADE_DEPTHWISE_PARAMS) { depthwise_rows_for<Floats8>(BLADE_DEPTHWISE_ARGS); }
#endif

// depthwise_rows, then the activation's unary function (SiLU, GELU) if any: a few rows at a time
// (about kUnaryBytes of output), each while it is still in L1/L2.
constexpr int64_t kUnaryBytes = int64_t{64} << 10;
void activated_rows(const DepthwiseShape& s, const float* input, const float* taps, const float* bias, const float* sum,
                    Activation act, float* output, int64_t begin, int64_t end, WeightPrefetch& weights) {
  if (act.unary == Unary::none) return depthwise_rows(s, input, taps, bias, sum, act.clamp, output, begin, end, weights);
  const int64_t row_floats = s.out_w * s.channels;
  const int64_t step = std::max<int64_t>(1, kUnaryBytes / std::max<int64_t>(1, row_floats * int64_t{sizeof(float)}));
  for (int64_t first = begin; first < end; first += step) {
    const int64_t last = std::min(end, first + step);
    depthwise_rows(s, input, taps, bias, sum, act.clamp, output, first, last, weights);
    unary_in_place(act.unary, output + first * row_floats, (last - first) * row_floats);
  }
}

}  // namespace

at::Tensor depthwise_tap_weight(const float* weight, int64_t channels, int64_t taps) {
  at::Tensor out = at::empty({taps, channels}, at::kFloat);
  float* dest = out.mutable_data_ptr<float>();
  for (int64_t c = 0; c < channels; ++c) {
    for (int64_t t = 0; t < taps; ++t) dest[t * channels + c] = weight[c * taps + t];
  }
  return out;
}

void depthwise_conv2d(const DepthwiseShape& shape, const float* input, const float* tap_weight, const float* bias,
                      const float* sum, Activation act, float* output) {
  const int64_t rows = shape.batch * shape.out_h;
  // A chunk of rows worth a thread wake-up: about 32K multiply-adds.
  const int64_t per_row = std::max<int64_t>(1, shape.out_w * shape.channels * shape.kernel_h * shape.kernel_w);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / per_row);
  // Each thread's span of the next patch convolution's weight (read on this, the calling thread:
  // the table of what follows what is its own), when this convolution's input is in the caches
  // (a larger one prefetches its own rows ahead, RowsAhead).
  // The spans live in the calling thread's buffer, grown once rather than allocated per call (a
  // hot path: 17 calls per MobileNetV2 run); the workers read them through `spans`, not by name
  // (a thread_local named in the lambda would be each worker's own).
  const int64_t threads = at::get_num_threads();
  thread_local std::vector<WeightSpan> span_buffer;
  span_buffer.assign(threads, WeightSpan{});
  const WeightSpan* spans = span_buffer.data();
  const bool small = shape.batch * shape.in_h * shape.in_w * shape.channels * int64_t{sizeof(float)} <= kPrefetchInputBytes;
  for (int64_t t = 0; small && t < threads; ++t) span_buffer[t] = upcoming_patch_weights(t, threads);
  // Where each thread is in its span: its chunks of rows continue where its last one stopped.
  static std::atomic<int64_t> calls{0};
  const int64_t call = calls.fetch_add(1, std::memory_order_relaxed);
  timed_parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    thread_local int64_t cursor_call = -1, cursor = 0;
    const int64_t t = std::min<int64_t>(at::get_thread_num(), threads - 1);
    if (cursor_call != call) cursor_call = call, cursor = 0;
    WeightPrefetch weights;
    if (spans[t].begin != nullptr && cursor < spans[t].bytes) {
      weights = WeightPrefetch{spans[t].begin + cursor, spans[t].begin + spans[t].bytes,
                               std::max<int64_t>(1, shape.channels / kWeightPrefetchChannels)};
    }
    activated_rows(shape, input, tap_weight, bias, sum, act, output, begin, end, weights);
    if (weights.next != nullptr) cursor = weights.next - spans[t].begin;
  });
}

void depthwise_conv2d_rows(const DepthwiseShape& shape, const float* input, const float* tap_weight, const float* bias,
                           const float* sum, Activation act, float* output, int64_t begin, int64_t end) {
  WeightPrefetch none;
  activated_rows(shape, input, tap_weight, bias, sum, act, output, begin, end, none);
}

}  // namespace blade
