#include "python_engine_call.h"

#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/api/object.h>
#include <torch/python.h>

#include "engine.h"

namespace blade {

namespace py = pybind11;

namespace {

// How the engine's outputs come back to Python: a list (blade.export's graphs), a tuple
// (torch.compile's graphs, a model returning a tuple of tensors) or one tensor (a model returning
// one tensor). Indexed by the Python side's name.
enum class Result { kList, kTuple, kSingle };
const std::pair<const char*, Result> kResults[] = {
    {"list", Result::kList}, {"tuple", Result::kTuple}, {"single", Result::kSingle}};

Result result_named(const std::string& name) {
  for (const auto& [known, result] : kResults) {
    if (name == known) return result;
  }
  throw py::value_error("engine_call: result must be list, tuple or single, got " + name);
}

// One engine called on a sequence of Python objects: inputs[order[i]] is the engine's input i,
// its outputs picks[k] are the result's element k. Everything per call is here in C++ because at
// [64, 4096] the Python version of this reordering, the argument checks and the result container
// (~1 us per call) were the whole difference to eager's call of a memory-bound op.
class BoundCall {
 public:
  BoundCall(c10::intrusive_ptr<Engine> engine, size_t arity, std::vector<size_t> order,
            std::vector<size_t> picks, Result result, py::object fallback)
      : engine_(std::move(engine)), arity_(arity), order_(std::move(order)), picks_(std::move(picks)),
        result_(result), fallback_(std::move(fallback)) {}

  py::object operator()(const py::handle& inputs) const {
    PyObject* const seq = inputs.ptr();
    const bool is_tuple = PyTuple_CheckExact(seq);
    if (!is_tuple && !PyList_CheckExact(seq)) return other(inputs, "a tuple or list");
    PyObject* const* items = is_tuple ? &PyTuple_GET_ITEM(seq, 0) : &PyList_GET_ITEM(seq, 0);
    if (static_cast<size_t>(Py_SIZE(seq)) != arity_) return other(inputs, std::to_string(arity_) + " tensors");
    // every argument (the engine's or not) torch.Tensor itself (or Parameter); a subclass, which
    // could mean something else than its data, only without a fallback (as TorchScript's forward,
    // which takes any tensor's data)
    for (size_t i = 0; i < arity_; ++i) {
      if (!THPVariable_CheckExact(items[i]) && (!fallback_.is_none() || !THPVariable_Check(items[i]))) {
        return other(inputs, std::to_string(arity_) + " tensors");
      }
    }
    std::vector<at::Tensor> engine_inputs;
    engine_inputs.reserve(order_.size());
    for (const size_t i : order_) engine_inputs.push_back(THPVariable_Unpack(items[i]));
    std::vector<at::Tensor> outputs;
    {
      py::gil_scoped_release no_gil;
      outputs = engine_->execute(engine_inputs);
    }
    for (const size_t k : picks_) {
      if (k >= outputs.size()) throw py::index_error("engine_call: the engine has fewer outputs than picked");
    }
    if (result_ == Result::kSingle) return wrap(outputs[picks_[0]]);
    py::object out = py::reinterpret_steal<py::object>(result_ == Result::kTuple ? PyTuple_New(picks_.size())
                                                                                  : PyList_New(picks_.size()));
    if (!out) throw py::error_already_set();
    for (size_t k = 0; k < picks_.size(); ++k) {
      PyObject* item = wrap(outputs[picks_[k]]).release().ptr();
      if (result_ == Result::kTuple) {
        PyTuple_SET_ITEM(out.ptr(), k, item);
      } else {
        PyList_SET_ITEM(out.ptr(), k, item);
      }
    }
    return out;
  }

 private:
  static py::object wrap(const at::Tensor& tensor) {
    PyObject* object = THPVariable_Wrap(tensor);
    if (!object) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(object);
  }

  // inputs that are not `arity` plain tensors: the fallback's answer, or a TypeError
  py::object other(const py::handle& inputs, const std::string& expected) const {
    if (!fallback_.is_none()) return fallback_(inputs);
    throw py::type_error("forward() expected " + expected + ", got " + py::repr(inputs).cast<std::string>());
  }

  c10::intrusive_ptr<Engine> engine_;
  size_t arity_;
  std::vector<size_t> order_, picks_;
  Result result_;
  py::object fallback_;
};

}  // namespace

// Calling a ScriptModule's forward from Python costs ~1.5 us per call beyond the engine itself:
// pybind into TorchScript (schema matching, a stack of IValues), the interpreter's list
// construct/unpack around the CallMethod, and the custom class's boxed call. The function
// returned here takes the forward's inputs as one tuple or list and calls Engine::execute (so the
// fallback modes and every input check stay).
void bind_engine_call(py::module_& m) {
  m.def(
      "engine_call",
      [](const py::object& script_object, size_t arity, std::vector<size_t> order, std::vector<size_t> picks,
         const std::string& result, py::object fallback) {
        // A torch.ScriptObject of class torch.classes.blade.Engine; toCustomClass checks the class.
        const auto object = py::cast<torch::jit::Object>(script_object);
        c10::intrusive_ptr<Engine> engine = c10::IValue(object._ivalue()).toCustomClass<Engine>();
        for (const size_t i : order) {
          if (i >= arity) throw py::value_error("engine_call: input position out of range");
        }
        if (result_named(result) == Result::kSingle && picks.size() != 1) {
          throw py::value_error("engine_call: a single result needs exactly one pick");
        }
        // wrap_pybind_function: errors and TORCH_WARNs (fallback mode's) reach Python as from any
        // torch op; BoundCall releases the GIL around the engine itself.
        BoundCall call(std::move(engine), arity, std::move(order), std::move(picks), result_named(result),
                       std::move(fallback));
        return py::cpp_function(torch::wrap_pybind_function(
                                    [call = std::move(call)](const py::handle& inputs) { return call(inputs); }),
                                py::arg("inputs"));
      },
      py::arg("engine"), py::arg("arity"), py::arg("order"), py::arg("picks"), py::arg("result"),
      py::arg("fallback") = py::none(),
      "A function of a tuple or list of `arity` tensors that runs a torch.classes.blade.Engine (its "
      "execute) on inputs[order[i]] without going through TorchScript and returns its outputs picks "
      "as a list, tuple or single tensor; other inputs go to fallback(inputs) (a TypeError without one).");
}

}  // namespace blade
