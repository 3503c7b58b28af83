// out[i] = table[ids[i]] for ids: int64[4] and the constant table: float32[10, 3]; an id outside
// [0, 10) fails the call with BLADE_ERR_INDEX_OUT_OF_RANGE, as generated gathers do.
#include <cstring>

#include "blade_abi.h"

extern "C" int32_t blade_engine_abi_version(void) { return BLADE_ABI_VERSION; }

extern "C" int32_t blade_engine_run(const BladeRuntime* /*rt*/, const void* const* inputs, void* const* outputs,
                                    const void* const* constants, const int64_t* /*sizes*/, void* /*scratch*/) {
  constexpr int64_t kIds = 4, kRows = 10, kDim = 3;
  const int64_t* ids = static_cast<const int64_t*>(inputs[0]);
  const float* table = static_cast<const float*>(constants[0]);
  float* out = static_cast<float*>(outputs[0]);
  for (int64_t i = 0; i < kIds; ++i) {
    if (ids[i] < 0 || ids[i] >= kRows) return BLADE_ERR_INDEX_OUT_OF_RANGE;
    std::memcpy(out + i * kDim, table + ids[i] * kDim, kDim * sizeof(float));
  }
  return BLADE_OK;
}
