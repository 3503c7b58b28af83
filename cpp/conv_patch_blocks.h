// conv_patch.cpp's block functions (a block of output pixels x a range of weight panels, its
// kernels in conv_patch_kernels.h), one version per ISA, each version in a translation unit of its
// own: conv_patch_x86_64_v4.cpp (16-float AVX-512 vectors), conv_patch_x86_64_v3.cpp (8-float
// AVX2 ones), conv_patch_x86_64.cpp (8-float ones for any CPU, and the only version off x86-64 or
// off g++). Their fully unrolled tiles took ~2 minutes of g++ -O2 as three versions of one file,
// the longest unit of the build; apart they compile in parallel. patch_conv picks one version.
#pragma once

#include <cstdint>

#include "activation.h"
#include "conv_patch.h"

// g++ on x86-64: versions per ISA level, each compiled under its target attribute.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BLADE_CONV_PATCH_ISA_VERSIONS 1
#define BLADE_ISA_TARGET(level) __attribute__((target("arch=" level)))
#else
#define BLADE_CONV_PATCH_ISA_VERSIONS 0
#define BLADE_ISA_TARGET(level)
#endif

namespace blade::conv_patch_blocks {

constexpr int64_t kPanel = 32;      // output channels per weight panel: two vectors
constexpr int64_t kTileRows = 6;    // pixels per register tile: 12 accumulators, 2 weights, 1 broadcast
                                    // (a pair tile, conv_patch_kernels.h kPairTiles: 5 pixels, 20 and 4)
constexpr int64_t kBlockRows = 48;  // pixels per work item (gathered together), a multiple of kTileRows
// Rows of a panel summed per pass over a block's tiles where the depth is more than two of them
// (conv_patch_kernels.h, panel_in_chunks): a chunk of the panel (12 KB) and of a block's rows (up
// to 18 KB) stay in a 32 KB L1 across the block's tiles (a pair tile's chunk, 24 KB, with the rows in
// a 48 KB one: not measured where L1 is 32 KB). Against one pass over the whole depth, in
// ResNet-18 (AVX-512 Xeon, 2 threads, in the model, alternating): the 512-channel 3x3 at 7x7 (depth
// 4608, the weight from memory) 1.41-1.46 -> 1.09-1.14 ms, the 3x3 stride-2 ones 0.51-0.60 ->
// 0.48-0.53 (chunks of 128; 128 and 192 did about as well as 96 on the deep ones); the model 15.37
// -> 14.51 ms. Prefetching two chunks ahead, or into L2 only, did no better.
constexpr int64_t kDepthChunk = 96;
// Floats a block's gather buffer has past its rows: gather's vector copies (copy_run) store up to
// 15 floats past a run.
constexpr int64_t kGatherSlack = 16;

// The block functions' parameters.
#define BLADE_BLOCK_PARAMS                                                                                        \
  const PatchConvShape &s, const float *input, const float *panels, const float *bias, const float *sum,          \
      Clamp clamp, float *output, int64_t begin, int64_t end, int64_t panel_begin, int64_t panel_end,             \
      float *gathered, float *staged, bool prefetch, const float *after, int64_t after_depth, bool pair_tiles
#define BLADE_BLOCK_ARGS                                                                                     \
  s, input, panels, bias, sum, clamp, output, begin, end, panel_begin, panel_end, gathered, staged, prefetch, \
      after, after_depth, pair_tiles

// Returns the panels it summed two at a time (pair tiles, where the ISA and pair_tiles allow).
using BlockKernel = int64_t (*)(BLADE_BLOCK_PARAMS);

struct BlockKernels {
  BlockKernel patch_block;  // output pixels [begin, end) x panels [panel_begin, panel_end), rows gathered
                            // (or a 1x1's input read in place); its last panel prefetches `after`
                            // (after_depth rows of kPanel floats) unless null
  BlockKernel image_block;  // the same reading image rows in place (PatchConvShape::image_rows)
};

#if BLADE_CONV_PATCH_ISA_VERSIONS
BlockKernels x86_64_v4_blocks();  // needs AVX-512 (x86-64-v4)
BlockKernels x86_64_v3_blocks();  // needs AVX2 and FMA (x86-64-v3)
#endif
BlockKernels baseline_blocks();   // any CPU

}  // namespace blade::conv_patch_blocks
