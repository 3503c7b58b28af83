#include "content_digest.h"

#include <openssl/evp.h>

#include <cstring>
#include <stdexcept>

namespace blade {

struct Sha256::Context {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  ~Context() { EVP_MD_CTX_free(ctx); }
};

Sha256::Sha256() : context_(std::make_unique<Context>()) {
  if (!context_->ctx || EVP_DigestInit_ex(context_->ctx, EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("OpenSSL cannot start a SHA-256 hash");
  }
}

Sha256::~Sha256() = default;

Sha256& Sha256::bytes(const void* data, size_t size) {
  if (size > 0 && EVP_DigestUpdate(context_->ctx, data, size) != 1) {
    throw std::runtime_error("OpenSSL SHA-256 update failed");
  }
  return *this;
}

Sha256& Sha256::integer(int64_t value) { return bytes(&value, sizeof(value)); }

Sha256& Sha256::real(double value) {
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  return bytes(&bits, sizeof(bits));
}

Sha256& Sha256::text(const std::string& value) {
  integer(static_cast<int64_t>(value.size()));
  return bytes(value.data(), value.size());
}

Sha256& Sha256::tensor(const at::Tensor& value) {
  if (!value.defined()) return text("undefined");
  text(c10::toString(value.scalar_type()));
  integer(value.dim());
  for (int64_t size : value.sizes()) integer(size);
  const at::Tensor dense = value.contiguous();
  return bytes(dense.const_data_ptr(), dense.nbytes());
}

std::string Sha256::hex() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_DigestFinal_ex(context_->ctx, digest, &length) != 1) {
    throw std::runtime_error("OpenSSL SHA-256 finish failed");
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < length; ++i) {
    out += kHex[digest[i] >> 4];
    out += kHex[digest[i] & 15];
  }
  return out;
}

}  // namespace blade
