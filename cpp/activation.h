// The activation epilogue of the runtime's convolution kernels (blade_abi.h BladeActivation).
//
// ReLU and the clamps are one clamp: ReLU is clamp(0, +inf), and clamp(-inf, +inf) is the identity
// (for every float, NaN included), so the kernels apply one formula in registers as they store, the
// engine's own Max-then-Min (optable.py), and stay exact for NaN, infinities and -0.
//
// SiLU (v * sigmoid(v)) is no clamp: the kernels that fuse it (patch, depthwise, and the pair of
// both) run silu_in_place over each block of output they have just stored, while it is in L1/L2;
// the others (Winograd, grouped, pointwise GEMM, oneDNN) over their whole output afterwards, which
// costs what the engine's own SiLU kernel would. Either way the floats are the engine's: the same
// blade_sigmoidf (engine_prelude.h) and one multiply.
#pragma once

#include <cstdint>
#include <limits>

#include "blade_abi.h"

namespace blade {

struct Clamp {
  bool on;  // false: the identity, kernels skip it
  float lo, hi;
};

// A convolution's activation: its clamp (the identity for SiLU), and whether SiLU follows. Kept
// apart so that the kernels' code, which takes only the Clamp, does not change with SiLU (a flag
// in Clamp changed g++'s register allocation in the patch kernel's tiles: a spill on an FMA chain).
struct Activation {
  Clamp clamp;
  bool silu;
};

// What `activation` (nullptr: none) computes; throws on an unknown kind.
Activation activation_of(const BladeActivation* activation);

// to[i] = from[i] * sigmoid(from[i]) for i in [0, count) (from == to: in place), on this thread.
void silu_range(const float* from, float* to, int64_t count);
inline void silu_in_place(float* data, int64_t count) { silu_range(data, data, count); }

// silu_range in parallel.
void silu_parallel(const float* from, float* to, int64_t count);
// The kernels that do not fuse SiLU: silu_parallel in place over `count` dense floats of output when
// act.silu, else nothing.
inline void silu_output(float* output, int64_t count, Activation act) {
  if (act.silu) silu_parallel(output, output, count);
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
