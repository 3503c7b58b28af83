// Registers torch.classes.blade.Engine with TorchScript. Linked into every build of the runtime
// (the Python extension and plain C++ libraries), so loading a saved module only needs this code.
#include <torch/custom_class.h>

#include "engine.h"
#include "engine_state.h"

TORCH_LIBRARY(blade, m) {
  m.class_<blade::Engine>("Engine")
      .def(torch::init(&blade::make_engine))
      .def("execute", &blade::Engine::execute)
      .def("name", [](const c10::intrusive_ptr<blade::Engine>& self) { return self->name(); })
      .def("info", [](const c10::intrusive_ptr<blade::Engine>& self) { return self->info(); })
      .def("run_engine", &blade::Engine::run_engine)
      .def("run_fallback", &blade::Engine::run_fallback)
      .def("set_fallback_mode", &blade::Engine::set_fallback_mode)
      .def("fallback_mode", &blade::Engine::fallback_mode)
      .def("has_fallback", &blade::Engine::has_fallback)
      .def("check_report", &blade::Engine::check_report)
      .def("profile", &blade::Engine::profile)
      .def_pickle([](const c10::intrusive_ptr<blade::Engine>& self) { return blade::to_state(*self); },
                  [](c10::IValue state) { return blade::from_state(state); });
}
