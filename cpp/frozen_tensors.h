// The per-call check behind blade/guards.py's FrozenWeights: which frozen parameter or buffer was
// replaced or written since compile time. In C++ because it runs before every compiled call over
// every frozen tensor (BERT: 73), where Python's per-tensor attribute reads cost ~0.25 us each.
#pragma once

#include <pybind11/pybind11.h>
#include <torch/python.h>

#include <cstdint>
#include <vector>

namespace blade {

// Hidden like pybind11's own types (it holds py::object): used inside this extension only.
class __attribute__((visibility("hidden"))) FrozenTensors {
 public:
  // positions[i]: where the compiled graph's caller passes tensors[i], or -1 when the graph
  // reads it as a module attribute. Snapshots each tensor's version counter and data pointer.
  FrozenTensors(const std::vector<int64_t>& positions, const std::vector<pybind11::object>& tensors);

  // The index of the first tensor that is not the same object at its position any more, or whose
  // version counter (every in-place write) or data pointer (`p.data = t`) moved; -1 if none did.
  int64_t changed(const pybind11::tuple& args) const;

  // Whether the caller passes the very tensor objects of compile time at their positions (then a
  // change is an in-place write; else other tensors are passed: another instance of the module,
  // or a replaced parameter).
  bool same_objects(const pybind11::tuple& args) const;

 private:
  struct Entry {
    int64_t position;
    pybind11::object object;  // identity: dynamo must pass this very tensor
    at::Tensor tensor;        // the same TensorImpl: its version and storage follow the parameter
    int64_t version;
    const void* data;
  };
  std::vector<Entry> entries_;

  // Whether args passes e's very tensor object at its position (always, for a module attribute).
  static bool passed_at(const pybind11::tuple& args, const Entry& e);
};

void bind_frozen_tensors(pybind11::module_& m);

}  // namespace blade
