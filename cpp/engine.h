// The Engine custom class (torch.classes.blade.Engine): one compiled cluster. It owns the engine's
// .so bytes (loaded from memory), the specs of its inputs and outputs, and its constants, and runs
// the cluster with execute(). Optionally it also carries the cluster's TorchScript subgraph for
// debugging (engine_fallback.h): run instead of the engine when it fails (mode "fallback"), next to
// it and compared (mode "check"), or always (mode "eager"). Free of pybind/Python so C++ programs
// can load blade modules too.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "blade_abi.h"
#include "engine_fallback.h"
#include "runtime.h"
#include "output_pool.h"
#include "oversubscription.h"
#include "scratch_pool.h"
#include "shared_library.h"
#include "tensor_spec.h"

namespace blade {

// Everything an Engine is made of; also what it serializes (engine_state.h).
struct EngineDefinition {
  std::string name;                  // the cluster's name, e.g. "cluster_2", used in every error
  at::Tensor so_bytes;               // the engine .so, uint8 1-D
  std::string isa;                   // x86-64 level the .so was compiled for (isa.h)
  int64_t abi_version = 0;           // BLADE_ABI_VERSION the .so was compiled against
  std::vector<SizeSymbol> symbols;   // run-time dims, in the order blade_engine_run's sizes holds them
  std::vector<TensorSpec> inputs;    // in the order blade_engine_run takes them
  std::vector<TensorSpec> outputs;
  std::vector<at::Tensor> constants;  // in the manifest's order
  int64_t scratch_bytes = 0;         // per-call workspace the engine needs (at the symbols' maxima)
  std::string info_json;             // opaque metadata for reports (manifest, source locations)
  // Debugging (state format 2): a torch.jit.save'd module, forward(List[Tensor]) -> List[Tensor],
  // computing the cluster in TorchScript; undefined or empty when compiled with fallback off.
  at::Tensor fallback_module;
  std::string fallback_mode = "off";  // off | fallback | check | eager
  double rtol = 1e-4;                 // tolerances of check mode
  double atol = 1e-5;
  std::string ops_source;            // the cluster's ops and their source lines, for reports
};

// Throws a c10::Error (RuntimeError in Python) "blade engine '<name>': <message>".
[[noreturn]] void throw_engine_error(const std::string& engine_name, const std::string& message);

class Engine : public torch::CustomClassHolder {
 public:
  // Validates the definition, loads the .so and checks its ABI version and ISA. Throws via
  // throw_engine_error on any problem; a bad .so never crashes the process.
  explicit Engine(EngineDefinition definition);

  // Runs the cluster as the fallback mode says (run_engine when off). Thread-safe.
  std::vector<at::Tensor> execute(const std::vector<at::Tensor>& inputs) const;

  // The compiled engine alone. Lock-free: every call has its own outputs and scratch. Inputs must
  // match the specs in dtype, shape and device (a size symbol takes its value from the first input
  // dim that has it, within its range, and every other dim with it must be equal); non-contiguous
  // ones are copied.
  std::vector<at::Tensor> run_engine(const std::vector<at::Tensor>& inputs) const;

  // The TorchScript subgraph alone; throws when the engine was compiled without one.
  std::vector<at::Tensor> run_fallback(const std::vector<at::Tensor>& inputs) const;

  // Switches the fallback mode at run time (e.g. to bisect a model); the state saves the new mode.
  void set_fallback_mode(const std::string& mode);
  std::string fallback_mode() const;
  bool has_fallback() const { return fallback_ != nullptr; }
  // The check-mode mismatch report of this engine, "" while its outputs have matched.
  std::string check_report() const;

  // Where an engine compiled with Config(profile=True) spends its time, as lines of text:
  // "runs\t<n>", "call_ns\t<total ns in run_engine>", then "<total ns>\t<kernel name>" per kernel
  // in execution order. "" for an engine compiled without profiling.
  std::string profile() const;

  const EngineDefinition& definition() const { return def_; }
  const std::string& name() const { return def_.name; }
  const std::string& info() const { return def_.info_json; }

 private:
  using RunFn = decltype(&blade_engine_run);
  // Exported only by engines compiled with -DBLADE_PROFILE (blade/engine/codegen.py).
  using ProfileFn = int32_t (*)(const char* const** names, int64_t* ns, int32_t capacity, int64_t* runs);
  // Exported by engines with GEMMs on constant weights (blade/engine/render.py).
  using WeightGemmsFn = decltype(&blade_engine_weight_gemms);
  using DerivedSizesFn = decltype(&blade_engine_derived_sizes);

  void load();
  // Each output's bytes at the size symbols' maxima (SIZE_MAX when that overflows).
  std::vector<size_t> largest_output_bytes() const;
  // Checks the .so's weight GEMMs against the constants and lets the runtime pack them (pack_weight_gemms).
  void pack_weights(WeightGemmsFn weight_gemms);
  // Finds blade_engine_derived_sizes when some symbols are derived (throws if the .so lacks it or
  // derives another number of them); derive_sizes fills them after bind_sizes and checks their ranges.
  void load_derived_sizes();
  template <class Sizes>
  void derive_sizes(Sizes& sizes) const;
  std::vector<at::Tensor> execute_checked(const std::vector<at::Tensor>& inputs) const;
  std::vector<at::Tensor> fall_back(const std::vector<at::Tensor>& inputs, const std::string& reason) const;
  [[noreturn]] void throw_input_count(size_t got) const;
  [[noreturn]] void throw_input_mismatch(size_t index, const at::Tensor& got) const;
  // Binds the size symbols from the inputs' shapes into `sizes`; throws naming the dim that is out
  // of its symbol's range or differs from the dim that bound the symbol.
  template <class Sizes>
  void bind_sizes(const std::vector<at::Tensor>& inputs, Sizes& sizes) const;
  [[noreturn]] void throw_run_failure(int32_t code) const;

  EngineDefinition def_;
  std::unique_ptr<SharedLibrary> library_;
  RunFn run_ = nullptr;
  ProfileFn profile_ = nullptr;
  DerivedSizesFn derived_sizes_ = nullptr;  // set when the last num_derived_ symbols are no input's dims
  size_t num_derived_ = 0;
  mutable std::atomic<int64_t> call_ns_{0};  // time in run_engine, counted only when profiling
  mutable CallModes call_modes_;             // serial or parallel calls in a serial window (oversubscription.h)
  std::vector<const void*> constant_data_;  // data pointers of def_.constants, fixed at load
  mutable PackedWeights packed_weights_;     // constants the runtime re-laid out (made on first use)
  std::unique_ptr<ScratchReservation> scratch_;  // keeps a populated scratch block ready while it lives
  std::unique_ptr<OutputReservation> outputs_;   // engines with run-time sizes: resident output blocks

  std::unique_ptr<FallbackSubgraph> fallback_;
  std::atomic<FallbackMode> mode_{FallbackMode::kOff};
  std::string load_error_;                     // why the .so did not load (then run_ is null)
  mutable std::once_flag warned_fallback_;     // "fallback" warns once per engine
  mutable std::mutex report_mutex_;            // guards check_report_
  mutable std::string check_report_;           // first check-mode mismatch; set once
  mutable std::atomic<bool> mismatched_{false};
};

}  // namespace blade
