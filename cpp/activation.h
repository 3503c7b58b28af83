// The activation epilogue of the runtime's convolution kernels (blade_abi.h BladeActivation).
//
// ReLU and the clamps are one clamp: ReLU is clamp(0, +inf), and clamp(-inf, +inf) is the identity
// (for every float, NaN included), so the kernels apply one formula in registers as they store, the
// engine's own Max-then-Min (optable.py), and stay exact for NaN, infinities and -0.
//
// SiLU (v * sigmoid(v)) and GELU (v * Phi(v)) are no clamp: the kernels that fuse them (patch,
// depthwise, and the pair of both) run unary_in_place over each block of output they have just
// stored, while it is in L1/L2; the others (Winograd, grouped, pointwise GEMM, oneDNN) over their
// whole output afterwards, which costs what the engine's own kernel would. Either way the floats
// are the engine's: the same blade_sigmoidf and one multiply, the same blade_geluf (engine_prelude.h).
#pragma once

#include <cstdint>
#include <limits>

#include "blade_abi.h"

namespace blade {

struct Clamp {
  bool on;  // false: the identity, kernels skip it
  float lo, hi;
};

// The elementwise function a convolution's output goes through after its clamp, if any.
enum class Unary : int8_t { none, silu, gelu };

// A convolution's activation: its clamp (the identity for SiLU and GELU), and the function after
// it. Kept apart so that the kernels' code, which takes only the Clamp, does not change with them
// (a flag in Clamp changed g++'s register allocation in the patch kernel's tiles: a spill on an
// FMA chain).
struct Activation {
  Clamp clamp;
  Unary unary;
};

// What `activation` (nullptr: none) computes; throws on an unknown kind.
Activation activation_of(const BladeActivation* activation);

// to[i] = f(from[i]) for i in [0, count) (from == to: in place), on this thread: f is SiLU,
// from[i] * sigmoid(from[i]), or GELU, blade_geluf(from[i]); none copies.
void unary_range(Unary f, const float* from, float* to, int64_t count);
inline void unary_in_place(Unary f, float* data, int64_t count) { unary_range(f, data, data, count); }

// unary_range in parallel.
void unary_parallel(Unary f, const float* from, float* to, int64_t count);
// The kernels that do not fuse the unary function: unary_parallel in place over `count` dense
// floats of output when act has one, else nothing.
inline void unary_output(float* output, int64_t count, Activation act) {
  if (act.unary != Unary::none) unary_parallel(act.unary, output, output, count);
}

// v clamped to [lo, hi] as the engine's Max(v, lo) then Min(v, hi) for bounds that are not NaN
// (activation_of refuses those): NaN stays NaN (every comparison with it is false) and a tie keeps v
// (-0 stays -0). One compare and blend per bound, which GCC vectorizes (vmaxps/vminps); the
// engine's `v != v ||` form made it scalarize the vector version lane by lane (20x slower).
// Written for float and for GCC vector types (bounds broadcast as `bound - V{}`, which keeps -0).
template <typename V>
__attribute__((always_inline)) inline V clamp_value(V v, float lo, float hi) {
  const V low = lo - V{}, high = hi - V{};
  v = v < low ? low : v;
  return v > high ? high : v;
}

template <>
__attribute__((always_inline)) inline float clamp_value<float>(float v, float lo, float hi) {
  v = v < lo ? lo : v;
  return v > hi ? hi : v;
}

}  // namespace blade
