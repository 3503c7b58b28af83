#include "engine_fallback.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/import.h>

#include <sstream>
#include <stdexcept>

#include "tensor_spec.h"

namespace blade {
namespace {

// Table, not a branch chain: name <-> mode.
const std::pair<const char*, FallbackMode> kModeNames[] = {
    {"off", FallbackMode::kOff},
    {"fallback", FallbackMode::kFallback},
    {"check", FallbackMode::kCheck},
    {"eager", FallbackMode::kEager},
};

std::string format_double(double value) {
  std::ostringstream out;
  out.precision(4);
  out << value;
  return out.str();
}

// "max abs error X, max rel error Y" of two same-shaped floating tensors (in float64).
std::string describe_error(const at::Tensor& got, const at::Tensor& want) {
  at::Tensor got64 = got.to(at::kDouble), want64 = want.to(at::kDouble);
  at::Tensor abs_error = (got64 - want64).abs().nan_to_num(std::numeric_limits<double>::infinity());
  at::Tensor rel_error = abs_error / want64.abs().clamp_min(std::numeric_limits<double>::min());
  return "max abs error " + format_double(abs_error.max().item<double>()) + ", max rel error " +
         format_double(rel_error.max().item<double>());
}

}  // namespace

FallbackMode fallback_mode_from_name(const std::string& name) {
  for (const auto& [text, mode] : kModeNames) {
    if (name == text) return mode;
  }
  throw std::invalid_argument("unknown fallback mode '" + name + "' (known: off, fallback, check, eager)");
}

std::string fallback_mode_name(FallbackMode mode) {
  for (const auto& [text, known] : kModeNames) {
    if (mode == known) return text;
  }
  return "?";
}

FallbackSubgraph::FallbackSubgraph(const at::Tensor& module_bytes) {
  if (!module_bytes.defined() || module_bytes.scalar_type() != at::kByte || module_bytes.dim() != 1) {
    throw std::runtime_error("the fallback subgraph must be a 1-D uint8 tensor, got " + describe(module_bytes));
  }
  at::Tensor bytes = module_bytes.contiguous();
  std::istringstream stream(std::string(static_cast<const char*>(bytes.const_data_ptr()),
                                        static_cast<size_t>(bytes.numel())));
  try {
    module_ = torch::jit::load(stream);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("cannot load the fallback TorchScript subgraph: ") + e.what());
  }
}

std::vector<at::Tensor> FallbackSubgraph::run(const std::vector<at::Tensor>& inputs) const {
  return module_.forward({c10::IValue(inputs)}).toTensorVector();
}

std::optional<std::string> compare_outputs(const std::vector<at::Tensor>& engine,
                                           const std::vector<at::Tensor>& reference,
                                           const std::vector<std::string>& output_names, double rtol,
                                           double atol) {
  if (engine.size() != reference.size()) {
    return "the engine returned " + std::to_string(engine.size()) + " outputs, the subgraph " +
           std::to_string(reference.size());
  }
  for (size_t i = 0; i < engine.size(); ++i) {
    const at::Tensor& got = engine[i];
    const at::Tensor& want = reference[i];
    const std::string which = "output " + std::to_string(i) +
                              (i < output_names.size() ? " ('" + output_names[i] + "')" : std::string());
    if (got.scalar_type() != want.scalar_type() || !got.sizes().equals(want.sizes())) {
      return which + ": the engine returned " + describe(got) + ", the subgraph " + describe(want);
    }
    if (at::isFloatingType(want.scalar_type())) {
      if (!at::isclose(got, want, rtol, atol, /*equal_nan=*/true).all().item<bool>()) {
        return which + ": " + describe_error(got, want);
      }
    } else if (!at::equal(got, want)) {
      return which + ": values differ (" + dtype_name(want.scalar_type()) + ", compared exactly)";
    }
  }
  return std::nullopt;
}

}  // namespace blade
