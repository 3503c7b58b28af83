#include "isa.h"

#include <algorithm>

namespace blade {

const std::vector<std::string>& known_isas() {
  static const std::vector<std::string> levels = {"x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4"};
  return levels;
}

namespace {

std::string detect_host_isa() {
#if defined(__x86_64__)
  // GCC >= 11 / clang >= 12 understand the level names and check OS support (XCR0) for AVX*.
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4";
  if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3";
  if (__builtin_cpu_supports("x86-64-v2")) return "x86-64-v2";
  return "x86-64";
#else
  return "unknown";
#endif
}

}  // namespace

const std::string& host_isa() {
  static const std::string isa = detect_host_isa();
  return isa;
}

bool isa_supported(const std::string& isa) {
  const auto& levels = known_isas();
  auto wanted = std::find(levels.begin(), levels.end(), isa);
  auto have = std::find(levels.begin(), levels.end(), host_isa());
  return wanted != levels.end() && have != levels.end() && wanted <= have;
}

}  // namespace blade
