// The runtime's SGEMM (BladeRuntime::sgemm): one call's arguments, the kernels that can run it
// (MKL's BLAS in gemm_mkl.cpp, oneDNN through libtorch in gemm_onednn.cpp, the runtime's own
// kernel on B in 32-column panels in gemm_panels.cpp) and the per-shape choice
// between them (gemm_choice.cpp), made by timing the candidates on this machine.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "runtime.h"

namespace blade {

// Row-major batched C_b = alpha * op(A_b) op(B_b) + beta * C_b, exactly blade_abi.h's contract.
struct GemmArgs {
  int64_t batch, m, n, k;
  float alpha;
  const float* a;
  int64_t lda, stride_a;
  int32_t trans_a;
  const float* b;
  int64_t ldb, stride_b;
  int32_t trans_b;
  float beta;
  float* c;
  int64_t ldc, stride_c;
};

// A non-owning float view of engine memory: [batch, rows, cols] (2-D when batch == 1).
// `batch_stride` may be 0 (an operand shared by every batch); `transposed` reads element [r][c]
// at c * ld + r instead of r * ld + c.
at::Tensor gemm_view(const float* data, int64_t batch, int64_t batch_stride, int64_t rows, int64_t cols, int64_t ld,
                     bool transposed);

// ---- MKL (gemm_mkl.cpp) ----

// MKL's sgemm_ with B packed once per engine when it is one of `weights`' constants, few-row
// GEMMs split in column blocks across ATen's threads; ATen's addmm/baddbmm when torch has no MKL
// or BLAS cannot take the arguments. Runs any GEMM of the contract.
void mkl_gemm(const GemmArgs& g, PackedWeights* weights);

// MKL's mkl_set_num_threads_local (the calling thread's MKL thread count, 0: the process-wide
// one), returning the previous value; 0 and no effect without MKL.
int mkl_set_local_threads(int threads);

// ---- oneDNN through libtorch (gemm_onednn.cpp) ----

// Whether libtorch's oneDNN matmul runs on this machine (torch's fp32 oneDNN matmul refuses CPUs
// without AVX-512 BW/VL/DQ or AVX-NE-CONVERT); probed once.
bool onednn_usable();

// at::native::mkldnn_matmul straight into C: any GEMM (k > 0); operands it cannot read in place
// (batch stride 0, padded rows of a batch) it copies first.
void onednn_matmul(const GemmArgs& g);

// A single GEMM whose B is one of `weights`' constants: oneDNN's inner product on alpha * op(B)
// reordered once per engine into oneDNN's blocked layout (mkldnn::_reorder_linear_weight), its
// result copied (or, beta != 0, added) into C.
bool onednn_packed_applies(const GemmArgs& g, PackedWeights* weights);
void onednn_packed(const GemmArgs& g, PackedWeights* weights);

// ---- the runtime's own kernel on B in 32-column panels (gemm_panels.cpp) ----

// Whether panels_gemm can run g (on a CPU with AVX-512, or AVX2 and FMA): a single GEMM when its B
// is one of the engine's constants (b_constant), any batch when B is computed.
bool panels_applies(const GemmArgs& g, bool b_constant);

// C = op(A) (alpha op(B)) + beta C straight into C, 8-row blocks of C's 32-column panels in
// registers: a constant B packed once per engine in 32-column panels; a computed B read in place
// (untransposed) or packed per call, panel by panel (transposed).
void panels_gemm(const GemmArgs& g, PackedWeights* weights);

// Packs g's constant B for panels_gemm now (the pack a first call would make; reads b, n, k, ldb,
// trans_b and alpha only).
void panels_pack(const GemmArgs& g, PackedWeights* weights);

// Whether g's constant B is packed for panels_gemm already (so running it packs nothing).
bool panels_packed(const GemmArgs& g, PackedWeights* weights);

// BladeRuntime::attention (blade_abi.h): with AVX-512 or AVX2, (head, block of query rows) tasks whose
// score rows stay in cache between Q.K^T, the softmax and P.V (K^T and V packed once per head and
// thread in 32- or 16-column panels); elsewhere head by head through gemm().
void attention(const BladeAttention& a, PackedWeights* weights);

// ---- the choice (gemm_choice.cpp) ----

// The runtime's sgemm: folds a weight shared by a batch of row-stacked GEMMs into one GEMM, then
// runs the kernel chosen for the call's shape.
void gemm(GemmArgs g, PackedWeights* weights);

}  // namespace blade
