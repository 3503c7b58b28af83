#include "engine_state.h"

#include <ATen/ops/empty.h>

#include <map>
#include <stdexcept>
#include <utility>

#include "content_digest.h"

namespace blade {
namespace {

// Position of the digests in EngineState; the fields before it (but the format) are the
// constructor's arguments.
constexpr size_t kDigestsField = std::tuple_size_v<EngineState> - 1;

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

void hash_specs(Sha256& hash, const std::vector<std::string>& names, const std::vector<std::string>& dtypes,
                const std::vector<std::vector<int64_t>>& shapes) {
  hash.integer(static_cast<int64_t>(names.size()));
  for (const std::string& name : names) hash.text(name);
  hash.integer(static_cast<int64_t>(dtypes.size()));
  for (const std::string& dtype : dtypes) hash.text(dtype);
  hash.integer(static_cast<int64_t>(shapes.size()));
  for (const auto& shape : shapes) {
    hash.integer(static_cast<int64_t>(shape.size()));
    for (int64_t size : shape) hash.integer(size);
  }
}

std::string fields_digest(const EngineState& s) {
  Sha256 hash;
  hash.text(std::get<1>(s)).text(std::get<3>(s)).integer(std::get<4>(s));
  hash_specs(hash, std::get<5>(s), std::get<6>(s), std::get<7>(s));
  hash_specs(hash, std::get<8>(s), std::get<9>(s), std::get<10>(s));
  hash.integer(std::get<12>(s)).text(std::get<13>(s)).text(std::get<15>(s));
  hash.real(std::get<16>(s)).real(std::get<17>(s)).text(std::get<18>(s));
  hash_specs(hash, std::get<19>(s), {}, std::get<20>(s));
  return hash.hex();
}

// What a digest's part is, in the words of an error message.
std::string describe_part(const std::string& digest) {
  static const std::map<std::string, std::string> kParts = {
      {"so", "its .so"},
      {"fallback_module", "its TorchScript fallback subgraph"},
      {"fields", "its specs and settings (name, ISA, ABI version, input/output names, dtypes and shapes, "
                 "scratch size, info, fallback mode, tolerances, ops, size symbols)"},
  };
  const std::string part = digest.substr(0, digest.rfind(' '));
  auto known = kParts.find(part);
  return known != kParts.end() ? known->second : part + " (its dtype, shape or bytes)";
}

// Throws naming the first part whose bytes no longer hash to what was saved with them.
void check_digests(const EngineState& state) {
  const std::string& name = std::get<1>(state);
  const std::vector<std::string>& saved = std::get<kDigestsField>(state);
  const std::vector<std::string> actual = content_digests(state);
  const std::string advice = ": the artifact was damaged or modified after it was saved, and nothing of it was "
                             "loaded. Restore a good copy or re-export the model";
  if (saved.size() != actual.size()) {
    throw_engine_error(name, "the state lists " + std::to_string(saved.size()) + " content hashes, but its " +
                                 std::to_string(std::get<11>(state).size()) + " constants, .so, subgraph and " +
                                 "fields need " + std::to_string(actual.size()) + advice);
  }
  for (size_t i = 0; i < actual.size(); ++i) {
    if (saved[i] != actual[i]) {
      throw_engine_error(name, "the content hash (SHA-256) of " + describe_part(actual[i]) +
                                   " differs from the one saved with it" + advice);
    }
  }
}

template <size_t... I>
c10::intrusive_ptr<Engine> construct(EngineState&& state, std::index_sequence<I...> /*fields 1..n*/) {
  return make_engine(std::move(std::get<I + 1>(state))...);
}

}  // namespace

std::vector<std::string> content_digests(const EngineState& state) {
  std::vector<std::string> digests = {
      "so " + Sha256().tensor(std::get<2>(state)).hex(),
      "fallback_module " + Sha256().tensor(std::get<14>(state)).hex(),
      "fields " + fields_digest(state),
  };
  const std::vector<at::Tensor>& constants = std::get<11>(state);
  for (size_t i = 0; i < constants.size(); ++i) {
    digests.push_back("constant " + std::to_string(i) + " " + Sha256().tensor(constants[i]).hex());
  }
  return digests;
}

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
                                       std::string ops_source, std::vector<std::string> symbol_names,
                                       std::vector<std::vector<int64_t>> symbol_ranges) {
  EngineDefinition def;
  try {
    def.symbols = make_symbols(symbol_names, symbol_ranges);
    def.inputs = make_specs("input", input_names, input_dtypes, input_shapes, def.symbols.size());
    def.outputs = make_specs("output", output_names, output_dtypes, output_shapes, def.symbols.size());
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
  std::vector<std::string> symbol_names;
  std::vector<std::vector<int64_t>> symbol_ranges;
  for (const SizeSymbol& symbol : def.symbols) {
    symbol_names.push_back(symbol.name);
    symbol_ranges.push_back({symbol.min, symbol.max});
  }
  EngineState state(kEngineStateFormat, def.name, def.so_bytes, def.isa, def.abi_version,
                    std::move(inputs.names), std::move(inputs.dtypes), std::move(inputs.shapes),
                    std::move(outputs.names), std::move(outputs.dtypes), std::move(outputs.shapes),
                    def.constants, def.scratch_bytes, def.info_json,
                    def.fallback_module.defined() ? def.fallback_module : at::empty({0}, at::kByte),
                    engine.fallback_mode(), def.rtol, def.atol, def.ops_source, std::move(symbol_names),
                    std::move(symbol_ranges), std::vector<std::string>());
  std::get<kDigestsField>(state) = content_digests(state);
  return state;
}

c10::intrusive_ptr<Engine> from_state(const c10::IValue& state) {
  const auto& fields = state.isTuple() ? state.toTupleRef().elements() : c10::ArrayRef<c10::IValue>();
  const std::string name = fields.size() > 1 && fields[1].isString() ? fields[1].toStringRef() : "?";
  if (fields.empty() || !fields[0].isInt()) {
    throw_engine_error(name, "the serialized state is not a blade Engine state (" + state.tagKind() + ")");
  }
  const int64_t format = fields[0].toInt();
  if (format == 3) {
    throw_engine_error(name, "saved with Engine state format 3 (runtime ABI version 3), whose engines this "
                             "runtime (ABI version " + std::to_string(BLADE_ABI_VERSION) + ") cannot run: re-export the model");
  }
  if (format == 1 || format == 2) {
    throw_engine_error(name, "saved with Engine state format " + std::to_string(format) +
                                 ", which carries no content hashes; this blade reads format " +
                                 std::to_string(kEngineStateFormat) +
                                 " only, whose hashes are checked before an engine is loaded: re-export the model");
  }
  if (format != kEngineStateFormat) {
    throw_engine_error(name, "serialized with Engine state format " + std::to_string(format) +
                                 ", this blade reads format " + std::to_string(kEngineStateFormat) +
                                 "; load it with the blade version that saved it or re-export");
  }
  constexpr size_t expected = std::tuple_size_v<EngineState>;
  if (fields.size() != expected) {
    throw_engine_error(name, "the serialized state has " + std::to_string(fields.size()) + " fields, format " +
                                 std::to_string(format) + " has " + std::to_string(expected));
  }
  EngineState args;
  try {
    args = state.to<EngineState>();
  } catch (const c10::Error& e) {
    throw_engine_error(name, std::string("the serialized state has fields of the wrong type (a damaged "
                                         "artifact?): ") + e.what_without_backtrace());
  }
  check_digests(args);  // before make_engine: a damaged .so must never reach dlopen
  return construct(std::move(args), std::make_index_sequence<kDigestsField - 1>());
}

}  // namespace blade
