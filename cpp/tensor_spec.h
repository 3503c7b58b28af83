// What an engine expects at each input and produces at each output: name, dtype, shape. A dim of a
// shape is a size (>= 0) or a size symbol: -1 - k stands for the engine's k-th SizeSymbol, a dim
// whose value is bound at run time from the inputs (Engine::run_engine) and passed to the engine.
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

// A run-time dim of an engine: its name (e.g. "s0", "batch") and inclusive range.
struct SizeSymbol {
  std::string name;
  int64_t min = 0;
  int64_t max = 0;
};

// The symbol a dim stands for (-1 for a static dim).
inline int64_t symbol_of(int64_t dim) { return dim < 0 ? -1 - dim : -1; }

struct TensorSpec {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;

  // Whether `t` can be handed to the engine as this value (after .contiguous()): a strided CPU
  // tensor of exactly this dtype and shape. Called on every input of every execute of an engine
  // without size symbols.
  bool accepts(const at::Tensor& t) const {
    return accepts_kind(t) && t.sizes().equals(shape);
  }
  // The same but for the sizes: a strided CPU tensor of this dtype.
  bool accepts_kind(const at::Tensor& t) const {
    return t.defined() && t.device().is_cpu() && t.layout() == c10::kStrided && t.scalar_type() == dtype;
  }

  // "int64[1, 128] on cpu", the form error messages use; symbols by name and range:
  // "float32[batch in 1..64, 128] on cpu".
  std::string describe(const std::vector<SizeSymbol>& symbols = {}) const;
};

// The same form for a tensor actually passed: "float32[1, 128] on cpu" (plus its layout if not strided).
std::string describe(const at::Tensor& t);

// Zips the three parallel lists of the constructor / manifest; `what` ("input", "output") names them
// in errors. Throws std::invalid_argument on length mismatch, unknown dtype or a negative dimension
// that names no symbol (num_symbols of them).
std::vector<TensorSpec> make_specs(const std::string& what, const std::vector<std::string>& names,
                                   const std::vector<std::string>& dtypes,
                                   const std::vector<std::vector<int64_t>>& shapes, size_t num_symbols = 0);

// Zips symbol names and [min, max] ranges; throws std::invalid_argument on length mismatch, a
// range that is not a pair, or min > max or min < 0.
std::vector<SizeSymbol> make_symbols(const std::vector<std::string>& names,
                                     const std::vector<std::vector<int64_t>>& ranges);

}  // namespace blade
