// The runtime's own GEMM for a constant weight (a Linear): B packed once per engine in panels of
// 32 columns (alpha folded in, like MKL's pack), each register block of 8 rows keeping its 8 x 32
// sums in 16 AVX-512 registers for the whole of K (one broadcast of A and two loads of B per 16
// FMAs), C written in place. On this machine's AMD EPYC cores (one thread, operands in cache) it
// ran at ~260 GFLOP/s where oneDNN's inner product reached ~235 and MKL ~110: the MLP block's
// [8, 256] x [256, 1024] 16 us (oneDNN 33, of which ~5 wrapping tensors, allocating its output and
// copying it into C; ONNX Runtime's MatMul ~27), BERT's [128, 256] x [256, 768] 183 us (oneDNN
// 214, ONNX Runtime 199). Threads split (panel, row chunk) tasks. gemm_choice.cpp times it against
// the libraries per shape, so it only runs where it wins.
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "gemm.h"

namespace blade {
namespace {

constexpr int64_t kPanel = 32;   // columns per packed panel: two 16-float registers per row
constexpr int kBlockRows = 8;    // rows per register block: 16 sums + 2 B vectors + 1 broadcast of 32
constexpr int64_t kPackTag = -3;  // PackedWeights key slot 1 (MKL: trans_b, oneDNN: -2, Winograd: -1)

#define BLADE_AVX512 __attribute__((target("avx512f,fma")))

// One register block: rows [0, R) of A (element (r, kk) at a[r * row_step + kk * k_step]) times one
// packed panel, into C's columns [0, width) of those rows (beta as BLAS reads it: 0 ignores C).
template <int R>
BLADE_AVX512 inline void block(int64_t k, const float* a, int64_t row_step, int64_t k_step, const float* panel,
                               float beta, float* c, int64_t ldc, int64_t width) {
  __m512 low[R], high[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) low[r] = high[r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m512 b_low = _mm512_load_ps(panel + kk * kPanel), b_high = _mm512_load_ps(panel + kk * kPanel + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * row_step + kk * k_step]);
      low[r] = _mm512_fmadd_ps(x, b_low, low[r]);
      high[r] = _mm512_fmadd_ps(x, b_high, high[r]);
    }
  }
  // The panel's padding columns (past n) are computed and not stored.
  const __mmask16 low_mask = width >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1);
  const __mmask16 high_mask =
      width >= kPanel ? 0xFFFF : width <= 16 ? 0 : static_cast<__mmask16>((1u << (width - 16)) - 1);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* row = c + r * ldc;
    if (beta != 0.0f) {  // BLAS: beta == 0 leaves C's old contents (NaN included) unread
      const __m512 scale = _mm512_set1_ps(beta);
      low[r] = _mm512_fmadd_ps(scale, _mm512_maskz_loadu_ps(low_mask, row), low[r]);
      high[r] = _mm512_fmadd_ps(scale, _mm512_maskz_loadu_ps(high_mask, row + 16), high[r]);
    }
    _mm512_mask_storeu_ps(row, low_mask, low[r]);
    _mm512_mask_storeu_ps(row + 16, high_mask, high[r]);
  }
}

// Rows [begin, end) of C's columns [column, column + width) from one panel, in register blocks of 8.
BLADE_AVX512 void panel_rows(const GemmArgs& g, const float* panel, int64_t column, int64_t width, int64_t begin,
                             int64_t end) {
  const int64_t row_step = g.trans_a ? 1 : g.lda, k_step = g.trans_a ? g.lda : 1;
  for (int64_t r0 = begin; r0 < end; r0 += kBlockRows) {
    const float* a = g.a + r0 * row_step;
    float* c = g.c + r0 * g.ldc + column;
    switch (std::min<int64_t>(kBlockRows, end - r0)) {
      case 1: block<1>(g.k, a, row_step, k_step, panel, g.beta, c, g.ldc, width); break;
      case 2: block<2>(g.k, a, row_step, k_step, panel, g.beta, c, g.ldc, width); break;
      case 3: block<3>(g.k, a, row_step, k_step, panel, g.beta, c, g.ldc, width); break;
      case 4: block<4>(g.k, a, row_step, k_step, panel, g.beta, c, g.ldc, width); break;
      case 5: block<5>(g.k, a, row_step, k_step, panel, g.beta, c, g.ldc, width); break;
      case 6: block<6>(g.k, a, row_step, k_step, panel, g.beta, c, g.ldc, width); break;
      case 7: block<7>(g.k, a, row_step, k_step, panel, g.beta, c, g.ldc, width); break;
      default: block<8>(g.k, a, row_step, k_step, panel, g.beta, c, g.ldc, width); break;
    }
  }
}

// alpha * op(B) as [panels][k][32] floats, the last panel's columns past n zero.
at::Tensor pack_panels(const GemmArgs& g) {
  const int64_t panels = (g.n + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels * g.k * kPanel}, at::kFloat);  // 64-byte aligned (c10's allocator)
  float* dest = packed.mutable_data_ptr<float>();
  for (int64_t kk = 0; kk < g.k; ++kk) {
    for (int64_t col = 0; col < g.n; ++col) {
      const float b = g.trans_b ? g.b[col * g.ldb + kk] : g.b[kk * g.ldb + col];
      dest[(col / kPanel * g.k + kk) * kPanel + col % kPanel] = g.alpha * b;
    }
  }
  return packed;
}

bool avx512_usable() {
  static const bool usable = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  return usable;
}

}  // namespace

bool panels_applies(const GemmArgs& g) {
  return g.batch == 1 && g.k > 0 && avx512_usable();
}

void panels_gemm(const GemmArgs& g, PackedWeights* weights) {
  int32_t alpha_bits;
  std::memcpy(&alpha_bits, &g.alpha, sizeof alpha_bits);
  const PackedWeights::Key key = {reinterpret_cast<int64_t>(g.b), kPackTag, g.trans_b, g.n, g.k, g.ldb, alpha_bits};
  const at::Tensor packed = weights->get(key, [&] { return pack_panels(g); });
  const float* panels = packed.const_data_ptr<float>();
  const int64_t count = (g.n + kPanel - 1) / kPanel;
  // Tasks are (panel, chunk of rows), panel-major; rows are chunked only as far as needed to give
  // every thread two tasks (a wide B: whole panels; a narrow one, ViT's 192 columns on many
  // threads: row chunks too). A task does at least kMinTaskFmas multiply-adds: a thread's wake-up
  // costs a few microseconds, more than a smaller share saves. In a parallel region (an engine's
  // own loop) at::parallel_for runs inline.
  constexpr int64_t kMinTaskFmas = 1 << 16;
  const int64_t blocks = (g.m + kBlockRows - 1) / kBlockRows;
  const int64_t wanted = 2 * static_cast<int64_t>(at::get_num_threads());
  const int64_t chunks = std::clamp<int64_t>((wanted + count - 1) / count, 1, blocks);
  const int64_t chunk_rows = (blocks + chunks - 1) / chunks * kBlockRows;
  const int64_t grain = std::max<int64_t>(1, kMinTaskFmas / (std::min(chunk_rows, g.m) * g.k * kPanel));
  at::parallel_for(0, count * chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task / chunks, first = task % chunks * chunk_rows;
      if (first >= g.m) continue;
      panel_rows(g, panels + p * g.k * kPanel, p * kPanel, std::min(kPanel, g.n - p * kPanel), first,
                 std::min(g.m, first + chunk_rows));
    }
  });
}

}  // namespace blade
