// SHA-256 content hashes of an Engine's parts (OpenSSL's libcrypto does the hashing). The Engine
// state stores them next to the bytes they cover; loading recomputes and compares them before the
// .so is written anywhere or dlopen'ed, so a damaged artifact is a clear error, not a crash.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace blade {

// An incremental SHA-256. Strings go in length-prefixed, so ("ab", "c") and ("a", "bc") differ.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  Sha256& bytes(const void* data, size_t size);
  Sha256& text(const std::string& value);
  Sha256& integer(int64_t value);
  Sha256& real(double value);  // its bit pattern: any change, however small, changes the hash
  // The dtype, shape and contiguous bytes of a tensor.
  Sha256& tensor(const at::Tensor& value);
  std::string hex();  // finishes the hash; the object cannot be fed afterwards

 private:
  struct Context;
  std::unique_ptr<Context> context_;
};

}  // namespace blade
