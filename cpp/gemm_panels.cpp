// The runtime's own GEMM on B in panels of 32 columns, each register block of 8 rows keeping its
// 8 x 32 sums in 16 AVX-512 registers for the whole of K (one broadcast of A and two loads of B per
// 16 FMAs), C written in place. A constant B (a Linear's weight) is packed once per engine (alpha
// folded in, like MKL's pack); on this machine's AMD EPYC cores (one thread, operands in cache) it
// ran at ~260 GFLOP/s where oneDNN's inner product reached ~235 and MKL ~110: the MLP block's
// [8, 256] x [256, 1024] 16 us (oneDNN 33, of which ~5 wrapping tensors, allocating its output and
// copying it into C; ONNX Runtime's MatMul ~27), BERT's [128, 256] x [256, 768] 183 us (oneDNN
// 214, ONNX Runtime 199). A computed B (attention's K^T and V, a batch of heads) is read in place
// or packed per call (per_call_gemm): at 4 heads of [128, 64] @ [64, 128] and [128, 128] @
// [128, 64] 39 and 33 us where oneDNN's matmul took 49 and 45 (its ~10 us per call dominates a few
// heads; at 32 heads the two are within 10% either way). Threads split (panel, row chunk) tasks.
// gemm_choice.cpp times it against the libraries per shape, so it only runs where it wins. Without
// AVX-512 an AVX2 kernel (below, 6 x 16 register blocks) runs both: a constant B packed once in
// 16-column panels, a computed one packed per call, each row block running across a group of panels.
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "engine_prelude.h"  // blade_expf: the engine's own exp, so the fused softmax rounds like it
#include "gemm.h"
#include "timed_parallel.h"

namespace blade {
namespace {

// Calls run(std::integral_constant<int, R>{}) with R = min(rows, kMax) (rows >= 1): a register
// block's row count as a compile-time constant, for the block kernels' full unrolls.
template <int kMax, typename F>
void with_row_count(int64_t rows, const F& run) {
  if constexpr (kMax > 1) {
    if (rows < kMax) return with_row_count<kMax - 1>(rows, run);
  }
  run(std::integral_constant<int, kMax>{});
}

constexpr int64_t kPanel = 32;   // columns per packed panel: two 16-float registers per row
constexpr int kBlockRows = 8;    // rows per register block: 16 sums + 2 B vectors + 1 broadcast of 32
constexpr int64_t kPackTag = -3;  // PackedWeights key slot 1 (MKL: trans_b, oneDNN: -2, Winograd: -1)

#define BLADE_AVX512 __attribute__((target("avx512f,fma")))

// The first `count` lanes of a 16-lane mask.
BLADE_AVX512 inline __mmask16 first_lanes16(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

// One register block: rows [0, R) of A (element (r, kk) at a[r * row_step + kk * k_step]) times one
// panel (row kk's 32 floats at panel + kk * panel_step), into C's columns [0, width) of those rows
// (beta as BLAS reads it: 0 ignores C). kInPlace: the panel is B itself (a computed, untransposed
// operand: rows ldb apart, possibly unaligned, the columns past `width` outside B, so loads are
// masked) and alpha, not folded into a pack, scales the sums; else a packed, zero-padded panel.
template <int R, bool kInPlace>
BLADE_AVX512 inline void block(int64_t k, const float* a, int64_t row_step, int64_t k_step, const float* panel,
                               int64_t panel_step, float alpha, float beta, float* c, int64_t ldc, int64_t width) {
  // The panel's padding columns (past n) are computed and not stored.
  const __mmask16 low_mask = first_lanes16(width), high_mask = width > 16 ? first_lanes16(width - 16) : 0;
  __m512 low[R], high[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) low[r] = high[r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* row = panel + kk * panel_step;
    const __m512 b_low = kInPlace ? _mm512_maskz_loadu_ps(low_mask, row) : _mm512_load_ps(row);
    const __m512 b_high = kInPlace ? _mm512_maskz_loadu_ps(high_mask, row + 16) : _mm512_load_ps(row + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * row_step + kk * k_step]);
      low[r] = _mm512_fmadd_ps(x, b_low, low[r]);
      high[r] = _mm512_fmadd_ps(x, b_high, high[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* row = c + r * ldc;
    if (kInPlace && alpha != 1.0f) {
      const __m512 scale = _mm512_set1_ps(alpha);
      low[r] = _mm512_mul_ps(scale, low[r]);
      high[r] = _mm512_mul_ps(scale, high[r]);
    }
    if (beta != 0.0f) {  // BLAS: beta == 0 leaves C's old contents (NaN included) unread
      const __m512 scale = _mm512_set1_ps(beta);
      low[r] = _mm512_fmadd_ps(scale, _mm512_maskz_loadu_ps(low_mask, row), low[r]);
      high[r] = _mm512_fmadd_ps(scale, _mm512_maskz_loadu_ps(high_mask, row + 16), high[r]);
    }
    _mm512_mask_storeu_ps(row, low_mask, low[r]);
    _mm512_mask_storeu_ps(row + 16, high_mask, high[r]);
  }
}

// Rows [begin, end) of C's columns [column, column + width) from one panel, in register blocks of 8
// (a, c: the GEMM's A and C, of one batch entry).
template <bool kInPlace>
BLADE_AVX512 void panel_rows(const GemmArgs& g, const float* a_base, float* c_base, const float* panel,
                             int64_t panel_step, float alpha, int64_t column, int64_t width, int64_t begin,
                             int64_t end) {
  const int64_t row_step = g.trans_a ? 1 : g.lda, k_step = g.trans_a ? g.lda : 1;
  for (int64_t r0 = begin; r0 < end; r0 += kBlockRows) {
    const float* a = a_base + r0 * row_step;
    float* c = c_base + r0 * g.ldc + column;
    const auto run = [&](auto rows) {
      block<decltype(rows)::value, kInPlace>(g.k, a, row_step, k_step, panel, panel_step, alpha, g.beta, c, g.ldc,
                                             width);
    };
    with_row_count<kBlockRows>(end - r0, run);
  }
}

// Packed panels on a CPU with AVX2 but no AVX-512 (16 vector registers of 8 floats), 16 columns
// wide (packed_panel_columns): a register block is up to 6 rows x the panel, its 12 sums kept in registers
// for the whole of K (two loads of B and 6 broadcasts of A per 12 FMAs). On such an AMD EPYC (one
// thread, CPU time, in an engine: [128, k] x [k, n] + relu) it ran GPT-2/BERT's GEMMs at 87-89
// GFLOP/s where MKL's sgemm -- there the only other candidate, libtorch's oneDNN matmul refusing
// the CPU -- ran at 81-85 and ONNX Runtime's MatMul at 77-90 (e.g. [256, 768] 573 us, MKL 618).
// A computed B (attention's K^T and V) is packed per call (per_call_gemm_avx2).
constexpr int kAvx2BlockRows = 6;
constexpr int64_t kAvx2Half = 16;

#define BLADE_AVX2 __attribute__((target("avx2,fma")))

// R rows of A times columns [0, width) (width <= 16) of one packed, zero-padded panel of 16 columns.
template <int R>
BLADE_AVX2 inline void block_avx2(int64_t k, const float* a, int64_t row_step, int64_t k_step, const float* half,
                                  float beta, float* c, int64_t ldc, int64_t width) {
  __m256 low[R], high[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) low[r] = high[r] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* row = half + kk * kAvx2Half;
    const __m256 b_low = _mm256_load_ps(row);
    const __m256 b_high = _mm256_load_ps(row + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * row_step + kk * k_step);
      low[r] = _mm256_fmadd_ps(x, b_low, low[r]);
      high[r] = _mm256_fmadd_ps(x, b_high, high[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    float* out = c + r * ldc;
    if (width == kAvx2Half) {
      if (beta != 0.0f) {  // BLAS: beta == 0 leaves C's old contents (NaN included) unread
        const __m256 scale = _mm256_set1_ps(beta);
        low[r] = _mm256_fmadd_ps(scale, _mm256_loadu_ps(out), low[r]);
        high[r] = _mm256_fmadd_ps(scale, _mm256_loadu_ps(out + 8), high[r]);
      }
      _mm256_storeu_ps(out, low[r]);
      _mm256_storeu_ps(out + 8, high[r]);
      continue;
    }
    // the panel's last columns: the padding past n is computed and not stored
    alignas(32) float sums[kAvx2Half];
    _mm256_store_ps(sums, low[r]);
    _mm256_store_ps(sums + 8, high[r]);
    for (int64_t j = 0; j < width; ++j) out[j] = beta != 0.0f ? std::fma(beta, out[j], sums[j]) : sums[j];
  }
}

// Rows [begin, end) of one batch entry's C, columns from `column` on, from `panels` packed panels of
// B (k x 16 floats each, one after the other) starting there, row block by row block: a block's
// rows of A stay in L1 while the panels stream past from L2.
BLADE_AVX2 void rows_of_all_panels_avx2(const GemmArgs& g, const float* a_base, float* c_base, const float* packed,
                                        int64_t column, int64_t panels, int64_t begin, int64_t end) {
  const int64_t row_step = g.trans_a ? 1 : g.lda, k_step = g.trans_a ? g.lda : 1;
  for (int64_t r0 = begin; r0 < end; r0 += kAvx2BlockRows) {
    const float* a = a_base + r0 * row_step;
    float* c = c_base + r0 * g.ldc + column;
    const auto run = [&](auto rows) {
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t width = std::min(kAvx2Half, g.n - column - p * kAvx2Half);
        block_avx2<decltype(rows)::value>(g.k, a, row_step, k_step, packed + p * g.k * kAvx2Half, g.beta,
                                          c + p * kAvx2Half, g.ldc, width);
      }
    };
    with_row_count<kAvx2BlockRows>(end - r0, run);
  }
}

bool avx512_usable() {
  static const bool usable = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  return usable;
}

// Columns per packed panel of a constant B: what one register block reads per depth. AVX2's blocks
// read 16 columns: in 32-column panels each of them streamed every other cache line of the pack
// (64 of every 128 bytes), so B took twice its size in L1/L2 and the prefetchers fetched lines no
// block of that pass used. One process runs one ISA, so a pack's layout never changes in it.
int64_t packed_panel_columns() { return avx512_usable() ? kPanel : kAvx2Half; }

// alpha * op(B) as [panels][k][columns] floats (columns = packed_panel_columns()), the last
// panel's columns past n zero.
at::Tensor pack_panels(const GemmArgs& g) {
  const int64_t columns = packed_panel_columns(), panels = (g.n + columns - 1) / columns;
  at::Tensor packed = at::zeros({panels * g.k * columns}, at::kFloat);  // 64-byte aligned (c10's allocator)
  float* dest = packed.mutable_data_ptr<float>();
  for (int64_t kk = 0; kk < g.k; ++kk) {
    for (int64_t col = 0; col < g.n; ++col) {
      const float b = g.trans_b ? g.b[col * g.ldb + kk] : g.b[kk * g.ldb + col];
      dest[(col / columns * g.k + kk) * columns + col % columns] = g.alpha * b;
    }
  }
  return packed;
}

bool avx2_usable() {
  static const bool usable = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return usable;
}

// How (item, chunk of rows) tasks split `items` panel-wide items (a panel of one batch entry), item
// major: rows are chunked only as far as needed to give every thread two tasks (a wide B: whole
// panels; a narrow one, ViT's 192 columns on many threads: row chunks too). A task does at least
// kMinTaskFmas multiply-adds: a thread's wake-up costs a few microseconds, more than a smaller
// share saves. In a parallel region (an engine's own loop) at::parallel_for runs inline.
struct Tasks {
  int64_t chunks, chunk_rows, grain;
};

Tasks split_tasks(const GemmArgs& g, int64_t items, int64_t columns = kPanel) {
  constexpr int64_t kMinTaskFmas = 1 << 16;
  const int64_t block_rows = avx512_usable() ? kBlockRows : kAvx2BlockRows;  // chunks of whole register blocks
  const int64_t blocks = (g.m + block_rows - 1) / block_rows;
  const int64_t wanted = 2 * static_cast<int64_t>(at::get_num_threads());
  const int64_t chunks = std::clamp<int64_t>((wanted + items - 1) / items, 1, blocks);
  const int64_t chunk_rows = (blocks + chunks - 1) / chunks * block_rows;
  return {chunks, chunk_rows, std::max<int64_t>(1, kMinTaskFmas / (std::min(chunk_rows, g.m) * g.k * columns))};
}

// A constant B's key in PackedWeights.
PackedWeights::Key pack_key(const GemmArgs& g) {
  int32_t alpha_bits;
  std::memcpy(&alpha_bits, &g.alpha, sizeof alpha_bits);
  return {reinterpret_cast<int64_t>(g.b), kPackTag, g.trans_b, g.n, g.k, g.ldb, alpha_bits};
}

// A constant B's panels, packed on first use (alpha folded in).
at::Tensor panels_of(const GemmArgs& g, PackedWeights* weights) {
  return weights->get(pack_key(g), [&] { return pack_panels(g); });
}

// A constant B on AVX2: (row chunk, group of panels) tasks, each running its rows register block
// by register block across its whole group (rows_of_all_panels_avx2): a block's 6 rows of A stay
// in L1 while the group's panels (kPackedGroupFloats: 128 KiB, in L2) stream past, as MLAS runs a
// 128-column slice. Panel by panel over every row, all of A came from L2 or L3 again for every
// 16 columns (1 MiB at 1024 rows of K = 256, more than a Zen 3 core's 512 KiB L2) and C was
// written 64 bytes a row. Each sum is still one FMA chain over the whole of K, in the same order:
// results are bitwise what they were. Zen 3, 2 threads, interleaved with ONNX Runtime's MatMul
// (median us, panel by panel -> by group, ORT): [1024, 256] @ [256, 768] 4116 -> 3512 (3439),
// @ [256, 1024] 6342 -> 5379 (4697), @ [256, 688] 4353 -> 2925 (3183), [1576, 192] @ [192, 576]
// 4793 -> 3730 (3760); K = 1024 and the 128-row GEMMs of batch 1 unchanged within noise.
constexpr int64_t kPackedGroupFloats = 1 << 15;

// Groups of about equal size (36 panels in 4 groups of 9, not 3 of 10 and one of 6: tasks of
// unequal size left a thread idle at the end), and about kClaimsPerThread tasks per thread,
// chunk-major, so each thread's contiguous share is its rows of A across every group (the split
// over M that MLAS makes where M >= N) and a stalled thread's chunks are still taken by the others.
struct GroupTasks {
  int64_t group, groups, chunk_rows, chunks;
};

GroupTasks group_tasks(const GemmArgs& g, int64_t panels) {
  const int64_t largest = std::max<int64_t>(1, kPackedGroupFloats / (g.k * kAvx2Half));
  const int64_t fewest_groups = (panels + largest - 1) / largest;
  const int64_t group = (panels + fewest_groups - 1) / fewest_groups;  // the panels split evenly over them
  const int64_t groups = (panels + group - 1) / group;
  const int64_t blocks = (g.m + kAvx2BlockRows - 1) / kAvx2BlockRows;
  const int64_t wanted = kClaimsPerThread * static_cast<int64_t>(at::get_num_threads());
  const int64_t chunks = std::clamp<int64_t>((wanted + groups - 1) / groups, 1, blocks);
  const int64_t chunk_rows = (blocks + chunks - 1) / chunks * kAvx2BlockRows;
  return {group, groups, chunk_rows, (g.m + chunk_rows - 1) / chunk_rows};
}

void packed_gemm_avx2(const GemmArgs& g, const float* panels) {
  const int64_t count = (g.n + kAvx2Half - 1) / kAvx2Half, panel_floats = g.k * kAvx2Half;
  const GroupTasks t = group_tasks(g, count);
  timed_parallel_for(0, t.chunks * t.groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t first = task / t.groups * t.chunk_rows, first_panel = task % t.groups * t.group;
      rows_of_all_panels_avx2(g, g.a, g.c, panels + first_panel * panel_floats, first_panel * kAvx2Half,
                              std::min(t.group, count - first_panel), first, std::min(g.m, first + t.chunk_rows));
    }
  });
}

// A constant B: packed once per engine (PackedWeights); with AVX-512, (panel, row chunk) tasks.
void packed_gemm(const GemmArgs& g, PackedWeights* weights) {
  const at::Tensor packed = panels_of(g, weights);
  const float* panels = packed.const_data_ptr<float>();
  if (!avx512_usable()) return packed_gemm_avx2(g, panels);
  const int64_t count = (g.n + kPanel - 1) / kPanel;
  const Tasks t = split_tasks(g, count);
  timed_parallel_for(0, count * t.chunks, t.grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task / t.chunks, first = task % t.chunks * t.chunk_rows;
      if (first >= g.m) continue;
      const int64_t width = std::min(kPanel, g.n - p * kPanel), last = std::min(g.m, first + t.chunk_rows);
      panel_rows<false>(g, g.a, g.c, panels + p * g.k * kPanel, kPanel, 1.0f, p * kPanel, width, first, last);
    }
  });
}

// A 16 x 16 block of floats transposed in registers: rows[i] becomes column i (the standard four
// rounds: pairs of elements, of pairs, then 128-bit lanes twice).
BLADE_AVX512 inline void transpose16(__m512 rows[16]) {
  __m512 t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(rows[i], rows[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    rows[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    rows[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    rows[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    rows[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 16; h += 8) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(rows[h + i], rows[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(rows[h + i], rows[h + i + 4], 0xDD);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    rows[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    rows[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

// alpha * B's columns [column, column + width) of a transposed B (its columns are rows of the
// operand in memory) as one zero-padded [k][32] panel in `dest` (64-byte aligned). Each 16
// columns x 16 depths is 16 row loads and an in-register transpose: at attention's K = 64 the
// gathers this replaced (two per panel row, ~20 cycles each here) cost 10-25% of Q.K^T's time
// (oneDNN's matmul was that much faster at 4 x 512 and 16 x 128 tokens). Loads past `width`
// or k are masked off (zeros), so no element outside B is read.
BLADE_AVX512 void pack_transposed_panel(const float* b, int64_t ldb, int64_t k, float alpha, int64_t column,
                                        int64_t width, float* dest) {
  const float* first = b + column * ldb;
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int64_t k0 = 0; k0 < k; k0 += 16) {
    const int64_t depth = std::min<int64_t>(16, k - k0);
    const __mmask16 depth_mask = first_lanes16(depth);
    for (int64_t half = 0; half < kPanel; half += 16) {
      __m512 rows[16];
#pragma GCC unroll 16
      for (int64_t j = 0; j < 16; ++j) {
        rows[j] = half + j < width ? _mm512_maskz_loadu_ps(depth_mask, first + (half + j) * ldb + k0)
                                   : _mm512_setzero_ps();
      }
      transpose16(rows);
      for (int64_t d = 0; d < depth; ++d) _mm512_store_ps(dest + (k0 + d) * kPanel + half, _mm512_mul_ps(scale, rows[d]));
    }
  }
}

// An 8 x 8 block of floats transposed in registers: rows[i] becomes column i (pairs of elements,
// of pairs, then 128-bit lanes).
BLADE_AVX2 inline void transpose8(__m256 rows[8]) {
  __m256 t[8];
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(rows[i], rows[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(rows[i], rows[i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4) {
    rows[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    rows[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    rows[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    rows[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2f128_ps(rows[i], rows[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(rows[i], rows[i + 4], 0x31);
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) rows[i] = t[i];
}

// The first `count` lanes of an AVX2 mask (maskload reads no element whose lane is off).
BLADE_AVX2 inline __m256i first_lanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// AVX2's pack_transposed_panel: alpha * columns [column, column + width) of a transposed B as one
// zero-padded [k][16] panel in `dest` (32-byte aligned), 8 columns x 8 depths at a time: 8 row loads
// and an in-register transpose. Loads past `width` or k are masked off, so no element outside B is read.
BLADE_AVX2 void pack_transposed_panel_avx2(const float* b, int64_t ldb, int64_t k, float alpha, int64_t column,
                                           int64_t width, float* dest) {
  const float* first = b + column * ldb;
  const __m256 scale = _mm256_set1_ps(alpha);
  for (int64_t k0 = 0; k0 < k; k0 += 8) {
    const int64_t depth = std::min<int64_t>(8, k - k0);
    const __m256i depth_mask = first_lanes(depth);
    for (int64_t half = 0; half < kAvx2Half; half += 8) {
      __m256 rows[8];
#pragma GCC unroll 8
      for (int64_t j = 0; j < 8; ++j) {
        const float* source = first + (half + j) * ldb + k0;
        rows[j] = half + j >= width ? _mm256_setzero_ps()
                  : depth == 8      ? _mm256_loadu_ps(source)
                                    : _mm256_maskload_ps(source, depth_mask);
      }
      transpose8(rows);
      for (int64_t d = 0; d < depth; ++d) _mm256_store_ps(dest + (k0 + d) * kAvx2Half + half, _mm256_mul_ps(scale, rows[d]));
    }
  }
}

// alpha * columns [column, column + width) (width <= 16) of an untransposed B as one zero-padded
// [k][16] panel in `dest` (32-byte aligned). Read in place instead (as the AVX-512 path reads it),
// attention's V in the fused QKV output (rows 3 KB apart, likely a new page every depth) ran
// [128, 128] @ [128, 64] at 74 GFLOP/s and [512, 512] @ [512, 64] at 72 (MKL 83-85); packed, 89-94.
BLADE_AVX2 void pack_panel_avx2(const float* b, int64_t ldb, int64_t k, float alpha, int64_t column, int64_t width,
                                float* dest) {
  const float* first = b + column;
  const __m256 scale = _mm256_set1_ps(alpha);
  const __m256i low_mask = first_lanes(std::min<int64_t>(width, 8)), high_mask = first_lanes(width - 8);
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* row = first + kk * ldb;
    const __m256 low = width >= 8 ? _mm256_loadu_ps(row) : _mm256_maskload_ps(row, low_mask);
    const __m256 high = width >= kAvx2Half ? _mm256_loadu_ps(row + 8)
                        : width > 8        ? _mm256_maskload_ps(row + 8, high_mask)
                                           : _mm256_setzero_ps();
    _mm256_store_ps(dest + kk * kAvx2Half, _mm256_mul_ps(scale, low));
    _mm256_store_ps(dest + kk * kAvx2Half + 8, _mm256_mul_ps(scale, high));
  }
}

// per_call_gemm on AVX2: (batch entry, group of panels, row chunk) tasks; a task packs its group of
// B's panels (alpha folded in) into its thread's buffer, unless the thread's previous task packed
// it already, then runs its rows over the whole group (rows_of_all_panels_avx2). A group is as many
// panels as fit kGroupFloats (all of attention's B at head dim 64 up to 1024 keys: a head's K^T, 64
// x 512, is 128 KB). On a Zen 3 core (1 thread, CPU time, 4 heads, Q/K/V in a fused QKV output)
// this ran [512, 64] @ [64, 512]^T at 88 GFLOP/s where panel by panel (each panel's pass streaming
// all of Q from L2) it ran at 81 and MKL at 79-86; at 128 keys 85-87, MKL 80-83.
void per_call_gemm_avx2(const GemmArgs& g) {
  constexpr int64_t kGroupFloats = 1 << 16;  // 256 KB: half of Zen 3's L2
  const int64_t panels = (g.n + kAvx2Half - 1) / kAvx2Half, panel_floats = g.k * kAvx2Half;
  const int64_t group = std::clamp<int64_t>(kGroupFloats / panel_floats, 1, panels);
  const int64_t groups = (panels + group - 1) / group, items = g.batch * groups;
  const Tasks t = split_tasks(g, items, group * kAvx2Half);
  timed_parallel_for(0, items * t.chunks, t.grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffer;
    buffer.resize(group * panel_floats + 16);  // + 16: room to align the panels to 64 bytes
    float* packed = buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) / sizeof(float) % 16) % 16;
    int64_t packed_item = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t item = task / t.chunks, first = task % t.chunks * t.chunk_rows;
      if (first >= g.m) continue;
      const int64_t batch = item / groups, first_panel = item % groups * group;
      const int64_t count = std::min(group, panels - first_panel), column = first_panel * kAvx2Half;
      if (item != packed_item) {
        const float* b = g.b + batch * g.stride_b;
        for (int64_t p = 0; p < count; ++p) {
          const int64_t at = column + p * kAvx2Half, width = std::min(kAvx2Half, g.n - at);
          float* panel = packed + p * panel_floats;
          if (g.trans_b) {
            pack_transposed_panel_avx2(b, g.ldb, g.k, g.alpha, at, width, panel);
          } else {
            pack_panel_avx2(b, g.ldb, g.k, g.alpha, at, width, panel);
          }
        }
        packed_item = item;
      }
      rows_of_all_panels_avx2(g, g.a + batch * g.stride_a, g.c + batch * g.stride_c, packed, column, count, first,
                              std::min(g.m, first + t.chunk_rows));
    }
  }, t.chunks);  // claimed in whole items: an item's tasks share one pack of its panels
}

// A B the engine computes (attention's K^T and V, per head: a batch), which no pack outlives.
// Without AVX-512, per_call_gemm_avx2. With it: untransposed, each panel is read where it is (row kk of a panel: 32 floats of B's row kk);
// transposed, each task first packs its panel into a buffer of its thread (4 x 8 KB per head of
// 64 dims at 128 keys), which its row blocks then share. oneDNN's matmul ran attention's
// [128, 64] @ [64, 128] and [128, 128] @ [128, 64] at ~170 GFLOP/s on one core here.
void per_call_gemm(const GemmArgs& g) {
  if (!avx512_usable()) return per_call_gemm_avx2(g);
  const int64_t count = (g.n + kPanel - 1) / kPanel, items = g.batch * count;
  const Tasks t = split_tasks(g, items);
  timed_parallel_for(0, items * t.chunks, t.grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffer;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t item = task / t.chunks, first = task % t.chunks * t.chunk_rows;
      if (first >= g.m) continue;
      const int64_t batch = item / count, column = item % count * kPanel;
      const int64_t width = std::min(kPanel, g.n - column), last = std::min(g.m, first + t.chunk_rows);
      const float* a = g.a + batch * g.stride_a;
      const float* b = g.b + batch * g.stride_b;
      float* c = g.c + batch * g.stride_c;
      if (!g.trans_b) {
        panel_rows<true>(g, a, c, b + column, g.ldb, g.alpha, column, width, first, last);
        continue;
      }
      buffer.resize(g.k * kPanel + 16);  // + 16: room to align the panel to 64 bytes (aligned loads)
      float* panel = buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) / sizeof(float) % 16) % 16;
      pack_transposed_panel(b, g.ldb, g.k, g.alpha, column, width, panel);
      panel_rows<false>(g, a, c, panel, kPanel, 1.0f, column, width, first, last);
    }
  });
}

// ---- fused attention (BladeRuntime::attention) ----

// Query rows per task: a block's score rows (rows x n floats) stay in L1/L2 between the Q.K^T
// GEMM that writes them, the softmax and the P.V GEMM that reads them. 60 KB at 512 keys.
constexpr int64_t kAttentionScoreFloats = 1 << 14;

int64_t attention_block_rows(int64_t m, int64_t n, int64_t block_rows) {
  const int64_t rows =
      std::max<int64_t>(block_rows, kAttentionScoreFloats / std::max<int64_t>(n, 1) / block_rows * block_rows);
  return std::min(rows, m);
}

// Element (o, i, r, c) of a step's mask.
template <class T>
inline const T* mask_row(const BladeScoreStep& s, int64_t o, int64_t i, int64_t r) {
  return static_cast<const T*>(s.mask) + o * s.strides[0] + i * s.strides[1] + r * s.strides[2];
}

// One score row (the raw q . k of query row r) through the steps and the softmax, in place: the
// engine's unfused code per element (Mul, Div, Where, Add), then max (NaN if any), e = exp(x - max),
// sum, e * (1 / sum); a row whose max equals zero_rows_max is 0 when zero_rows (the steps first).
void score_steps(const BladeAttention& a, int64_t o, int64_t i, int64_t r, float* x) {
  const int64_t n = a.n;
  for (int32_t k = 0; k < a.step_count; ++k) {
    const BladeScoreStep& s = a.steps[k];
    const float value = s.value;
    switch (s.kind) {
      case BLADE_SCORE_MUL:
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) x[c] = x[c] * value;
        break;
      case BLADE_SCORE_DIV:
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) x[c] = x[c] / value;
        break;
      case BLADE_SCORE_KEEP: {
        const uint8_t* m = mask_row<uint8_t>(s, o, i, r);
        const int64_t step = s.strides[3];
        if (step == 1) {
#pragma omp simd
          for (int64_t c = 0; c < n; ++c) x[c] = m[c] ? x[c] : value;
        } else {
          for (int64_t c = 0; c < n; ++c) x[c] = m[c * step] ? x[c] : value;
        }
        break;
      }
      default: {  // BLADE_SCORE_ADD
        const float* m = mask_row<float>(s, o, i, r);
        const int64_t step = s.strides[3];
        if (step == 1) {
#pragma omp simd
          for (int64_t c = 0; c < n; ++c) x[c] = x[c] + m[c];
        } else {
          for (int64_t c = 0; c < n; ++c) x[c] = x[c] + m[c * step];
        }
      }
    }
  }
}

void score_row(const BladeAttention& a, int64_t o, int64_t i, int64_t r, float* x) {
  score_steps(a, o, i, r, x);
  const int64_t n = a.n;
  float top = -std::numeric_limits<float>::infinity();
  int32_t nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
  for (int64_t c = 0; c < n; ++c) {
    top = x[c] > top ? x[c] : top;
    nan |= x[c] != x[c];
  }
  if (nan) top = std::numeric_limits<float>::quiet_NaN();
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t c = 0; c < n; ++c) {
    const float e = blade_expf(x[c] - top);
    x[c] = e;
    total = total + e;
  }
  const float scale = 1.0f / total;
  const bool zero = a.zero_rows != 0 && top == a.zero_rows_max;
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) x[c] = zero ? 0.0f : x[c] * scale;
}

// blade_expf (engine_prelude.h, its AVX2 version) on 8 lanes: the same operations in the same order,
// so each lane rounds like the engine's vectorized loop (g++ -O2 left the scalar version's loop
// unvectorized here: 1M exps at 512 keys took longer than both GEMMs).
BLADE_AVX2 inline __m256 expf_avx2(__m256 x) {
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 shifted = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic);
  const __m256 n = _mm256_sub_ps(shifted, magic);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256 scaled = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_castps_si256(e), _mm256_slli_epi32(_mm256_castps_si256(shifted), 23)));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  // x <= hi ? scaled : x + inf (NaN: x + inf), then x < lo ? 0
  const __m256 in_range = _mm256_blendv_ps(_mm256_add_ps(x, inf), scaled,
                                           _mm256_cmp_ps(x, _mm256_set1_ps(88.7228317261f), _CMP_LE_OQ));
  return _mm256_blendv_ps(in_range, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365402222f), _CMP_LT_OQ));
}

// score_row with its hot loops (the mask step, max, exp and sum, the scaling) 8 lanes at a time.
BLADE_AVX2 void score_row_avx2(const BladeAttention& a, int64_t o, int64_t i, int64_t r, float* x) {
  const int64_t n = a.n, vector_end = n / 8 * 8;
  for (int32_t k = 0; k < a.step_count; ++k) {
    const BladeScoreStep& s = a.steps[k];
    const __m256 value = _mm256_set1_ps(s.value);
    int64_t c = 0;
    if (s.kind == BLADE_SCORE_MUL) {
      for (; c < vector_end; c += 8) _mm256_storeu_ps(x + c, _mm256_mul_ps(_mm256_loadu_ps(x + c), value));
      for (; c < n; ++c) x[c] = x[c] * s.value;
    } else if (s.kind == BLADE_SCORE_KEEP && s.strides[3] == 1) {
      const uint8_t* m = mask_row<uint8_t>(s, o, i, r);
      for (; c < vector_end; c += 8) {
        int64_t bytes;
        std::memcpy(&bytes, m + c, 8);
        const __m256i lanes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
        const __m256 drop = _mm256_castsi256_ps(_mm256_cmpeq_epi32(lanes, _mm256_setzero_si256()));
        _mm256_storeu_ps(x + c, _mm256_blendv_ps(_mm256_loadu_ps(x + c), value, drop));
      }
      for (; c < n; ++c) x[c] = m[c] ? x[c] : s.value;
    } else {  // the other steps: score_row's scalar loops
      BladeAttention one = a;
      one.step_count = 1;
      one.steps[0] = s;
      score_steps(one, o, i, r, x);
    }
  }
  __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan8 = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c < vector_end; c += 8) {
    const __m256 v = _mm256_loadu_ps(x + c);
    top8 = _mm256_max_ps(v, top8);  // max_ps(a, b) is b when either is NaN: NaNs are flagged apart
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float top = -std::numeric_limits<float>::infinity();
  bool nan = _mm256_movemask_ps(nan8) != 0;
  for (int l = 0; l < 8; ++l) top = lanes[l] > top ? lanes[l] : top;
  for (; c < n; ++c) {
    top = x[c] > top ? x[c] : top;
    nan |= x[c] != x[c];
  }
  if (nan) top = std::numeric_limits<float>::quiet_NaN();
  const __m256 top_v = _mm256_set1_ps(top);
  __m256 sum8 = _mm256_setzero_ps();
  for (c = 0; c < vector_end; c += 8) {
    const __m256 e = expf_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + c), top_v));
    _mm256_storeu_ps(x + c, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  _mm256_store_ps(lanes, sum8);
  float total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; c < n; ++c) {
    x[c] = blade_expf(x[c] - top);
    total = total + x[c];
  }
  const float scale = 1.0f / total;
  const bool zero = a.zero_rows != 0 && top == a.zero_rows_max;
  if (zero) {  // stored, not multiplied: the row's e are NaN (exp(-inf - -inf))
    std::fill(x, x + n, 0.0f);
    return;
  }
  const __m256 scale_v = _mm256_set1_ps(scale);
  for (c = 0; c < vector_end; c += 8) _mm256_storeu_ps(x + c, _mm256_mul_ps(_mm256_loadu_ps(x + c), scale_v));
  for (; c < n; ++c) x[c] = x[c] * scale;
}

// R rows of A times the packed panels [0, panels) of B into C (n columns), one register block.
template <int R>
BLADE_AVX2 void rows_times_panels_avx2(int64_t k, const float* a, int64_t row_step, int64_t k_step,
                                       const float* packed, int64_t panels, int64_t n, float* c, int64_t ldc) {
  for (int64_t p = 0; p < panels; ++p) {
    block_avx2<R>(k, a, row_step, k_step, packed + p * k * kAvx2Half, 0.0f, c + p * kAvx2Half, ldc,
                  std::min(kAvx2Half, n - p * kAvx2Half));
  }
}

// Rows [first, last) of C = op(A) @ packed B (`panels` panels of k x 16), register block by block.
BLADE_AVX2 void block_rows_avx2(int64_t k, const float* a, int64_t row_step, int64_t k_step, const float* packed,
                                int64_t n, float* c, int64_t ldc, int64_t rows) {
  const int64_t panels = (n + kAvx2Half - 1) / kAvx2Half;
  for (int64_t r0 = 0; r0 < rows; r0 += kAvx2BlockRows) {
    const float* a_rows = a + r0 * row_step;
    float* c_rows = c + r0 * ldc;
    const auto run = [&](auto count) {
      rows_times_panels_avx2<decltype(count)::value>(k, a_rows, row_step, k_step, packed, panels, n, c_rows, ldc);
    };
    with_row_count<kAvx2BlockRows>(rows - r0, run);
  }
}

// op(B) [k, n] (ld, trans) as packed, zero-padded 16-column panels in `dest`.
BLADE_AVX2 void pack_all_panels_avx2(const float* b, int64_t ld, int32_t trans, int64_t k, int64_t n, float* dest) {
  for (int64_t column = 0; column < n; column += kAvx2Half) {
    const int64_t width = std::min(kAvx2Half, n - column);
    float* panel = dest + column / kAvx2Half * k * kAvx2Half;
    if (trans) {
      pack_transposed_panel_avx2(b, ld, k, 1.0f, column, width, panel);
    } else {
      pack_panel_avx2(b, ld, k, 1.0f, column, width, panel);
    }
  }
}

// A thread's 64-byte aligned buffer of at least `floats` floats (grown, never shrunk).
float* aligned_buffer(std::vector<float>& buffer, int64_t floats) {
  if (static_cast<int64_t>(buffer.size()) < floats + 16) buffer.resize(floats + 16);
  return buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) / sizeof(float) % 16) % 16;
}

// ---- the fused attention's AVX-512 pieces: 16-lane softmax steps, 32-column panels ----

// expf_avx2 on 16 lanes: the same operations in the same order (the runtime's blade_expf), so the
// fused softmax rounds alike on both ISAs.
BLADE_AVX512 inline __m512 expf_avx512(__m512 x) {
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 shifted = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic);
  const __m512 n = _mm512_sub_ps(shifted, magic);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512 scaled = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_castps_si512(e), _mm512_slli_epi32(_mm512_castps_si512(shifted), 23)));
  // x <= hi ? scaled : x + inf (NaN: x + inf), then x < lo ? 0
  const __m512 in_range = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(88.7228317261f), _CMP_LE_OQ),
                                               _mm512_add_ps(x, _mm512_set1_ps(std::numeric_limits<float>::infinity())),
                                               scaled);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365402222f), _CMP_LT_OQ), in_range,
                              _mm512_setzero_ps());
}

// score_row with every contiguous step, the max, exp and sum, and the scaling 16 lanes at a time
// (the row's last lanes masked); a strided mask step runs score_row's scalar loop.
BLADE_AVX512 void score_row_avx512(const BladeAttention& a, int64_t o, int64_t i, int64_t r, float* x) {
  const int64_t n = a.n;
  for (int32_t k = 0; k < a.step_count; ++k) {
    const BladeScoreStep& s = a.steps[k];
    const __m512 value = _mm512_set1_ps(s.value);
    if (s.kind == BLADE_SCORE_MUL || s.kind == BLADE_SCORE_DIV) {
      const bool mul = s.kind == BLADE_SCORE_MUL;
      for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 lanes = first_lanes16(n - c);
        const __m512 v = _mm512_maskz_loadu_ps(lanes, x + c);
        _mm512_mask_storeu_ps(x + c, lanes, mul ? _mm512_mul_ps(v, value) : _mm512_div_ps(v, value));
      }
    } else if (s.kind == BLADE_SCORE_KEEP && s.strides[3] == 1) {
      const uint8_t* m = mask_row<uint8_t>(s, o, i, r);
      for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 lanes = first_lanes16(n - c);
        __m128i bytes;
        if (n - c >= 16) {
          bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m + c));
        } else {  // the row's last bytes only: none past it is read
          alignas(16) uint8_t last[16] = {};
          std::memcpy(last, m + c, n - c);
          bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(last));
        }
        const __m512i keep = _mm512_cvtepu8_epi32(bytes);
        const __mmask16 drop = _mm512_cmpeq_epi32_mask(keep, _mm512_setzero_si512());
        _mm512_mask_storeu_ps(x + c, lanes, _mm512_mask_blend_ps(drop, _mm512_maskz_loadu_ps(lanes, x + c), value));
      }
    } else if (s.kind == BLADE_SCORE_ADD && s.strides[3] == 1) {
      const float* m = mask_row<float>(s, o, i, r);
      for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 lanes = first_lanes16(n - c);
        _mm512_mask_storeu_ps(x + c, lanes,
                              _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, x + c), _mm512_maskz_loadu_ps(lanes, m + c)));
      }
    } else {  // a strided mask: score_row's scalar loop
      BladeAttention one = a;
      one.step_count = 1;
      one.steps[0] = s;
      score_steps(one, o, i, r, x);
    }
  }
  const float minus_inf = -std::numeric_limits<float>::infinity();
  __m512 top16 = _mm512_set1_ps(minus_inf);
  __mmask16 nan = 0;
  for (int64_t c = 0; c < n; c += 16) {
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(minus_inf), first_lanes16(n - c), x + c);
    top16 = _mm512_max_ps(v, top16);  // max_ps(a, b) is b when either is NaN: NaNs are flagged apart
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  const float top = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(top16);
  const __m512 top_v = _mm512_set1_ps(top);
  __m512 sum16 = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 lanes = first_lanes16(n - c);
    const __m512 e = expf_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + c), top_v));
    _mm512_mask_storeu_ps(x + c, lanes, e);
    sum16 = _mm512_add_ps(sum16, _mm512_maskz_mov_ps(lanes, e));
  }
  if (a.zero_rows != 0 && top == a.zero_rows_max) {  // stored, not multiplied: the row's e are NaN
    std::fill(x, x + n, 0.0f);
    return;
  }
  const __m512 scale = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum16));
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 lanes = first_lanes16(n - c);
    _mm512_mask_storeu_ps(x + c, lanes, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, x + c), scale));
  }
}

// Columns [column, column + width) of an untransposed B as one zero-padded [k][32] panel in `dest`
// (64-byte aligned); loads past `width` are masked off.
BLADE_AVX512 void pack_panel_avx512(const float* b, int64_t ldb, int64_t k, int64_t column, int64_t width,
                                    float* dest) {
  const __mmask16 low = first_lanes16(width), high = width > 16 ? first_lanes16(width - 16) : 0;
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* row = b + kk * ldb + column;
    _mm512_store_ps(dest + kk * kPanel, _mm512_maskz_loadu_ps(low, row));
    _mm512_store_ps(dest + kk * kPanel + 16, _mm512_maskz_loadu_ps(high, row + 16));
  }
}

// The fused attention's per-ISA pieces: register block rows, panel width, how op(B) [k, n] is
// packed into panels, C = op(A) @ packed B for a block of rows, and one score row's softmax.
struct Avx2Attention {
  static constexpr int64_t kRows = kAvx2BlockRows, kColumns = kAvx2Half;
  static void pack(const float* b, int64_t ld, int32_t trans, int64_t k, int64_t n, float* dest) {
    pack_all_panels_avx2(b, ld, trans, k, n, dest);
  }
  static void rows(int64_t k, const float* a, int64_t row_step, int64_t k_step, const float* packed, int64_t n,
                   float* c, int64_t ldc, int64_t rows) {
    block_rows_avx2(k, a, row_step, k_step, packed, n, c, ldc, rows);
  }
  static void score_row(const BladeAttention& a, int64_t o, int64_t i, int64_t r, float* x) {
    score_row_avx2(a, o, i, r, x);
  }
};

// AVX-512: 8 x 32 register blocks (block<R, false>) on 32-column panels. At BERT's 4 heads of 64
// dims, 128 keys, batch 8 with a bool mask (AMD EPYC Zen 5, 2 threads, interleaved, best of 15):
// 0.52 ms a call where the AVX2 version took 0.85 (its GEMMs ran at ~200 GFLOP/s against the
// layer's projections' ~380); of the 0.52, the softmax rows 0.17 and each GEMM 0.16. Whole models
// through blade.load: BERT padded b8 19.5 -> 18.9 ms, b1 2.94 -> 2.71, T5 encoder b1 2.90 -> 2.65,
// ViT b1 3.27 -> 2.83. (A memcpy per 16 mask bytes, not only at the row's end, made the softmax
// slower than AVX2's.)
struct Avx512Attention {
  static constexpr int64_t kRows = kBlockRows, kColumns = kPanel;
  static void pack(const float* b, int64_t ld, int32_t trans, int64_t k, int64_t n, float* dest) {
    for (int64_t column = 0; column < n; column += kPanel) {
      const int64_t width = std::min(kPanel, n - column);
      float* panel = dest + column / kPanel * k * kPanel;
      if (trans) {
        pack_transposed_panel(b, ld, k, 1.0f, column, width, panel);
      } else {
        pack_panel_avx512(b, ld, k, column, width, panel);
      }
    }
  }
  static void rows(int64_t k, const float* a, int64_t row_step, int64_t k_step, const float* packed, int64_t n,
                   float* c, int64_t ldc, int64_t rows) {
    const int64_t panels = (n + kPanel - 1) / kPanel;
    for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
      const auto run = [&](auto count) {
        for (int64_t p = 0; p < panels; ++p) {
          block<decltype(count)::value, false>(k, a + r0 * row_step, row_step, k_step, packed + p * k * kPanel, kPanel,
                                               1.0f, 0.0f, c + r0 * ldc + p * kPanel, ldc,
                                               std::min(kPanel, n - p * kPanel));
        }
      };
      with_row_count<kBlockRows>(rows - r0, run);
    }
  }
  static void score_row(const BladeAttention& a, int64_t o, int64_t i, int64_t r, float* x) {
    score_row_avx512(a, o, i, r, x);
  }
};

// The fused attention: (o, i, block of query rows) tasks. A thread packs K^T and V of an (o, i)
// into its buffers once (again only when its next task is another (o, i)); each task then runs its
// rows' Q.K^T into a score block in cache, the softmax rows, and P.V into out.
template <class Isa>
void fused_attention(const BladeAttention& a) {
  const int64_t rows = attention_block_rows(a.m, a.n, Isa::kRows), blocks = (a.m + rows - 1) / rows;
  const int64_t heads = a.outer * a.inner, n_padded = (a.n + Isa::kColumns - 1) / Isa::kColumns * Isa::kColumns;
  const int64_t dv_padded = (a.dv + Isa::kColumns - 1) / Isa::kColumns * Isa::kColumns;
  const int64_t task_fmas = std::max<int64_t>(1, rows * a.n * (a.d + a.dv));
  timed_parallel_for(0, heads * blocks, std::max<int64_t>(1, (1 << 16) / task_fmas), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> k_buffer, v_buffer, score_buffer;
    float* k_packed = aligned_buffer(k_buffer, a.d * n_padded);
    float* v_packed = aligned_buffer(v_buffer, a.n * dv_padded);
    float* scores = aligned_buffer(score_buffer, rows * a.n);
    int64_t packed_head = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / blocks, first = task % blocks * rows, count = std::min(rows, a.m - first);
      const int64_t o = head / a.inner, i = head % a.inner;
      if (head != packed_head) {
        Isa::pack(a.kt + o * a.k_strides[0] + i * a.k_strides[1], a.ldk, a.trans_k, a.d, a.n, k_packed);
        Isa::pack(a.v + o * a.v_strides[0] + i * a.v_strides[1], a.ldv, a.trans_v, a.n, a.dv, v_packed);
        packed_head = head;
      }
      const int64_t q_row = a.trans_q ? 1 : a.ldq, q_k = a.trans_q ? a.ldq : 1;
      const float* q = a.q + o * a.q_strides[0] + i * a.q_strides[1] + first * q_row;
      Isa::rows(a.d, q, q_row, q_k, k_packed, a.n, scores, a.n, count);
      for (int64_t r = 0; r < count; ++r) Isa::score_row(a, o, i, first + r, scores + r * a.n);
      float* out = a.out + o * a.out_strides[0] + i * a.out_strides[1] + first * a.ldo;
      Isa::rows(a.n, scores, a.n, 1, v_packed, a.dv, out, a.ldo, count);
    }
  }, blocks);  // claimed in whole heads: a head's blocks share one pack of its K and V
}

}  // namespace

void panels_pack(const GemmArgs& g, PackedWeights* weights) { panels_of(g, weights); }

bool panels_packed(const GemmArgs& g, PackedWeights* weights) {
  return weights != nullptr && weights->has(pack_key(g));
}

void attention(const BladeAttention& a, PackedWeights* weights) {
  if (a.outer * a.inner * a.m * a.dv == 0) return;
  if (a.n > 0 && a.d > 0 && avx512_usable()) return fused_attention<Avx512Attention>(a);
  if (a.n > 0 && a.d > 0 && avx2_usable()) return fused_attention<Avx2Attention>(a);
  // Without AVX2 (or an empty sum): the unfused computation, head by head through the runtime's GEMM.
  std::vector<float> scores(std::max<int64_t>(a.m * a.n, 1));
  for (int64_t o = 0; o < a.outer; ++o) {
    for (int64_t i = 0; i < a.inner; ++i) {
      gemm({1, a.m, a.n, a.d, 1.0f, a.q + o * a.q_strides[0] + i * a.q_strides[1], a.ldq, 0, a.trans_q,
            a.kt + o * a.k_strides[0] + i * a.k_strides[1], a.ldk, 0, a.trans_k, 0.0f, scores.data(), a.n, 0},
           weights);
      for (int64_t r = 0; r < a.m; ++r) score_row(a, o, i, r, scores.data() + r * a.n);
      gemm({1, a.m, a.dv, a.n, 1.0f, scores.data(), a.n, 0, 0, a.v + o * a.v_strides[0] + i * a.v_strides[1], a.ldv,
            0, a.trans_v, 0.0f, a.out + o * a.out_strides[0] + i * a.out_strides[1], a.ldo, 0},
           weights);
    }
  }
}

bool panels_applies(const GemmArgs& g, bool b_constant) {
  if (g.k <= 0 || !(avx512_usable() || avx2_usable())) return false;
  return g.batch == 1 || !b_constant;
}

void panels_gemm(const GemmArgs& g, PackedWeights* weights) {
  if (g.batch == 1 && weights != nullptr && weights->is_constant(g.b)) return packed_gemm(g, weights);
  TORCH_CHECK(avx512_usable() || avx2_usable(), "blade: the panels GEMM needs AVX2 and FMA");
  per_call_gemm(g);
}

}  // namespace blade
