#include "python_engine_call.h"

#include <pybind11/stl.h>
#include <torch/csrc/jit/api/object.h>
#include <torch/python.h>

#include "engine.h"

namespace blade {

namespace py = pybind11;

// Calling a ScriptModule's forward from Python costs ~1.5 us per call beyond the engine itself:
// pybind into TorchScript (schema matching, a stack of IValues), the interpreter's list
// construct/unpack around the CallMethod, and the custom class's boxed call. The function
// returned here takes the engine's inputs as a list of tensors and calls Engine::execute (so the
// fallback modes and every input check stay).
void bind_engine_call(py::module_& m) {
  m.def(
      "engine_call",
      [](const py::object& script_object) {
        // A torch.ScriptObject of class torch.classes.blade.Engine; toCustomClass checks the class.
        const auto object = py::cast<torch::jit::Object>(script_object);
        c10::intrusive_ptr<Engine> engine = c10::IValue(object._ivalue()).toCustomClass<Engine>();
        // wrap_pybind_function_no_gil: errors and TORCH_WARNs (fallback mode's) reach Python as
        // from any torch op, and the GIL is released during the call.
        return py::cpp_function(torch::wrap_pybind_function_no_gil(
                                    [engine](const std::vector<at::Tensor>& inputs) { return engine->execute(inputs); }),
                                py::arg("inputs"));
      },
      py::arg("engine"),
      "A function of the engine's input list that runs a torch.classes.blade.Engine (its execute) "
      "without going through TorchScript.");
}

}  // namespace blade
