// The two outside views of an Engine: the constructor's argument list (what the torch side calls
// with a manifest in hand) and the pickled state torch.jit.save stores.
//
// State layout, a tuple:
//   (format_version=1, name, so_bytes: uint8 Tensor, isa, abi_version,
//    input_names, input_dtypes, input_shapes, output_names, output_dtypes, output_shapes,
//    constants: Tensor[], scratch_bytes, info_json)
// i.e. the format version followed by the constructor's arguments. The .so bytes and constants are
// tensors so torch.jit.save writes them as tensor records, not pickled bytes. A later format (e.g.
// one carrying a fallback TorchScript subgraph) bumps kEngineStateFormat; from_state checks the
// version before reading anything else, so old runtimes reject new files with a clear message.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <string>
#include <tuple>
#include <vector>

#include "engine.h"

namespace blade {

constexpr int64_t kEngineStateFormat = 1;

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
                               std::string>;                       // info_json

// The constructor of torch.classes.blade.Engine.
c10::intrusive_ptr<Engine> make_engine(std::string name, at::Tensor so_bytes, std::string isa,
                                       int64_t abi_version, std::vector<std::string> input_names,
                                       std::vector<std::string> input_dtypes,
                                       std::vector<std::vector<int64_t>> input_shapes,
                                       std::vector<std::string> output_names,
                                       std::vector<std::string> output_dtypes,
                                       std::vector<std::vector<int64_t>> output_shapes,
                                       std::vector<at::Tensor> constants, int64_t scratch_bytes,
                                       std::string info_json);

EngineState to_state(const Engine& engine);

// Takes any IValue (not EngineState) so that a state of another format or arity still reaches
// the version check and gets a clear error instead of a type mismatch inside the unpickler.
c10::intrusive_ptr<Engine> from_state(const c10::IValue& state);

}  // namespace blade
