// BLADE_ISA_CLONES: compile a function once per x86-64 level (v4: AVX-512; v3: AVX2 with FMA) and
// pick the clone when the extension loads. The extension builds for baseline x86-64, and its own
// kernels (depthwise.cpp, conv_gemm.cpp, winograd.cpp) are vector loops that need the wider registers.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BLADE_ISA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define BLADE_ISA_CLONES
#endif
