// GEMM through MKL's Fortran sgemm_, which the torch wheel's libtorch_cpu exports, called directly
// (found with dlsym at first use): an addmm through ATen costs a few microseconds of tensor
// wrapping per call, a lot next to the small GEMMs of an MLP. Builds without MKL, and arguments
// BLAS cannot express, go through ATen.
#include <ATen/Parallel.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <limits>

#include "gemm.h"
#include "timed_parallel.h"

namespace blade {
namespace {

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

// MKL's thread count for the calling thread only (0: back to the process-wide one); returns the
// previous value. MKL_Set_Num_Threads_Local is the C entry (argument by value); the lower-case
// names are the Fortran one, which takes a pointer.
using SetLocalThreads = int (*)(int threads);

struct Mkl {
  FortranSgemm sgemm = nullptr;  // null: no MKL, use ATen
  FortranSgemmPackGetSize pack_get_size = nullptr;
  FortranSgemmPack pack = nullptr;
  FortranSgemmCompute compute = nullptr;
  SetLocalThreads set_local_threads = nullptr;
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
  mkl.set_local_threads = reinterpret_cast<SetLocalThreads>(dlsym(handle, "MKL_Set_Num_Threads_Local"));
  return mkl;
}

const Mkl& mkl() {
  static const Mkl found = find_mkl();
  return found;
}

bool fits_int(int64_t v) { return v >= 0 && v <= std::numeric_limits<int>::max(); }

// at::cpu:: calls the CPU kernels directly: no dispatcher or autograd hops. With C passed as both
// `self` and `out`, ATen accumulates in place, and beta == 0 ignores C's old contents.
void aten_sgemm(const GemmArgs& g) {
  at::Tensor va = gemm_view(g.a, g.batch, g.stride_a, g.m, g.k, g.lda, g.trans_a != 0);
  at::Tensor vb = gemm_view(g.b, g.batch, g.stride_b, g.k, g.n, g.ldb, g.trans_b != 0);
  at::Tensor vc = gemm_view(g.c, g.batch, g.stride_c, g.m, g.n, g.ldc, false);
  if (g.batch == 1) {
    at::cpu::addmm_out(vc, vc, va, vb, g.beta, g.alpha);
  } else {
    at::cpu::baddbmm_out(vc, vc, va, vb, g.beta, g.alpha);
  }
}

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands, keep the
// transposition flags. BLAS wants every leading dimension at least the rows of its column-major
// operand; anything else (never emitted by blade's codegen) goes to ATen.
bool blas_can_take(const GemmArgs& g) {
  const bool sizes_fit = fits_int(g.m) && fits_int(g.n) && fits_int(g.k) && fits_int(g.lda) && fits_int(g.ldb) &&
                         fits_int(g.ldc) && fits_int(g.batch);
  return sizes_fit && g.lda >= std::max<int64_t>(1, g.trans_a ? g.m : g.k) &&
         g.ldb >= std::max<int64_t>(1, g.trans_b ? g.k : g.n) && g.ldc >= std::max<int64_t>(1, g.n);
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
  void run(int64_t i, int n0, int width, const float* packed_b) const { run_rows(i, 0, m, n0, width, packed_b); }
  // Rows [r0, r0 + rows) of C: A's rows start at row r0 (column r0 when A is stored transposed).
  void run_rows(int64_t i, int64_t r0, int rows, int n0, int width, const float* packed_b) const {
    const float* a_i = a + i * stride_a + (ta == 'T' ? r0 : r0 * lda);
    float* c_columns = c + i * stride_c + r0 * ldc + n0;
    if (packed_b != nullptr) {
      const char packed_slot = 'P';
      mkl().compute(&packed_slot, &ta, &width, &rows, &k, packed_b, &ldb, a_i, &lda, &beta, c_columns, &ldc);
    } else {
      mkl().sgemm(&tb, &ta, &width, &rows, &k, &alpha, b_columns(i, n0), &ldb, a_i, &lda, &beta, c_columns, &ldc);
    }
  }
};

}  // namespace

void mkl_gemm(const GemmArgs& g, PackedWeights* weights) {
  if (mkl().sgemm == nullptr || !blas_can_take(g)) {
    aten_sgemm(g);
    return;
  }
  const BlasGemm gemm{g.trans_a ? 'T' : 'N', g.trans_b ? 'T' : 'N', static_cast<int>(g.m), static_cast<int>(g.k),
                      static_cast<int>(g.lda), static_cast<int>(g.ldb), static_cast<int>(g.ldc), g.alpha, g.beta,
                      g.a, g.b, g.c, g.stride_a, g.stride_b, g.stride_c, g.trans_b, static_cast<int>(g.batch),
                      weights};
  const int64_t n = g.n, batch = g.batch;
  const int64_t blocks = column_blocks(batch, g.m, n);
  if (blocks > 1) {
    const int64_t width = (n + blocks - 1) / blocks;
    const int64_t block_width = (width + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
    timed_parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
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
  // When the threads do not divide the batch (ViT's 3 heads on 2 threads: one thread would run 2
  // heads, the other 1), each GEMM is split in row blocks, one per thread, so they share evenly.
  const int64_t threads = at::get_num_threads();
  const int64_t row_blocks = batch % threads == 0 ? 1 : std::min<int64_t>(threads, g.m);
  const int64_t block_rows = (g.m + row_blocks - 1) / row_blocks;
  timed_parallel_for(0, batch * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / row_blocks, r0 = task % row_blocks * block_rows;
      if (r0 >= g.m) continue;
      gemm.run_rows(i, r0, static_cast<int>(std::min(block_rows, g.m - r0)), 0, width, packed_b);
    }
  });
}

at::Tensor gemm_view(const float* data, int64_t batch, int64_t batch_stride, int64_t rows, int64_t cols, int64_t ld,
                     bool transposed) {
  const std::array<int64_t, 3> sizes = {batch, rows, cols};
  const std::array<int64_t, 3> strides = {batch_stride, transposed ? 1 : ld, transposed ? ld : 1};
  const size_t first = batch == 1 ? 1 : 0;  // a single GEMM is a 2-D view
  return at::for_blob(const_cast<float*>(data), at::IntArrayRef(sizes.data() + first, 3 - first))
      .strides(at::IntArrayRef(strides.data() + first, 3 - first))
      .options(at::TensorOptions().dtype(at::kFloat))
      .target_device(at::kCPU)
      .make_tensor();
}

void set_gemm_column_split_rows(int64_t max_rows) {
  split_max_rows.store(max_rows < 0 ? kSplitMaxRows : max_rows, std::memory_order_relaxed);
}

int mkl_set_local_threads(int threads) {
  return mkl().set_local_threads != nullptr ? mkl().set_local_threads(threads) : 0;
}

}  // namespace blade
