// Runtime calls on constant weights (which the runtime may pack once per engine) next to the same
// calls on operands computed into scratch (which change every call and must never be cached).
//   inputs:    x float32[1, 3, 8, 8], y float32[5, 16], v float32[16, 8], u float32[4, 3, 3, 3]
//   constants: w float32[4, 3, 3, 3], b float32[4], m float32[16, 8]
//   outputs:   conv(x, w) + b, y @ m, y @ (2 v), conv(x, 2 u): [1, 4, 6, 6], [5, 8], [5, 8], [1, 4, 6, 6]
#include "blade_abi.h"

extern "C" int32_t blade_engine_abi_version(void) { return BLADE_ABI_VERSION; }

extern "C" int32_t blade_engine_run(const BladeRuntime* rt, const void* const* inputs, void* const* outputs,
                                    const void* const* constants, const int64_t* /*sizes*/, void* scratch) {
  const float* x = static_cast<const float*>(inputs[0]);
  const float* y = static_cast<const float*>(inputs[1]);
  const float* v = static_cast<const float*>(inputs[2]);
  const float* u = static_cast<const float*>(inputs[3]);
  float* doubled_v = static_cast<float*>(scratch);    // 128 floats
  float* doubled_u = doubled_v + 128;                 // 108 floats
  for (int i = 0; i < 128; ++i) doubled_v[i] = 2 * v[i];
  for (int i = 0; i < 108; ++i) doubled_u[i] = 2 * u[i];

  const int64_t x_shape[] = {1, 3, 8, 8}, w_shape[] = {4, 3, 3, 3};
  const int64_t strides[] = {1, 1}, pads[] = {0, 0, 0, 0}, dilations[] = {1, 1};
  const auto* w = static_cast<const float*>(constants[0]);
  const auto* b = static_cast<const float*>(constants[1]);
  const auto* m = static_cast<const float*>(constants[2]);
  rt->conv(2, x_shape, x, w_shape, w, b, strides, pads, dilations, 1, static_cast<float*>(outputs[0]), 0, nullptr, 0);
  rt->sgemm(1, 5, 8, 16, 1.0f, y, 16, 0, 0, m, 8, 0, 0, 0.0f, static_cast<float*>(outputs[1]), 8, 0);
  rt->sgemm(1, 5, 8, 16, 1.0f, y, 16, 0, 0, doubled_v, 8, 0, 0, 0.0f, static_cast<float*>(outputs[2]), 8, 0);
  rt->conv(2, x_shape, x, w_shape, doubled_u, nullptr, strides, pads, dilations, 1, static_cast<float*>(outputs[3]), 0, nullptr, 0);
  return BLADE_OK;
}
