// The record hashes of an exported blade archive, checked by any loader before torch::jit::load.
//
// torch.jit.load reads an archive's records without checking the zip's CRC-32s, so damage in a
// record that is not an engine's (TorchScript code, pickles, TorchScript constants) loads as a
// wrong program or wrong weights. blade.export writes "extra/blade_records.txt": one line
// "<sha256 hex> <record name>" per record of the archive but itself and torch's archive id;
// verify_archive compares them.
// blade.load calls it; a C++ server calls it before torch::jit::load (examples/cpp/blade_run.cpp).
#pragma once
#include <string>

namespace blade {

constexpr const char* kRecordsFile = "extra/blade_records.txt";

// Throws std::runtime_error naming the archive and the first record that is missing, extra or
// whose SHA-256 differs from the one listed.
void verify_archive(const std::string& path);

}  // namespace blade
