// sum = x + y + bias (bias broadcast over rows), product = x * y; x, y: float32[64, 128].
// The sum is staged in scratch to exercise the runtime's per-call scratch buffer.
#include "blade_abi.h"

namespace {
constexpr int64_t kRows = 64, kCols = 128;
}

extern "C" int32_t blade_engine_abi_version(void) { return BLADE_ABI_VERSION; }

extern "C" int32_t blade_engine_run(const BladeRuntime* rt, const void* const* inputs, void* const* outputs,
                                    const void* const* constants, const int64_t* /*sizes*/, void* scratch) {
  const float* x = static_cast<const float*>(inputs[0]);
  const float* y = static_cast<const float*>(inputs[1]);
  const float* bias = static_cast<const float*>(constants[0]);
  float* sum = static_cast<float*>(outputs[0]);
  float* product = static_cast<float*>(outputs[1]);
  float* staged = static_cast<float*>(scratch);
  blade::parallel_for(rt, 0, kRows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < kCols; ++c) {
        int64_t i = r * kCols + c;
        staged[i] = x[i] + y[i];
        product[i] = x[i] * y[i];
      }
      for (int64_t c = 0; c < kCols; ++c) sum[r * kCols + c] = staged[r * kCols + c] + bias[c];
    }
  });
  return BLADE_OK;
}
