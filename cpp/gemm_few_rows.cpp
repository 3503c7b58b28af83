// The runtime's own GEMM for a few rows times a constant weight (a Linear on a handful of tokens:
// the MLP block's [8, 256] x [256, 1024]). At so few rows the work is streaming B once, and the
// libraries' fixed costs dominate: oneDNN's inner product took 33 us a call on one core, ~5 us of it
// wrapping tensors, allocating its output and copying that into C; MKL's sgemm ran 57 us. This
// kernel reads B from panels of 32 columns packed once per engine (alpha folded in, like MKL's
// pack), keeps each row's 32 sums in two AVX-512 registers for the whole of K, and writes C in
// place: 16 us on the same GEMM. Threads split the panels. gemm_choice.cpp times it against the
// libraries per shape, so it only runs where it wins.
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

// Every row of C's columns [column, column + width) from one panel, in register blocks of 8 rows.
BLADE_AVX512 void panel_rows(const GemmArgs& g, const float* panel, int64_t column, int64_t width) {
  const int64_t row_step = g.trans_a ? 1 : g.lda, k_step = g.trans_a ? g.lda : 1;
  for (int64_t r0 = 0; r0 < g.m; r0 += kBlockRows) {
    const float* a = g.a + r0 * row_step;
    float* c = g.c + r0 * g.ldc + column;
    switch (std::min<int64_t>(kBlockRows, g.m - r0)) {
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

bool few_rows_applies(const GemmArgs& g) {
  return g.batch == 1 && g.m <= kFewRowsMaxRows && g.k > 0 && avx512_usable();
}

void few_rows_gemm(const GemmArgs& g, PackedWeights* weights) {
  int32_t alpha_bits;
  std::memcpy(&alpha_bits, &g.alpha, sizeof alpha_bits);
  const PackedWeights::Key key = {reinterpret_cast<int64_t>(g.b), kPackTag, g.trans_b, g.n, g.k, g.ldb, alpha_bits};
  const at::Tensor packed = weights->get(key, [&] { return pack_panels(g); });
  const float* panels = packed.const_data_ptr<float>();
  const int64_t count = (g.n + kPanel - 1) / kPanel;
  // Tasks of whole panels, at least kMinTaskFmas multiply-adds each: a thread's wake-up costs a
  // few microseconds, more than a smaller share saves. In a parallel region (an engine's own loop)
  // at::parallel_for runs inline.
  constexpr int64_t kMinTaskFmas = 1 << 16;
  const int64_t grain = std::max<int64_t>(1, kMinTaskFmas / (g.m * g.k * kPanel));
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      panel_rows(g, panels + p * g.k * kPanel, p * kPanel, std::min(kPanel, g.n - p * kPanel));
    }
  });
}

}  // namespace blade
