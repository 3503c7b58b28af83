// A shared library loaded straight from bytes in memory, so that an engine .so can live inside a
// serialized TorchScript module and be loaded with no file left on disk. Torch-free.
#pragma once
#include <cstddef>

namespace blade {

class SharedLibrary {
 public:
  // Loads `size` bytes of ELF shared object with RTLD_NOW | RTLD_LOCAL: from an anonymous memory
  // file (memfd_create) when the kernel offers one, else from a temp file unlinked right after
  // dlopen. Throws std::runtime_error carrying the loader's message on any failure.
  SharedLibrary(const void* data, size_t size);
  ~SharedLibrary();
  SharedLibrary(const SharedLibrary&) = delete;
  SharedLibrary& operator=(const SharedLibrary&) = delete;

  // The address of an exported symbol, nullptr when the library has none by that name.
  void* find(const char* symbol) const;

 private:
  void* handle_;
};

}  // namespace blade
