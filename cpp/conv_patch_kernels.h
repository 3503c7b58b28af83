// conv_patch.cpp's kernels, included by the translation units of its block functions
// (conv_patch_blocks.h), one per ISA: each instantiates them for its vector type under its target.
// Internal linkage (an anonymous namespace): each unit compiles its own copy, as the single file did.
#pragma once

#include <algorithm>
#include <cstring>

#include "blade_abi.h"
#include "conv_patch_blocks.h"
#include "float_vectors.h"

// The target of this unit's functions (conv_patch_blocks.h's BLADE_ISA_TARGET), defined by the unit
// before it includes this header; none for the baseline unit.
#ifndef BLADE_PATCH_TARGET
#define BLADE_PATCH_TARGET
#endif

namespace blade {
namespace {

// The kernels are templates on the vector type V, instantiated once per ISA (the block functions'
// versions, conv_patch_blocks.h): 16 floats (one AVX-512 register) where AVX-512 is, 8 (one AVX2 register)
// elsewhere. A 16-float vector in an AVX2 function is no pair of registers to g++: it keeps the
// accumulators on the stack and broadcasts through it (ResNet-18's 3x3/2 128->256 at 28x28 ran
// 69 ms instead of ~1 ms on an AVX2-only EPYC). The vector types and their loads: float_vectors.h.
using namespace float_vectors;
using conv_patch_blocks::kBlockRows;
using conv_patch_blocks::kDepthChunk;
using conv_patch_blocks::kGatherSlack;
using conv_patch_blocks::kPanel;
using conv_patch_blocks::kTileRows;

// Output channels one tile covers: a whole panel in two AVX-512 vectors a pixel (6 x 2 accumulators
// of 32 registers), half a panel in two AVX2 ones (6 x 2 of 16 registers; a whole panel, 6 x 4,
// would not fit).
template <typename V>
constexpr int64_t kTileChannels = 2 * kLanes<V>;

// Pair tiles, AVX-512 only: up to kPairTileRows pixels x 64 channels, two adjacent whole panels
// summed together (patch_block_for pairs them, into a channels-last output). A step over the depth
// then takes 4 weight loads and 5 broadcasts for 20 multiply-adds, where 6 x 2 tiles take 2 and 6
// for 12 (and their loop's own instructions): the broadcasts and loop overhead left the 6 x 2 loop
// at ~75% of the multiply-add ports' peak on an AVX-512 Xeon (1x1 convolutions of ResNet-50's
// shapes, one core: ~125-140 GFLOP/s, ~135-155 in pair tiles). The second panel's row is
// depth * kPanel floats after the first's (multiply_add's next_panel). (AVX2's 16 registers hold
// no 20 accumulators.)
template <typename V>
constexpr bool kPairTiles = kLanes<V> == 16;
template <typename V, int Vectors>
constexpr bool kPairTile = kPairTiles<V> && Vectors == 4;
// 5, not kTileRows: 6 x 4 tiles (24 accumulators) left g++ too few registers in the prefetching
// tile (it parked integers in vector registers and kept a weight vector on the stack) and were
// 3-7% slower.
constexpr int kPairTileRows = 5;
// Pair tiles for blocks of at least this many pixels. Fewer read each weight row for too few pixels:
// the convolution waits on its weight's stream (MobileNetV2 b1's 1x1s at 5x5, 25 pixels, cold
// weights: 0.106 -> 0.118 ms with pairs, 320 -> 1280; the 10x10 stage's blocks of 25 no better),
// and a pair's two streams arrive slower than one (where cache-hot, the same convolutions ran 3-8%
// faster in pairs).
constexpr int64_t kPairMinRows = 32;

// The last panel's channels past the output's are not read or written: its last vector (past a
// half vector, finish_tile) goes through the short array y (an array, not a vector argument: this function is not cloned per
// ISA, and vector arguments pass differently with and without AVX-512).
__attribute__((noinline)) void partial_store(float* y, const float* bias, const float* sum, Clamp clamp, float* out,
                                             int64_t width) {
  // Each branch outside its loop: a `bias ? bias[j] : 0` inside may become a masked load through
  // the null pointer, which AMD cores run many times slower (conv_gemm.cpp).
  if (bias != nullptr) {
    for (int64_t j = 0; j < width; ++j) y[j] += bias[j];
  }
  if (sum != nullptr) {
    for (int64_t j = 0; j < width; ++j) y[j] += sum[j];
  }
  if (clamp.on) {
    for (int64_t j = 0; j < width; ++j) y[j] = clamp_value(y[j], clamp.lo, clamp.hi);
  }
  std::memcpy(out, y, width * sizeof(float));
}

template <typename V, int Rows, int Vectors>
__attribute__((always_inline)) inline void zero_tile(V (&acc)[Rows][Vectors]) {
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
    if constexpr (Vectors > 2) {
#pragma GCC unroll 4
      for (int v = 0; v < Vectors; ++v) acc[r][v] = V{};
    } else {
#pragma GCC unroll 2
      for (int v = 0; v < Vectors; ++v) acc[r][v] = V{};
    }
  }
}

// One step over the depth: acc[r] += a[r * lda] * the panel row `w` (kPanel floats; a pair tile's
// vectors 2 and 3 from the next panel's row, next_panel floats on: kPairTiles).
template <typename V, int Rows, int Vectors>
__attribute__((always_inline)) inline void multiply_add(V (&acc)[Rows][Vectors], const float* a, int64_t lda,
                                                        const float* w, int64_t next_panel) {
  // The vector loops unrolled fully: a 3-vector loop under `unroll 2` kept the accumulators in
  // memory (5x slower), and `unroll 4` on the 2-vector loops made the 6x2 tiles 1.4-2x slower
  // at batch 8 (same trip count: g++'s code differs anyway), so each count has its own pragma.
  V weight[Vectors];
  if constexpr (kPairTile<V, Vectors>) {
    // Vectors 2 and 3 from the next panel's row (kPairTiles).
    const float* partner = w + next_panel;
    weight[0] = load<V>(w);
    weight[1] = load<V>(w + kLanes<V>);
    weight[2] = load<V>(partner);
    weight[3] = load<V>(partner + kLanes<V>);
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const V x = a[r * lda] - V{};  // broadcast (x - 0 is x, -0 included)
#pragma GCC unroll 4
      for (int v = 0; v < Vectors; ++v) acc[r][v] += x * weight[v];
    }
  } else if constexpr (Vectors > 2) {
#pragma GCC unroll 4
    for (int v = 0; v < Vectors; ++v) weight[v] = load<V>(w + kLanes<V> * v);
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const V x = a[r * lda] - V{};  // broadcast (x - 0 is x, -0 included)
#pragma GCC unroll 4
      for (int v = 0; v < Vectors; ++v) acc[r][v] += x * weight[v];
    }
  } else {
#pragma GCC unroll 2
    for (int v = 0; v < Vectors; ++v) weight[v] = load<V>(w + kLanes<V> * v);
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const V x = a[r * lda] - V{};  // broadcast (x - 0 is x, -0 included)
#pragma GCC unroll 2
      for (int v = 0; v < Vectors; ++v) acc[r][v] += x * weight[v];
    }
  }
}

// Vector v of a tile's row r (its sums) + bias + residual (rows ldc floats apart, like out's), then
// the clamp, stored once.
template <typename V>
__attribute__((always_inline)) inline void finish_vector(V sums, int r, int v, const float* bias, const float* sum,
                                                         Clamp clamp, float* out, int64_t ldc, int64_t width) {
  constexpr int lanes = kLanes<V>;
  if (lanes * (v + 1) <= width) {
    V y = sums;
    if (bias != nullptr) y += load<V>(bias + lanes * v);
    if (sum != nullptr) y += load<V>(sum + r * ldc + lanes * v);
    if (clamp.on) y = clamp_value(y, clamp.lo, clamp.hi);
    store<V>(out + r * ldc + lanes * v, y);
  } else {
    // A partial vector's first 8 lanes, when it has them, as a half vector (24 channels, 16 + 8:
    // MobileNetV2's projections to 24 stored a third of their outputs float by float); the
    // rest, if any, float by float.
    const int64_t j = lanes * v, rest = width - j;
    int64_t half = 0;
    if constexpr (lanes == 16) {
      if (rest >= 8) {
        Floats8 y = __builtin_shufflevector(sums, sums, 0, 1, 2, 3, 4, 5, 6, 7);
        if (bias != nullptr) y += load<Floats8>(bias + j);
        if (sum != nullptr) y += load<Floats8>(sum + r * ldc + j);
        if (clamp.on) y = clamp_value(y, clamp.lo, clamp.hi);
        store<Floats8>(out + r * ldc + j, y);
        half = 8;
      }
    }
    if (rest > half) {
      float y[lanes];
      store<V>(y, sums);
      partial_store(y + half, bias != nullptr ? bias + j + half : nullptr,
                    sum != nullptr ? sum + r * ldc + j + half : nullptr, clamp, out + r * ldc + j + half,
                    rest - half);
    }
  }
}

// A tile's sums + bias + residual, then the clamp, stored once (finish_vector; the vector loops
// unrolled as in multiply_add).
template <typename V, int Rows, int Vectors>
__attribute__((always_inline)) inline void finish_tile(V (&acc)[Rows][Vectors], const float* bias,
                                                       const float* sum, Clamp clamp, float* out, int64_t ldc,
                                                       int64_t width) {
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
    if constexpr (Vectors > 2) {
#pragma GCC unroll 4
      for (int v = 0; v < Vectors; ++v) finish_vector<V>(acc[r][v], r, v, bias, sum, clamp, out, ldc, width);
    } else {
#pragma GCC unroll 2
      for (int v = 0; v < Vectors; ++v) finish_vector<V>(acc[r][v], r, v, bias, sum, clamp, out, ldc, width);
    }
  }
}

// A tile of Rows pixels x `width` (<= kLanes<V> * Vectors) output channels: the sums over the depth in
// registers, then bias, residual and clamp, stored once. Rows of `a` (and of sum and out) are
// lda (ldc) floats apart; lda is the depth (a pair tile's second panel lda * kPanel floats on).
// With Prefetch, the first of every `every` steps over the depth also prefetches a row of kPanel
// floats, consecutive rows from `next` on (see panel_rows), and a pair tile the row lda * kPanel
// floats after each of them too: the next pair's second panel where `next` is the next pair's
// first in this convolution (the next convolution's panels, or input rows ahead, elsewhere: lines
// of little use, but no register of its own for a distance that holds everywhere). With
// Continue the sums start from what `out` holds (an earlier chunk's, panel_in_chunks: whole vectors,
// width is kLanes<V> * Vectors), else from zero.
template <typename V, int Rows, int Vectors, bool Prefetch, bool Continue = false>
__attribute__((always_inline)) inline void tile(const float* a, int64_t lda, const float* panel, int64_t depth,
                                                const float* bias, const float* sum, Clamp clamp, float* out,
                                                int64_t ldc, int64_t width, const float* next, int64_t every) {
  V acc[Rows][Vectors];
  if constexpr (Continue) {
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      // (`unroll 2` for pair tiles too: with `unroll 4` their chunked 1x1 convolutions ran 5-9%
      // slower, one core.)
#pragma GCC unroll 2
      for (int v = 0; v < Vectors; ++v) acc[r][v] = load<V>(out + r * ldc + kLanes<V> * v);
    }
  } else {
    zero_tile(acc);
  }
  if constexpr (Prefetch) {
    static_assert(kPanel == 32, "a panel row is two 64-byte lines");
    for (int64_t k0 = 0; k0 < depth; k0 += every, next += kPanel) {
      __builtin_prefetch(next);
      __builtin_prefetch(next + 16);
      if constexpr (kPairTile<V, Vectors>) {
        __builtin_prefetch(next + lda * kPanel);
        __builtin_prefetch(next + lda * kPanel + 16);
      }
      const int64_t k_end = std::min(depth, k0 + every);
      for (int64_t k = k0; k < k_end; ++k) multiply_add(acc, a + k, lda, panel + k * kPanel, lda * kPanel);
    }
  } else {
    for (int64_t k = 0; k < depth; ++k) multiply_add(acc, a + k, lda, panel + k * kPanel, lda * kPanel);
  }
  finish_tile<V, Rows, Vectors>(acc, bias, sum, clamp, out, ldc, width);
}

// tile as a function of its own, for the one-vector tiles (16 output channels or fewer with
// AVX-512: MobileNetV2's 32 -> 16): inlined into the block functions (thousands of instructions),
// g++ kept one accumulator of the 6 x 1 tile on the stack, a store and a reload per step on its
// accumulation chain (and the loop bound too); out of line its few registers are its own: that
// 1x1 convolution at 80x80 took 85 -> 50 us (one core), 373 -> 254 us at batch 8 on 2 threads.
// The two-vector tiles' loops stayed clean inlined. Pair tiles too run out of line: inlined, g++
// kept an accumulator and the rows' offsets on the stack (a store and reloads every step), and the
// 512 -> 128 1x1 at 28x28 ran at 91 GFLOP/s instead of 138 (one core). (BLADE_PATCH_TARGET: an
// out-of-line function does not take its caller's target, so it names the unit's.)
template <typename V, int Rows, int Vectors, bool Prefetch, bool Continue>
BLADE_PATCH_TARGET __attribute__((noinline)) void tile_out_of_line(const float* a, int64_t lda, const float* panel,
                                                                   int64_t depth, const float* bias, const float* sum,
                                                                   Clamp clamp, float* out, int64_t ldc, int64_t width,
                                                                   const float* next, int64_t every) {
  tile<V, Rows, Vectors, Prefetch, Continue>(a, lda, panel, depth, bias, sum, clamp, out, ldc, width, next, every);
}

template <typename V, int Rows, int Vectors, bool Prefetch, bool Continue>
__attribute__((always_inline)) inline void placed_tile(const float* a, int64_t lda, const float* panel, int64_t depth,
                                                       const float* bias, const float* sum, Clamp clamp, float* out,
                                                       int64_t ldc, int64_t width, const float* next, int64_t every) {
  if constexpr (Vectors == 1 || kPairTile<V, Vectors>) {
    tile_out_of_line<V, Rows, Vectors, Prefetch, Continue>(a, lda, panel, depth, bias, sum, clamp, out, ldc, width, next,
                                                           every);
  } else {
    tile<V, Rows, Vectors, Prefetch, Continue>(a, lda, panel, depth, bias, sum, clamp, out, ldc, width, next, every);
  }
}

template <typename V, int Rows, int Vectors, bool Continue>
__attribute__((always_inline)) inline void tile_prefetching(const float* a, int64_t lda, const float* panel,
                                                            int64_t depth, const float* bias, const float* sum,
                                                            Clamp clamp, float* out, int64_t ldc, int64_t width,
                                                            const float* next, int64_t every) {
  if (next != nullptr) {
    placed_tile<V, Rows, Vectors, true, Continue>(a, lda, panel, depth, bias, sum, clamp, out, ldc, width, next, every);
  } else {
    placed_tile<V, Rows, Vectors, false, Continue>(a, lda, panel, depth, bias, sum, clamp, out, ldc, width, nullptr, 1);
  }
}

// One tile of `rows` (1..MaxRows) pixels: tile_prefetching's Rows picked at run time.
template <typename V, int Vectors, int MaxRows, bool Continue>
__attribute__((always_inline)) inline void tile_of_rows(int64_t rows, const float* a, int64_t lda, const float* panel,
                                                        int64_t depth, const float* bias, const float* sum, Clamp clamp,
                                                        float* out, int64_t ldc, int64_t width, const float* next,
                                                        int64_t every) {
  if constexpr (MaxRows > 1) {
    if (rows < MaxRows) {
      tile_of_rows<V, Vectors, MaxRows - 1, Continue>(rows, a, lda, panel, depth, bias, sum, clamp, out, ldc, width, next,
                                                      every);
      return;
    }
  }
  tile_prefetching<V, MaxRows, Vectors, Continue>(a, lda, panel, depth, bias, sum, clamp, out, ldc, width, next, every);
}

// `rows` pixels of one panel (or a pair's two) in as few tiles of at most MaxRows as it takes, of
// even sizes (25 pixels: five of 5, not four of 6 and one of 1 that streams the whole panel again
// for one pixel).
// The tiles prefetch the next panel (null: none) while they reuse this one from the cache: a
// panel of a large weight (MobileNetV2's 320 -> 1280 at 5x5: 1.6 MB, cold in the model) otherwise
// arrives at the memory's pace during its first tile, and that conv took twice its cache-hot time.
// Each of the panel's `slices` * tiles tiles (this call's are slice `slice`'s) prefetches an equal
// share of the next panel's rows, one row every few steps: the whole next panel from the first
// tile (a row of 128 bytes every step of ~5 cycles) asked more of the memory than it delivers, and
// that tile waited on its own loads behind the prefetches. With `ahead` (a 1x1's next block of
// input rows, input_ahead), tile 0 prefetches the whole next panel and tiles 1 and 2 the ahead
// block's first 2 * depth * kPanel floats, the rows of 64 pixels, a row a step (a block has at
// most kBlockRows = 48). Pair tiles prefetch the next pair's second panel with them (tile), and
// where the rows come from `ahead` also the rows 32 pixels on (a pointer of their own would cost
// the tile a register; those lines are partly the same, partly the block after).
template <typename V, int Vectors, int MaxRows = kTileRows, bool Continue = false>
__attribute__((always_inline)) inline void panel_rows(const float* a, int64_t lda, const float* panel, int64_t depth,
                                                      const float* bias, const float* sum, Clamp clamp, float* out,
                                                      int64_t ldc, int64_t width, int64_t rows, const float* next,
                                                      int64_t next_depth, const float* ahead, int64_t slice,
                                                      int64_t slices) {
  const int64_t tiles = (rows + MaxRows - 1) / MaxRows;
  // Rows of the next panel (next_depth of them) a tile prefetches, one at the first of every
  // `every` steps.
  const int64_t sharing = ahead != nullptr ? 1 : slices * tiles;
  const int64_t share = std::max<int64_t>(1, (next_depth + sharing - 1) / sharing);
  const int64_t every = ahead != nullptr ? 1 : std::max<int64_t>(1, depth / share);
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int64_t end = rows * (t + 1) / tiles;
    const float* tile_sum = sum != nullptr ? sum + r * ldc : nullptr;
    const int64_t first_row = (slice * tiles + t) * share;  // of the next panel, this tile's share
    const float* tile_next = ahead != nullptr ? (t == 0 && slice == 0 ? next
                                                 : t <= 2 && slice == 0 ? ahead + (t - 1) * depth * kPanel
                                                                        : nullptr)
                             : next != nullptr && first_row < next_depth ? next + first_row * kPanel
                                                                    : nullptr;
    tile_of_rows<V, Vectors, MaxRows, Continue>(end - r, a + r * lda, lda, panel, depth, bias, tile_sum, clamp,
                                                out + r * ldc, ldc, width, tile_next, every);
    r = end;
  }
}

// Where the image-row tiles read (image_block): Rows adjacent output pixels of one image row whose
// taps all lie inside the image width (undilated along it), straight from the channels-last image.
// Per kernel row inside the image height one run of `run` = kernel_w * channels floats: pixel r's
// lda = stride_w * channels floats after pixel 0's, kernel row i's row_step floats after row 0's.
// The kernel rows in the top/bottom padding are skipped (their taps add zeros); `panel` starts at
// the first one inside.
struct ImageRows {
  const float* a;  // pixel 0's run in the first kernel row inside the image
  int64_t lda, row_step, run, kernel_rows;
};

// The image-row counterpart of tile (no prefetch: it serves first convolutions, whose weights are
// a few KB). Its own function so that tile, which every 1x1 convolution runs, stays as it was (one
// tile for both, reading through a per-source callback, made the 1x1 convolutions 1.7-2x slower).
template <typename V, int Rows, int Vectors>
__attribute__((always_inline)) inline void image_tile(const ImageRows& src, const float* panel, const float* bias,
                                                      const float* sum, Clamp clamp, float* out, int64_t ldc,
                                                      int64_t width) {
  V acc[Rows][Vectors];
  zero_tile(acc);
  const int64_t lda = src.lda, run = src.run;
  for (int64_t i = 0; i < src.kernel_rows; ++i) {
    const float* a = src.a + i * src.row_step;
    const float* p = panel + i * run * kPanel;
    for (int64_t k = 0; k < run; ++k) multiply_add(acc, a + k, lda, p + k * kPanel, 0);  // (no pair tiles)
  }
  finish_tile<V, Rows, Vectors>(acc, bias, sum, clamp, out, ldc, width);
}

// panel_rows for image rows: `rows` pixels in even tiles of at most kTileRows.
template <typename V, int Vectors>
__attribute__((always_inline)) inline void image_panel_rows(const ImageRows& src, const float* panel,
                                                            const float* bias, const float* sum, Clamp clamp,
                                                            float* out, int64_t ldc, int64_t width, int64_t rows) {
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int64_t end = rows * (t + 1) / tiles;
    const float* tile_sum = sum != nullptr ? sum + r * ldc : nullptr;
    ImageRows ta = src;
    ta.a += r * src.lda;
    float* tout = out + r * ldc;
    switch (end - r) {
      case 1: image_tile<V, 1, Vectors>(ta, panel, bias, tile_sum, clamp, tout, ldc, width); break;
      case 2: image_tile<V, 2, Vectors>(ta, panel, bias, tile_sum, clamp, tout, ldc, width); break;
      case 3: image_tile<V, 3, Vectors>(ta, panel, bias, tile_sum, clamp, tout, ldc, width); break;
      case 4: image_tile<V, 4, Vectors>(ta, panel, bias, tile_sum, clamp, tout, ldc, width); break;
      case 5: image_tile<V, 5, Vectors>(ta, panel, bias, tile_sum, clamp, tout, ldc, width); break;
      default: image_tile<V, 6, Vectors>(ta, panel, bias, tile_sum, clamp, tout, ldc, width); break;
    }
    r = end;
  }
}

__attribute__((always_inline)) inline const float* shifted(const float* p, int64_t by) { return p != nullptr ? p + by : nullptr; }

// `rows` pixels of one panel's `width` channels, as tiles of kTileChannels<V> channels (a whole
// panel with AVX-512, its two halves with AVX2), all of them sharing the prefetch of `next`; or of
// a pair of whole panels (width 2 * kPanel, kPairTiles), as pair tiles.
template <typename V, bool Continue = false>
__attribute__((always_inline)) inline void panel_slices(const float* a, int64_t lda, const float* panel, int64_t depth,
                                                        const float* bias, const float* sum, Clamp clamp, float* out,
                                                        int64_t ldc, int64_t width, int64_t rows, const float* next,
                                                        int64_t next_depth, const float* ahead = nullptr) {
  if constexpr (kLanes<V> == 8) {
    // 17-24 channels with AVX2 (MobileNetV2's projections to 24) as one tile of three vectors x 4
    // pixels (12 accumulators, 3 weights, 1 broadcast: 7 loads for 12 FMAs, each pixel's input read
    // once), not a 16-wide 6x2 tile and an 8-wide 6x1 one (7 loads for 6 FMAs, the input read twice):
    // 96 -> 24 and 144 -> 24 at 40x40, one core: 99 -> 87 and 158 -> 149 us at batch 1, 1097 -> 734
    // and 3083 -> 2464 us at batch 8. (32 as four vectors x 3 pixels was 15-25% slower than two
    // 16-wide tiles.)
    if (width > 2 * kLanes<V> && width <= 3 * kLanes<V>) {
      panel_rows<V, 3, 4, Continue>(a, lda, panel, depth, bias, sum, clamp, out, ldc, width, rows, next, next_depth, ahead, 0, 1);
      return;
    }
  }
  if constexpr (kPairTiles<V>) {
    if (width == 2 * kPanel) {
      panel_rows<V, 4, kPairTileRows, Continue>(a, lda, panel, depth, bias, sum, clamp, out, ldc, width, rows, next,
                                            next_depth, ahead, 0, 1);
      return;
    }
  }
  const int64_t slices = (width + kTileChannels<V> - 1) / kTileChannels<V>;
  for (int64_t slice = 0, j = 0; slice < slices; ++slice, j += kTileChannels<V>) {
    const int64_t w = std::min(kTileChannels<V>, width - j);
    if (w > kLanes<V>) {
      panel_rows<V, 2, kTileRows, Continue>(a, lda, panel + j, depth, shifted(bias, j), shifted(sum, j), clamp, out + j, ldc, w, rows,
                       next, next_depth, ahead, slice, slices);
    } else {
      panel_rows<V, 1, kTileRows, Continue>(a, lda, panel + j, depth, shifted(bias, j), shifted(sum, j), clamp, out + j, ldc, w, rows,
                       next, next_depth, ahead, slice, slices);
    }
  }
}

// panel_slices for image rows.
template <typename V>
__attribute__((always_inline)) inline void image_panel_slices(const ImageRows& src, const float* panel, const float* bias,
                                                              const float* sum, Clamp clamp, float* out, int64_t ldc,
                                                              int64_t width, int64_t rows) {
  for (int64_t j = 0; j < width; j += kTileChannels<V>) {
    const int64_t w = std::min(kTileChannels<V>, width - j);
    if (w > kLanes<V>) {
      image_panel_rows<V, 2>(src, panel + j, shifted(bias, j), shifted(sum, j), clamp, out + j, ldc, w, rows);
    } else {
      image_panel_rows<V, 1>(src, panel + j, shifted(bias, j), shifted(sum, j), clamp, out + j, ldc, w, rows);
    }
  }
}

// Copies of the short runs gather makes (MobileNetV2's stem: 9 floats, three a pixel) as whole
// vectors: each one a memmove call cost the stem 67 of its 116 us (one core). A store may run up
// to 15 floats past the run, into the part of dest written next (runs go out in increasing
// order; the buffer has kGatherSlack floats more, conv_patch_blocks.h); a load runs past only while
// it stays inside the input (`limit` is its end), else the tail goes float by float.

template <typename V>
__attribute__((always_inline)) inline void copy_run(float* dest, const float* from, int64_t count, const float* limit) {
  constexpr int lanes = kLanes<V>;
  int64_t i = 0;
  for (; i + lanes <= count; i += lanes) store<V>(dest + i, load<V>(from + i));
  if (i == count) return;
  if (from + i + lanes <= limit) {
    store<V>(dest + i, load<V>(from + i));
  } else {
    for (; i < count; ++i) dest[i] = from[i];
  }
}

template <typename V>
__attribute__((always_inline)) inline void zero_run(float* dest, int64_t count) {
  for (int64_t i = 0; i < count; i += kLanes<V>) store<V>(dest + i, V{});
}

// The receptive fields of output pixels [begin, end) as rows of dest ([kh][kw][channel] each,
// zeros where a tap falls into the padding), from a channels-last image batch. An undilated
// kernel row inside the image is one run of kernel_w * channels floats. dest holds
// kGatherSlack floats past the rows.
template <typename V>
__attribute__((always_inline)) inline void gather(const PatchConvShape& s, const float* input, int64_t begin,
                                                  int64_t end, float* dest) {
  const int64_t channels = s.in_channels, depth = s.depth(), run = s.kernel_w * channels;
  const float* limit = input + s.batch * s.in_h * s.in_w * channels;
  int64_t n = begin / (s.out_h * s.out_w), oh = begin / s.out_w % s.out_h, ow = begin % s.out_w;
  for (int64_t row = begin; row < end; ++row) {
    const float* image = input + n * s.in_h * s.in_w * channels;
    float* d = dest + (row - begin) * depth;
    const int64_t iw0 = ow * s.stride_w - s.pad_left;
    const bool whole_rows = s.dilation_w == 1 && iw0 >= 0 && iw0 + s.kernel_w <= s.in_w;
    for (int64_t kh = 0; kh < s.kernel_h; ++kh, d += run) {
      const int64_t ih = oh * s.stride_h - s.pad_top + kh * s.dilation_h;
      if (ih < 0 || ih >= s.in_h) {
        zero_run<V>(d, run);
      } else if (whole_rows) {
        copy_run<V>(d, image + (ih * s.in_w + iw0) * channels, run, limit);
      } else {
        for (int64_t kw = 0; kw < s.kernel_w; ++kw) {
          const int64_t iw = iw0 + kw * s.dilation_w;
          float* tap = d + kw * channels;
          if (iw < 0 || iw >= s.in_w) {
            zero_run<V>(tap, channels);
          } else {
            copy_run<V>(tap, image + (ih * s.in_w + iw) * channels, channels, limit);
          }
        }
      }
    }
    if (++ow == s.out_w) {
      ow = 0;
      if (++oh == s.out_h) oh = 0, ++n;
    }
  }
}

// An NCHW output's channels [j0, j0 + width) of pixels [begin, end) from `staged` (one row of kPanel
// floats per pixel, bias added): + residual (NCHW too), then the clamp, the channels-last path's
// order. Each channel's pixels are a contiguous run within an image.
template <bool kSum, bool kClamp>
__attribute__((always_inline)) inline void scatter_nchw(const PatchConvShape& s, const float* staged, const float* sum,
                                                        Clamp clamp, float* output, int64_t begin, int64_t end,
                                                        int64_t j0, int64_t width) {
  const int64_t plane = s.out_h * s.out_w;
  for (int64_t row = begin; row < end;) {
    const int64_t n = row / plane, p0 = row % plane, run = std::min(end - row, plane - p0);
    for (int64_t j = 0; j < width; ++j) {
      const int64_t at = (n * s.out_channels + j0 + j) * plane + p0;
      const float* from = staged + (row - begin) * kPanel + j;
      for (int64_t r = 0; r < run; ++r) {
        float v = from[r * kPanel];
        if (kSum) v += sum[at + r];
        if (kClamp) v = clamp_value(v, clamp.lo, clamp.hi);
        output[at + r] = v;
      }
    }
    row += run;
  }
}

// Where panel p of pixels [begin, end) goes: a channels-last output directly (bias, residual and
// clamp in the tile), an NCHW one through `staged` (kBlockRows x kPanel floats, bias only; the
// residual and clamp in scatter_panel).
struct PanelTarget {
  const float *panel, *bias, *sum;
  float* out;
  int64_t ldc, width;
  Clamp clamp;
};

__attribute__((always_inline)) inline PanelTarget panel_target(const PatchConvShape& s, const float* panels,
                                                              const float* bias, const float* sum, Clamp clamp,
                                                              float* output, float* staged, int64_t begin, int64_t p) {
  const int64_t j0 = p * kPanel, channels = s.out_channels;
  const bool direct_out = s.output_channels_last;
  return PanelTarget{panels + p * s.depth() * kPanel,
                     bias != nullptr ? bias + j0 : nullptr,
                     sum != nullptr && direct_out ? sum + begin * channels + j0 : nullptr,
                     direct_out ? output + begin * channels + j0 : staged,
                     direct_out ? channels : kPanel,
                     std::min(kPanel, channels - j0),
                     direct_out ? clamp : Clamp{}};
}

// An NCHW output's panel p of pixels [begin, end) from `staged`.
__attribute__((always_inline)) inline void scatter_panel(const PatchConvShape& s, const float* staged, const float* sum,
                                                         Clamp clamp, float* output, int64_t begin, int64_t end,
                                                         int64_t p, int64_t width) {
  const int64_t j0 = p * kPanel;
  if (sum != nullptr) {
    if (clamp.on) scatter_nchw<true, true>(s, staged, sum, clamp, output, begin, end, j0, width);
    else scatter_nchw<true, false>(s, staged, sum, clamp, output, begin, end, j0, width);
  } else {
    if (clamp.on) scatter_nchw<false, true>(s, staged, sum, clamp, output, begin, end, j0, width);
    else scatter_nchw<false, false>(s, staged, sum, clamp, output, begin, end, j0, width);
  }
}

// A 1x1 convolution's input rows are read in place, each row's depth floats once per panel; the
// first panel's tiles meet them cold when the input exceeds the caches (MobileNetV2's 144 -> 24 at
// 40x40 from batch 8: 7.4 MB, written by the depthwise convolution before it), and the tiles then
// wait on memory (4 rows of 576 bytes a tile: too short a stream for the hardware prefetchers). So
// above kAheadInputBytes each block's first panel prefetches the next block's rows (panel_rows).
// Below, the input is still in the caches from the layer that wrote it. (Past the input's end the
// prefetches of the last blocks touch nothing: a prefetch never faults.)
constexpr int64_t kAheadInputBytes = int64_t{4} << 20;
__attribute__((always_inline)) inline bool input_ahead(const PatchConvShape& s) {
  return s.batch * s.in_h * s.in_w * s.in_channels * int64_t{sizeof(float)} > kAheadInputBytes;
}

// A whole panel (kPanel channels), or a pair of them, of `rows` pixels summed over the depth in
// chunks of kDepthChunk rows (a pair's: 24 KB of weight, which a 48 KB L1 holds with the rows; on
// an AVX-512 Xeon chunks of 48 rows were 2-8% slower): each tile sums one chunk, its running sums
// kept in the output (or the NCHW staging block) between chunks and reloaded for the next (bitwise
// the sums of one pass); bias, residual and clamp come with the last chunk. A chunk of the panel and of the rows stays in L1 across all of the
// block's tiles, where in one pass every tile streamed the whole panel from L2 and the first tile
// of a weight that comes from memory waited on it. Each chunk prefetches the next one (the last
// chunk `next`, next_depth rows: what panel_slices would prefetch over the panel).
template <typename V>
__attribute__((always_inline)) inline void panel_in_chunks(const float* a, int64_t depth, const PanelTarget& t,
                                                           int64_t rows, const float* next, int64_t next_depth) {
  for (int64_t k0 = 0; k0 < depth; k0 += kDepthChunk) {
    const int64_t chunk = std::min(kDepthChunk, depth - k0), rest = depth - k0 - chunk;
    const bool last = rest == 0;
    const float* chunk_next = last ? next : t.panel + (k0 + chunk) * kPanel;
    const int64_t chunk_next_depth = std::min(kDepthChunk, last ? next_depth : rest);
    const float* bias = last ? t.bias : nullptr;
    const float* sum = last ? t.sum : nullptr;
    const Clamp clamp = last ? t.clamp : Clamp{};
    if (k0 == 0) {
      panel_slices<V, false>(a, depth, t.panel, chunk, bias, sum, clamp, t.out, t.ldc, t.width, rows, chunk_next,
                             chunk_next_depth);
    } else {
      panel_slices<V, true>(a + k0, depth, t.panel + k0 * kPanel, chunk, bias, sum, clamp, t.out, t.ldc, t.width,
                            rows, chunk_next, chunk_next_depth);
    }
  }
}

// How many panels from p on a block function sums in one pass, 2 (pair tiles; t widened to both)
// where kPairTiles and pair_tiles allow, the block has kPairMinRows pixels and panels p and p + 1
// are whole and in its range, into a channels-last output (an NCHW one is staged a panel at a
// time); else 1.
template <typename V>
__attribute__((always_inline)) inline int64_t panel_step(const PatchConvShape& s, int64_t rows, int64_t p,
                                                         int64_t panel_end, bool pair_tiles, PanelTarget& t) {
  if (!(kPairTiles<V> && pair_tiles && s.output_channels_last && rows >= kPairMinRows && p + 1 < panel_end &&
        (p + 2) * kPanel <= s.out_channels)) {
    return 1;
  }
  t.width = 2 * kPanel;
  return 2;
}

// Output pixels [begin, end) x panels [panel_begin, panel_end), rows gathered (or a 1x1's input
// read in place); with pair_tiles (and kPairTiles) two whole panels at a time into a channels-last
// output. Returns the panels summed in pairs.
template <typename V>
__attribute__((always_inline)) inline int64_t patch_block_for(BLADE_BLOCK_PARAMS) {
  const int64_t depth = s.depth(), channels = s.out_channels;
  const float* a = input + begin * depth;
  if (!s.direct()) {
    gather<V>(s, input, begin, end, gathered);
    a = gathered;
  }
  const float* ahead = nullptr;
  if (s.direct() && input_ahead(s) && end < s.batch * s.out_h * s.out_w) ahead = input + end * depth;
  int64_t paired = 0;
  for (int64_t p = panel_begin, step = 1; p < panel_end; p += step) {
    PanelTarget t = panel_target(s, panels, bias, sum, clamp, output, staged, begin, p);
    step = panel_step<V>(s, end - begin, p, panel_end, pair_tiles, t);
    const bool pair = step > 1;
    paired += pair ? step : 0;
    // The next panel even past this item's (its neighbour's, or this thread's next item's), or
    // after the last one `after` (after_depth rows) when the caller knows what this thread does next;
    // a pair tile prefetches the panel after that one too (tile).
    const bool last = p + step == panel_end && after != nullptr;
    const float* next = last ? after : prefetch && (p + step) * kPanel < channels ? t.panel + step * depth * kPanel : nullptr;
    const int64_t next_depth = last ? after_depth : depth;
    // (Not when the residual is the output itself: the chunks' running sums would overwrite it.)
    if (depth > 2 * kDepthChunk && (t.width == kPanel || pair) && !(p == panel_begin && ahead != nullptr) &&
        t.sum != t.out) {
      panel_in_chunks<V>(a, depth, t, end - begin, next, next_depth);
    } else {
      panel_slices<V>(a, depth, t.panel, depth, t.bias, t.sum, t.clamp, t.out, t.ldc, t.width, end - begin, next,
                      next_depth, p == panel_begin ? ahead : nullptr);
    }
    if (!s.output_channels_last) scatter_panel(s, staged, sum, clamp, output, begin, end, p, t.width);
  }
  return paired;
}

// A run of a block's pixels [begin, end) whose rows are read one way: from the image or gathered.
struct Segment {
  int64_t begin, end;
  bool from_image;
};

// Appends pixels [begin, end) to segments, a gathered run merged into a gathered last one that
// ends at begin (a run read from the image stays within its image row).
inline void append(Segment* segments, int& count, int64_t begin, int64_t end, bool from_image) {
  if (begin == end) return;
  if (!from_image && count > 0 && !segments[count - 1].from_image && segments[count - 1].end == begin) {
    segments[count - 1].end = end;
  } else {
    segments[count++] = {begin, end, from_image};
  }
}

// Pixels [begin, end) as segments, in order: within each output row the pixels whose taps all lie
// inside the image width, when at least kTileRows of them (fewer would make short tiles), read
// from the image; the rest gathered (a row's right border and the next row's left border one
// segment). Returns the count, at most end - begin. (noinline: out of line, as when its three
// callers shared one file; called once per unit, g++ would inline it and allocate image_block's
// registers differently.)
__attribute__((noinline)) int image_segments(const PatchConvShape& s, int64_t begin, int64_t end, Segment* segments) {
  int count = 0;
  // Output columns [inside_begin, inside_end): every tap inside the width (dilation_w is 1).
  const int64_t inside_begin = std::min((s.pad_left + s.stride_w - 1) / s.stride_w, s.out_w);
  const int64_t last_start = s.in_w - s.kernel_w + s.pad_left;  // the largest ow * stride_w inside
  const int64_t inside_end =
      last_start < 0 ? inside_begin : std::max(inside_begin, std::min(s.out_w, last_start / s.stride_w + 1));
  for (int64_t row = begin; row < end;) {
    const int64_t ow = row % s.out_w, row_end = std::min(end, row + s.out_w - ow);
    const int64_t lo = row + std::clamp(inside_begin - ow, int64_t{0}, row_end - row);
    const int64_t hi = row + std::clamp(inside_end - ow, lo - row, row_end - row);
    if (hi - lo >= kTileRows) {
      append(segments, count, row, lo, false);
      append(segments, count, lo, hi, true);
      append(segments, count, hi, row_end, false);
    } else {
      append(segments, count, row, row_end, false);
    }
    row = row_end;
  }
  return count;
}

// The image rows of output pixels from `pixel` on (one image row, every tap inside the width) in
// the channels-last image, and the first kernel row inside the image height.
inline ImageRows image_rows(const PatchConvShape& s, const float* input, int64_t pixel, int64_t& first) {
  const int64_t n = pixel / (s.out_h * s.out_w), oh = pixel / s.out_w % s.out_h, ow = pixel % s.out_w;
  const int64_t ih0 = oh * s.stride_h - s.pad_top;  // kernel row 0's image row
  first = ih0 >= 0 ? 0 : (-ih0 + s.dilation_h - 1) / s.dilation_h;
  const int64_t last = s.in_h > ih0 ? std::min(s.kernel_h, (s.in_h - ih0 + s.dilation_h - 1) / s.dilation_h) : 0;
  const int64_t channels = s.in_channels, kernel_rows = std::max<int64_t>(0, last - first);
  const float* a = kernel_rows == 0 ? input
                                    : input + ((n * s.in_h + ih0 + first * s.dilation_h) * s.in_w +
                                               ow * s.stride_w - s.pad_left) * channels;
  return ImageRows{a, s.stride_w * channels, s.dilation_h * s.in_w * channels, s.kernel_w * channels, kernel_rows};
}

// patch_block for convolutions that read image rows in place (PatchConvShape::image_rows): the
// pixels whose taps lie inside the width from the image, the others gathered. Gathering every
// pixel cost MobileNetV2's stem (3 channels, runs of 9 floats) as much as its multiply-adds.
// (No prefetch: a first convolution's weight is a few KB.)
template <typename V>
__attribute__((always_inline)) inline int64_t image_block_for(BLADE_BLOCK_PARAMS) {
  const int64_t depth = s.depth();
  Segment segments[kBlockRows];
  const int count = image_segments(s, begin, end, segments);
  // In increasing order: a gathered run's last store may run into the rows after it.
  for (int i = 0; i < count; ++i) {
    if (!segments[i].from_image) {
      gather<V>(s, input, segments[i].begin, segments[i].end, gathered + (segments[i].begin - begin) * depth);
    }
  }
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const PanelTarget t = panel_target(s, panels, bias, sum, clamp, output, staged, begin, p);
    for (int i = 0; i < count; ++i) {
      const Segment& segment = segments[i];
      const int64_t offset = segment.begin - begin, rows = segment.end - segment.begin;
      const float* segment_sum = t.sum != nullptr ? t.sum + offset * t.ldc : nullptr;
      float* out = t.out + offset * t.ldc;
      if (segment.from_image) {
        int64_t first = 0;
        const ImageRows src = image_rows(s, input, segment.begin, first);
        const float* panel = t.panel + first * src.run * kPanel;
        image_panel_slices<V>(src, panel, t.bias, segment_sum, t.clamp, out, t.ldc, t.width, rows);
      } else {
        const float* a = gathered + offset * depth;
        panel_slices<V>(a, depth, t.panel, depth, t.bias, segment_sum, t.clamp, out, t.ldc, t.width, rows, nullptr, 0);
      }
    }
    if (!s.output_channels_last) scatter_panel(s, staged, sum, clamp, output, begin, end, p, t.width);
  }
  // No pair tiles: on image rows they were slower (ResNet's 7x7 stride-2 stem, 3 -> 64 channels at
  // 224x224, one core: 130 -> 118 GFLOP/s; its short runs of 21 floats a kernel row).
  return 0;
}

}  // namespace
}  // namespace blade
