// The debugging fallback of an Engine: the cluster's original TorchScript subgraph, saved by
// torch.jit.save as a module whose forward(List[Tensor]) -> List[Tensor] computes what the engine
// computes, plus the comparison check mode uses. Loads with libtorch alone (no Python).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/api/module.h>

#include <optional>
#include <string>
#include <vector>

namespace blade {

// What an engine does with its fallback subgraph (the Config field `fallback`).
enum class FallbackMode { kOff, kFallback, kCheck, kEager };

// "off", "fallback", "check", "eager"; throws std::invalid_argument for anything else.
FallbackMode fallback_mode_from_name(const std::string& name);
std::string fallback_mode_name(FallbackMode mode);

class FallbackSubgraph {
 public:
  // `module_bytes`: uint8 1-D tensor holding a torch.jit.save'd module. Throws std::runtime_error
  // when the bytes are not such a module.
  explicit FallbackSubgraph(const at::Tensor& module_bytes);

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) const;

 private:
  mutable torch::jit::Module module_;  // forward is const in effect; the API is not const-qualified
};

// nullopt when every engine output matches the reference (same dtype and shape; floating values
// within atol + rtol * |reference|, NaNs equal; others exactly); else which output differs and how.
std::optional<std::string> compare_outputs(const std::vector<at::Tensor>& engine,
                                           const std::vector<at::Tensor>& reference,
                                           const std::vector<std::string>& output_names, double rtol,
                                           double atol);

}  // namespace blade
