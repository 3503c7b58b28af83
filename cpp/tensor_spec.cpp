#include "tensor_spec.h"

#include <sstream>
#include <stdexcept>
#include <utility>

namespace blade {
namespace {

// The dtypes engine code handles (blade/engine/manifest.py DTYPES), by manifest name.
const std::pair<const char*, c10::ScalarType> kDtypes[] = {
    {"float32", c10::kFloat}, {"float64", c10::kDouble}, {"int64", c10::kLong},
    {"int32", c10::kInt},     {"bool", c10::kBool},
};

// numpy spellings of dtypes engines do not take, so error messages name what users passed the
// way the manifest names what the engine wanted.
const std::pair<const char*, c10::ScalarType> kOtherDtypes[] = {
    {"uint8", c10::kByte},        {"int8", c10::kChar},         {"int16", c10::kShort},
    {"float16", c10::kHalf},      {"bfloat16", c10::kBFloat16}, {"complex64", c10::kComplexFloat},
    {"complex128", c10::kComplexDouble},
};

}  // namespace

c10::ScalarType dtype_from_name(const std::string& name) {
  for (const auto& [known, dtype] : kDtypes) {
    if (name == known) return dtype;
  }
  throw std::invalid_argument("unsupported dtype '" + name +
                              "' (engines take float32, float64, int64, int32, bool)");
}

std::string dtype_name(c10::ScalarType dtype) {
  for (const auto& table : {c10::ArrayRef(kDtypes), c10::ArrayRef(kOtherDtypes)}) {
    for (const auto& [known, candidate] : table) {
      if (dtype == candidate) return known;
    }
  }
  return c10::toString(dtype);
}

std::string TensorSpec::describe(const std::vector<SizeSymbol>& symbols) const {
  std::ostringstream out;
  out << dtype_name(dtype) << "[";
  for (size_t d = 0; d < shape.size(); ++d) {
    const int64_t symbol = symbol_of(shape[d]);
    out << (d ? ", " : "");
    if (symbol < 0) {
      out << shape[d];
    } else {
      const SizeSymbol& s = symbols.at(static_cast<size_t>(symbol));
      out << s.name << " in " << s.min << ".." << s.max;
    }
  }
  out << "] on cpu";
  return out.str();
}

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  std::ostringstream out;
  out << dtype_name(t.scalar_type()) << t.sizes() << " on " << t.device();
  if (t.layout() != c10::kStrided) out << " (layout " << t.layout() << ")";
  return out.str();
}

std::vector<TensorSpec> make_specs(const std::string& what, const std::vector<std::string>& names,
                                   const std::vector<std::string>& dtypes,
                                   const std::vector<std::vector<int64_t>>& shapes, size_t num_symbols) {
  if (dtypes.size() != names.size() || shapes.size() != names.size()) {
    throw std::invalid_argument(what + " names, dtypes and shapes differ in length (" +
                                std::to_string(names.size()) + ", " + std::to_string(dtypes.size()) +
                                ", " + std::to_string(shapes.size()) + ")");
  }
  std::vector<TensorSpec> specs;
  specs.reserve(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    for (int64_t dim : shapes[i]) {
      if (dim < 0 && symbol_of(dim) >= static_cast<int64_t>(num_symbols)) {
        throw std::invalid_argument(what + " " + std::to_string(i) + " ('" + names[i] +
                                    "') has a negative dimension that names no size symbol (" +
                                    std::to_string(num_symbols) + " declared)");
      }
    }
    try {
      specs.push_back({names[i], dtype_from_name(dtypes[i]), shapes[i]});
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(what + " " + std::to_string(i) + " ('" + names[i] + "'): " + e.what());
    }
  }
  return specs;
}

std::vector<SizeSymbol> make_symbols(const std::vector<std::string>& names,
                                     const std::vector<std::vector<int64_t>>& ranges) {
  if (names.size() != ranges.size()) {
    throw std::invalid_argument("size symbol names and ranges differ in length (" + std::to_string(names.size()) +
                                ", " + std::to_string(ranges.size()) + ")");
  }
  std::vector<SizeSymbol> symbols;
  for (size_t i = 0; i < names.size(); ++i) {
    const auto& range = ranges[i];
    if (range.size() != 2 || range[0] < 0 || range[0] > range[1]) {
      throw std::invalid_argument("size symbol '" + names[i] + "' needs a range [min, max] with 0 <= min <= max, got " +
                                  c10::str(c10::IntArrayRef(range)));
    }
    symbols.push_back({names[i], range[0], range[1]});
  }
  return symbols;
}

}  // namespace blade
