// Runs an archive written by blade.export with libtorch alone:
//
//   blade_run model.blade.pt inputs.pt [outputs.pt]
//
// inputs.pt holds the inputs as a list of tensors, saved from Python with torch.save([x, ...], path).
// Prints every output's dtype, shape and first values; with outputs.pt, also saves the outputs
// (torch.load(path) in Python reads them back as a tuple of tensors).
//
// Before torch::jit::load it checks the archive's record hashes (blade::verify_archive): libtorch
// itself does not check the zip's CRC-32s, so damaged code or weights would load as a wrong model.
#include <torch/script.h>
#include <torch/serialize.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

#include "archive_check.h"

namespace {

std::vector<char> read_file(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(std::string("cannot open ") + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<torch::jit::IValue> load_inputs(const char* path) {
  torch::IValue saved = torch::pickle_load(read_file(path));
  std::vector<torch::jit::IValue> inputs;
  for (const auto& item : saved.toListRef()) inputs.push_back(item.toTensor());
  return inputs;
}

// The archive returns one tensor or a tuple/list of tensors.
std::vector<at::Tensor> flatten(const torch::IValue& out) {
  if (out.isTensor()) return {out.toTensor()};
  std::vector<at::Tensor> tensors;
  const auto& items = out.isTuple() ? out.toTupleRef().elements().vec() : out.toListRef().vec();
  for (const auto& item : items) tensors.push_back(item.toTensor());
  return tensors;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: " << argv[0] << " model.blade.pt inputs.pt [outputs.pt]\n";
    return 2;
  }
  try {
    torch::NoGradGuard no_grad;
    blade::verify_archive(argv[1]);
    torch::jit::Module model = torch::jit::load(argv[1]);
    model.eval();
    std::vector<at::Tensor> outputs = flatten(model.forward(load_inputs(argv[2])));
    for (size_t i = 0; i < outputs.size(); ++i) {
      const at::Tensor& t = outputs[i];
      at::Tensor first = t.flatten().slice(0, 0, 4).to(at::kDouble);
      std::cout << "output " << i << ": " << t.dtype() << " " << t.sizes() << " first values";
      for (int64_t k = 0; k < first.numel(); ++k) std::cout << " " << first[k].item<double>();
      std::cout << "\n";
    }
    if (argc > 3) {
      // A tuple of tensors: Python's torch.load (weights_only) reads it back as a tuple.
      std::vector<torch::jit::IValue> items(outputs.begin(), outputs.end());
      std::vector<char> bytes = torch::pickle_save(c10::ivalue::Tuple::create(std::move(items)));
      std::ofstream(argv[3], std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
  } catch (const std::exception& e) {
    std::cerr << "blade_run: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
