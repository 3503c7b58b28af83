// The BladeRuntime callbacks (GEMM, threads, convolution) on torch's own libraries.
//
// GEMM: MKL's Fortran sgemm_, which the torch wheel's libtorch_cpu exports, called directly (found
// with dlsym at first use): an addmm through ATen costs a few microseconds of tensor wrapping per
// call, a lot next to the small GEMMs of an MLP. Builds without MKL, and arguments BLAS cannot
// express, go through ATen.
// Convolution: 3x3 stride-1 channels-last convolutions with a constant weight and >= 64 channels
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
#include "conv_gemm.h"
#include "depthwise.h"
#include "winograd.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mkldnn_reorder_conv2d_weight.h>
#include <ATen/ops/to_mkldnn.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace blade {
namespace {

thread_local PackedWeights* current_weights = nullptr;  // set by PackingScope

// ---- GEMM ----

// Fortran BLAS sgemm (column-major, LP64: 32-bit integers), as MKL exports it.
using FortranSgemm = void (*)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                              const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                              const float* beta, float* c, const int* ldc);

// MKL's packed GEMM: an operand copied once into MKL's internal layout (alpha folded in), then
// multiplied many times with identifier 'P' in its transa/transb slot.
using FortranSgemmPackGetSize = size_t (*)(const char* identifier, const int* m, const int* n, const int* k);
using FortranSgemmPack = void (*)(const char* identifier, const char* trans, const int* m, const int* n,
                                  const int* k, const float* alpha, const float* src, const int* ld, float* dest);
using FortranSgemmCompute = void (*)(const char* transa, const char* transb, const int* m, const int* n,
                                     const int* k, const float* a, const int* lda, const float* b, const int* ldb,
                                     const float* beta, float* c, const int* ldc);

struct Mkl {
  FortranSgemm sgemm = nullptr;  // null: no MKL, use ATen
  FortranSgemmPackGetSize pack_get_size = nullptr;
  FortranSgemmPack pack = nullptr;
  FortranSgemmCompute compute = nullptr;
  bool can_pack() const { return pack_get_size && pack && compute; }
};

// MKL's BLAS from the library that holds ATen (libtorch_cpu in torch's wheels); empty without MKL.
Mkl find_mkl() {
  Mkl mkl;
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&at::get_num_threads), &info) == 0 || info.dli_fname == nullptr) return mkl;
  void* handle = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);  // already loaded: only a reference
  // Only MKL's: a reference BLAS sgemm_ elsewhere could be single-threaded or slower than ATen's.
  if (handle == nullptr || dlsym(handle, "mkl_get_max_threads") == nullptr) return mkl;
  mkl.sgemm = reinterpret_cast<FortranSgemm>(dlsym(handle, "sgemm_"));
  mkl.pack_get_size = reinterpret_cast<FortranSgemmPackGetSize>(dlsym(handle, "sgemm_pack_get_size_"));
  mkl.pack = reinterpret_cast<FortranSgemmPack>(dlsym(handle, "sgemm_pack_"));
  mkl.compute = reinterpret_cast<FortranSgemmCompute>(dlsym(handle, "sgemm_compute_"));
  return mkl;
}

const Mkl& mkl() {
  static const Mkl found = find_mkl();
  return found;
}

bool fits_int(int64_t v) { return v >= 0 && v <= std::numeric_limits<int>::max(); }

// A non-owning float view of engine memory. `batch_stride` may be 0 (an operand shared by every
// batch); `transposed` reads element [r][c] at c * ld + r instead of r * ld + c.
at::Tensor view(const float* data, int64_t batch, int64_t batch_stride, int64_t rows, int64_t cols,
                int64_t ld, bool transposed) {
  const std::array<int64_t, 3> sizes = {batch, rows, cols};
  const std::array<int64_t, 3> strides = {batch_stride, transposed ? 1 : ld, transposed ? ld : 1};
  const size_t first = batch == 1 ? 1 : 0;  // a single GEMM is a 2-D view
  return at::for_blob(const_cast<float*>(data), at::IntArrayRef(sizes.data() + first, 3 - first))
      .strides(at::IntArrayRef(strides.data() + first, 3 - first))
      .options(at::TensorOptions().dtype(at::kFloat))
      .target_device(at::kCPU)
      .make_tensor();
}

// at::cpu:: calls the CPU kernels directly: no dispatcher or autograd hops. With C passed as both
// `self` and `out`, ATen accumulates in place, and beta == 0 ignores C's old contents.
void aten_sgemm(int64_t batch, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                int64_t stride_a, int32_t trans_a, const float* b, int64_t ldb, int64_t stride_b,
                int32_t trans_b, float beta, float* c, int64_t ldc, int64_t stride_c) {
  at::Tensor va = view(a, batch, stride_a, m, k, lda, trans_a != 0);
  at::Tensor vb = view(b, batch, stride_b, k, n, ldb, trans_b != 0);
  at::Tensor vc = view(c, batch, stride_c, m, n, ldc, false);
  if (batch == 1) {
    at::cpu::addmm_out(vc, vc, va, vb, beta, alpha);
  } else {
    at::cpu::baddbmm_out(vc, vc, va, vb, beta, alpha);
  }
}

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands, keep the
// transposition flags. BLAS wants every leading dimension at least the rows of its column-major
// operand; anything else (never emitted by blade's codegen) goes to ATen.
bool blas_can_take(int64_t m, int64_t n, int64_t k, int64_t lda, int32_t trans_a, int64_t ldb,
                   int32_t trans_b, int64_t ldc) {
  const bool sizes_fit = fits_int(m) && fits_int(n) && fits_int(k) && fits_int(lda) && fits_int(ldb) &&
                         fits_int(ldc);
  return sizes_fit && lda >= std::max<int64_t>(1, trans_a ? m : k) &&
         ldb >= std::max<int64_t>(1, trans_b ? k : n) && ldc >= std::max<int64_t>(1, n);
}

// B (the Fortran call's first operand) packed by MKL once per engine when it is one of the
// engine's constants shared by the whole batch (a weight); nullptr otherwise.
const float* packed_gemm_weight(PackedWeights* weights, const float* b, int32_t trans_b, int64_t stride_b, int batch,
                                int n, int m, int k, float alpha, int ldb) {
  if (weights == nullptr || !mkl().can_pack() || k == 0 || (batch > 1 && stride_b != 0) || !weights->is_constant(b)) {
    return nullptr;
  }
  int32_t alpha_bits;
  std::memcpy(&alpha_bits, &alpha, sizeof alpha_bits);
  const PackedWeights::Key key = {reinterpret_cast<int64_t>(b), trans_b, n, m, k, ldb, alpha_bits};
  const at::Tensor packed = weights->get(key, [&] {
    const char identifier = 'A', trans = trans_b ? 'T' : 'N';
    const size_t bytes = mkl().pack_get_size(&identifier, &n, &m, &k);
    at::Tensor dest = at::empty({static_cast<int64_t>((bytes + sizeof(float) - 1) / sizeof(float))}, at::kFloat);
    mkl().pack(&identifier, &trans, &n, &m, &k, &alpha, b, &ldb, dest.mutable_data_ptr<float>());
    return dest;
  });
  return packed.const_data_ptr<float>();  // the engine's PackedWeights keeps it alive
}


// MKL runs a GEMM with few rows (a Linear on a handful of tokens) on about one core: on the MLP
// block's [8, 256] x [256, 1024] it took 47 us with two threads, as long as one core's FMAs
// need. Such GEMMs are split here into column blocks, one per thread of ATen's pool, each a
// serial MKL call on its own packed slice of the weight. Few rows only: with many, MKL
// threads well itself. Columns per block stay a multiple of 16 floats (whole cache lines of C).
constexpr int64_t kSplitMaxRows = 32;
std::atomic<int64_t> split_max_rows{kSplitMaxRows};  // settable for tests and A/B measurements
constexpr int64_t kSplitMinColumns = 128;  // per block: narrower slices are not worth a wake-up
constexpr int64_t kSplitAlign = 16;

// The number of column blocks for one GEMM of m rows and n columns (1: no split).
int64_t column_blocks(int64_t batch, int64_t m, int64_t n) {
  if (batch != 1 || m > split_max_rows.load(std::memory_order_relaxed) || at::in_parallel_region()) {
    return 1;
  }
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / kSplitMinColumns));
}

// One sgemm's Fortran arguments (row-major C = op(A) op(B) as column-major C^T = op(B)^T op(A)^T),
// run on a column range [n0, n0 + width) of C, i.e. a row range of the Fortran call's first
// operand: B's columns start at b + n0 (at row n0, b + n0 * ldb, when B is stored transposed).
struct BlasGemm {
  char ta, tb;
  int m, k, lda, ldb, ldc;
  float alpha, beta;
  const float* a;
  const float* b;
  float* c;
  int64_t stride_a, stride_b, stride_c;
  int32_t trans_b;
  int batch;
  PackedWeights* weights;  // the calling thread's scope: pool threads have none of their own

  const float* b_columns(int64_t i, int n0) const {
    return b + i * stride_b + (trans_b ? static_cast<int64_t>(n0) * ldb : n0);
  }
  // MKL's packed copy of the columns' B when B is a constant shared by the batch, else nullptr
  // (looked up once per column block, not per GEMM of a batch).
  const float* packed(int n0, int width) const {
    return packed_gemm_weight(weights, b_columns(0, n0), trans_b, stride_b, batch, width, m, k, alpha, ldb);
  }
  void run(int64_t i, int n0, int width, const float* packed_b) const {
    const float* a_i = a + i * stride_a;
    float* c_columns = c + i * stride_c + n0;
    if (packed_b != nullptr) {
      const char packed_slot = 'P';
      mkl().compute(&packed_slot, &ta, &width, &m, &k, packed_b, &ldb, a_i, &lda, &beta, c_columns, &ldc);
    } else {
      mkl().sgemm(&tb, &ta, &width, &m, &k, &alpha, b_columns(i, n0), &ldb, a_i, &lda, &beta, c_columns, &ldc);
    }
  }
};

void sgemm(int64_t batch, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           int64_t stride_a, int32_t trans_a, const float* b, int64_t ldb, int64_t stride_b,
           int32_t trans_b, float beta, float* c, int64_t ldc, int64_t stride_c) {
  if (batch <= 0 || m <= 0 || n <= 0) return;
  if (mkl().sgemm == nullptr || !blas_can_take(m, n, k, lda, trans_a, ldb, trans_b, ldc) || !fits_int(batch)) {
    aten_sgemm(batch, m, n, k, alpha, a, lda, stride_a, trans_a, b, ldb, stride_b, trans_b, beta, c, ldc,
               stride_c);
    return;
  }
  const BlasGemm gemm{trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', static_cast<int>(m), static_cast<int>(k),
                      static_cast<int>(lda), static_cast<int>(ldb), static_cast<int>(ldc), alpha, beta, a, b, c,
                      stride_a, stride_b, stride_c, trans_b, static_cast<int>(batch), current_weights};
  const int64_t blocks = column_blocks(batch, m, n);
  if (blocks > 1) {
    const int64_t width = (n + blocks - 1) / blocks;
    const int64_t block_width = (width + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        const int64_t n0 = j * block_width;
        if (n0 >= n) continue;
        const int column = static_cast<int>(n0), width = static_cast<int>(std::min(block_width, n - n0));
        gemm.run(0, column, width, gemm.packed(column, width));
      }
    });
    return;
  }
  const int width = static_cast<int>(n);
  const float* packed_b = gemm.packed(0, width);
  if (batch == 1 || batch < at::get_num_threads()) {
    for (int64_t i = 0; i < batch; ++i) gemm.run(i, 0, width, packed_b);  // MKL threads each GEMM itself
    return;
  }
  // Many small GEMMs (attention heads): one per task; MKL runs serially inside a parallel region.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) gemm.run(i, 0, width, packed_b);
  });
}

// ---- threads ----

void parallel_for(int64_t begin, int64_t end, int64_t grain, blade_range_fn fn, void* ctx) {
  // ATen divides by the grain; a generated loop may ask for 0 meaning "any chunking".
  at::parallel_for(begin, end, std::max<int64_t>(grain, 1),
                   [fn, ctx](int64_t chunk_begin, int64_t chunk_end) { fn(ctx, chunk_begin, chunk_end); });
}

// ---- convolution ----

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
// passes and Inductor's CPU freezing call): mkldnn::_convolution_pointwise, with the epilogue as
// oneDNN post-ops (a binary "add" post-op reading `sum`, an eltwise one for the activation; the
// "sum" post-op is only offered in place, into `sum` itself).
at::Tensor onednn_conv(const at::Tensor& x, const at::Tensor& packed_weight, const std::optional<at::Tensor>& bias,
                       at::IntArrayRef padding, at::IntArrayRef stride, at::IntArrayRef dilation, int64_t groups,
                       const std::optional<at::Tensor>& sum = std::nullopt, int32_t activation = BLADE_ACTIVATION_NONE) {
  static const c10::OperatorHandle unary =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_convolution_pointwise", "");
  static const c10::OperatorHandle binary =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_convolution_pointwise", "binary");
  const bool relu = activation == BLADE_ACTIVATION_RELU;
  const c10::IValue b = bias ? c10::IValue(*bias) : c10::IValue();
  const auto no_scalars = c10::List<std::optional<at::Scalar>>();
  std::vector<c10::IValue> stack;
  if (sum) {
    stack = {x, *sum, packed_weight, b, padding.vec(), stride.vec(), dilation.vec(), groups, std::string("add"),
             at::Scalar(1.0), relu ? c10::IValue(std::string("relu")) : c10::IValue(), no_scalars, c10::IValue()};
    binary.callBoxed(&stack);
  } else {
    stack = {x, packed_weight, b, padding.vec(), stride.vec(), dilation.vec(), groups,
             std::string(relu ? "relu" : "none"), no_scalars, c10::IValue()};
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
ConvKernelSwitch winograd_kernel, depthwise_kernel, pointwise_kernel;

ConvKernelSwitch* conv_kernel_switch(const std::string& kernel) {
  if (kernel == "winograd") return &winograd_kernel;
  if (kernel == "depthwise") return &depthwise_kernel;
  if (kernel == "pointwise") return &pointwise_kernel;
  TORCH_CHECK(false, "blade runtime: no convolution kernel named '", kernel, "' (winograd, depthwise, pointwise)");
}

// Winograd where it is exact enough and pays: 3x3, stride 1, no dilation or groups, channels-last
// in and out (the layout blade picks for convolutions that feed convolutions), a constant weight
// (transformed once per engine), at least kWinogradMinChannels channels each way (below that the
// transforms cost more than the multiplies they save) and kWinogradMinTiles 2x2 output tiles: the
// GEMMs stream a transformed weight 16/9 the size of the original, and with few tiles they are
// bound by that stream (ResNet's 512-channel 7x7 stage, 16 tiles: no faster than oneDNN, measured
// in one process; its 14x14 stage, 49 tiles: 0.2-0.4 ms faster per convolution).
constexpr int64_t kWinogradMinChannels = 64;
constexpr int64_t kWinogradMinTiles = 32;

std::optional<Conv3x3Shape> winograd_shape(int32_t spatial, const int64_t* input_shape, const int64_t* weight_shape,
                                           const float* weight, const int64_t* strides, const int64_t* pads,
                                           const int64_t* dilations, int64_t groups, int32_t layout) {
  const int32_t channels_last = BLADE_CONV_INPUT_CHANNELS_LAST | BLADE_CONV_OUTPUT_CHANNELS_LAST;
  if (!winograd_kernel.enabled.load(std::memory_order_relaxed) || spatial != 2 || layout != channels_last || groups != 1 ||
      weight_shape[2] != 3 || weight_shape[3] != 3 || strides[0] != 1 || strides[1] != 1 || dilations[0] != 1 ||
      dilations[1] != 1 || weight_shape[0] < kWinogradMinChannels || weight_shape[1] < kWinogradMinChannels ||
      current_weights == nullptr || !current_weights->is_constant(weight)) {
    return std::nullopt;
  }
  const Conv3x3Shape shape{input_shape[0], input_shape[2], input_shape[3], weight_shape[1], weight_shape[0],
                           pads[0], pads[1], input_shape[2] + pads[0] + pads[2] - 2,
                           input_shape[3] + pads[1] + pads[3] - 2};
  if (winograd_tiles(shape) < kWinogradMinTiles) return std::nullopt;
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
  shape.out_h = (shape.in_h + pads[0] + pads[2] - dilations[0] * (shape.kernel_h - 1) - 1) / strides[0] + 1;
  shape.out_w = (shape.in_w + pads[1] + pads[3] - dilations[1] * (shape.kernel_w - 1) - 1) / strides[1] + 1;
  return shape;
}

void conv(int32_t spatial, const int64_t* input_shape, const float* input, const int64_t* weight_shape,
          const float* weight, const float* bias, const int64_t* strides, const int64_t* pads,
          const int64_t* dilations, int64_t groups, float* output, int32_t layout, const float* sum,
          int32_t activation) {
  TORCH_CHECK(activation == BLADE_ACTIVATION_NONE || activation == BLADE_ACTIVATION_RELU,
              "blade runtime: unknown convolution activation ", activation);
  TORCH_CHECK(layout == 0 || spatial == 2, "blade runtime: channels-last convolution must be 2-D");
  if (const auto shape = winograd_shape(spatial, input_shape, weight_shape, weight, strides, pads, dilations, groups,
                                       layout)) {
    PackedWeights* weights = current_weights;
    const at::Tensor u = weights->get({reinterpret_cast<int64_t>(weight), -1 /* winograd */}, [&] {
      at::Tensor transformed = winograd_weight(weight, shape->out_channels, shape->in_channels);
      weights->add_constant(transformed.const_data_ptr(), transformed.nbytes());  // so its GEMMs pack it
      return transformed;
    });
    winograd_conv3x3(*shape, input, u.const_data_ptr<float>(), bias, sum, activation == BLADE_ACTIVATION_RELU,
                     output, weights);
    winograd_kernel.calls.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (const auto shape = depthwise_shape(spatial, input_shape, weight_shape, strides, pads, dilations, groups, layout)) {
    const int64_t taps = shape->kernel_h * shape->kernel_w;
    PackedWeights* weights = current_weights;
    const auto relayout = [&] { return depthwise_tap_weight(weight, shape->channels, taps); };
    // Re-laid out once per engine for a constant weight, on every call for a computed one.
    const at::Tensor tap_weight = weights != nullptr && weights->is_constant(weight)
                                      ? weights->get({reinterpret_cast<int64_t>(weight), -2 /* depthwise */}, relayout)
                                      : relayout();
    depthwise_conv2d(*shape, input, tap_weight.const_data_ptr<float>(), bias, sum,
                     activation == BLADE_ACTIVATION_RELU, output);
    depthwise_kernel.calls.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (pointwise_kernel.enabled.load(std::memory_order_relaxed)) {
    if (const auto shape = pointwise_shape(spatial, input_shape, weight_shape, strides, pads, dilations, groups, layout)) {
      pointwise_conv(*shape, input, weight, bias, sum, activation == BLADE_ACTIVATION_RELU, output);
      pointwise_kernel.calls.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
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
  if (auto packed = packed_conv_weight(spatial, weight, w, x, padding, stride, dilation, groups, out_format)) {
    y = onednn_conv(x, *packed, b, padding, stride, dilation, groups, addend, activation);
  } else {
    const std::vector<int64_t> output_padding(spatial, 0);
    y = at::convolution(x, w, b, stride, padding, dilation, false, output_padding, groups);
    if (addend) y.add_(*addend);
    if (activation == BLADE_ACTIVATION_RELU) y.relu_();
  }
  // Both return a fresh tensor: one cheap pass into the engine's buffer (the same layout when
  // the probe above kept oneDNN), next to the convolution.
  if (y.numel() > 0) engine_tensor(output, y.sizes(), out_channels_last).copy_(y);
}

const BladeRuntime kRuntime = {BLADE_ABI_VERSION, &sgemm, &parallel_for, &conv};

}  // namespace

const BladeRuntime* runtime() { return &kRuntime; }

void set_conv_kernel_enabled(const std::string& kernel, bool enabled) {
  conv_kernel_switch(kernel)->enabled.store(enabled, std::memory_order_relaxed);
}

int64_t conv_kernel_calls(const std::string& kernel) {
  return conv_kernel_switch(kernel)->calls.load(std::memory_order_relaxed);
}

void set_gemm_column_split_rows(int64_t max_rows) {
  split_max_rows.store(max_rows < 0 ? kSplitMaxRows : max_rows, std::memory_order_relaxed);
}

// ---- PackedWeights ----

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

at::Tensor PackedWeights::get(const Key& key, const std::function<at::Tensor()>& pack) {
  std::lock_guard<std::mutex> lock(mutex_);  // packing under the lock: concurrent first calls pack once
  auto it = packed_.find(key);
  if (it == packed_.end()) it = packed_.emplace(key, pack()).first;
  return it->second;
}

PackingScope::PackingScope(PackedWeights* weights) : previous_(current_weights) { current_weights = weights; }
PackingScope::~PackingScope() { current_weights = previous_; }

}  // namespace blade
