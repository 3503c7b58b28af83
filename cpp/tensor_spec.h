// What an engine expects at each input and produces at each output: name, dtype, static shape.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace blade {

// Manifest dtype names are numpy spellings ("float32", "int64", "bool"). Throws
// std::invalid_argument for a name engines do not support.
c10::ScalarType dtype_from_name(const std::string& name);
// The numpy spelling of a dtype ("float16" too, for error messages); c10's name for exotic ones.
std::string dtype_name(c10::ScalarType dtype);

struct TensorSpec {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;

  // Whether `t` can be handed to the engine as this value (after .contiguous()): a strided CPU
  // tensor of exactly this dtype and shape. Called on every input of every execute.
  bool accepts(const at::Tensor& t) const {
    return t.defined() && t.device().is_cpu() && t.layout() == c10::kStrided &&
           t.scalar_type() == dtype && t.sizes().equals(shape);
  }

  // "int64[1, 128] on cpu", the form error messages use.
  std::string describe() const;
};

// The same form for a tensor actually passed: "float32[1, 128] on cpu" (plus its layout if not strided).
std::string describe(const at::Tensor& t);

// Zips the three parallel lists of the constructor / manifest; `what` ("input", "output") names them
// in errors. Throws std::invalid_argument on length mismatch, unknown dtype or negative dimension.
std::vector<TensorSpec> make_specs(const std::string& what, const std::vector<std::string>& names,
                                   const std::vector<std::string>& dtypes,
                                   const std::vector<std::vector<int64_t>>& shapes);

}  // namespace blade
