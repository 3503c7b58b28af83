// The BladeRuntime table (blade_abi.h) this process hands to every engine call.
#pragma once
#include "blade_abi.h"

namespace blade {

// One static instance: GEMM and convolution through ATen (MKL/oneDNN underneath), loops on ATen's
// intra-op thread pool.
const BladeRuntime* runtime();

}  // namespace blade
