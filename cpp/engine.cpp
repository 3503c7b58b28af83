#include "engine.h"

#include <ATen/EmptyTensor.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>

#include "isa.h"
#include "oversubscription.h"
#include "runtime.h"
#include "scratch_pool.h"

namespace blade {
namespace {

using AbiVersionFn = decltype(&blade_engine_abi_version);

std::string describe_error_code(int32_t code) {
  switch (code) {
    case BLADE_ERR_INDEX_OUT_OF_RANGE:
      return "index out of range in a gather/embedding";
    case BLADE_ERR_DIVISION_BY_ZERO:
      return "ZeroDivisionError: integer division by zero";
    case BLADE_ERR_SIZE_MISMATCH:
      return "an input dim differs from the size the engine computes it to be from the other inputs' dims "
             "(the sizes dynamo's guards related when it was compiled)";
    default:
      return "unknown error code " + std::to_string(code);
  }
}

std::string list_isas() {
  std::string out;
  for (const auto& isa : known_isas()) out += (out.empty() ? "" : ", ") + isa;
  return out;
}

}  // namespace

void throw_engine_error(const std::string& engine_name, const std::string& message) {
  TORCH_CHECK(false, "blade engine '", engine_name, "': ", message);
}

Engine::Engine(EngineDefinition definition) : def_(std::move(definition)) {
  const at::Tensor& bytes = def_.so_bytes;
  if (!bytes.defined() || bytes.scalar_type() != at::kByte || bytes.dim() != 1 || !bytes.device().is_cpu()) {
    throw_engine_error(def_.name, "the .so bytes must be a 1-D uint8 CPU tensor, got " + describe(bytes));
  }
  def_.so_bytes = bytes.contiguous();
  if (def_.scratch_bytes < 0) throw_engine_error(def_.name, "negative scratch_bytes");
  // Every symbol must be bound by some input dim, or be derived from those (the trailing unbound
  // ones: load() checks that the .so computes them), or an output's size would be unknown.
  std::vector<bool> bound(def_.symbols.size(), false);
  for (const TensorSpec& spec : def_.inputs) {
    for (int64_t dim : spec.shape) {
      if (symbol_of(dim) >= 0) bound[static_cast<size_t>(symbol_of(dim))] = true;
    }
  }
  while (num_derived_ < bound.size() && !bound[bound.size() - 1 - num_derived_]) ++num_derived_;
  for (size_t k = 0; k + num_derived_ < bound.size(); ++k) {
    if (!bound[k]) {
      throw_engine_error(def_.name, "size symbol '" + def_.symbols[k].name + "' is no input's dim, so no call could bind it");
    }
  }
  packed_weights_.set_shapes_vary(!def_.symbols.empty());
  for (size_t i = 0; i < def_.constants.size(); ++i) {
    at::Tensor& constant = def_.constants[i];
    if (!constant.defined() || !constant.device().is_cpu() || constant.layout() != c10::kStrided) {
      throw_engine_error(def_.name, "constant " + std::to_string(i) + " must be a CPU tensor, got " +
                                        describe(constant));
    }
    constant = constant.contiguous();
    constant_data_.push_back(constant.const_data_ptr());
    packed_weights_.add_constant(constant.const_data_ptr(), constant.nbytes());
  }
  if (def_.fallback_module.defined() && def_.fallback_module.numel() > 0) {
    try {
      fallback_ = std::make_unique<FallbackSubgraph>(def_.fallback_module);
    } catch (const std::exception& e) {
      throw_engine_error(def_.name, e.what());
    }
  }
  set_fallback_mode(def_.fallback_mode);
  try {
    load();
  } catch (const c10::Error& e) {
    if (mode_ == FallbackMode::kOff) throw;
    // Debugging modes keep a model with a broken artifact running on its subgraph.
    load_error_ = e.what_without_backtrace();
    TORCH_WARN(load_error_, "; fallback mode '", def_.fallback_mode,
               "' runs the cluster's TorchScript subgraph instead");
  }
  // Its scratch is made resident now, not page by page in the calls (scratch_pool.h).
  if (run_) scratch_ = std::make_unique<ScratchReservation>(static_cast<size_t>(def_.scratch_bytes));
  // And so are its outputs at their largest when their sizes vary (output_pool.h).
  if (run_ && !def_.symbols.empty()) outputs_ = std::make_unique<OutputReservation>(largest_output_bytes());
}

std::vector<size_t> Engine::largest_output_bytes() const {
  std::vector<size_t> bytes;
  for (const TensorSpec& spec : def_.outputs) {
    size_t total = c10::elementSize(spec.dtype);
    for (int64_t dim : spec.shape) {
      const int64_t symbol = symbol_of(dim);
      const int64_t largest = symbol >= 0 ? def_.symbols[static_cast<size_t>(symbol)].max : dim;
      // saturates: a block is capped at kPopulateLimit anyway
      if (largest < 0 || __builtin_mul_overflow(total, static_cast<size_t>(largest), &total)) total = SIZE_MAX;
    }
    bytes.push_back(total);
  }
  return bytes;
}

void Engine::set_fallback_mode(const std::string& name) {
  FallbackMode mode;
  try {
    mode = fallback_mode_from_name(name);
  } catch (const std::invalid_argument& e) {
    throw_engine_error(def_.name, e.what());
  }
  if (mode != FallbackMode::kOff && !fallback_) {
    throw_engine_error(def_.name, "fallback mode '" + name +
                                      "' needs the cluster's TorchScript subgraph, and this engine was "
                                      "compiled without one (compile with blade.Config(fallback=...))");
  }
  mode_ = mode;
}

std::string Engine::fallback_mode() const { return fallback_mode_name(mode_); }

std::string Engine::check_report() const {
  std::lock_guard<std::mutex> lock(report_mutex_);
  return check_report_;
}

void Engine::load() {
  if (def_.abi_version != BLADE_ABI_VERSION) {
    throw_engine_error(def_.name, "compiled for runtime ABI version " + std::to_string(def_.abi_version) +
                                      ", this runtime speaks version " + std::to_string(BLADE_ABI_VERSION) +
                                      "; recompile the model with this blade");
  }
  if (!isa_supported(def_.isa)) {
    throw_engine_error(def_.name, "compiled for ISA '" + def_.isa + "', which this CPU (" + host_isa() +
                                      ") cannot run (known ISAs: " + list_isas() + ")");
  }
  try {
    library_ = std::make_unique<SharedLibrary>(def_.so_bytes.const_data_ptr(),
                                               static_cast<size_t>(def_.so_bytes.numel()));
  } catch (const std::exception& e) {
    throw_engine_error(def_.name, std::string("cannot load the engine .so: ") + e.what());
  }
  auto abi_version = reinterpret_cast<AbiVersionFn>(library_->find("blade_engine_abi_version"));
  run_ = reinterpret_cast<RunFn>(library_->find("blade_engine_run"));
  profile_ = reinterpret_cast<ProfileFn>(library_->find("blade_engine_profile"));
  if (!abi_version || !run_) {
    throw_engine_error(def_.name, "the .so does not export blade_engine_abi_version and blade_engine_run");
  }
  if (abi_version() != BLADE_ABI_VERSION) {
    throw_engine_error(def_.name, "the .so was built against runtime ABI version " +
                                      std::to_string(abi_version()) + ", this runtime speaks version " +
                                      std::to_string(BLADE_ABI_VERSION));
  }
  load_derived_sizes();
  const auto weight_gemms = reinterpret_cast<WeightGemmsFn>(library_->find("blade_engine_weight_gemms"));
  if (weight_gemms) pack_weights(weight_gemms);
}

void Engine::load_derived_sizes() {
  if (num_derived_ == 0) return;
  derived_sizes_ = reinterpret_cast<DerivedSizesFn>(library_->find("blade_engine_derived_sizes"));
  const std::string first = def_.symbols[def_.symbols.size() - num_derived_].name;
  if (!derived_sizes_) {
    throw_engine_error(def_.name, "size symbol '" + first + "' is no input's dim, and the .so does not export "
                                      "blade_engine_derived_sizes to compute it");
  }
  // A count check with no sizes bound would read garbage: ask with the bound slots at their minima.
  std::vector<int64_t> sizes;
  for (const SizeSymbol& s : def_.symbols) sizes.push_back(s.min);
  const int32_t count = derived_sizes_(sizes.data());
  if (count < 0 || static_cast<size_t>(count) != num_derived_) {
    throw_engine_error(def_.name, "the .so derives " + std::to_string(count) + " size symbols, the manifest has " +
                                      std::to_string(num_derived_) + " that no input binds (from '" + first + "')");
  }
}

template <class Sizes>
void Engine::derive_sizes(Sizes& sizes) const {
  derived_sizes_(sizes.data());
  for (size_t k = sizes.size() - num_derived_; k < sizes.size(); ++k) {
    const SizeSymbol& s = def_.symbols[k];
    if (sizes[k] < s.min || sizes[k] > s.max) {  // the engine would write outside what was planned
      throw_engine_error(def_.name, "derived size symbol '" + s.name + "' is " + std::to_string(sizes[k]) +
                                        ", outside its range [" + std::to_string(s.min) + ", " +
                                        std::to_string(s.max) + "]");
    }
  }
}

void Engine::pack_weights(WeightGemmsFn weight_gemms) {
  const BladeWeightGemm* gemms = nullptr;
  const int32_t count = weight_gemms(&gemms);
  for (int32_t i = 0; i < count; ++i) {
    // The runtime reads op(B) [k, n] from the constant: the .so's table must keep it inside.
    const BladeWeightGemm& w = gemms[i];
    const bool listed = w.constant >= 0 && w.constant < static_cast<int64_t>(def_.constants.size());
    const at::Tensor* constant = listed ? &def_.constants[static_cast<size_t>(w.constant)] : nullptr;
    const int64_t last = w.trans_b ? (w.n - 1) * w.ldb + w.k - 1 : (w.k - 1) * w.ldb + w.n - 1;
    if (constant == nullptr || constant->scalar_type() != at::kFloat || w.offset < 0 || w.n < 1 || w.k < 1 ||
        w.ldb < (w.trans_b ? w.k : w.n) || w.offset + last >= constant->numel()) {
      throw_engine_error(def_.name, "weight GEMM " + std::to_string(i) + " of the .so reads outside its constant " +
                                        std::to_string(w.constant));
    }
  }
  pack_weight_gemms(gemms, count, constant_data_.data(), &packed_weights_);
}

std::vector<at::Tensor> Engine::execute(const std::vector<at::Tensor>& inputs) const {
  switch (mode_.load()) {
    case FallbackMode::kEager:
      return fallback_->run(inputs);
    case FallbackMode::kCheck:
      return execute_checked(inputs);
    case FallbackMode::kFallback:
      if (!run_) return fall_back(inputs, load_error_);
      try {
        return run_engine(inputs);
      } catch (const c10::Error& e) {
        return fall_back(inputs, e.what_without_backtrace());
      }
    case FallbackMode::kOff:
      break;
  }
  return run_engine(inputs);
}

std::vector<at::Tensor> Engine::run_fallback(const std::vector<at::Tensor>& inputs) const {
  if (!fallback_) throw_engine_error(def_.name, "compiled without its TorchScript subgraph (fallback off)");
  return fallback_->run(inputs);
}

std::vector<at::Tensor> Engine::fall_back(const std::vector<at::Tensor>& inputs, const std::string& reason) const {
  std::call_once(warned_fallback_, [&] {
    TORCH_WARN("blade: engine '", def_.name, "' runs its TorchScript subgraph instead (fallback mode; ",
               "warned once per engine): ", reason);
  });
  return fallback_->run(inputs);
}

// Check mode: the subgraph is the reference. The engine's outputs are returned while they match;
// after the first mismatch (reported once) the engine keeps returning the reference.
std::vector<at::Tensor> Engine::execute_checked(const std::vector<at::Tensor>& inputs) const {
  std::vector<at::Tensor> reference = fallback_->run(inputs);
  if (mismatched_) return reference;
  std::vector<at::Tensor> outputs;
  std::optional<std::string> problem;
  try {
    outputs = run_engine(inputs);
    std::vector<std::string> names;
    for (const TensorSpec& spec : def_.outputs) names.push_back(spec.name);
    problem = compare_outputs(outputs, reference, names, def_.rtol, def_.atol);
  } catch (const c10::Error& e) {
    problem = std::string("the engine raised: ") + e.what_without_backtrace();
  }
  if (!problem) return outputs;
  std::lock_guard<std::mutex> lock(report_mutex_);
  if (!mismatched_.exchange(true)) {
    check_report_ = "blade check: engine '" + def_.name + "' differs from its TorchScript subgraph (rtol=" +
                    std::to_string(def_.rtol) + ", atol=" + std::to_string(def_.atol) + "): " + *problem +
                    ". It returns the subgraph's results from now on. Its ops:\n" + def_.ops_source;
    TORCH_WARN(check_report_);
  }
  return reference;
}

std::string Engine::profile() const {
  if (!profile_) return "";
  int64_t runs = 0;
  const char* const* names = nullptr;
  const int32_t count = profile_(&names, nullptr, 0, &runs);
  std::vector<int64_t> ns(static_cast<size_t>(std::max(count, 0)));
  profile_(&names, ns.data(), count, &runs);
  std::string text = "runs\t" + std::to_string(runs) + "\ncall_ns\t" + std::to_string(call_ns_.load()) + "\n";
  for (int32_t k = 0; k < count; ++k) text += std::to_string(ns[k]) + "\t" + names[k] + "\n";
  return text;
}

std::vector<at::Tensor> Engine::run_engine(const std::vector<at::Tensor>& inputs) const {
  TORCH_CHECK(run_, load_error_);  // only a debugging mode keeps an engine whose .so did not load
  const auto start = std::chrono::steady_clock::now();  // for the profile and call_modes_
  const size_t num_inputs = def_.inputs.size();
  if (inputs.size() != num_inputs) throw_input_count(inputs.size());

  c10::SmallVector<int64_t, 4> sizes(def_.symbols.size(), -1);
  if (!sizes.empty()) bind_sizes(inputs, sizes);
  if (num_derived_ > 0) derive_sizes(sizes);
  c10::SmallVector<const void*, 8> input_data(num_inputs);
  c10::SmallVector<at::Tensor, 2> contiguous_copies;  // keep copies alive through the run
  for (size_t i = 0; i < num_inputs; ++i) {
    const at::Tensor& input = inputs[i];
    if (sizes.empty() && !def_.inputs[i].accepts(input)) throw_input_mismatch(i, input);
    if (input.is_contiguous()) {
      input_data[i] = input.const_data_ptr();
    } else {
      contiguous_copies.push_back(input.contiguous());
      input_data[i] = contiguous_copies.back().const_data_ptr();
    }
  }

  std::vector<at::Tensor> outputs;
  outputs.reserve(def_.outputs.size());
  c10::SmallVector<void*, 8> output_data;
  c10::SmallVector<int64_t, 6> shape;
  for (const TensorSpec& spec : def_.outputs) {
    shape.assign(spec.shape.begin(), spec.shape.end());
    for (int64_t& dim : shape) {
      if (symbol_of(dim) >= 0) dim = sizes[static_cast<size_t>(symbol_of(dim))];
    }
    // ATen's CPU empty itself, past the dispatcher (~0.1 us a call); at::empty would also fill it
    // with NaN under torch.use_deterministic_algorithms, which the engine overwrites entirely.
    // Outputs whose sizes vary come from the output pool (output_pool.h).
    outputs.push_back(outputs_ ? at::detail::empty_generic(shape, output_allocator(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                           spec.dtype, std::nullopt)
                               : at::detail::empty_cpu(shape, spec.dtype));
    output_data.push_back(outputs.back().mutable_data_ptr());
  }

  const ScratchLease scratch(static_cast<size_t>(def_.scratch_bytes));
  const PackingScope packing(&packed_weights_);
  gemm_new_call();
  // In a serial window the engine's measured choice (oversubscription.h), else parallel unless a
  // window starts within the call.
  const bool window = serial_now();
  const bool serial = window && call_modes_.choose_serial();
  const CallModeScope mode(!window ? CallMode::kUndecided : serial ? CallMode::kSerial : CallMode::kParallel);
  const SerialScope serial_while_oversubscribed;
  int32_t code = run_(runtime(), input_data.data(), output_data.data(), constant_data_.data(), sizes.data(),
                      scratch.data());
  if (code != BLADE_OK) throw_run_failure(code);
  const int64_t ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  int64_t elements = 0;
  for (const at::Tensor& input : inputs) elements += input.numel();
  call_modes_.record(serial, ns, elements);
  if (profile_) call_ns_.fetch_add(ns, std::memory_order_relaxed);
  return outputs;
}

void Engine::throw_input_count(size_t got) const {
  throw_engine_error(def_.name, "expected " + std::to_string(def_.inputs.size()) + " inputs, got " +
                                    std::to_string(got));
}

void Engine::throw_input_mismatch(size_t index, const at::Tensor& got) const {
  const TensorSpec& spec = def_.inputs[index];
  throw_engine_error(def_.name, "input " + std::to_string(index) + " ('" + spec.name + "') expected " +
                                    spec.describe(def_.symbols) + ", got " + describe(got));
}

template <class Sizes>
void Engine::bind_sizes(const std::vector<at::Tensor>& inputs, Sizes& sizes) const {
  // Where each symbol was bound, for the message of a later dim that differs: (input, dim).
  c10::SmallVector<std::pair<size_t, size_t>, 4> bound_at(sizes.size(), std::pair<size_t, size_t>(0, 0));
  for (size_t i = 0; i < def_.inputs.size(); ++i) {
    const TensorSpec& spec = def_.inputs[i];
    const at::Tensor& input = inputs[i];
    if (!spec.accepts_kind(input) || input.dim() != static_cast<int64_t>(spec.shape.size())) {
      throw_input_mismatch(i, input);
    }
    for (size_t d = 0; d < spec.shape.size(); ++d) {
      const int64_t value = input.size(static_cast<int64_t>(d));
      const int64_t symbol = symbol_of(spec.shape[d]);
      if (symbol < 0) {
        if (value != spec.shape[d]) throw_input_mismatch(i, input);
        continue;
      }
      const SizeSymbol& s = def_.symbols[static_cast<size_t>(symbol)];
      const std::string where = "input " + std::to_string(i) + " ('" + spec.name + "') dim " + std::to_string(d);
      int64_t& size = sizes[static_cast<size_t>(symbol)];
      if (size < 0) {
        if (value < s.min || value > s.max) {
          throw_engine_error(def_.name, where + " is size symbol '" + s.name + "' with range [" +
                                            std::to_string(s.min) + ", " + std::to_string(s.max) + "], got " +
                                            std::to_string(value) + " (input " + describe(input) + ")");
        }
        size = value;
        bound_at[static_cast<size_t>(symbol)] = {i, d};
      } else if (value != size) {
        const auto [first, first_dim] = bound_at[static_cast<size_t>(symbol)];
        throw_engine_error(def_.name, where + " is size symbol '" + s.name + "', which input " +
                                          std::to_string(first) + " ('" + def_.inputs[first].name + "') dim " +
                                          std::to_string(first_dim) + " set to " + std::to_string(size) +
                                          ", got " + std::to_string(value) + " (input " + describe(input) + ")");
      }
    }
  }
}

void Engine::throw_run_failure(int32_t code) const {
  throw_engine_error(def_.name, "execution failed: " + describe_error_code(code));
}

}  // namespace blade
