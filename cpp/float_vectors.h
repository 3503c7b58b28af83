// GCC vector types for the hand-written conv kernels (conv_patch.cpp, depthwise.cpp), which are
// templates on the vector type V and instantiated once per ISA: Floats16 (one AVX-512 register)
// in their x86-64-v4 versions, Floats8 (one AVX2 register) elsewhere. A 16-float vector in an AVX2
// function is no register pair to g++: it keeps such accumulators on the stack.
#pragma once

#include <cstdint>

namespace blade {
namespace float_vectors {

typedef float Floats16 __attribute__((vector_size(64), aligned(4)));
typedef float Floats8 __attribute__((vector_size(32), aligned(4)));
typedef float Floats4 __attribute__((vector_size(16), aligned(4)));  // one SSE register (grouped_conv.cpp's groups of 4)

template <typename V>
constexpr int64_t kLanes = sizeof(V) / sizeof(float);

// Unaligned loads and stores through memcpy: a typedef's aligned(4) does not survive as a template
// argument (V is then the naturally aligned vector, and a plain dereference faults on unaligned rows).
template <typename V>
__attribute__((always_inline)) inline V load(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(V));
  return v;
}
template <typename V>
__attribute__((always_inline)) inline void store(float* p, V v) { __builtin_memcpy(p, &v, sizeof(V)); }

}  // namespace float_vectors
}  // namespace blade
