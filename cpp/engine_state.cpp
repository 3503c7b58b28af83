#include "engine_state.h"

#include <ATen/ops/empty.h>

#include <stdexcept>
#include <utility>

namespace blade {
namespace {

struct SpecColumns {
  std::vector<std::string> names;
  std::vector<std::string> dtypes;
  std::vector<std::vector<int64_t>> shapes;
};

SpecColumns to_columns(const std::vector<TensorSpec>& specs) {
  SpecColumns columns;
  for (const TensorSpec& spec : specs) {
    columns.names.push_back(spec.name);
    columns.dtypes.push_back(dtype_name(spec.dtype));
    columns.shapes.push_back(spec.shape);
  }
  return columns;
}

}  // namespace

c10::intrusive_ptr<Engine> make_engine(std::string name, at::Tensor so_bytes, std::string isa,
                                       int64_t abi_version, std::vector<std::string> input_names,
                                       std::vector<std::string> input_dtypes,
                                       std::vector<std::vector<int64_t>> input_shapes,
                                       std::vector<std::string> output_names,
                                       std::vector<std::string> output_dtypes,
                                       std::vector<std::vector<int64_t>> output_shapes,
                                       std::vector<at::Tensor> constants, int64_t scratch_bytes,
                                       std::string info_json, at::Tensor fallback_module,
                                       std::string fallback_mode, double rtol, double atol,
                                       std::string ops_source) {
  EngineDefinition def;
  try {
    def.inputs = make_specs("input", input_names, input_dtypes, input_shapes);
    def.outputs = make_specs("output", output_names, output_dtypes, output_shapes);
  } catch (const std::invalid_argument& e) {
    throw_engine_error(name, e.what());
  }
  def.name = std::move(name);
  def.so_bytes = std::move(so_bytes);
  def.isa = std::move(isa);
  def.abi_version = abi_version;
  def.constants = std::move(constants);
  def.scratch_bytes = scratch_bytes;
  def.info_json = std::move(info_json);
  def.fallback_module = std::move(fallback_module);
  def.fallback_mode = std::move(fallback_mode);
  def.rtol = rtol;
  def.atol = atol;
  def.ops_source = std::move(ops_source);
  return c10::make_intrusive<Engine>(std::move(def));
}

EngineState to_state(const Engine& engine) {
  const EngineDefinition& def = engine.definition();
  SpecColumns inputs = to_columns(def.inputs);
  SpecColumns outputs = to_columns(def.outputs);
  return EngineState(kEngineStateFormat, def.name, def.so_bytes, def.isa, def.abi_version,
                     std::move(inputs.names), std::move(inputs.dtypes), std::move(inputs.shapes),
                     std::move(outputs.names), std::move(outputs.dtypes), std::move(outputs.shapes),
                     def.constants, def.scratch_bytes, def.info_json,
                     def.fallback_module.defined() ? def.fallback_module : at::empty({0}, at::kByte),
                     engine.fallback_mode(), def.rtol, def.atol, def.ops_source);
}

c10::intrusive_ptr<Engine> from_state(const c10::IValue& state) {
  const auto& fields = state.isTuple() ? state.toTupleRef().elements() : c10::ArrayRef<c10::IValue>();
  const std::string name = fields.size() > 1 && fields[1].isString() ? fields[1].toStringRef() : "?";
  if (fields.empty() || !fields[0].isInt()) {
    throw_engine_error(name, "the serialized state is not a blade Engine state (" + state.tagKind() + ")");
  }
  const int64_t format = fields[0].toInt();
  if (format != kEngineStateFormat && format != 1) {
    throw_engine_error(name, "serialized with Engine state format " + std::to_string(format) +
                                 ", this blade reads formats 1 and " + std::to_string(kEngineStateFormat) +
                                 "; load it with the blade version that saved it or re-export");
  }
  const size_t expected = format == 1 ? kEngineStateFormat1Fields : std::tuple_size_v<EngineState>;
  if (fields.size() != expected) {
    throw_engine_error(name, "the serialized state has " + std::to_string(fields.size()) + " fields, format " +
                                 std::to_string(format) + " has " + std::to_string(expected));
  }
  std::vector<c10::IValue> elements(fields.begin(), fields.end());
  if (format == 1) {  // an engine saved before fallback subgraphs existed: it has none
    elements.insert(elements.end(), {at::empty({0}, at::kByte), std::string("off"), 1e-4, 1e-5, std::string()});
  }
  auto args = c10::IValue(c10::ivalue::Tuple::create(std::move(elements))).to<EngineState>();
  return std::apply(
      [](int64_t /*format*/, auto&&... rest) { return make_engine(std::move(rest)...); }, std::move(args));
}

}  // namespace blade
