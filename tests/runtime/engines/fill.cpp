// out = float32[4] filled with FILL_VALUE (set with -DFILL_VALUE=...), reporting ABI version
// ABI_VERSION (default: the real one).
#include "blade_abi.h"

#ifndef ABI_VERSION
#define ABI_VERSION BLADE_ABI_VERSION
#endif

extern "C" int32_t blade_engine_abi_version(void) { return ABI_VERSION; }

extern "C" int32_t blade_engine_run(const BladeRuntime* /*rt*/, const void* const* /*inputs*/,
                                    void* const* outputs, const void* const* /*constants*/, const int64_t* /*sizes*/, void* /*scratch*/) {
  float* out = static_cast<float*>(outputs[0]);
  for (int i = 0; i < 4; ++i) out[i] = FILL_VALUE;
  return BLADE_OK;
}
