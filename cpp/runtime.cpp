// ATen-backed implementations of the BladeRuntime callbacks (GEMM, threads, convolution).
//
// Errors: ATen checks malformed GEMM arguments (which only a broken engine would pass) and throws.
// The exception unwinds through the engine's frames (g++ emits unwind tables on x86-64 by default)
// into Engine::execute, where torch turns it into a RuntimeError; an engine never catches it.
#include "runtime.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <array>
#include <optional>
#include <vector>

namespace blade {
namespace {

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

// at::cpu:: calls the CPU kernels directly: no dispatcher or autograd hops on the tiny-GEMM path.
// With C passed as both `self` and `out`, ATen accumulates in place, and beta == 0 ignores C's old
// contents (NaN/Inf in an uninitialised buffer do not leak through).
void sgemm(int64_t batch, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           int64_t stride_a, int32_t trans_a, const float* b, int64_t ldb, int64_t stride_b,
           int32_t trans_b, float beta, float* c, int64_t ldc, int64_t stride_c) {
  if (batch <= 0 || m <= 0 || n <= 0) return;
  at::Tensor va = view(a, batch, stride_a, m, k, lda, trans_a != 0);
  at::Tensor vb = view(b, batch, stride_b, k, n, ldb, trans_b != 0);
  at::Tensor vc = view(c, batch, stride_c, m, n, ldc, false);
  if (batch == 1) {
    at::cpu::addmm_out(vc, vc, va, vb, beta, alpha);
  } else {
    at::cpu::baddbmm_out(vc, vc, va, vb, beta, alpha);
  }
}

void parallel_for(int64_t begin, int64_t end, int64_t grain, blade_range_fn fn, void* ctx) {
  // ATen divides by the grain; a generated loop may ask for 0 meaning "any chunking".
  at::parallel_for(begin, end, std::max<int64_t>(grain, 1),
                   [fn, ctx](int64_t chunk_begin, int64_t chunk_end) { fn(ctx, chunk_begin, chunk_end); });
}

at::Tensor dense(const float* data, at::IntArrayRef sizes) {
  return at::from_blob(const_cast<float*>(data), sizes, at::TensorOptions().dtype(at::kFloat));
}

// at::convolution picks the best CPU kernel (oneDNN / slow_conv / depthwise) for the shapes. It
// returns a fresh tensor, copied into the engine's buffer (one cheap pass next to the conv).
void conv(int32_t spatial, const int64_t* input_shape, const float* input, const int64_t* weight_shape,
          const float* weight, const float* bias, const int64_t* strides, const int64_t* pads,
          const int64_t* dilations, int64_t groups, float* output) {
  at::Tensor x = dense(input, at::IntArrayRef(input_shape, 2 + spatial));
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
  const std::vector<int64_t> output_padding(spatial, 0);
  const at::Tensor y = at::convolution(x, w, b, at::IntArrayRef(strides, spatial), padding,
                                       at::IntArrayRef(dilations, spatial), false, output_padding, groups);
  if (y.numel() > 0) dense(output, y.sizes()).copy_(y);
}

const BladeRuntime kRuntime = {BLADE_ABI_VERSION, &sgemm, &parallel_for, &conv};

}  // namespace

const BladeRuntime* runtime() { return &kRuntime; }

}  // namespace blade
