// out = cat(x, x) along rows: x float32[rows, 4], out float32[twice, 4]. rows = sizes[0] is bound
// from x; twice = sizes[1] no input has: blade_engine_derived_sizes computes it (TWICE, default
// 2 * rows). DERIVED_COUNT (default 1) is what it claims to fill; NO_DERIVED leaves it out.
#include "blade_abi.h"

#ifndef TWICE
#define TWICE (2 * sizes[0])
#endif
#ifndef DERIVED_COUNT
#define DERIVED_COUNT 1
#endif

extern "C" int32_t blade_engine_abi_version(void) { return BLADE_ABI_VERSION; }

#ifndef NO_DERIVED
extern "C" int32_t blade_engine_derived_sizes(int64_t* sizes) {
  sizes[1] = TWICE;
  return DERIVED_COUNT;
}
#endif

extern "C" int32_t blade_engine_run(const BladeRuntime* /*rt*/, const void* const* inputs, void* const* outputs,
                                    const void* const* /*constants*/, const int64_t* sizes, void* /*scratch*/) {
  const float* x = static_cast<const float*>(inputs[0]);
  float* out = static_cast<float*>(outputs[0]);
  for (int64_t i = 0; i < sizes[0] * 4; ++i) out[i] = out[sizes[0] * 4 + i] = x[i];
  return BLADE_OK;
}
