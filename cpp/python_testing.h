// Test-only Python hooks into the runtime table, for checking it without compiling an engine.
#pragma once
#include <pybind11/pybind11.h>

namespace blade {

void bind_testing(pybind11::module_& m);

}  // namespace blade
