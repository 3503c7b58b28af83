#include "winograd.h"

#include "isa_clones.h"
#include "timed_parallel.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <vector>

namespace blade {
namespace {

// The transforms are add-only loops over contiguous channels, vectorized with `omp simd` (the
// extension builds with -fopenmp; the fixed 4x4 inner loops are unrolled first, or -O2 leaves the
// channel loop scalar) and cloned per ISA (isa_clones.h): the extension is built for baseline
// x86-64, and AVX-512 doubles their throughput.

// v[e * plane + c] = (B^T d B)[e] for the 4x4 patch d whose pixel e (row-major) starts at pixel[e].
BLADE_ISA_CLONES void input_transform_2(const float* const* pixel, int64_t channels, float* v, int64_t plane) {
  constexpr int kPoints = 16;
#pragma omp simd
  for (int64_t c = 0; c < channels; ++c) {
    float d[kPoints], t[kPoints];
    #pragma GCC unroll 16
    for (int e = 0; e < kPoints; ++e) d[e] = pixel[e][c];
    #pragma GCC unroll 16
    for (int j = 0; j < 4; ++j) {  // B^T d, B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]
      t[0 * 4 + j] = d[0 * 4 + j] - d[2 * 4 + j];
      t[1 * 4 + j] = d[1 * 4 + j] + d[2 * 4 + j];
      t[2 * 4 + j] = d[2 * 4 + j] - d[1 * 4 + j];
      t[3 * 4 + j] = d[1 * 4 + j] - d[3 * 4 + j];
    }
    #pragma GCC unroll 16
    for (int i = 0; i < 4; ++i) {  // (B^T d) B
      v[(i * 4 + 0) * plane + c] = t[i * 4 + 0] - t[i * 4 + 2];
      v[(i * 4 + 1) * plane + c] = t[i * 4 + 1] + t[i * 4 + 2];
      v[(i * 4 + 2) * plane + c] = t[i * 4 + 2] - t[i * 4 + 1];
      v[(i * 4 + 3) * plane + c] = t[i * 4 + 1] - t[i * 4 + 3];
    }
  }
}

// out[q][k] = clamp(y[q] + bias[k] + sum[q][k]) for the Outputs values y of channel k of a tile.
template <int Outputs, bool kSum, bool kClamp>
__attribute__((always_inline)) inline void store_outputs(const float (&y)[Outputs], int64_t k, const float* bias,
                                                         const float* const* sum, Clamp clamp, float* const* out) {
  #pragma GCC unroll 16
  for (int q = 0; q < Outputs; ++q) {
    float value = y[q] + bias[k];
    if (kSum) value += sum[q][k];
    if (kClamp) value = clamp_value(value, clamp.lo, clamp.hi);
    out[q][k] = value;
  }
}

// out[q][k] = clamp((A^T m A)[q] + bias[k] + sum[q][k]) for the 2x2 outputs q of one tile, m[e] at
// m[e * plane + k]. Outputs outside the image point at a scratch row (written, never read).
template <bool kSum, bool kClamp>
BLADE_ISA_CLONES void output_transform_2(const float* m, int64_t plane, int64_t channels, const float* bias,
                                         const float* const* sum, Clamp clamp, float* const* out) {
  constexpr int kPoints = 16;
#pragma omp simd
  for (int64_t k = 0; k < channels; ++k) {
    float s[kPoints], t[8];
    #pragma GCC unroll 16
    for (int e = 0; e < kPoints; ++e) s[e] = m[e * plane + k];
    #pragma GCC unroll 16
    for (int j = 0; j < 4; ++j) {  // A^T s, A^T = [1 1 1 0; 0 1 -1 -1]
      t[0 * 4 + j] = s[0 * 4 + j] + s[1 * 4 + j] + s[2 * 4 + j];
      t[1 * 4 + j] = s[1 * 4 + j] - s[2 * 4 + j] - s[3 * 4 + j];
    }
    float y[4];
    #pragma GCC unroll 16
    for (int i = 0; i < 2; ++i) {  // (A^T s) A
      y[i * 2 + 0] = t[i * 4 + 0] + t[i * 4 + 1] + t[i * 4 + 2];
      y[i * 2 + 1] = t[i * 4 + 1] - t[i * 4 + 2] - t[i * 4 + 3];
    }
    store_outputs<4, kSum, kClamp>(y, k, bias, sum, clamp, out);
  }
}

// F(4x4, 3x3) (Lavin & Gray's points 0, +-1, +-2 and infinity): 36 multiplies per 16 outputs
// where F(2x2, 3x3) takes 64 (16 per 4), its input and output transforms per output fewer too,
// at ~15x F(2x2)'s rounding (max error ~3e-6 of the largest output on random 64-256-channel
// layers against float64, where F(2x2) and a direct convolution are at ~2e-7).

// r = B^T x for 6 values x (one column or row of a 6x6 tile),
// B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0; 0 4 0 -5 0 1].
__attribute__((always_inline)) inline void input_points_4(const float (&x)[6], float (&r)[6]) {
  r[0] = 4.0f * x[0] - 5.0f * x[2] + x[4];
  r[1] = -4.0f * (x[1] + x[2]) + x[3] + x[4];
  r[2] = 4.0f * (x[1] - x[2]) - x[3] + x[4];
  r[3] = 2.0f * (x[3] - x[1]) - x[2] + x[4];
  r[4] = 2.0f * (x[1] - x[3]) - x[2] + x[4];
  r[5] = 4.0f * x[1] - 5.0f * x[3] + x[5];
}

// r = A^T x for 6 values x, A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1].
__attribute__((always_inline)) inline void output_points_4(const float (&x)[6], float (&r)[4]) {
  const float plus12 = x[1] + x[2], minus12 = x[1] - x[2], plus34 = x[3] + x[4], minus34 = x[3] - x[4];
  r[0] = x[0] + plus12 + plus34;
  r[1] = minus12 + 2.0f * minus34;
  r[2] = plus12 + 4.0f * plus34;
  r[3] = minus12 + 8.0f * minus34 + x[5];
}

// v[e * plane + c] = (B^T d B)[e] for the 6x6 patch d whose pixel e (row-major) starts at pixel[e].
BLADE_ISA_CLONES void input_transform_4(const float* const* pixel, int64_t channels, float* v, int64_t plane) {
#pragma omp simd
  for (int64_t c = 0; c < channels; ++c) {
    float t[36];
    #pragma GCC unroll 6
    for (int j = 0; j < 6; ++j) {  // B^T d, column j
      float x[6], r[6];
      #pragma GCC unroll 6
      for (int i = 0; i < 6; ++i) x[i] = pixel[i * 6 + j][c];
      input_points_4(x, r);
      #pragma GCC unroll 6
      for (int i = 0; i < 6; ++i) t[i * 6 + j] = r[i];
    }
    #pragma GCC unroll 6
    for (int i = 0; i < 6; ++i) {  // (B^T d) B, row i
      float x[6], r[6];
      #pragma GCC unroll 6
      for (int j = 0; j < 6; ++j) x[j] = t[i * 6 + j];
      input_points_4(x, r);
      #pragma GCC unroll 6
      for (int j = 0; j < 6; ++j) v[(i * 6 + j) * plane + c] = r[j];
    }
  }
}

// out[q][k] = clamp((A^T m A)[q] + bias[k] + sum[q][k]) for the 4x4 outputs q of one tile, m[e] at
// m[e * plane + k]. Outputs outside the image point at a scratch row (written, never read).
template <bool kSum, bool kClamp>
BLADE_ISA_CLONES void output_transform_4(const float* m, int64_t plane, int64_t channels, const float* bias,
                                         const float* const* sum, Clamp clamp, float* const* out) {
#pragma omp simd
  for (int64_t k = 0; k < channels; ++k) {
    float t[24];
    #pragma GCC unroll 6
    for (int j = 0; j < 6; ++j) {  // A^T m, column j
      float x[6], r[4];
      #pragma GCC unroll 6
      for (int i = 0; i < 6; ++i) x[i] = m[(i * 6 + j) * plane + k];
      output_points_4(x, r);
      #pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) t[i * 6 + j] = r[i];
    }
    float y[16];
    #pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // (A^T m) A, row i
      float x[6], r[4];
      #pragma GCC unroll 6
      for (int j = 0; j < 6; ++j) x[j] = t[i * 6 + j];
      output_points_4(x, r);
      #pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) y[i * 4 + j] = r[j];
    }
    store_outputs<16, kSum, kClamp>(y, k, bias, sum, clamp, out);
  }
}

using InputTransform = void (*)(const float* const*, int64_t, float*, int64_t);
using OutputTransform = void (*)(const float*, int64_t, int64_t, const float*, const float* const*, Clamp,
                                 float* const*);

// Each tile size's transforms.
template <int Tile>
struct Transforms;
template <>
struct Transforms<2> {
  static constexpr InputTransform input = input_transform_2;
  static constexpr OutputTransform output[2][2] = {{output_transform_2<false, false>, output_transform_2<false, true>},
                                                   {output_transform_2<true, false>, output_transform_2<true, true>}};
};
template <>
struct Transforms<4> {
  static constexpr InputTransform input = input_transform_4;
  static constexpr OutputTransform output[2][2] = {{output_transform_4<false, false>, output_transform_4<false, true>},
                                                   {output_transform_4<true, false>, output_transform_4<true, true>}};
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether x[0, n) holds no infinity or NaN (x - x is 0 for every finite x, NaN otherwise).
BLADE_ISA_CLONES bool all_finite(const float* x, int64_t n) {
  float check = 0.0f;
#pragma omp simd reduction(+ : check)
  for (int64_t i = 0; i < n; ++i) check += x[i] - x[i];
  return check == 0.0f;
}

// F(2x2): a weight of at most kBlockedWeightFloats transformed floats (64 x 64 channels: 256 KiB) is run
// block of tiles by block of tiles (tile_blocks), each block's transformed inputs and outputs at
// most kBlockFloats (512 KiB; 768 with the weight: within the L2 of every x86 core we ran on, 1 MiB
// and up). In three passes over every tile, ResNet-18's 64-channel 3x3 at 56x56 (784 tiles) wrote and
// read 3.2 MB buffers twice, beyond an L2, and spent about as long in its transforms as in its
// GEMMs: blocks of 56 tiles took it from 0.80-0.93 to 0.63-0.72 ms (2 threads, an Intel Xeon with
// AVX-512, in the model; ONNX Runtime's direct convolution ~0.7). A larger weight is streamed once
// per block: ResNet's 128-channel one (1 MiB transformed, 196 tiles) was 3-20% slower in blocks of
// 16-128 tiles, so from there on the passes stay.
constexpr int64_t kBlockedWeightFloats = 16 * 64 * 64;  // F(2x2)'s transformed weight
constexpr int64_t kBlockFloats = int64_t{1} << 17;

// How many blocks of tiles to run (0: run in three passes): as few as hold at most kBlockFloats
// each, at least one a thread, and a multiple of the threads where there are more (784 tiles on 2
// threads: 14 blocks of 56, not 13 of up to 64, one of them left for one thread at the end).
int64_t tile_blocks(int64_t c_in, int64_t c_out, int64_t tiles, int64_t threads) {
  constexpr int64_t kPoints = 16;  // F(2x2)'s
  if (kPoints * c_in * c_out > kBlockedWeightFloats) return 0;
  const int64_t most_tiles = std::max<int64_t>(1, kBlockFloats / (kPoints * (c_in + c_out)));
  int64_t blocks = std::max(ceil_div(tiles, most_tiles), std::min(threads, tiles));
  if (blocks > threads && blocks % threads != 0) blocks = ceil_div(blocks, threads) * threads;
  return std::min(blocks, tiles);
}

// G g G^T of F(2x2, 3x3) for the 3x3 filter g, point e at dest[e * stride].
void weight_transform_2(const float* g, float* dest, int64_t stride) {
  float gg[4][3];  // G g, G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1]
  for (int j = 0; j < 3; ++j) {
    gg[0][j] = g[0 * 3 + j];
    gg[1][j] = 0.5f * (g[0 * 3 + j] + g[1 * 3 + j] + g[2 * 3 + j]);
    gg[2][j] = 0.5f * (g[0 * 3 + j] - g[1 * 3 + j] + g[2 * 3 + j]);
    gg[3][j] = g[2 * 3 + j];
  }
  for (int i = 0; i < 4; ++i) {  // (G g) G^T
    const float row[4] = {gg[i][0], 0.5f * (gg[i][0] + gg[i][1] + gg[i][2]), 0.5f * (gg[i][0] - gg[i][1] + gg[i][2]),
                          gg[i][2]};
    for (int j = 0; j < 4; ++j) dest[(i * 4 + j) * stride] = row[j];
  }
}

// G g G^T of F(4x4, 3x3): G = [1/4 0 0; -1/6 -1/6 -1/6; -1/6 1/6 -1/6; 1/24 1/12 1/6;
// 1/24 -1/12 1/6; 0 0 1], in double (the transformed weight rounded once).
void weight_transform_4(const float* g, float* dest, int64_t stride) {
  constexpr double kG[6][3] = {{1.0 / 4, 0, 0},           {-1.0 / 6, -1.0 / 6, -1.0 / 6}, {-1.0 / 6, 1.0 / 6, -1.0 / 6},
                               {1.0 / 24, 1.0 / 12, 1.0 / 6}, {1.0 / 24, -1.0 / 12, 1.0 / 6}, {0, 0, 1}};
  double gg[6][3];  // G g
  for (int i = 0; i < 6; ++i) {
    for (int j = 0; j < 3; ++j) gg[i][j] = kG[i][0] * g[0 * 3 + j] + kG[i][1] * g[1 * 3 + j] + kG[i][2] * g[2 * 3 + j];
  }
  for (int i = 0; i < 6; ++i) {  // (G g) G^T
    for (int j = 0; j < 6; ++j) {
      dest[(i * 6 + j) * stride] = static_cast<float>(gg[i][0] * kG[j][0] + gg[i][1] * kG[j][1] + gg[i][2] * kG[j][2]);
    }
  }
}

}  // namespace

int64_t winograd_tiles(const Conv3x3Shape& shape, int64_t tile) {
  return shape.batch * ceil_div(shape.out_h, tile) * ceil_div(shape.out_w, tile);
}

at::Tensor winograd_weight(const float* weight, int64_t out_channels, int64_t in_channels, int64_t tile) {
  const int64_t points = (tile + 2) * (tile + 2);
  at::Tensor u = at::empty({points, in_channels, out_channels}, at::kFloat);
  float* dest = u.mutable_data_ptr<float>();
  const auto transform = tile == 4 ? weight_transform_4 : weight_transform_2;
  for (int64_t k = 0; k < out_channels; ++k) {
    for (int64_t c = 0; c < in_channels; ++c) {
      transform(weight + (k * in_channels + c) * 9, dest + c * out_channels + k, in_channels * out_channels);
    }
  }
  return u;
}

namespace {

template <int Tile>
bool winograd_conv3x3_tiles(const Conv3x3Shape& shape, const float* input, const float* transformed_weight,
                            const float* bias, const float* sum, Clamp clamp, float* output, PackedWeights* weights) {
  // (Tile + 2)^2 transformed points per tile of Tile x Tile outputs
  constexpr int64_t kSide = Tile + 2, kPoints = kSide * kSide, kOutputs = Tile * Tile;
  const Conv3x3Shape& s = shape;
  const int64_t c_in = s.in_channels, c_out = s.out_channels;
  const int64_t tiles_h = ceil_div(s.out_h, Tile), tiles_w = ceil_div(s.out_w, Tile), tiles = winograd_tiles(s, Tile);
  if (tiles == 0 || c_out == 0) return true;
  if constexpr (Tile == 4) {
    // An infinity or NaN in a 6x6 input tile reaches all 16 outputs of F(4x4)'s tile through its
    // transforms (inf - inf), also those whose 3x3 window does not hold it and which a direct
    // convolution computes finite; F(2x2)'s transforms keep such values within the outputs whose
    // window holds them. So an input that is not all finite goes to F(2x2) (the caller).
    std::atomic<bool> finite{true};
    const int64_t count = s.batch * s.in_h * s.in_w * c_in;
    timed_parallel_for(0, count, 1 << 16, [&](int64_t begin, int64_t end) {
      if (!all_finite(input + begin, end - begin)) finite.store(false, std::memory_order_relaxed);
    });
    if (!finite.load(std::memory_order_relaxed)) return false;
  }
  // (image, top row, left column) of a tile's output
  auto origin = [&](int64_t tile, int64_t& n, int64_t& row, int64_t& col) {
    n = tile / (tiles_h * tiles_w);
    row = Tile * (tile % (tiles_h * tiles_w) / tiles_w);
    col = Tile * (tile % tiles_w);
  };
  // Pixels outside the image, a missing bias or sum: read, never written (the calling thread's, which
  // waits while the tasks read it).
  thread_local std::vector<float> zero_row;
  zero_row.resize(std::max<size_t>(zero_row.size(), std::max(c_in, c_out)));
  const float* zeros = zero_row.data();
  const int64_t threads = at::get_num_threads();

  // Tiles [begin, end)'s transformed inputs at v (tile t's channels at v + (t - begin) * c_in, point
  // e's plane `plane` floats after point e - 1's), and their outputs from m (laid out alike).
  const auto transform_inputs = [&](int64_t begin, int64_t end, float* v, int64_t plane) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t n, row, col;
      origin(t, n, row, col);
      const float* pixel[kPoints];
      for (int e = 0; e < kPoints; ++e) {
        const int64_t ih = row - s.pad_top + e / kSide, iw = col - s.pad_left + e % kSide;
        const bool inside = ih >= 0 && ih < s.in_h && iw >= 0 && iw < s.in_w;
        pixel[e] = inside ? input + ((n * s.in_h + ih) * s.in_w + iw) * c_in : zeros;
      }
      Transforms<Tile>::input(pixel, c_in, v + (t - begin) * c_in, plane);
    }
  };
  const OutputTransform transform = Transforms<Tile>::output[sum != nullptr][clamp.on];
  const auto transform_outputs = [&](int64_t begin, int64_t end, const float* m, int64_t plane, float* discard) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t n, row, col;
      origin(t, n, row, col);
      float* out[kOutputs];
      const float* addend[kOutputs];
      for (int q = 0; q < kOutputs; ++q) {
        const int64_t oh = row + q / Tile, ow = col + q % Tile;
        const bool inside = oh < s.out_h && ow < s.out_w;
        const int64_t offset = ((n * s.out_h + oh) * s.out_w + ow) * c_out;
        out[q] = inside ? output + offset : discard;
        addend[q] = inside && sum != nullptr ? sum + offset : zeros;
      }
      transform(m + (t - begin) * c_out, plane, c_out, bias != nullptr ? bias : zeros, addend, clamp, out);
    }
  };
  const auto multiply = [&](int64_t rows, const float* v, float* m, int64_t e) {
    runtime()->sgemm(1, rows, c_out, c_in, 1.0f, v + e * rows * c_in, c_in, 0, 0,
                     transformed_weight + e * c_in * c_out, c_out, 0, 0, 0.0f, m + e * rows * c_out, c_out, 0);
  };
  // F(4x4) in three passes: on ResNet-18's 64-channel 56x56 ones blocks of tiles took 0.53-0.58 ms,
  // three passes 0.48-0.55 (in the model, alternating; its transformed weight is 576 KB).
  if (const int64_t blocks = Tile == 2 ? tile_blocks(c_in, c_out, tiles, threads) : 0; blocks > 0) {
    // Each task transforms a block of tiles, runs its GEMMs (one a point) and transforms their outputs while
    // the block's transformed values are still in the thread's L2 (the weight, at most
    // kBlockedWeightFloats, stays there across the thread's blocks).
    const int64_t block_tiles = ceil_div(tiles, blocks);
    timed_parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      const PackingScope scope(weights);  // per thread: the scope is thread-local
      thread_local std::vector<float> own;
      own.resize(std::max<size_t>(own.size(), kPoints * block_tiles * (c_in + c_out) + c_out));
      float* v = own.data();                            // [points, block tiles, c_in]
      float* m = v + kPoints * block_tiles * c_in;      // [points, block tiles, c_out]
      float* discard = m + kPoints * block_tiles * c_out;
      for (int64_t b = first; b < last; ++b) {
        const int64_t begin = tiles * b / blocks, end = tiles * (b + 1) / blocks, rows = end - begin;
        transform_inputs(begin, end, v, rows * c_in);
        for (int64_t e = 0; e < kPoints; ++e) multiply(rows, v, m, e);
        transform_outputs(begin, end, m, rows * c_out, discard);
      }
    });
    return true;
  }
  // Else in three passes over all tiles, each split across the threads, through [points, tiles, c]
  // buffers.
  // Scratch kept per calling thread (engine calls on several threads each get their own): a fresh
  // multi-megabyte buffer per call comes from mmap, and its page faults cost more than the
  // convolution (measured: +1.3 ms per call on a 64-channel 56x56 convolution).
  thread_local std::vector<float> scratch;
  scratch.resize(std::max<size_t>(scratch.size(), kPoints * tiles * (c_in + c_out)));
  float* v = scratch.data();                     // [points, tiles, c_in]
  float* m = v + kPoints * tiles * c_in;         // [points, tiles, c_out]
  // Tiles per task: about 16K channel values, but no more than an equal share per thread (the 14x14
  // stage's 49 tiles x 256 channels were one task: both transforms ran on one thread while the
  // other waited).
  const int64_t grain = std::max<int64_t>(1, std::min(16384 / std::max(c_in, c_out), ceil_div(tiles, threads)));
  timed_parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    transform_inputs(begin, end, v + begin * c_in, tiles * c_in);
  });
  // One GEMM per point, each on its own slice of the transformed weight, which the runtime packs
  // once (the slices lie in the engine's constants). The points are split across the threads, each
  // GEMM serial in its task: one fork-join for all of them instead of one per GEMM, and equal shares
  // on 2 or 4 threads (each threaded GEMM split [tiles x c_out] in blocks of its own and waited
  // for the slowest: ResNet-18's 14x14 stage has 49 tiles).
  timed_parallel_for(0, kPoints, 1, [&](int64_t begin, int64_t end) {
    const PackingScope scope(weights);  // per thread: the scope is thread-local
    for (int64_t e = begin; e < end; ++e) multiply(tiles, v, m, e);
  });
  timed_parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> discard(c_out);  // outputs of edge tiles that fall outside the image
    transform_outputs(begin, end, m + begin * c_out, tiles * c_out, discard.data());
  });
  return true;
}

}  // namespace

bool winograd_conv3x3(const Conv3x3Shape& shape, int64_t tile, const float* input, const float* transformed_weight,
                      const float* bias, const float* sum, Clamp clamp, float* output, PackedWeights* weights) {
  return tile == 4 ? winograd_conv3x3_tiles<4>(shape, input, transformed_weight, bias, sum, clamp, output, weights)
                   : winograd_conv3x3_tiles<2>(shape, input, transformed_weight, bias, sum, clamp, output, weights);
}

}  // namespace blade
