#include "grouped_conv.h"
#include "activation.h"
#include "float_vectors.h"
#include "timed_parallel.h"

#include <ATen/ops/empty.h>

#include <algorithm>

namespace blade {
namespace {

// The kernels are templates on the vector type V: one AVX2 register (8 floats) for groups of a
// multiple of 8 output channels (RegNet's group width 8 among them), one SSE register (4 floats) for
// the others (ResNeXt 32x4d's first stage: groups of 4), in every version (the x86-64-v4 one gets
// AVX-512's extra registers for the same tiles).
using namespace float_vectors;

// What a tap in the padding reads: the padding's zeros (the patch kernel's gather reads the same).
alignas(64) const float kZeros[kGroupedMaxGroupIn] = {};

// Pixels a tile holds for its number of vectors: 8 accumulator chains at least (two FMA pipes of
// four cycles' latency), at most 12 accumulators (with the weights and a broadcast in 16 registers).
template <int Vectors>
constexpr int kTilePixels = Vectors == 1 ? 8 : Vectors == 2 ? 6 : 4;

// Where a group's values start: image at its group's first input channel, weight at its group's
// [taps][in][out] block, and the tile's first output channel (`co`) within the group.
struct GroupRow {
  const float* image;   // batch entry's image, from the group's first input channel
  const float* weight;  // the group's packed weight, from output channel co
  const float* bias;    // from the group's output channel co, or null
  const float* sum;     // output row's residual at the group's channel co, or null
  float* out;           // output row at the group's channel co
  int64_t oh;
};

// Pixels ow0 .. ow0 + Pixels - 1 of the row (Checked: the columns cols[0 .. Pixels - 1]) x
// Vectors * kLanes<V> output channels: the sums over the taps and the group's input channels in
// registers, then bias, residual and clamp, stored once. Unchecked tiles are the row's pixels whose
// taps all lie inside the image width; checked ones (the border pixels) read the row of zeros for
// taps in the padding. GroupIn: the group's input channels when known at compile time (the inner
// loop unrolled whole, its loads at fixed offsets), else 0.
template <typename V, int Pixels, int Vectors, int GroupIn, bool Checked>
__attribute__((always_inline)) inline void tile(const GroupedShape& s, const GroupRow& r, int64_t ow0,
                                                const int64_t* cols, Clamp clamp) {
  const int64_t group_in = GroupIn > 0 ? GroupIn : s.group_in(), group_out = s.group_out(), channels = s.in_channels;
  const auto column = [&](int p) { return Checked ? cols[p] : ow0 + p; };
  V acc[Pixels][Vectors];
#pragma GCC unroll 8
  for (int p = 0; p < Pixels; ++p) {
#pragma GCC unroll 4
    for (int v = 0; v < Vectors; ++v) acc[p][v] = V{};
  }
  for (int64_t kh = 0; kh < s.kernel_h; ++kh) {
    const int64_t ih = r.oh * s.stride_h - s.pad_top + kh * s.dilation_h;
    if (ih < 0 || ih >= s.in_h) continue;  // the whole tile's row of taps lies in the padding
    const float* image_row = r.image + ih * s.in_w * channels;
    for (int64_t kw = 0; kw < s.kernel_w; ++kw) {
      const float* x[Pixels];
#pragma GCC unroll 8
      for (int p = 0; p < Pixels; ++p) {
        const int64_t iw = column(p) * s.stride_w - s.pad_left + kw * s.dilation_w;
        x[p] = !Checked || (iw >= 0 && iw < s.in_w) ? image_row + iw * channels : kZeros;
      }
      const float* w = r.weight + (kh * s.kernel_w + kw) * group_in * group_out;
#pragma GCC unroll 16
      for (int64_t c = 0; c < group_in; ++c, w += group_out) {
        V weight[Vectors];
#pragma GCC unroll 4
        for (int v = 0; v < Vectors; ++v) weight[v] = load<V>(w + kLanes<V> * v);
#pragma GCC unroll 8
        for (int p = 0; p < Pixels; ++p) {
          const V xp = x[p][c] - V{};  // broadcast (x - 0 is x, -0 included)
#pragma GCC unroll 4
          for (int v = 0; v < Vectors; ++v) acc[p][v] += xp * weight[v];
        }
      }
    }
  }
  const int64_t out_channels = s.out_channels;
#pragma GCC unroll 8
  for (int p = 0; p < Pixels; ++p) {
#pragma GCC unroll 4
    for (int v = 0; v < Vectors; ++v) {
      const int64_t at = column(p) * out_channels + kLanes<V> * v;
      V y = acc[p][v];
      if (r.bias != nullptr) y += load<V>(r.bias + kLanes<V> * v);
      if (r.sum != nullptr) y += load<V>(r.sum + at);
      if (clamp.on) y = clamp_value(y, clamp.lo, clamp.hi);
      store<V>(r.out + at, y);
    }
  }
}

// `pixels` (1 .. MaxPixels) pixels as one tile of that many.
template <typename V, int Vectors, int GroupIn, bool Checked, int MaxPixels>
__attribute__((always_inline)) inline void tile_of(const GroupedShape& s, const GroupRow& r, int64_t ow0,
                                                   const int64_t* cols, int64_t pixels, Clamp clamp) {
  if constexpr (MaxPixels > 1) {
    if (pixels < MaxPixels) return tile_of<V, Vectors, GroupIn, Checked, MaxPixels - 1>(s, r, ow0, cols, pixels, clamp);
  }
  tile<V, MaxPixels, Vectors, GroupIn, Checked>(s, r, ow0, cols, clamp);
}

// The output columns whose taps all lie inside the image width: [first, last).
struct Interior {
  int64_t first, last;
  explicit Interior(const GroupedShape& s) {
    first = std::min((s.pad_left + s.stride_w - 1) / s.stride_w, s.out_w);
    const int64_t last_start = s.in_w - 1 - (s.kernel_w - 1) * s.dilation_w + s.pad_left;  // largest ow * stride_w
    last = last_start < 0 ? first : std::clamp(last_start / s.stride_w + 1, first, s.out_w);
  }
};

// A whole output row of one group's Vectors * kLanes<V> channels from co: its interior pixels in
// tiles of even sizes (a 7-pixel row as 4 + 3, not 6 + 1: a one-pixel tile is one accumulator
// chain, bound by its latency), its border pixels (both sides together) in checked tiles.
template <typename V, int Vectors, int GroupIn>
__attribute__((always_inline)) inline void row_tiles(const GroupedShape& s, const GroupRow& r, const Interior& in,
                                                     Clamp clamp) {
  constexpr int pixels = kTilePixels<Vectors>;
  const int64_t interior = in.last - in.first;
  const int64_t tiles = (interior + pixels - 1) / pixels;
  for (int64_t t = 0, ow = in.first; t < tiles; ++t) {
    const int64_t end = in.first + interior * (t + 1) / tiles;
    tile_of<V, Vectors, GroupIn, false, pixels>(s, r, ow, nullptr, end - ow, clamp);
    ow = end;
  }
  int64_t border[pixels];
  int64_t count = 0;
  const auto add_border = [&](int64_t ow) {
    border[count++] = ow;
    if (count == pixels) {
      tile<V, pixels, Vectors, GroupIn, true>(s, r, 0, border, clamp);
      count = 0;
    }
  };
  for (int64_t ow = 0; ow < in.first; ++ow) add_border(ow);
  for (int64_t ow = in.last; ow < s.out_w; ++ow) add_border(ow);
  if (count > 0) tile_of<V, Vectors, GroupIn, true, pixels>(s, r, 0, border, count, clamp);
}

// row_tiles with the group's input channels as a constant where they are one vector's worth (8, or
// 4 for 4-float vectors: RegNet's and ResNeXt's narrow groups, whose inner loop is short), else
// read at run time.
template <typename V, int Vectors>
__attribute__((always_inline)) inline void group_row(const GroupedShape& s, const GroupRow& r, const Interior& in,
                                                     Clamp clamp) {
  if (s.group_in() == kLanes<V>) return row_tiles<V, Vectors, kLanes<V>>(s, r, in, clamp);
  row_tiles<V, Vectors, 0>(s, r, in, clamp);
}

// Whether work items go group by group (all rows of a group, then the next group's) rather than
// row by row: where the weights outweigh an image, so that a group's weights stay in the caches
// across its rows (ResNeXt's 1024-channel 7x7 stage: 1.2 MB of weights, a 200 KB image); else a
// row's input lines, which hold several groups' channels, serve its groups one after another.
bool by_group(const GroupedShape& s) {
  return s.out_channels * s.group_in() * s.kernel_h * s.kernel_w > s.in_h * s.in_w * s.in_channels;
}

// Work items [begin, end) of the flattened (batch * out_h) x groups range, in by_group's order:
// each an output row of one group, its output channels 16 or 24 at a time (8 for the last ones;
// 4 at a time in groups of a multiple of 4 but not of 8).
__attribute__((always_inline)) inline void items_for(const GroupedShape& s, const float* input, const float* weight,
                                                     const float* bias, const float* sum, Clamp clamp, float* output,
                                                     int64_t begin, int64_t end) {
  const int64_t group_in = s.group_in(), group_out = s.group_out(), rows = s.batch * s.out_h;
  const int64_t image_floats = s.in_h * s.in_w * s.in_channels, row_floats = s.out_w * s.out_channels;
  const int64_t group_weights = s.kernel_h * s.kernel_w * group_in * group_out;
  const bool group_major = by_group(s);
  const Interior interior(s);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t row = group_major ? item % rows : item / s.groups;
    const int64_t g = group_major ? item / rows : item % s.groups;
    const int64_t n = row / s.out_h;
    for (int64_t co = 0; co < group_out;) {
      const int64_t channel = g * group_out + co;
      const GroupRow r{input + n * image_floats + g * group_in, weight + g * group_weights + co,
                       bias != nullptr ? bias + channel : nullptr,
                       sum != nullptr ? sum + row * row_floats + channel : nullptr, output + row * row_floats + channel,
                       row % s.out_h};
      const int64_t rest = group_out - co;
      if (group_out % 8 != 0) {
        group_row<Floats4, 1>(s, r, interior, clamp);
        co += 4;
      } else if (rest == 24) {
        group_row<Floats8, 3>(s, r, interior, clamp);
        co += 24;
      } else if (rest >= 16) {
        group_row<Floats8, 2>(s, r, interior, clamp);
        co += 16;
      } else {
        group_row<Floats8, 1>(s, r, interior, clamp);
        co += 8;
      }
    }
  }
}

// items_for per ISA, picked when the extension loads (g++'s function multiversioning).
#define BLADE_GROUPED_PARAMS                                                                              \
  const GroupedShape &s, const float *input, const float *weight, const float *bias, const float *sum, \
      Clamp clamp, float *output, int64_t begin, int64_t end
#define BLADE_GROUPED_ARGS s, input, weight, bias, sum, clamp, output, begin, end
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("arch=x86-64-v4"))) void grouped_items(BLADE_GROUPED_PARAMS) { items_for(BLADE_GROUPED_ARGS); }
__attribute__((target("arch=x86-64-v3"))) void grouped_items(BLADE_GROUPED_PARAMS) { items_for(BLADE_GROUPED_ARGS); }
__attribute__((target("default"))) void grouped_items(BLADE_GROUPED_PARAMS) { items_for(BLADE_GROUPED_ARGS); }
#else
void grouped_items(BLADE_GROUPED_PARAMS) { items_for(BLADE_GROUPED_ARGS); }
#endif

}  // namespace

at::Tensor grouped_conv_weight(const float* weight, const GroupedShape& shape) {
  const int64_t group_in = shape.group_in(), group_out = shape.group_out(), taps = shape.kernel_h * shape.kernel_w;
  at::Tensor out = at::empty({shape.groups, taps, group_in, group_out}, at::kFloat);
  float* dest = out.mutable_data_ptr<float>();
  for (int64_t g = 0; g < shape.groups; ++g) {
    for (int64_t o = 0; o < group_out; ++o) {
      const float* from = weight + (g * group_out + o) * group_in * taps;  // [in][kh][kw] of output channel o
      for (int64_t c = 0; c < group_in; ++c) {
        for (int64_t t = 0; t < taps; ++t) dest[((g * taps + t) * group_in + c) * group_out + o] = from[c * taps + t];
      }
    }
  }
  return out;
}

void grouped_conv2d(const GroupedShape& shape, const float* input, const float* packed_weight, const float* bias,
                    const float* sum, Clamp clamp, float* output) {
  const int64_t items = shape.batch * shape.out_h * shape.groups;
  // A chunk of items worth a thread wake-up: about 32K multiply-adds.
  const int64_t per_item = std::max<int64_t>(
      1, shape.out_w * shape.group_out() * shape.group_in() * shape.kernel_h * shape.kernel_w);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / per_item);
  timed_parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    grouped_items(shape, input, packed_weight, bias, sum, clamp, output, begin, end);
  });
}

}  // namespace blade
