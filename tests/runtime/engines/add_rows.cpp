// sum = x + y over a run-time number of rows: x, y, sum: float32[rows, 4], rows = sizes[0] (the
// manifest's first size symbol). Exercises the host's binding of size symbols.
#include "blade_abi.h"

extern "C" int32_t blade_engine_abi_version(void) { return BLADE_ABI_VERSION; }

extern "C" int32_t blade_engine_run(const BladeRuntime* /*rt*/, const void* const* inputs, void* const* outputs,
                                    const void* const* /*constants*/, const int64_t* sizes, void* /*scratch*/) {
  const float* x = static_cast<const float*>(inputs[0]);
  const float* y = static_cast<const float*>(inputs[1]);
  float* sum = static_cast<float*>(outputs[0]);
  for (int64_t i = 0; i < sizes[0] * 4; ++i) sum[i] = x[i] + y[i];
  return BLADE_OK;
}
