#include "shared_library.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace blade {
namespace {

constexpr int kOpenFlags = RTLD_NOW | RTLD_LOCAL;

std::runtime_error system_error(const std::string& what) {
  return std::runtime_error(what + ": " + std::strerror(errno));
}

std::runtime_error loader_error(const std::string& what) {
  const char* message = dlerror();
  return std::runtime_error(what + ": " + (message ? message : "unknown dlopen error"));
}

class UniqueFd {
 public:
  explicit UniqueFd(int fd = -1) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  ~UniqueFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

 private:
  int fd_;
};

void write_all(int fd, const void* data, size_t size) {
  auto* cursor = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t written = ::write(fd, cursor, size);
    if (written < 0) {
      if (errno == EINTR) continue;
      throw system_error("cannot write the shared object");
    }
    cursor += written;
    size -= static_cast<size_t>(written);
  }
}

std::string fd_path(int fd) { return "/proc/self/fd/" + std::to_string(fd); }

// dlopen looks a path up among the loaded libraries by name before it reads the file. A library
// that dlclose could not unload (one with STB_GNU_UNIQUE symbols is never unloaded) keeps its
// name "/proc/self/fd/N" after fd N is closed and reused, and dlopen of the reused name would
// silently hand back the old library. So move to a new fd number until the name is unclaimed.
UniqueFd fd_with_unclaimed_name(UniqueFd fd) {
  std::vector<UniqueFd> claimed;  // kept open while searching so dup cannot return them again
  while (void* loaded = dlopen(fd_path(fd.get()).c_str(), kOpenFlags | RTLD_NOLOAD)) {
    dlclose(loaded);
    UniqueFd next(fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
    if (!next.valid()) throw system_error("cannot duplicate the memory file descriptor");
    claimed.push_back(std::exchange(fd, std::move(next)));
  }
  return fd;
}

// nullptr when this kernel or sandbox offers no memfd (or no /proc to open it by path).
void* open_from_memory_file(const void* data, size_t size) {
  UniqueFd fd(memfd_create("blade_engine", MFD_CLOEXEC));
  if (!fd.valid() || access("/proc/self/fd", F_OK) != 0) return nullptr;
  write_all(fd.get(), data, size);
  fd = fd_with_unclaimed_name(std::move(fd));
  // The mapping keeps the memory file alive once loaded, so the fd closes on return.
  void* handle = dlopen(fd_path(fd.get()).c_str(), kOpenFlags);
  if (!handle) throw loader_error("dlopen failed");
  return handle;
}

void* open_from_temp_file(const void* data, size_t size) {
  const char* tmpdir = std::getenv("TMPDIR");
  std::string path = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/blade_engine_XXXXXX.so";
  UniqueFd fd(mkstemps(path.data(), 3));
  if (!fd.valid()) throw system_error("cannot create a temp file for the shared object in " + path);
  void* handle = nullptr;
  try {
    write_all(fd.get(), data, size);
    handle = dlopen(path.c_str(), kOpenFlags);
  } catch (...) {
    unlink(path.c_str());
    throw;
  }
  unlink(path.c_str());
  if (!handle) throw loader_error("dlopen failed");
  return handle;
}

}  // namespace

SharedLibrary::SharedLibrary(const void* data, size_t size) {
  handle_ = open_from_memory_file(data, size);
  if (!handle_) handle_ = open_from_temp_file(data, size);
}

SharedLibrary::~SharedLibrary() { dlclose(handle_); }

void* SharedLibrary::find(const char* symbol) const { return dlsym(handle_, symbol); }

}  // namespace blade
