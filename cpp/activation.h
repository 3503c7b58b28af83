// The activation epilogue of the runtime's convolution kernels (blade_abi.h BladeActivation).
//
// Every activation the ABI offers is a clamp: ReLU is clamp(0, +inf), and clamp(-inf, +inf) is the
// identity (for every float, NaN included), so the kernels apply one formula, the engine's own
// Max-then-Min (optable.py), and stay exact for NaN, infinities and -0.
#pragma once

#include <cstdint>
#include <limits>

#include "blade_abi.h"

namespace blade {

struct Clamp {
  bool on;  // false: the identity, kernels skip it
  float lo, hi;
};

// The clamp `activation` (nullptr: none) computes; throws on an unknown kind.
Clamp clamp_of(const BladeActivation* activation);

// v clamped to [lo, hi] as the engine's Max(v, lo) then Min(v, hi) for bounds that are not NaN
// (clamp_of refuses those): NaN stays NaN (every comparison with it is false) and a tie keeps v
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
