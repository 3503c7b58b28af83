// Which x86-64 microarchitecture level (the -march names GCC and clang share) this CPU runs.
// Engine .so files are compiled for one level; loading one on a host below it would die with SIGILL
// on the first unsupported instruction, so the Engine asks here first. Torch-free.
#pragma once
#include <string>
#include <vector>

namespace blade {

// Levels from lowest to highest; each one implies all before it.
const std::vector<std::string>& known_isas();

// The highest level of known_isas() this CPU (and OS: AVX state saving) supports;
// "unknown" on a non-x86-64 host, where no engine ISA is supported.
const std::string& host_isa();

// True when code compiled with -march=<isa> can run here; false for unknown names.
bool isa_supported(const std::string& isa);

}  // namespace blade
