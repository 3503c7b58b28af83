#include "conv_patch.h"

#include <ATen/ops/zeros.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <unordered_map>
#include <unistd.h>
#include <vector>

#include "activation.h"
#include "blade_abi.h"
#include "conv_extent.h"
#include "conv_patch_blocks.h"
#include "isa.h"
#include "isa_clones.h"
#include "timed_parallel.h"

namespace blade {
namespace {

using conv_patch_blocks::BlockKernel;
using conv_patch_blocks::BlockKernels;
using conv_patch_blocks::kBlockRows;
using conv_patch_blocks::kGatherSlack;
using conv_patch_blocks::kPanel;
using conv_patch_blocks::kTileRows;

// The block functions of an ISA level (the baseline's below x86-64-v3, or without versions).
const BlockKernels& level_block_kernels(const std::string& isa) {
#if BLADE_CONV_PATCH_ISA_VERSIONS
  static const BlockKernels v4 = conv_patch_blocks::x86_64_v4_blocks(), v3 = conv_patch_blocks::x86_64_v3_blocks();
  if (isa == "x86-64-v4") return v4;
  if (isa == "x86-64-v3") return v3;
#endif
  static const BlockKernels baseline = conv_patch_blocks::baseline_blocks();
  return baseline;
}

// The versions set_patch_isa picked (tests), else null.
std::atomic<const BlockKernels*> chosen_block_kernels{nullptr};

// The block functions for this CPU, picked once (g++'s function multiversioning picked them when
// they were versions of one function in one file; isa.h checks the same levels).
const BlockKernels& block_kernels() {
  if (const BlockKernels* chosen = chosen_block_kernels.load(std::memory_order_relaxed)) return *chosen;
  static const BlockKernels& kernels = level_block_kernels(isa_supported("x86-64-v4")   ? "x86-64-v4"
                                                           : isa_supported("x86-64-v3") ? "x86-64-v3"
                                                                                        : "");
  return kernels;
}

// The activation's unary function (SiLU, GELU) over what a block call just stored (in L1/L2
// still): output pixels [begin, end) x the channels of panels [panel_begin, panel_end).
void unary_block(Unary f, const PatchConvShape& s, float* output, int64_t begin, int64_t end, int64_t panel_begin,
                 int64_t panel_end) {
  const int64_t c0 = panel_begin * kPanel, c1 = std::min(panel_end * kPanel, s.out_channels);
  if (s.output_channels_last) {
    if (c0 == 0 && c1 == s.out_channels) return unary_in_place(f, output + begin * c1, (end - begin) * c1);
    for (int64_t row = begin; row < end; ++row) unary_in_place(f, output + row * s.out_channels + c0, c1 - c0);
    return;
  }
  const int64_t plane = s.out_h * s.out_w;
  for (int64_t row = begin; row < end;) {
    const int64_t n = row / plane, p0 = row % plane, run = std::min(end - row, plane - p0);
    for (int64_t c = c0; c < c1; ++c) unary_in_place(f, output + (n * s.out_channels + c) * plane + p0, run);
    row += run;
  }
}

// Image rows [begin, end) (over the batch) of an NCHW input as channels-last pixels. Three
// channels (an RGB image, every stem) get their own loop: with the count fixed g++ interleaves
// the planes with vector shuffles where the general loop copies float by float (MobileNetV2's b8
// stem: 140 of its 860 us, one core).
BLADE_ISA_CLONES void rows_to_channels_last(const float* input, int64_t channels, int64_t height, int64_t width,
                                            int64_t begin, int64_t end, float* output) {
  const int64_t plane = height * width;
  for (int64_t image_row = begin; image_row < end; ++image_row) {
    const int64_t n = image_row / height, first = image_row % height * width;
    const float* image = input + n * channels * plane + first;
    float* dest = output + (n * plane + first) * channels;
    if (channels == 3) {
      const float *r = image, *g = image + plane, *b = image + 2 * plane;
      for (int64_t p = 0; p < width; ++p) {
        dest[3 * p] = r[p];
        dest[3 * p + 1] = g[p];
        dest[3 * p + 2] = b[p];
      }
      continue;
    }
    for (int64_t p = 0; p < width; ++p) {
      for (int64_t c = 0; c < channels; ++c) dest[p * channels + c] = image[c * plane + p];
    }
  }
}

// This thread's staging block for NCHW outputs (patch_block): at most kBlockRows pixels a block.
float* staged_block() {
  thread_local std::vector<float> staged(kBlockRows * kPanel);
  return staged.data();
}

// The weight panels of the patch convolution that came after another one (keyed by its panels)
// the last time, on this thread: an engine runs its convolutions in the same order on every call,
// so while a convolution with few pixels (MobileNetV2's 5x5 stage: 25 pixels, 0.1-1.6 MB of
// weight each, cold at every call) computes its last panels, each thread prefetches the panel it
// will start the next one with, instead of meeting it cold. (A stale entry — the weights freed,
// or the order changed — only prefetches the wrong lines: a prefetch never faults.) With the next
// panel's prefetch spread over a panel's tiles (panel_rows), MobileNetV2 b1's eight 5x5-stage 1x1
// convolutions: 1270 -> 923 us at 2 threads, 1847 -> 1260 at one; its 10x10 ones 0.82-0.89 of
// before at 2 threads (measured in one process, both ways alternating every 10 calls, medians).
struct Successor {
  const float* panels = nullptr;
  int64_t depth = 0, panel_count = 0;
  bool shared_panels = false;  // every thread reads every panel (else each its run's share)
};

class Successors {
 public:
  // This convolution follows the one before it on this thread; returns what followed this one last.
  Successor follow(const float* panels, int64_t depth, int64_t panel_count, bool shared_panels) {
    if (previous_ != nullptr) {
      if (table_.size() >= kMaxEntries) table_.clear();  // engines come and go: stay small
      table_[previous_] = Successor{panels, depth, panel_count, shared_panels};
    }
    previous_ = panels;
    return upcoming();
  }

  // What followed the last patch convolution on this thread the last time: the one expected next.
  Successor upcoming() const {
    const auto found = table_.find(previous_);
    return found != table_.end() ? found->second : Successor{};
  }

 private:
  static constexpr size_t kMaxEntries = 4096;
  std::unordered_map<const float*, Successor> table_;
  const float* previous_ = nullptr;
};

Successors& successors() {
  thread_local Successors table;
  return table;
}

// How many blocks patch_conv cuts `rows` output pixels into on `threads` threads (see there).
int64_t pixel_blocks(int64_t rows, int64_t threads) {
  int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  if (blocks > threads && blocks % threads != 0) blocks = (blocks + threads - 1) / threads * threads;
  return blocks;
}

// Gathered rows (all of a thread's pixels, gathered once) of at most this many floats: 1 MB.
constexpr int64_t kFewGatheredFloats = int64_t{1} << 18;

// A gathered convolution (not direct()) with fewer pixel blocks than two a thread, a channels-last
// output and panels the threads divide: each thread gathers every pixel's rows once and computes
// all of them for an equal share of the panels, so that each streams its share of the weight once,
// each panel over every pixel. Split by pixel blocks as larger convolutions are, each thread read
// every panel for half the pixels: ResNet-50's 1024 -> 2048 1x1 stride-2 shortcut (49 pixels, an
// 8 MB weight, cold in the model) took 1.34 ms that way and 1.07 this way (AVX-512 Xeon, 2 threads,
// in the model, alternating). (Direct ones read their rows in place: patch_conv's few-pixels path.)
bool few_gathered_pixels(const PatchConvShape& s, int64_t threads) {
  const int64_t rows = s.batch * s.out_h * s.out_w, panel_count = (s.out_channels + kPanel - 1) / kPanel;
  return !s.direct() && s.output_channels_last && pixel_blocks(rows, threads) < 2 * threads &&
         panel_count % threads == 0 && rows * s.depth() <= kFewGatheredFloats;
}

std::atomic<int64_t> l2_cache_bytes_set{-1};  // set_l2_cache_bytes's value; -1: sysconf's

// Pair tiles where the block functions have them (set_patch_pair_tiles; on by default), and the
// panels they summed so (patch_pair_tile_panels).
std::atomic<bool> pair_tiles_on{true};
std::atomic<int64_t> pair_tile_panels{0};

// Adds a thread's count of paired panels (one atomic add per thread and convolution, not per block).
void count_pair_tiles(int64_t panels) {
  if (panels != 0) pair_tile_panels.fetch_add(panels, std::memory_order_relaxed);
}

}  // namespace

bool set_patch_isa(const std::string& isa) {
  if (isa.empty()) {
    chosen_block_kernels.store(nullptr, std::memory_order_relaxed);
    return true;
  }
  if (isa != "x86-64" && !isa_supported(isa)) return false;
#if !BLADE_CONV_PATCH_ISA_VERSIONS
  if (isa != "x86-64") return false;  // (one version only, the baseline's)
#endif
  chosen_block_kernels.store(&level_block_kernels(isa), std::memory_order_relaxed);
  return true;
}

void set_patch_pair_tiles(bool on) { pair_tiles_on.store(on, std::memory_order_relaxed); }

int64_t patch_pair_tile_panels() { return pair_tile_panels.load(std::memory_order_relaxed); }

void set_l2_cache_bytes(int64_t bytes) { l2_cache_bytes_set.store(bytes, std::memory_order_relaxed); }

int64_t l2_cache_bytes() {
  if (const int64_t set = l2_cache_bytes_set.load(std::memory_order_relaxed); set >= 0) return set;
  static const int64_t bytes = [] {
#ifdef _SC_LEVEL2_CACHE_SIZE
    return std::max<int64_t>(0, sysconf(_SC_LEVEL2_CACHE_SIZE));
#else
    return int64_t{0};
#endif
  }();
  return bytes;
}

WeightSpan upcoming_patch_weights(int64_t thread, int64_t threads) {
  const Successor next = successors().upcoming();
  if (next.panels == nullptr || threads < 1) return {};
  // A thread of the few-pixels path starts at its run's share of the panels (its run of the same
  // index, as in patch_conv); on the other path every thread reads the panels from the first.
  const int64_t first = next.shared_panels ? 0 : next.panel_count * thread / threads;
  const int64_t end = next.shared_panels ? next.panel_count : next.panel_count * (thread + 1) / threads;
  const int64_t panel_bytes = next.depth * kPanel * int64_t{sizeof(float)};
  return WeightSpan{reinterpret_cast<const char*>(next.panels) + first * panel_bytes, (end - first) * panel_bytes};
}

std::optional<PatchConvShape> patch_conv_shape(int32_t spatial, const int64_t* input_shape, const int64_t* weight_shape,
                                               const int64_t* strides, const int64_t* pads, const int64_t* dilations,
                                               int64_t groups, int32_t layout) {
  if (spatial != 2 || groups != 1 || layout == 0) return std::nullopt;
  PatchConvShape s{input_shape[0], input_shape[1], input_shape[2], input_shape[3], weight_shape[0],
                   weight_shape[2], weight_shape[3], strides[0], strides[1], dilations[0], dilations[1],
                   pads[0], pads[1], 0, 0, (layout & BLADE_CONV_INPUT_CHANNELS_LAST) != 0,
                   (layout & BLADE_CONV_OUTPUT_CHANNELS_LAST) != 0};
  s.out_h = conv_output_extent(s.in_h, pads[0], pads[2], s.kernel_h, s.stride_h, s.dilation_h);
  s.out_w = conv_output_extent(s.in_w, pads[1], pads[3], s.kernel_w, s.stride_w, s.dilation_w);
  // Deeper: few pixels whose panels stay in L2 across their tiles. ResNet-50's 512-channel 3x3
  // stride-2 at 7x7 (depth 4608, 590 KB panels, 49 pixels): 1.38 ms against oneDNN's 1.53 in the
  // model (a 2 MB L2, 2 threads, alternating); on a 512 KB L2 it stays oneDNN's.
  if (s.depth() > kPatchMaxDepth && !(few_gathered_pixels(s, at::get_num_threads()) &&
                                      2 * s.depth() * kPanel * int64_t{sizeof(float)} <= l2_cache_bytes())) {
    return std::nullopt;
  }
  return s;
}

at::Tensor patch_conv_weight(const float* weight, const PatchConvShape& s) {
  const int64_t depth = s.depth(), panels = (s.out_channels + kPanel - 1) / kPanel, taps = s.kernel_h * s.kernel_w;
  at::Tensor packed = at::zeros({panels, depth, kPanel}, at::kFloat);
  float* dest = packed.mutable_data_ptr<float>();
  for (int64_t o = 0; o < s.out_channels; ++o) {
    for (int64_t c = 0; c < s.in_channels; ++c) {
      for (int64_t t = 0; t < taps; ++t) {
        dest[((o / kPanel) * depth + t * s.in_channels + c) * kPanel + o % kPanel] = weight[(o * s.in_channels + c) * taps + t];
      }
    }
  }
  return packed;
}

void patch_conv(const PatchConvShape& s, const float* input, const float* panels, const float* bias,
                const float* sum, Activation act, float* output) {
  const Clamp clamp = act.clamp;
  const int64_t rows = s.batch * s.out_h * s.out_w;
  if (rows <= 0 || s.out_channels == 0) return;
  // An NCHW input (a model's image, 3 channels) is gathered from a channels-last copy: strided
  // single floats per tap cost more than the multiply-adds (MobileNetV2's stem: 180 -> 131 us, one core).
  thread_local std::vector<float> transposed;
  if (!s.input_channels_last) {
    const int64_t plane = s.in_h * s.in_w;
    transposed.resize(s.batch * s.in_channels * plane);
    float* to = transposed.data();
    const float* from = input;
    timed_parallel_for(0, s.batch * s.in_h, std::max<int64_t>(1, 16384 / (s.in_w * s.in_channels)), [&](int64_t b, int64_t e) {
      rows_to_channels_last(from, s.in_channels, s.in_h, s.in_w, b, e, to);
    });
    input = transposed.data();
  }
  // Blocks of up to kBlockRows pixels, as many as a multiple of the threads where there are more
  // than threads, the pixels split evenly between them (panel_rows cuts any count into even
  // tiles): 100 pixels on 2 threads run as 4 blocks of 25 (blocks of whole 6-pixel tiles, 30 + 30
  // + 30 + 10, left one thread 60 pixels and the other 40; MobileNetV2 has 16 such 10x10 1x1
  // convolutions). Block b is pixels [rows * b / blocks, rows * (b + 1) / blocks).
  const int64_t threads = at::get_num_threads();
  const int64_t blocks = pixel_blocks(rows, threads);
  const int64_t block_rows = (rows + blocks - 1) / blocks;  // the largest block
  const int64_t panel_count = (s.out_channels + kPanel - 1) / kPanel;
  // A thread's first block prefetches its panels (panel_rows); later blocks find them in its cache
  // unless the weight exceeds about half an L2 (prefetching hot panels cost MobileNetV2's 16 -> 96
  // at 80x80, 6 KB of weight in 134 blocks, 4%).
  const bool large_weight = panel_count * s.depth() * kPanel * int64_t{sizeof(float)} > (int64_t{1} << 19);
  const bool few_pixels = blocks < 2 * threads && (s.direct() || few_gathered_pixels(s, threads));
  const Successor successor = successors().follow(panels, s.depth(), panel_count, !few_pixels);
  const bool pair_tiles = pair_tiles_on.load(std::memory_order_relaxed);
  if (few_pixels) {
    // Few pixels (MobileNetV2's 5x5 stage: 25 pixels, 5 to 40 panels): units of one panel x one
    // pixel block, panel by panel, cut into one equal run of units a thread, so each thread
    // streams its share of the weight once. Chunks of whole panels or of pixel blocks claimed
    // from a counter split 10 panels 4 + 6 (chunks of 2 and 3) and 5 panels 3 + 2 (960 -> 320 at
    // 5x5: 176 us at 2 threads against 251 at one). With panels the threads do not divide, the
    // pixels (at least a tile a thread) are cut into at least `threads` blocks so that the runs
    // still come out even (neighbouring threads share one panel). One thread takes this path too
    // (one block: one run), so that its last panel prefetches the next convolution's first.
    // Gathered rows are one block (all pixels), each run's gathered once (few_gathered_pixels).
    const bool split_rows = s.direct() && panel_count % threads != 0 && rows >= threads * kTileRows;
    const int64_t row_blocks = !s.direct() ? 1 : split_rows ? std::max(blocks, threads) : blocks;
    // A run worth a thread wake-up: about 64K multiply-adds (a 1x1 image runs on one thread).
    const int64_t work = rows * s.depth() * panel_count * kPanel;
    const int64_t units = panel_count * row_blocks, runs = std::clamp<int64_t>(work >> 16, 1, std::min(threads, units));
    timed_parallel_for(0, runs, 1, [&](int64_t run_begin, int64_t run_end) {
      thread_local std::vector<float> gathered;
      if (!s.direct()) gathered.resize(rows * s.depth() + kGatherSlack);
      int64_t paired = 0;
      for (int64_t run = run_begin; run < run_end; ++run) {
        const int64_t unit_begin = units * run / runs, unit_end = units * (run + 1) / runs;
        // The panel this run's thread is likely to start the next convolution with (its run of the
        // same index, when that one runs as many; the first one's thread runs the first).
        const float* after = successor.panels != nullptr
                                 ? successor.panels + successor.panel_count * run / runs * successor.depth * kPanel
                                 : nullptr;
        for (int64_t unit = unit_begin; unit < unit_end;) {
          const int64_t panel = unit / row_blocks, block = unit % row_blocks;
          // A whole pixel block's run of panels in one call (its panels prefetched one ahead).
          const int64_t panel_end = row_blocks == 1 ? unit_end : panel + 1;
          const int64_t unit_next = row_blocks == 1 ? unit_end : unit + 1;
          const int64_t begin = rows * block / row_blocks, end = rows * (block + 1) / row_blocks;
          paired += block_kernels().patch_block(s, input, panels, bias, sum, clamp, output, begin, end, panel,
                                                panel_end, gathered.data(), staged_block(), true,
                                                unit_next == unit_end ? after : nullptr, successor.depth, pair_tiles);
          if (act.unary != Unary::none) unary_block(act.unary, s, output, begin, end, panel, panel_end);
          unit = unit_next;
        }
      }
      count_pair_tiles(paired);
    });
    return;
  }
  // Fewer pixel blocks than two a thread on gathered rows (or one thread): the panels are split
  // across the threads too.
  const int64_t splits = blocks >= 2 * threads ? 1 : std::min(panel_count, (2 * threads + blocks - 1) / blocks);
  // A work item worth a thread wake-up: about 64K multiply-adds.
  const int64_t item_work = block_rows * s.depth() * kPanel * ((panel_count + splits - 1) / splits);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, item_work));
  const BlockKernel block_kernel = s.image_rows() ? block_kernels().image_block : block_kernels().patch_block;
  timed_parallel_for(0, blocks * splits, grain, [&](int64_t item_begin, int64_t item_end) {
    thread_local std::vector<float> gathered;
    if (!s.direct()) gathered.resize(block_rows * s.depth() + kGatherSlack);
    int64_t paired = 0;
    for (int64_t item = item_begin; item < item_end; ++item) {
      const int64_t block = item / splits, split = item % splits;
      const int64_t begin = rows * block / blocks, end = rows * (block + 1) / blocks;
      const int64_t panel_begin = split * panel_count / splits, panel_end = (split + 1) * panel_count / splits;
      paired += block_kernel(s, input, panels, bias, sum, clamp, output, begin, end, panel_begin, panel_end,
                             gathered.data(), staged_block(), item == item_begin || large_weight, nullptr, 0, pair_tiles);
      if (act.unary != Unary::none) unary_block(act.unary, s, output, begin, end, panel_begin, panel_end);
    }
    count_pair_tiles(paired);
  });
}

void patch_conv_pixels(const PatchConvShape& s, const float* input, const float* panels, const float* bias,
                       Activation act, float* output, int64_t begin, int64_t end) {
  TORCH_CHECK(s.direct() && s.output_channels_last, "patch_conv_pixels: a direct convolution with a channels-last output");
  if (begin >= end) return;
  const int64_t panel_count = (s.out_channels + kPanel - 1) / kPanel;
  // (Its paired panels not counted: called for a few rows at a time, each count an atomic add.)
  block_kernels().patch_block(s, input, panels, bias, nullptr, act.clamp, output, begin, end, 0, panel_count, nullptr,
                              nullptr, false, nullptr, 0, pair_tiles_on.load(std::memory_order_relaxed));
  if (act.unary != Unary::none) unary_block(act.unary, s, output, begin, end, 0, panel_count);
}

}  // namespace blade
