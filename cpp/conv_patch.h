// Convolutions as one GEMM over the output pixels with the epilogue in registers: the runtime's
// own register-blocked kernel for ungrouped 2-D convolutions with a channels-last output, or an
// NCHW output from a channels-last input (a model's last convolution, whose output is returned).
//
// A row of the GEMM is one output pixel's receptive field (kernel_h * kernel_w * in_channels
// values, channels innermost); a 1x1 stride-1 unpadded convolution on a channels-last input reads
// its rows straight from the input, any other gathers a block of rows (padding as zeros) into a
// small per-thread buffer first. The weight is packed once per engine into panels of 32 output
// channels ([K][32], zero-padded), each tile of 6 pixels x 32 channels (16 with AVX2; with
// AVX-512, into a channels-last output and in blocks of 32 pixels or more, 5 pixels x 64: two
// adjacent panels) summed in registers over K and then finished in registers: + bias,
// + residual, then the clamp (the unfused engine's order), and stored once. Against an MKL/oneDNN GEMM followed by an epilogue pass (conv_gemm.h)
// this saves the second pass over the output, which on MobileNet-sized 1x1 convolutions
// (few channels, many pixels) cost as much as the GEMM; against oneDNN's convolution for the
// stem (3 input channels, TF padding) it saves oneDNN's padded copy, fresh output and copy back.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

#include "activation.h"

namespace blade {

struct PatchConvShape {
  int64_t batch, in_channels, in_h, in_w, out_channels;
  int64_t kernel_h, kernel_w, stride_h, stride_w, dilation_h, dilation_w;
  int64_t pad_top, pad_left;  // the bottom/right pads are implied by out_h/out_w
  int64_t out_h, out_w;
  bool input_channels_last;
  bool output_channels_last;  // else NCHW (only from a channels-last input)

  int64_t depth() const { return in_channels * kernel_h * kernel_w; }  // K of the GEMM
  // Rows read in place from the input (no gather).
  bool direct() const {
    return input_channels_last && kernel_h == 1 && kernel_w == 1 && stride_h == 1 && stride_w == 1 && pad_top == 0 &&
           pad_left == 0 && out_h == in_h && out_w == in_w;
  }
  // Pixels whose taps all lie inside the image width read their rows straight from the image
  // (conv_patch.cpp, image_block): a first convolution (at most kImageRowsMaxChannels input
  // channels, a model's image), undilated along the width. Its gather copies runs of
  // kernel_w * in_channels floats per kernel row, too short to copy at the memory's pace (9 floats
  // on MobileNetV2's stem); wider inputs gather long runs.
  static constexpr int64_t kImageRowsMaxChannels = 4;
  bool image_rows() const { return !direct() && in_channels <= kImageRowsMaxChannels && dilation_w == 1; }
};

// The shape for a 2-D ungrouped convolution with a channels-last output or a channels-last input
// (`layout` holds the BLADE_CONV_*_CHANNELS_LAST bits; NCHW to NCHW stays oneDNN's, and the 1x1
// ones conv_gemm.h's GEMM) and at most kPatchMaxDepth values per receptive field; nullopt
// otherwise. Past that a weight panel (depth x 32 floats, 288 KB at the limit) no longer stays in
// L2 across the tiles that reuse it, and oneDNN's blocked convolution wins (ResNet-18's 512-channel
// 3x3 at 7x7, depth 4608: 2.09 ms here against oneDNN's 1.86; its 256-channel one, depth 2304,
// 0.94 against 0.96; one core). Deeper ones are taken when their pixels are few enough for each
// thread to gather them all and stream its share of the panels once (few_gathered_pixels) and a
// panel fits half this CPU's L2, which then holds it across its tiles.
constexpr int64_t kPatchMaxDepth = 2304;
std::optional<PatchConvShape> patch_conv_shape(int32_t spatial, const int64_t* input_shape, const int64_t* weight_shape,
                                               const int64_t* strides, const int64_t* pads, const int64_t* dilations,
                                               int64_t groups, int32_t layout);

// This CPU's L2 per core in bytes (sysconf); 0 when the C library does not say. Tests set it
// (set_l2_cache_bytes; -1: sysconf's again) to take the deep path on any CPU, or not.
int64_t l2_cache_bytes();
void set_l2_cache_bytes(int64_t bytes);

// Tests: run the block functions of ISA level `isa` ("x86-64", "x86-64-v3", "x86-64-v4"; "" this
// CPU's best again) so each version is checked on one machine. False (nothing changed) when this
// CPU lacks the level, or the build has only the baseline's (not g++ on x86-64).
bool set_patch_isa(const std::string& isa);

// Tests and A/B measurements: the AVX-512 block functions' pair tiles (two weight panels summed
// together, conv_patch_kernels.h kPairTiles) on (default) or off, and how many panels patch_conv
// has summed so in this process. Bitwise the same sums either way.
void set_patch_pair_tiles(bool on);
int64_t patch_pair_tile_panels();

// weight [out, in, kh, kw] -> panels [ceil(out / 32)][kh * kw * in][32], zero-padded.
at::Tensor patch_conv_weight(const float* weight, const PatchConvShape& shape);

// The weight bytes thread `thread` of `threads` is expected to read first in the next patch
// convolution on this calling thread (the one that followed the last one run, the last time: an
// engine runs its convolutions in the same order every call); empty when none is known. For the
// layer in between (a depthwise convolution) to prefetch while memory is idle; a stale guess only
// prefetches lines nobody reads.
struct WeightSpan {
  const char* begin = nullptr;
  int64_t bytes = 0;
};
WeightSpan upcoming_patch_weights(int64_t thread, int64_t threads);

// output = act(conv(input) + bias + sum), sum in the output's layout; bias and sum may be null.
void patch_conv(const PatchConvShape& shape, const float* input, const float* panels, const float* bias,
                const float* sum, Activation act, float* output);

// Output pixels [begin, end) of a direct() convolution with a channels-last output (every panel),
// on the calling thread: act(conv(input) + bias). For a caller that runs the convolution a few
// rows at a time into a buffer of its own (expand_depthwise.h).
void patch_conv_pixels(const PatchConvShape& shape, const float* input, const float* panels, const float* bias,
                       Activation act, float* output, int64_t begin, int64_t end);

}  // namespace blade
