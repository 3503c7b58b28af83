// Compiled as the engine's own loops are in this respect (compiler.py: -fno-trapping-math): so that
// g++ may compute both sides of blade_sigmoidf's selects and vectorize silu_range with AVX2. With
// trapping math it keeps them as branches (the divide on the untaken side might trap) and only the
// AVX-512 clone, which masks, vectorized: 1.4 ns a float on the AVX2 one. Before the includes: a
// scoped `optimize` pragma or attribute drops target_clones' ISA (no vector types at all).
#pragma GCC optimize("no-trapping-math")

#include "activation.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "isa_clones.h"
#include "timed_parallel.h"
// blade_sigmoidf, the engine's own (its non-AVX-512 version here: this unit builds for baseline
// x86-64; the AVX-512 one gives the same floats bit for bit).
#include "engine_prelude.h"

namespace blade {

Activation activation_of(const BladeActivation* activation) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  constexpr Clamp identity{false, -inf, inf};
  if (activation == nullptr || activation->kind == BLADE_ACTIVATION_NONE) return {identity, Unary::none};
  if (activation->kind == BLADE_ACTIVATION_SILU) return {identity, Unary::silu};
  if (activation->kind == BLADE_ACTIVATION_GELU) return {identity, Unary::gelu};
  if (activation->kind == BLADE_ACTIVATION_RELU) return {{true, 0.0f, inf}, Unary::none};  // v < 0 ? 0 : v is exactly clamp(0, +inf)
  TORCH_CHECK(activation->kind == BLADE_ACTIVATION_CLAMP, "blade runtime: unknown convolution activation ",
              activation->kind);
  TORCH_CHECK(!std::isnan(activation->lo) && !std::isnan(activation->hi), "blade runtime: a NaN clamp bound");
  return {{true, activation->lo, activation->hi}, Unary::none};
}

// One clone per ISA level so that the loops vectorize with the widest registers the CPU has, as
// the engine's own loops over Mul(v, Sigmoid(v)) and Gelu(v) do (tests/engine/test_vectorized.py
// checks); `omp simd`: the runtime builds at -O2, whose cost model would not vectorize them.
BLADE_ISA_CLONES void silu_range(const float* from, float* to, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    const float v = from[i];
    to[i] = v * blade_sigmoidf(v);
  }
}

// flatten: blade_geluf inlined, as in the engine's loops (-O2 left it a call, one float a step).
BLADE_ISA_CLONES __attribute__((flatten)) void gelu_range(const float* from, float* to, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) to[i] = blade_geluf(from[i]);
}

void unary_range(Unary f, const float* from, float* to, int64_t count) {
  switch (f) {
    case Unary::silu: return silu_range(from, to, count);
    case Unary::gelu: return gelu_range(from, to, count);
    case Unary::none: if (from != to) std::copy(from, from + count, to);
  }
}

void unary_parallel(Unary f, const float* from, float* to, int64_t count) {
  timed_parallel_for(0, count, 16384, [&](int64_t begin, int64_t end) { unary_range(f, from + begin, to + begin, end - begin); });
}

}  // namespace blade
