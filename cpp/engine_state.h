// The two outside views of an Engine: the constructor's argument list (what the torch side calls
// with a manifest in hand) and the pickled state torch.jit.save stores.
//
// State layout (format 2), a tuple:
//   (format_version=2, name, so_bytes: uint8 Tensor, isa, abi_version,
//    input_names, input_dtypes, input_shapes, output_names, output_dtypes, output_shapes,
//    constants: Tensor[], scratch_bytes, info_json,
//    fallback_module: uint8 Tensor (empty: none), fallback_mode, rtol, atol, ops_source)
// i.e. the format version followed by the constructor's arguments. The .so bytes, constants and
// the fallback subgraph are tensors so torch.jit.save writes them as tensor records, not pickled
// bytes. Format 1 (the same without the five debugging fields) still loads, as an engine without
// a fallback subgraph. from_state checks the version before reading anything else, so older
// runtimes reject newer files with a clear message.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <string>
#include <tuple>
#include <vector>

#include "engine.h"

namespace blade {

constexpr int64_t kEngineStateFormat = 2;

using EngineState = std::tuple<int64_t,                            // kEngineStateFormat
                               std::string,                        // name
                               at::Tensor,                         // so_bytes
                               std::string,                        // isa
                               int64_t,                            // abi_version
                               std::vector<std::string>,           // input_names
                               std::vector<std::string>,           // input_dtypes
                               std::vector<std::vector<int64_t>>,  // input_shapes
                               std::vector<std::string>,           // output_names
                               std::vector<std::string>,           // output_dtypes
                               std::vector<std::vector<int64_t>>,  // output_shapes
                               std::vector<at::Tensor>,            // constants
                               int64_t,                            // scratch_bytes
                               std::string,                        // info_json
                               at::Tensor,                         // fallback_module
                               std::string,                        // fallback_mode
                               double,                             // rtol
                               double,                             // atol
                               std::string>;                       // ops_source

// Format 1: the first 14 fields of EngineState.
constexpr size_t kEngineStateFormat1Fields = 14;

// The constructor of torch.classes.blade.Engine.
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
                                       std::string ops_source);

EngineState to_state(const Engine& engine);

// Takes any IValue (not EngineState) so that a state of another format or arity still reaches
// the version check and gets a clear error instead of a type mismatch inside the unpickler.
c10::intrusive_ptr<Engine> from_state(const c10::IValue& state);

}  // namespace blade
