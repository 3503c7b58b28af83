// out[b] = x[b] @ w for x: float32[2, 8, 16] and the constant w: float32[16, 4] shared by the batch
// (batch stride 0), through the runtime's sgemm.
#include "blade_abi.h"

extern "C" int32_t blade_engine_abi_version(void) { return BLADE_ABI_VERSION; }

extern "C" int32_t blade_engine_run(const BladeRuntime* rt, const void* const* inputs, void* const* outputs,
                                    const void* const* constants, const int64_t* /*sizes*/, void* /*scratch*/) {
  constexpr int64_t B = 2, M = 8, K = 16, N = 4;
  rt->sgemm(B, M, N, K, 1.0f, static_cast<const float*>(inputs[0]), K, M * K, 0,
            static_cast<const float*>(constants[0]), N, 0, 0, 0.0f, static_cast<float*>(outputs[0]), N, M * N);
  return BLADE_OK;
}
