// GEMM through the oneDNN inside libtorch. Its C API (dnnl_*) is not exported, so this goes through
// what is: at::native::mkldnn_matmul (oneDNN's matmul primitive on views of the operands, writing
// into C) and the mkldnn::_reorder_linear_weight / mkldnn::_linear_pointwise operators (oneDNN's
// inner product on a weight reordered once into its blocked layout, as Inductor's frozen CPU
// graphs call it). On AMD EPYC with AVX-512, MKL 2024's sgemm took a slow path (~100 GFLOP/s a
// core) where these ran at ~230 (bench/gemm.py); gemm_choice.cpp times both per shape.
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "gemm.h"

namespace at::native {
// Exported by libtorch_cpu (aten/src/ATen/native/mkldnn/Matmul.cpp), not in its installed headers.
// result = alpha * mat1 @ mat2 + beta * result for 2-D or 3-D (batched) float tensors.
TORCH_API void mkldnn_matmul(const Tensor& mat1, const Tensor& mat2, const Tensor& result, float beta, float alpha);
}  // namespace at::native

namespace blade {
namespace {

constexpr int64_t kOnednnPackTag = -2;  // PackedWeights key slot 1 (MKL: trans_b, Winograd: -1)

const c10::OperatorHandle& linear_op() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return op;
}

const c10::OperatorHandle& reorder_op() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
  return op;
}

// y = x @ w^T for x [m, k] and a weight from reorder_weight: a fresh [m, n] tensor.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed) {
  std::vector<c10::IValue> stack = {x, packed, c10::IValue(), std::string("none"),
                                    c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  linear_op().callBoxed(&stack);
  return std::move(stack[0]).toTensor();
}

// w [n, k] in oneDNN's blocked layout for an inner product over `rows` rows.
at::Tensor reorder_weight(const at::Tensor& w, int64_t rows) {
  std::vector<c10::IValue> stack = {w, std::optional<int64_t>(rows)};
  reorder_op().callBoxed(&stack);
  return std::move(stack[0]).toTensor();
}

bool probe_onednn() {
  if (!at::hasMKLDNN()) return false;
  try {
    const float a[4] = {1, 2, 3, 4};
    float c[4] = {0, 0, 0, 0};
    const GemmArgs g{1, 2, 2, 2, 1.0f, a, 2, 0, 0, a, 2, 0, 1, 0.0f, c, 2, 0};
    onednn_matmul(g);
    const at::Tensor x = gemm_view(a, 1, 0, 2, 2, 2, false);
    linear(x, reorder_weight(x, 2));
    return c[0] == 5 && c[1] == 11 && c[2] == 11 && c[3] == 25;  // [[1,2],[3,4]] @ its transpose
  } catch (const c10::Error&) {
    return false;  // e.g. "mkldnn_matmul: ... needs the cpu support avx_ne_convert or avx512bw, ..."
  }
}

}  // namespace

bool onednn_usable() {
  static const bool usable = probe_onednn();
  return usable;
}

void onednn_matmul(const GemmArgs& g) {
  const at::Tensor a = gemm_view(g.a, g.batch, g.stride_a, g.m, g.k, g.lda, g.trans_a != 0);
  const at::Tensor b = gemm_view(g.b, g.batch, g.stride_b, g.k, g.n, g.ldb, g.trans_b != 0);
  const at::Tensor c = gemm_view(g.c, g.batch, g.stride_c, g.m, g.n, g.ldc, false);
  at::native::mkldnn_matmul(a, b, c, g.beta, g.alpha);
}

bool onednn_packed_applies(const GemmArgs& g, PackedWeights* weights) {
  return g.batch == 1 && weights != nullptr && weights->is_constant(g.b);
}

void onednn_packed(const GemmArgs& g, PackedWeights* weights) {
  int32_t alpha_bits;
  std::memcpy(&alpha_bits, &g.alpha, sizeof alpha_bits);
  // oneDNN picks the blocked layout for the number of rows it will see; one layout per weight, for
  // the rows of its first call (at least 64): an engine with run-time sizes would otherwise keep a
  // weight copy for every row count it meets. The inner product runs on whatever layout the weight
  // has, and the layouts for 8 to 4096 rows ran any of those row counts equally fast (a [1024, 256]
  // weight, one thread; the one for a single row was up to 1.5x slower at 8 rows).
  const PackedWeights::Key key = {reinterpret_cast<int64_t>(g.b), kOnednnPackTag, g.trans_b, g.n, g.k, g.ldb,
                                  alpha_bits};
  const at::Tensor packed = weights->get(key, [&] {
    // The inner product's weight is [n, k] = op(B)^T, with alpha folded in (as MKL's pack does).
    const at::Tensor w = gemm_view(g.b, 1, 0, g.k, g.n, g.ldb, g.trans_b != 0).t();
    return reorder_weight(g.alpha == 1.0f ? w.contiguous() : w.mul(g.alpha).contiguous(),
                          std::max<int64_t>(g.m, 64));
  });
  const at::Tensor y = linear(gemm_view(g.a, 1, 0, g.m, g.k, g.lda, g.trans_a != 0), packed);
  at::Tensor c = gemm_view(g.c, 1, 0, g.m, g.n, g.ldc, false);
  if (g.beta == 0.0f) {
    c.copy_(y);  // C's old contents are ignored, NaN included
  } else {
    if (g.beta != 1.0f) c.mul_(g.beta);
    c.add_(y);
  }
}

}  // namespace blade
