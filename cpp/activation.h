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

// v clamped to [lo, hi] as the engine's Max then Min: NaN stays NaN, a tie keeps v. Written for
// float and for GCC vector types (the comparisons are then lane masks, the ?: a blend).
template <typename V>
__attribute__((always_inline)) inline V clamp_value(V v, float lo, float hi) {
  v = ((v != v) | (v >= lo)) ? v : V{} + lo;
  return ((v != v) | (v <= hi)) ? v : V{} + hi;
}

template <>
__attribute__((always_inline)) inline float clamp_value<float>(float v, float lo, float hi) {
  v = (v != v || v >= lo) ? v : lo;
  return (v != v || v <= hi) ? v : hi;
}

}  // namespace blade
