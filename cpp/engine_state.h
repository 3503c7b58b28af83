// The two outside views of an Engine: the constructor's argument list (what the torch side calls
// with a manifest in hand) and the pickled state torch.jit.save stores.
//
// State layout (format 4), a tuple:
//   (format_version=4, name, so_bytes: uint8 Tensor, isa, abi_version,
//    input_names, input_dtypes, input_shapes, output_names, output_dtypes, output_shapes,
//    constants: Tensor[], scratch_bytes, info_json,
//    fallback_module: uint8 Tensor (empty: none), fallback_mode, rtol, atol, ops_source,
//    symbol_names, symbol_ranges: [[min, max], ...],
//    digests: ["<part> <sha256 hex>", ...])
// (a shape dim -1 - k is the k-th size symbol, tensor_spec.h; format 4 added the symbols with ABI
// version 4, so a format-3 state's engine could not load anyway).
// i.e. the format version, the constructor's arguments, and SHA-256 hashes of the parts (the .so,
// the fallback subgraph, each constant, and all the other fields together; content_digests).
// The .so bytes, constants and the fallback subgraph are tensors so torch.jit.save writes them as
// tensor records, not pickled bytes.
//
// Integrity: torch.jit.load does not check the zip's CRC-32s, so a damaged record reaches us as
// is. from_state compares every hash before the Engine is built (before its .so is dlopen'ed) and
// names the part that differs. Formats 1 and 2 carried no hashes; loading them unchecked would
// bring back exactly the crashes the hashes exist to prevent, so they are rejected with a
// message to re-export. from_state checks the version before reading anything else, so older
// runtimes reject newer files with a clear message.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <string>
#include <tuple>
#include <vector>

#include "engine.h"

namespace blade {

constexpr int64_t kEngineStateFormat = 4;

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
                               std::string,                        // ops_source
                               std::vector<std::string>,           // symbol_names
                               std::vector<std::vector<int64_t>>,  // symbol_ranges
                               std::vector<std::string>>;          // digests

// "<part> <sha256 hex>" for each part of a state: "so", "fallback_module", "fields" (every field
// but the tensors, the format and the digests), then "constant <i>" per constant. The digests
// field of `state` is ignored.
std::vector<std::string> content_digests(const EngineState& state);

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
                                       std::string ops_source, std::vector<std::string> symbol_names,
                                       std::vector<std::vector<int64_t>> symbol_ranges);

EngineState to_state(const Engine& engine);

// Takes any IValue (not EngineState) so that a state of another format or arity still reaches
// the version check and gets a clear error instead of a type mismatch inside the unpickler.
c10::intrusive_ptr<Engine> from_state(const c10::IValue& state);

}  // namespace blade
