// The Engine custom class (torch.classes.blade.Engine): one compiled cluster. It owns the engine's
// .so bytes (loaded from memory), the specs of its inputs and outputs, and its constants, and runs
// the cluster with execute(). Free of pybind/Python so C++ programs can load blade modules too.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <memory>
#include <string>
#include <vector>

#include "blade_abi.h"
#include "shared_library.h"
#include "tensor_spec.h"

namespace blade {

// Everything an Engine is made of; also what it serializes (engine_state.h).
struct EngineDefinition {
  std::string name;                  // the cluster's name, e.g. "cluster_2", used in every error
  at::Tensor so_bytes;               // the engine .so, uint8 1-D
  std::string isa;                   // x86-64 level the .so was compiled for (isa.h)
  int64_t abi_version = 0;           // BLADE_ABI_VERSION the .so was compiled against
  std::vector<TensorSpec> inputs;    // in the order blade_engine_run takes them
  std::vector<TensorSpec> outputs;
  std::vector<at::Tensor> constants;  // in the manifest's order
  int64_t scratch_bytes = 0;         // per-call workspace the engine needs
  std::string info_json;             // opaque metadata for reports (manifest, source locations)
};

// Throws a c10::Error (RuntimeError in Python) "blade engine '<name>': <message>".
[[noreturn]] void throw_engine_error(const std::string& engine_name, const std::string& message);

class Engine : public torch::CustomClassHolder {
 public:
  // Validates the definition, loads the .so and checks its ABI version and ISA. Throws via
  // throw_engine_error on any problem; a bad .so never crashes the process.
  explicit Engine(EngineDefinition definition);

  // Runs the engine. Thread-safe and lock-free: every call has its own outputs and scratch.
  // Inputs must match the specs in dtype, shape and device; non-contiguous ones are copied.
  std::vector<at::Tensor> execute(const std::vector<at::Tensor>& inputs) const;

  const EngineDefinition& definition() const { return def_; }
  const std::string& name() const { return def_.name; }
  const std::string& info() const { return def_.info_json; }

 private:
  using RunFn = decltype(&blade_engine_run);

  void load();
  [[noreturn]] void throw_input_count(size_t got) const;
  [[noreturn]] void throw_input_mismatch(size_t index, const at::Tensor& got) const;
  [[noreturn]] void throw_run_failure(int32_t code) const;

  EngineDefinition def_;
  std::unique_ptr<SharedLibrary> library_;
  RunFn run_ = nullptr;
  std::vector<const void*> constant_data_;  // data pointers of def_.constants, fixed at load
};

}  // namespace blade
