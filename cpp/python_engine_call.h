// A direct Python call of one Engine: what blade.load's module uses when the archive's graph is
// exactly one engine call (blade/direct.py), instead of the TorchScript forward around it.
#pragma once
#include <pybind11/pybind11.h>

namespace blade {

void bind_engine_call(pybind11::module_& m);

}  // namespace blade
