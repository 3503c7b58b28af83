// The BladeRuntime callbacks (GEMM, threads, convolution) on torch's own libraries.
//
// GEMM: gemm.h (MKL's sgemm_ or oneDNN through libtorch, whichever this machine runs faster for
// the call's shape).
// Convolution: depthwise convolutions between channels-last tensors run depthwise.h's kernel, 1x1
// ones conv_gemm.h's GEMM; 3x3 stride-1 channels-last convolutions with a constant weight and >= 64 channels
// run Winograd F(2x2, 3x3) (winograd.h: 2.25x fewer multiplies, as GEMMs on a weight transformed
// and packed once; measured 20% off ResNet-18). Other 2-D convolutions with a constant weight run
// oneDNN's convolution on the weight reordered once into its blocked layout (kept in the calling
// engine's PackedWeights); eager torch reorders it on every call. The rest goes through
// at::convolution.
//
// Errors: ATen checks malformed arguments (which only a broken engine would pass) and throws. The
// exception unwinds through the engine's frames (g++ emits unwind tables on x86-64 by default) into
// Engine::execute, where torch turns it into a RuntimeError; an engine never catches it.
#include "runtime.h"
#include "activation.h"
#include "conv_gemm.h"
#include "conv_extent.h"
#include "conv_patch.h"
#include "depthwise.h"
#include "expand_depthwise.h"
#include "gemm.h"
#include "grouped_conv.h"
#include "isa_clones.h"
#include "oversubscription.h"
#include "timed_parallel.h"
#include "winograd.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mkldnn_reorder_conv2d_weight.h>
#include <ATen/ops/to_mkldnn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

namespace blade {
namespace {

thread_local PackedWeights* current_weights = nullptr;  // set by PackingScope
std::atomic<int64_t> packs_made{0};                       // PackedWeights::get's packs, process-wide

// ---- GEMM ----

void sgemm(int64_t batch, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           int64_t stride_a, int32_t trans_a, const float* b, int64_t ldb, int64_t stride_b,
           int32_t trans_b, float beta, float* c, int64_t ldc, int64_t stride_c) {
  const SerialScope serial_while_oversubscribed;  // see conv below
  gemm({batch, m, n, k, alpha, a, lda, stride_a, trans_a, b, ldb, stride_b, trans_b, beta, c, ldc, stride_c},
       current_weights);
}

// ---- threads ----

void parallel_for(int64_t begin, int64_t end, int64_t grain, blade_range_fn fn, void* ctx) {
  timed_parallel_for(begin, end, grain, [fn, ctx](int64_t chunk_begin, int64_t chunk_end) { fn(ctx, chunk_begin, chunk_end); });
}

// ---- convolution ----

template <bool kClamp>
BLADE_ISA_CLONES void copy_range(const float* from, float* to, int64_t begin, int64_t end, Clamp clamp) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) to[i] = kClamp ? clamp_value(from[i], clamp.lo, clamp.hi) : from[i];
}

// to[i] = the activation (clamp, SiLU or GELU) of from[i] for `count` dense floats (from == to: in
// place), in parallel.
void copy_activated(const float* from, float* to, int64_t count, Activation act) {
  if (act.unary != Unary::none) return unary_parallel(act.unary, from, to, count);
  const auto copy = act.clamp.on ? copy_range<true> : copy_range<false>;
  timed_parallel_for(0, count, 16384, [&](int64_t begin, int64_t end) { copy(from, to, begin, end, act.clamp); });
}

at::Tensor dense(const float* data, at::IntArrayRef sizes) {
  return at::from_blob(const_cast<float*>(data), sizes, at::TensorOptions().dtype(at::kFloat));
}

// An engine tensor: dense row-major, or (channels_last) a 4-D [n, c, h, w] stored as [n, h, w, c].
at::Tensor engine_tensor(const float* data, at::IntArrayRef sizes, bool channels_last) {
  if (!channels_last) return dense(data, sizes);
  const std::array<int64_t, 4> strides = {sizes[1] * sizes[2] * sizes[3], 1, sizes[3] * sizes[1], sizes[1]};
  return at::from_blob(const_cast<float*>(data), sizes, strides, at::TensorOptions().dtype(at::kFloat));
}

// oneDNN's convolution on a weight already in its blocked layout (what torch's own frozen-model
// passes and Inductor's CPU freezing call): mkldnn::_convolution_pointwise, with `sum` as a binary
// "add" post-op (the "sum" post-op is only offered in place, into `sum` itself).
at::Tensor onednn_conv(const at::Tensor& x, const at::Tensor& packed_weight, const std::optional<at::Tensor>& bias,
                       at::IntArrayRef padding, at::IntArrayRef stride, at::IntArrayRef dilation, int64_t groups,
                       const std::optional<at::Tensor>& sum = std::nullopt) {
  static const c10::OperatorHandle unary =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_convolution_pointwise", "");
  static const c10::OperatorHandle binary =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_convolution_pointwise", "binary");
  const c10::IValue b = bias ? c10::IValue(*bias) : c10::IValue();
  const auto no_scalars = c10::List<std::optional<at::Scalar>>();
  std::vector<c10::IValue> stack;
  if (sum) {
    stack = {x, *sum, packed_weight, b, padding.vec(), stride.vec(), dilation.vec(), groups, std::string("add"),
             at::Scalar(1.0), c10::IValue(), no_scalars, c10::IValue()};
    binary.callBoxed(&stack);
  } else {
    stack = {x, packed_weight, b, padding.vec(), stride.vec(), dilation.vec(), groups,
             std::string("none"), no_scalars, c10::IValue()};
    unary.callBoxed(&stack);
  }
  return std::move(stack[0]).toTensor();
}

// [n, c_out, *out_size] of a convolution padded symmetrically by `padding`.
std::vector<int64_t> conv_output_sizes(const at::Tensor& x, const at::Tensor& w, at::IntArrayRef padding,
                                       at::IntArrayRef stride, at::IntArrayRef dilation) {
  std::vector<int64_t> sizes = {x.size(0), w.size(0)};
  for (size_t d = 0; d < padding.size(); ++d) {
    sizes.push_back((x.size(2 + d) + 2 * padding[d] - dilation[d] * (w.size(2 + d) - 1) - 1) / stride[d] + 1);
  }
  return sizes;
}

// The weight in oneDNN's layout for this convolution, packed once per engine; nullopt when it
// cannot be (no engine packing scope, a weight computed at run time, no oneDNN, not 2-D).
std::optional<at::Tensor> packed_conv_weight(int32_t spatial, const float* weight, const at::Tensor& w,
                                             const at::Tensor& x, at::IntArrayRef padding, at::IntArrayRef stride,
                                             at::IntArrayRef dilation, int64_t groups, at::MemoryFormat out_format) {
  PackedWeights* weights = current_weights;
  if (spatial != 2 || weights == nullptr || !weights->is_constant(weight) || !at::hasMKLDNN()) return std::nullopt;
  const at::MemoryFormat in_format = x.suggest_memory_format();
  PackedWeights::Key key = {reinterpret_cast<int64_t>(weight), groups, static_cast<int64_t>(in_format),
                            static_cast<int64_t>(out_format)};
  for (at::IntArrayRef part : {w.sizes(), x.sizes(), padding, stride, dilation}) key.insert(key.end(), part.begin(), part.end());
  at::Tensor packed = weights->get(key, [&] {
    at::Tensor candidate = at::mkldnn_reorder_conv2d_weight(w.to_mkldnn(), padding, stride, dilation, groups, x.sizes());
    // oneDNN picks its output layout (channels-last for a ResNet stem even from NCHW input). When
    // that is not the engine's layout, the copy into the engine's buffer transposes the output,
    // and ATen's own convolution reorders the weight on every call instead. Probe once and keep
    // the packed weight unless the output is the larger of the two (measured on ResNet's stem,
    // an 800K-element output: 1.5 ms transposing copy against 1.0 ms for ATen's convolution).
    const at::Tensor probe = onednn_conv(at::zeros(x.sizes(), at::TensorOptions().dtype(at::kFloat).memory_format(in_format)),
                                         candidate, std::nullopt, padding, stride, dilation, groups);
    return probe.is_contiguous(out_format) || probe.numel() < w.numel() ? candidate : at::Tensor();
  });
  if (!packed.defined()) return std::nullopt;  // an undefined entry: this convolution is ATen's
  return packed;
}

// The runtime's own convolution kernels, each on by default; switchable and counted per process for
// tests and A/B measurements against oneDNN's convolution.
struct ConvKernelSwitch {
  std::atomic<bool> enabled{true};
  std::atomic<int64_t> calls{0};
};
ConvKernelSwitch winograd_kernel, winograd4_kernel, depthwise_kernel, grouped_kernel, pointwise_kernel, patch_kernel,
    expand_depthwise_kernel;

ConvKernelSwitch* conv_kernel_switch(const std::string& kernel) {
  if (kernel == "winograd") return &winograd_kernel;
  if (kernel == "winograd4") return &winograd4_kernel;
  if (kernel == "depthwise") return &depthwise_kernel;
  if (kernel == "grouped") return &grouped_kernel;
  if (kernel == "pointwise") return &pointwise_kernel;
  if (kernel == "patch") return &patch_kernel;
  if (kernel == "expand_depthwise") return &expand_depthwise_kernel;
  TORCH_CHECK(false, "blade runtime: no convolution kernel named '", kernel,
              "' (winograd, winograd4, depthwise, grouped, pointwise, patch, expand_depthwise)");
}

// Winograd where it is exact enough and pays: 3x3, stride 1, no dilation or groups, channels-last
// in and out (the layout blade picks for convolutions that feed convolutions), a constant weight
// (transformed once per engine), at least kWinogradMinChannels channels each way (from
// kWinogradTimedMinChannels it is timed against the other kernels, winograd_marginal; below, the
// transforms cost more than the multiplies they save) and kWinogradMinTiles 2x2 output tiles: the
// GEMMs stream a transformed weight 16/9 the size of the original, and with few tiles they are
// bound by that stream (ResNet's 512-channel 7x7 stage, 16 tiles: on one core slower than oneDNN,
// ~1 ms per convolution; its 14x14 stage, 49 tiles: 0.2-0.4 ms faster per convolution). On more
// threads the 16 GEMMs split evenly by point, where oneDNN's batch-1 7x7 convolution scales badly:
// there Winograd may take from kWinogradMinTilesThreaded tiles (ResNet-18 b1 at 2 threads with its
// three 512-channel 3x3 convolutions on Winograd: 3.7% and 8% off the whole model on an AMD EPYC,
// two runs, each in one process, alternating; at 1 thread, CPU time, the same switch cost 8%), and
// whether it does is timed per shape (first_is_faster: on an Intel Xeon oneDNN's was 2x faster there).
constexpr int64_t kWinogradMinChannels = 64;
constexpr int64_t kWinogradTimedMinChannels = 24;
constexpr int64_t kWinogradMinTiles = 32;
constexpr int64_t kWinogradMinTilesThreaded = 16;

std::optional<Conv3x3Shape> winograd_shape(int32_t spatial, const int64_t* input_shape, const int64_t* weight_shape,
                                           const float* weight, const int64_t* strides, const int64_t* pads,
                                           const int64_t* dilations, int64_t groups, int32_t layout) {
  const int32_t channels_last = BLADE_CONV_INPUT_CHANNELS_LAST | BLADE_CONV_OUTPUT_CHANNELS_LAST;
  if (!winograd_kernel.enabled.load(std::memory_order_relaxed) || spatial != 2 || layout != channels_last || groups != 1 ||
      weight_shape[2] != 3 || weight_shape[3] != 3 || strides[0] != 1 || strides[1] != 1 || dilations[0] != 1 ||
      dilations[1] != 1 || weight_shape[0] < kWinogradTimedMinChannels || weight_shape[1] < kWinogradTimedMinChannels ||
      current_weights == nullptr || !current_weights->is_constant(weight)) {
    return std::nullopt;
  }
  const Conv3x3Shape shape{input_shape[0], input_shape[2], input_shape[3], weight_shape[1], weight_shape[0],
                           pads[0], pads[1], input_shape[2] + pads[0] + pads[2] - 2,
                           input_shape[3] + pads[1] + pads[3] - 2};
  const bool threaded = at::get_num_threads() > 1 && !serial_here();
  if (winograd_tiles(shape, 2) < (threaded ? kWinogradMinTilesThreaded : kWinogradMinTiles)) return std::nullopt;
  return shape;
}

// The depthwise kernel (depthwise.h) for every 2-D depthwise convolution (one filter per channel,
// in channels == out channels == groups) between channels-last tensors, any stride, dilation and
// padding.
std::optional<DepthwiseShape> depthwise_shape(int32_t spatial, const int64_t* input_shape, const int64_t* weight_shape,
                                              const int64_t* strides, const int64_t* pads, const int64_t* dilations,
                                              int64_t groups, int32_t layout) {
  const int32_t channels_last = BLADE_CONV_INPUT_CHANNELS_LAST | BLADE_CONV_OUTPUT_CHANNELS_LAST;
  if (!depthwise_kernel.enabled.load(std::memory_order_relaxed) || spatial != 2 || layout != channels_last || groups < 2 || groups != input_shape[1] ||
      weight_shape[0] != groups || weight_shape[1] != 1) {
    return std::nullopt;
  }
  DepthwiseShape shape{input_shape[0], input_shape[2], input_shape[3], input_shape[1], weight_shape[2],
                       weight_shape[3], strides[0], strides[1], dilations[0], dilations[1], pads[0], pads[1], 0, 0};
  shape.out_h = conv_output_extent(shape.in_h, pads[0], pads[2], shape.kernel_h, strides[0], dilations[0]);
  shape.out_w = conv_output_extent(shape.in_w, pads[1], pads[3], shape.kernel_w, strides[1], dilations[1]);
  return shape;
}

// The grouped kernel (grouped_conv.h) for every other 2-D grouped convolution between
// channels-last tensors whose groups have a multiple of 4 output channels (RegNet, ResNeXt) and at
// most kGroupedMaxGroupIn input channels, any stride, dilation and padding. Others (a channel
// multiplier of 2, groups of 2 output channels) stay oneDNN's.
std::optional<GroupedShape> grouped_shape(int32_t spatial, const int64_t* input_shape, const int64_t* weight_shape,
                                          const int64_t* strides, const int64_t* pads, const int64_t* dilations,
                                          int64_t groups, int32_t layout) {
  const int32_t channels_last = BLADE_CONV_INPUT_CHANNELS_LAST | BLADE_CONV_OUTPUT_CHANNELS_LAST;
  if (!grouped_kernel.enabled.load(std::memory_order_relaxed) || spatial != 2 || layout != channels_last || groups < 2 ||
      weight_shape[0] % (groups * kGroupedLanes) != 0 || weight_shape[1] > kGroupedMaxGroupIn) {
    return std::nullopt;
  }
  GroupedShape shape{input_shape[0], input_shape[2], input_shape[3], input_shape[1], weight_shape[0], groups,
                     weight_shape[2], weight_shape[3], strides[0], strides[1], dilations[0], dilations[1],
                     pads[0], pads[1], 0, 0};
  shape.out_h = conv_output_extent(shape.in_h, pads[0], pads[2], shape.kernel_h, strides[0], dilations[0]);
  shape.out_w = conv_output_extent(shape.in_w, pads[1], pads[3], shape.kernel_w, strides[1], dilations[1]);
  return shape;
}

// The key of a conv weight's pack in a kernel's own layout (`kind` tells the kernels' packs of one
// weight apart; the relayouts read the weight's [out, in, kh, kw] only, and engines sharing the
// constant share the pack, so its shape is part of the key).
PackedWeights::Key conv_pack_key(const float* weight, int64_t kind, const int64_t* weight_shape) {
  return {reinterpret_cast<int64_t>(weight), kind, weight_shape[0], weight_shape[1], weight_shape[2], weight_shape[3]};
}

// A weight in a kernel's own layout: laid out once for a constant weight, on every call for a
// computed one.
at::Tensor relaid_weight(const float* weight, int64_t kind, const int64_t* weight_shape,
                         const std::function<at::Tensor()>& relayout) {
  PackedWeights* weights = current_weights;
  return weights != nullptr && weights->is_constant(weight) ? weights->get(conv_pack_key(weight, kind, weight_shape), relayout)
                                                            : relayout();
}

// The output tile Winograd runs a shape in: 4x4 (F(4x4, 3x3), winograd.h) where its GEMMs have
// kWinograd4MinTiles rows or more and its transformed weight (36 x c_in x c_out floats) is at most
// 128 x 128 channels' (2.4 MB), else 2x2. In ResNet-18 b1 (AVX-512 Xeon, 2 threads, in the model,
// alternating): the 64-channel 3x3 at 56x56 (196 tiles) 0.58-0.66 -> 0.48-0.55 ms, the 128-channel
// one at 28x28 (49 tiles) 0.52-0.57 -> 0.46-0.49, the model 12.77 -> 12.05 ms; the 256-channel one
// at 14x14 (16 tiles, a 9.4 MB weight) 0.63-0.68 -> 0.99 (its GEMMs stream the weight for few
// rows), and alone at batch 2-8 slower too.
constexpr int64_t kWinograd4MinTiles = 32;
constexpr int64_t kWinograd4MaxChannelProduct = 128 * 128;
int64_t winograd_tile(const Conv3x3Shape& shape) {
  return winograd4_kernel.enabled.load(std::memory_order_relaxed) && winograd_tiles(shape, 4) >= kWinograd4MinTiles &&
                 shape.in_channels * shape.out_channels <= kWinograd4MaxChannelProduct
             ? 4
             : 2;
}

void conv_winograd(const Conv3x3Shape& shape, const float* input, const int64_t* weight_shape, const float* weight,
                   const float* bias, const float* sum, Activation act, float* output) {
  PackedWeights* weights = current_weights;
  const auto run = [&](int64_t tile) {
    const at::Tensor u = weights->get(conv_pack_key(weight, tile == 4 ? -5 /* winograd 4x4 */ : -1 /* winograd */,
                                                    weight_shape),
                                      [&] { return winograd_weight(weight, shape.out_channels, shape.in_channels, tile); });
    // so its GEMMs pack it (also when another engine of the same weight transformed it)
    if (!weights->is_constant(u.const_data_ptr())) weights->add_constant(u.const_data_ptr(), u.nbytes());
    return winograd_conv3x3(shape, tile, input, u.const_data_ptr<float>(), bias, sum, act.clamp, output, weights);
  };
  // F(4x4) declines an input that is not all finite (winograd.h): F(2x2) then
  if (winograd_tile(shape) == 4 && run(4)) {
    winograd4_kernel.calls.fetch_add(1, std::memory_order_relaxed);
  } else {
    run(2);
  }
  unary_output(output, shape.batch * shape.out_h * shape.out_w * shape.out_channels, act);
  winograd_kernel.calls.fetch_add(1, std::memory_order_relaxed);
}

constexpr int kChoiceTimings = 3;  // timed calls each, after each way's first (packing) call
constexpr int64_t kWinogradChoice = 0, kPatchChoice = 1;  // first_is_faster keys' first entry

bool first_is_faster(std::vector<int64_t> key, int64_t outputs, int64_t weight_bytes, const float* weight,
                     const std::function<void(float*)>& first, const std::function<void(float*)>& second);
void conv_library(int32_t spatial, const int64_t* input_shape, const float* input, const int64_t* weight_shape,
                  const float* weight, const float* bias, const int64_t* strides, const int64_t* pads,
                  const int64_t* dilations, int64_t groups, float* output, int32_t layout, const float* sum,
                  Activation act);

// Where the patch kernel may lose to oneDNN's, one timing per process and shape decides
// (first_is_faster): a gathered window (not 1x1) of at least 32 input channels into fewer than 64
// output channels (one or two 32-channel panels, few multiplies per gathered value). On an Intel
// Xeon (AVX-512, 2 threads) oneDNN ran such 3x3 convolutions 5-22% faster (DPT's head: 32 -> 32
// at 224x224 4.85 -> 4.31 ms, 64 -> 32 at 112x112 2.36 -> 1.81), where from fewer input channels
// (16 -> 32: 1.3x; a 3-channel stem: 2.7x) or into 64 (even) the patch kernel held. Not inside a
// parallel region or in serial mode (may_time_here): the patch kernel there.
std::atomic<bool> patch_timing{true};  // set_patch_timing

// Whether this call may time a shape (first_is_faster): not in serial mode, and not inside a
// parallel region (an engine's own loop), where a timing's lock held while its convolutions use
// the thread pool would deadlock a pool thread waiting on it.
bool may_time_here() { return !serial_here() && !at::in_parallel_region(); }

bool patch_marginal(const PatchConvShape& shape) {
  return patch_timing.load(std::memory_order_relaxed) && shape.kernel_h * shape.kernel_w > 1 &&
         shape.in_channels >= 32 && shape.out_channels < 64 && may_time_here();
}

// Every convolution Winograd does not run: the runtime's other kernels, else oneDNN or ATen.
void conv_other(int32_t spatial, const int64_t* input_shape, const float* input, const int64_t* weight_shape,
                const float* weight, const float* bias, const int64_t* strides, const int64_t* pads,
                const int64_t* dilations, int64_t groups, float* output, int32_t layout, const float* sum,
                Activation act) {
  if (const auto shape = depthwise_shape(spatial, input_shape, weight_shape, strides, pads, dilations, groups, layout)) {
    const int64_t taps = shape->kernel_h * shape->kernel_w;
    const at::Tensor tap_weight = relaid_weight(weight, -2 /* depthwise */, weight_shape, [&] {
      return depthwise_tap_weight(weight, shape->channels, taps);
    });
    depthwise_conv2d(*shape, input, tap_weight.const_data_ptr<float>(), bias, sum, act, output);
    depthwise_kernel.calls.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const auto pointwise = [&] {
    if (!pointwise_kernel.enabled.load(std::memory_order_relaxed)) return false;
    const auto shape = pointwise_shape(spatial, input_shape, weight_shape, strides, pads, dilations, groups, layout);
    if (!shape) return false;
    pointwise_conv(*shape, input, weight, bias, sum, act.clamp, output);
    unary_output(output, shape->batch * shape->pixels * shape->out_channels, act);
    pointwise_kernel.calls.fetch_add(1, std::memory_order_relaxed);
    return true;
  };
  // A grouped 1x1 whose groups are wide enough for GEMMs: those (the grouped kernel sums 4-24
  // output channels a tile; SqueezeBERT's 64-256 channel groups took 0.17 ms there, 0.09-0.11 as GEMMs).
  if (groups > 1 && pointwise()) return;
  if (const auto shape = grouped_shape(spatial, input_shape, weight_shape, strides, pads, dilations, groups, layout)) {
    const at::Tensor packed = relaid_weight(weight, -4 /* grouped */, weight_shape,
                                            [&] { return grouped_conv_weight(weight, *shape); });
    grouped_conv2d(*shape, input, packed.const_data_ptr<float>(), bias, sum, act.clamp, output);
    unary_output(output, shape->batch * shape->out_h * shape->out_w * shape->out_channels, act);
    grouped_kernel.calls.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (patch_kernel.enabled.load(std::memory_order_relaxed)) {
    if (const auto shape = patch_conv_shape(spatial, input_shape, weight_shape, strides, pads, dilations, groups, layout)) {
      const auto run_patch = [&](float* out) {
        const at::Tensor panels = relaid_weight(weight, -3 /* patch */, weight_shape,
                                                [&] { return patch_conv_weight(weight, *shape); });
        patch_conv(*shape, input, panels.const_data_ptr<float>(), bias, sum, act, out);
      };
      const auto run_library = [&](float* out) {
        conv_library(spatial, input_shape, input, weight_shape, weight, bias, strides, pads, dilations, groups, out,
                     layout, sum, act);
      };
      const std::vector<int64_t> key = {kPatchChoice, shape->batch, shape->in_channels, shape->in_h, shape->in_w,
                                        shape->out_channels, shape->kernel_h, shape->kernel_w, shape->stride_h,
                                        shape->stride_w, shape->dilation_h, shape->dilation_w, shape->pad_top,
                                        shape->pad_left, shape->out_h, shape->out_w, layout};
      const int64_t weight_bytes = shape->out_channels * shape->depth() * static_cast<int64_t>(sizeof(float));
      const int64_t outputs = shape->batch * shape->out_h * shape->out_w * shape->out_channels;
      if (!patch_marginal(*shape) || first_is_faster(key, outputs, weight_bytes, weight, run_patch, run_library)) {
        run_patch(output);
        patch_kernel.calls.fetch_add(1, std::memory_order_relaxed);
        return;
      }
    }
  }
  if (pointwise()) return;
  conv_library(spatial, input_shape, input, weight_shape, weight, bias, strides, pads, dilations, groups, output, layout,
               sum, act);
}

// oneDNN's convolution on a weight packed once, else ATen's.
void conv_library(int32_t spatial, const int64_t* input_shape, const float* input, const int64_t* weight_shape,
                  const float* weight, const float* bias, const int64_t* strides, const int64_t* pads,
                  const int64_t* dilations, int64_t groups, float* output, int32_t layout, const float* sum,
                  Activation act) {
  const bool out_channels_last = (layout & BLADE_CONV_OUTPUT_CHANNELS_LAST) != 0;
  at::Tensor x = engine_tensor(input, at::IntArrayRef(input_shape, 2 + spatial),
                               (layout & BLADE_CONV_INPUT_CHANNELS_LAST) != 0);
  const at::Tensor w = dense(weight, at::IntArrayRef(weight_shape, 2 + spatial));
  std::optional<at::Tensor> b;
  if (bias != nullptr) b = dense(bias, at::IntArrayRef(weight_shape, 1));
  std::vector<int64_t> padding(pads, pads + spatial);
  if (!std::equal(pads, pads + spatial, pads + spatial)) {
    // ATen pads symmetrically only: pad explicitly (constant_pad_nd lists the last dim first).
    std::vector<int64_t> pad_nd;
    for (int32_t d = spatial - 1; d >= 0; --d) {
      pad_nd.push_back(pads[d]);
      pad_nd.push_back(pads[spatial + d]);
    }
    x = at::constant_pad_nd(x, pad_nd, 0);
    std::fill(padding.begin(), padding.end(), 0);
  }
  const at::IntArrayRef stride(strides, spatial), dilation(dilations, spatial);
  at::Tensor y;
  const at::MemoryFormat out_format = out_channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  std::optional<at::Tensor> addend;
  if (sum != nullptr) {
    addend = engine_tensor(sum, conv_output_sizes(x, w, padding, stride, dilation), out_channels_last);
  }
  // The activation is the runtime's own, applied while copying into the engine's buffer: oneDNN's
  // eltwise post-ops (relu, clip) turn NaN into 0 or a bound, where torch keeps NaN.
  if (auto packed = packed_conv_weight(spatial, weight, w, x, padding, stride, dilation, groups, out_format)) {
    y = onednn_conv(x, *packed, b, padding, stride, dilation, groups, addend);
  } else {
    const std::vector<int64_t> output_padding(spatial, 0);
    y = at::convolution(x, w, b, stride, padding, dilation, false, output_padding, groups);
    if (addend) y.add_(*addend);
  }
  // Both return a fresh tensor: one cheap pass into the engine's buffer (the same layout when
  // the probe above kept oneDNN), next to the convolution.
  if (y.numel() == 0) return;
  if (y.is_contiguous(out_format)) {
    copy_activated(y.const_data_ptr<float>(), output, y.numel(), act);
  } else {
    engine_tensor(output, y.sizes(), out_channels_last).copy_(y);
    if (act.clamp.on || act.unary != Unary::none) copy_activated(output, output, y.numel(), act);
  }
}

// Where Winograd may or may not pay (a few tiles on several threads, winograd_marginal) one timing
// per process and shape decides: the first call at the shape runs both ways a few times on its own
// operands into a scratch output, each packing its weight into packs of its own that are dropped
// afterwards (so only the winner's packs live in the engine), and the faster runs from then on.
// ResNet-18 b1's three 512-channel 3x3 convolutions at 7x7 (16 tiles), 2 threads: on an AMD EPYC
// (AVX2) Winograd took 3.7-8% off the whole model; on an Intel Xeon (AVX-512) it took 2.37 ms a
// convolution where oneDNN's took 1.23 (ONNX Runtime's 1.36), 13% of the model.

// So are 24-63 channels either way (DPT's and Depth Anything's heads): on the AVX-512 Xeon, 2
// threads, channels-last, medians of 6 alternating runs against the best other kernel: 24 -> 24
// and 32 -> 64 at 112x112 1.30x / 1.35x, 32 -> 128 at 56x56 1.39x; 32 -> 32 at 224x224, 64 -> 32
// at 112x112 and 48 -> 48 at 56x56 even (0.97-1.03: memory-bound, single runs swung either way
// with the machine's load); 32 -> 32 at 28x28 / 14x14 0.80x / 0.45x of the patch kernel (few
// tiles split over the threads); from 16 channels it lost (32 -> 16: 0.85x). On one thread
// (single runs) F(4x4) was 1.36-1.71x faster at every such shape tried.
// Where a call may not time (may_time_here) it keeps the rule from before (Winograd from
// kWinogradMinTilesThreaded tiles; on one thread, as there, Winograd won at every few-channel
// shape measured).
bool winograd_marginal(const Conv3x3Shape& shape) {
  if (shape.in_channels < kWinogradMinChannels || shape.out_channels < kWinogradMinChannels) return may_time_here();
  return at::get_num_threads() > 1 && may_time_here() && winograd_tiles(shape, 2) < kWinogradMinTiles;
}

struct TimedChoices {
  // held while a shape is timed: two timings at once would time each other (recursive: a timed way
  // may be a convolution that times its own choice)
  std::recursive_mutex mutex;
  std::map<std::vector<int64_t>, bool> first_wins;
};

TimedChoices& timed_choices() {
  static TimedChoices choices;
  return choices;
}

// Whether `first` computes the convolution keyed `key` (its kind, shape and threads) faster than
// `second`, timed once per process and key (winograd_marginal, patch_marginal): each runs a few
// times on the call's own operands into a scratch output of `outputs` floats, packing its weight
// into packs of its own that are dropped afterwards (so only the winner's packs live in the engine).
bool first_is_faster(std::vector<int64_t> key, int64_t outputs, int64_t weight_bytes, const float* weight,
                     const std::function<void(float*)>& first, const std::function<void(float*)>& second) {
  key.push_back(at::get_num_threads());
  TimedChoices& choices = timed_choices();
  std::lock_guard<std::recursive_mutex> lock(choices.mutex);
  if (const auto it = choices.first_wins.find(key); it != choices.first_wins.end()) return it->second;
  PackedWeights own;  // the timing's packs, freed when it ends
  own.add_constant(weight, weight_bytes);
  const PackingScope scope(&own);
  at::Tensor scratch = at::empty({outputs}, at::kFloat);
  float* out = scratch.mutable_data_ptr<float>();
  first(out);  // each way's first call packs
  second(out);
  std::array<double, 2> best = {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity()};
  for (int i = 0; i < kChoiceTimings; ++i) {
    for (int way = 0; way < 2; ++way) {
      const auto start = std::chrono::steady_clock::now();
      (way == 0 ? first : second)(out);
      best[way] = std::min(best[way], std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  return choices.first_wins[key] = best[0] <= best[1];
}

void conv(int32_t spatial, const int64_t* input_shape, const float* input, const int64_t* weight_shape,
          const float* weight, const float* bias, const int64_t* strides, const int64_t* pads,
          const int64_t* dilations, int64_t groups, float* output, int32_t layout, const float* sum,
          const BladeActivation* activation) {
  TORCH_CHECK(layout == 0 || spatial <= 2, "blade runtime: channels-last convolution must be 1-D or 2-D");
  if (spatial == 1) {
    // [n, c, l] is [n, c, 1, l] (and [n, l, c] channels-last is [n, 1, l, c]): the 2-D kernels take
    // it, e.g. a depthwise or grouped Conv1d the runtime's kernels and not oneDNN's.
    const int64_t input_2d[] = {input_shape[0], input_shape[1], 1, input_shape[2]};
    const int64_t weight_2d[] = {weight_shape[0], weight_shape[1], 1, weight_shape[2]};
    const int64_t strides_2d[] = {1, strides[0]}, dilations_2d[] = {1, dilations[0]};
    const int64_t pads_2d[] = {0, pads[0], 0, pads[1]};
    return conv(2, input_2d, input, weight_2d, weight, bias, strides_2d, pads_2d, dilations_2d, groups, output, layout,
                sum, activation);
  }
  // Engine::execute decides serial mode once per call, but a stall seen by an earlier region of the
  // same call starts it too: from then on, this call's GEMMs and convolutions (MKL's and ATen's own
  // OpenMP regions, which no timed region covers) run on the calling thread as well. Under load a
  // T5 b8 call that started parallel took ~1 s instead of ~150 ms serially, its GEMMs still on 2
  // threads after serial mode had begun.
  const SerialScope serial_while_oversubscribed;
  const Activation act = activation_of(activation);
  const auto run_other = [&](float* out) {
    conv_other(spatial, input_shape, input, weight_shape, weight, bias, strides, pads, dilations, groups, out, layout,
               sum, act);
  };
  if (const auto shape = winograd_shape(spatial, input_shape, weight_shape, weight, strides, pads, dilations, groups,
                                       layout)) {
    const auto run_winograd = [&](float* out) {
      conv_winograd(*shape, input, weight_shape, weight, bias, sum, act, out);
    };
    const int64_t weight_bytes = weight_shape[0] * weight_shape[1] * 9 * static_cast<int64_t>(sizeof(float));
    const std::vector<int64_t> key = {kWinogradChoice, shape->batch, shape->in_h, shape->in_w, shape->in_channels,
                                      shape->out_channels, shape->pad_top, shape->pad_left, shape->out_h, shape->out_w};
    const int64_t outputs = shape->batch * shape->out_h * shape->out_w * shape->out_channels;
    if (!winograd_marginal(*shape) || first_is_faster(key, outputs, weight_bytes, weight, run_winograd, run_other)) {
      return run_winograd(output);
    }
  }
  run_other(output);
}

void conv_call(const BladeConv& c) {
  conv(c.spatial, c.input_shape, c.input, c.weight_shape, c.weight, c.bias, c.strides, c.pads, c.dilations, c.groups,
       c.output, c.layout, c.sum, c.activation);
}

// The pair as one expand_depthwise.h call when first is a 1x1 convolution the patch kernel runs in
// place (constant weight, no sum), second a depthwise one the depthwise kernel runs, and together
// pays; false otherwise (nothing computed).
bool expand_depthwise_pair(const BladeConv& first, const BladeConv& second) {
  if (!expand_depthwise_kernel.enabled.load(std::memory_order_relaxed) ||
      !patch_kernel.enabled.load(std::memory_order_relaxed) || first.sum != nullptr || current_weights == nullptr ||
      !current_weights->is_constant(first.weight) || !current_weights->is_constant(second.weight) ||
      second.input != first.output || first.spatial != 2 || second.spatial != 2) {
    return false;
  }
  const auto expand = patch_conv_shape(first.spatial, first.input_shape, first.weight_shape, first.strides, first.pads,
                                       first.dilations, first.groups, first.layout);
  const auto depthwise = depthwise_shape(second.spatial, second.input_shape, second.weight_shape, second.strides,
                                         second.pads, second.dilations, second.groups, second.layout);
  if (!expand || !depthwise || !expand_feeds_depthwise(*expand, *depthwise) ||
      !expand_depthwise_pays(*expand, *depthwise, serial_here() ? 1 : at::get_num_threads())) {
    return false;
  }
  // the packs the two convolutions apart use (shared with them, one per weight and kind)
  const at::Tensor panels = relaid_weight(first.weight, -3 /* patch */, first.weight_shape,
                                          [&] { return patch_conv_weight(first.weight, *expand); });
  const at::Tensor taps = relaid_weight(second.weight, -2 /* depthwise */, second.weight_shape, [&] {
    return depthwise_tap_weight(second.weight, depthwise->channels, depthwise->kernel_h * depthwise->kernel_w);
  });
  expand_depthwise_conv2d(*expand, first.input, panels.const_data_ptr<float>(), first.bias,
                          activation_of(first.activation), *depthwise, taps.const_data_ptr<float>(), second.bias,
                          second.sum, activation_of(second.activation), second.output);
  expand_depthwise_kernel.calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void conv_pair(const BladeConv* first, const BladeConv* second) {
  {
    const SerialScope serial_while_oversubscribed;  // as conv's
    if (expand_depthwise_pair(*first, *second)) return;
  }
  conv_call(*first);
  conv_call(*second);
}

void attention(const BladeAttention* a) {
  const SerialScope serial_while_oversubscribed;  // as sgemm's
  blade::attention(*a, current_weights);
}

const BladeRuntime kRuntime = {BLADE_ABI_VERSION, &sgemm, &parallel_for, &conv, &attention, &conv_pair};

}  // namespace

const BladeRuntime* runtime() { return &kRuntime; }

void set_conv_kernel_enabled(const std::string& kernel, bool enabled) {
  conv_kernel_switch(kernel)->enabled.store(enabled, std::memory_order_relaxed);
}

int64_t conv_kernel_calls(const std::string& kernel) {
  return conv_kernel_switch(kernel)->calls.load(std::memory_order_relaxed);
}

// ---- PackedWeights ----

PackedWeights::~PackedWeights() = default;

void PackedWeights::add_constant(const void* data, size_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(data);
  std::unique_lock<std::shared_mutex> lock(ranges_mutex_);
  constant_ranges_.emplace_back(begin, begin + bytes);
}

bool PackedWeights::is_constant(const void* data) const {
  const auto address = reinterpret_cast<uintptr_t>(data);
  std::shared_lock<std::shared_mutex> lock(ranges_mutex_);
  return std::any_of(constant_ranges_.begin(), constant_ranges_.end(),
                     [&](const auto& range) { return range.first <= address && address < range.second; });
}

namespace {

// Every engine's packs, weakly, by key: engines holding one constant storage (the captures of an
// export share equal weights, blade/shared_constants.py) pack each of its weights once. A key starts
// with an address inside a constant of the engine that asks (callers check is_constant), and every
// engine holding a pack holds the constant it was made from, so while a pack lives the bytes at its
// address are the ones it was packed from; once the last engine holding it is gone it is freed (a
// weak reference keeps no memory but the tensor's small header, dropped by the next sweep).
class SharedPacks {
 public:
  at::Tensor find(const PackedWeights::Key& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = packs_.find(key);
    if (it == packs_.end()) return at::Tensor();
    auto impl = it->second.lock();
    return impl ? at::Tensor(std::move(impl)) : at::Tensor();
  }
  void add(const PackedWeights::Key& key, const at::Tensor& pack) {
    if (!pack.defined()) return;  // "no pack here" entries are cheap to find again
    std::lock_guard<std::mutex> lock(mutex_);
    packs_.insert_or_assign(key, Weak(pack.getIntrusivePtr()));
    if (packs_.size() >= 2 * live_after_sweep_ + 64) {  // amortized: each sweep at least halves what it walks next
      for (auto it = packs_.begin(); it != packs_.end();) it = it->second.expired() ? packs_.erase(it) : std::next(it);
      live_after_sweep_ = packs_.size();
    }
  }

 private:
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  std::mutex mutex_;
  std::map<PackedWeights::Key, Weak> packs_;
  size_t live_after_sweep_ = 0;
};

SharedPacks& shared_packs() {
  static SharedPacks* packs = new SharedPacks();  // never destroyed: engines may outlive static destructors
  return *packs;
}

}  // namespace

at::Tensor PackedWeights::get(const Key& key, const std::function<at::Tensor()>& pack) {
  std::lock_guard<std::mutex> lock(mutex_);  // packing under the lock: concurrent first calls pack once
  auto it = packed_.find(key);
  if (it == packed_.end()) {
    at::Tensor made = shared_packs().find(key);
    if (!made.defined()) {
      made = pack();
      packs_made.fetch_add(1, std::memory_order_relaxed);
      shared_packs().add(key, made);
    }
    it = packed_.emplace(key, std::move(made)).first;
  }
  return it->second;
}

bool PackedWeights::has(const Key& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (packed_.count(key) != 0) return true;
  at::Tensor shared = shared_packs().find(key);  // another engine's pack of the same constant: adopt it
  if (!shared.defined()) return false;
  packed_.emplace(key, std::move(shared));
  return true;
}

int64_t packed_weight_count() { return packs_made.load(std::memory_order_relaxed); }

void set_patch_timing(bool on) { patch_timing.store(on, std::memory_order_relaxed); }

int64_t timed_conv_shapes() {
  TimedChoices& choices = timed_choices();
  std::lock_guard<std::recursive_mutex> lock(choices.mutex);
  return static_cast<int64_t>(choices.first_wins.size());
}

PackingScope::PackingScope(PackedWeights* weights) : previous_(current_weights) { current_weights = weights; }
PackingScope::~PackingScope() { current_weights = previous_; }

}  // namespace blade
