#include "scratch_pool.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

namespace blade {
namespace {

constexpr uintptr_t kScratchAlignment = 64;  // promised to engines by blade_abi.h

struct Block {
  c10::DataPtr data;
  size_t bytes = 0;
};

}  // namespace

// Writes a byte in every page of the block's first kPopulateLimit bytes, so the kernel maps them
// now rather than in a call (an engine's scratch has no defined contents, so the zeros are free).
void populate(void* data, size_t bytes) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t end = std::min(bytes, kPopulateLimit);
  if (end == 0) return;
  volatile char* bytes_of = static_cast<volatile char*>(data);
  for (size_t i = 0; i < end; i += page) bytes_of[i] = 0;
  bytes_of[end - 1] = 0;  // the last page, when the block does not start on a page boundary
}

namespace {

Block allocate(size_t bytes) {
  Block block{c10::GetCPUAllocator()->allocate(bytes), bytes};
  TORCH_CHECK(reinterpret_cast<uintptr_t>(block.data.get()) % kScratchAlignment == 0,
              "the CPU allocator returned scratch memory that is not 64-byte aligned");
  populate(block.data.get(), bytes);
  return block;
}

// Which block of `blocks` is the largest (blocks.end() when empty).
std::vector<Block>::iterator largest(std::vector<Block>& blocks) {
  return std::max_element(blocks.begin(), blocks.end(),
                          [](const Block& a, const Block& b) { return a.bytes < b.bytes; });
}

// Blocks are made (allocated and populated) and freed outside the lock: populating 100 MiB takes
// tens of milliseconds, and other threads' calls only need the lock to borrow a free block.
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: engines may outlive static destructors
    return *pool;
  }

  void reserve(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      reserved_.insert(bytes);
      if (largest_block() >= bytes) return;
    }
    Block made;
    try {
      made = allocate(bytes);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      reserved_.erase(reserved_.find(bytes));  // the reservation's destructor will not run
      throw;
    }
    std::vector<Block> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = largest(free_);
      if (it != free_.end()) {  // the new block replaces the largest free one, now too small
        dropped.push_back(std::move(*it));
        free_.erase(it);
      }
      free_.push_back(std::move(made));
    }
  }

  void unreserve(size_t bytes) {
    std::vector<Block> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      reserved_.erase(reserved_.find(bytes));
      // Free blocks larger than every live engine needs: what a destroyed engine kept resident.
      const size_t needed = target();
      for (auto it = free_.begin(); it != free_.end();) {
        if (it->bytes > needed) {
          dropped.push_back(std::move(*it));
          it = free_.erase(it);
        } else {
          ++it;
        }
      }
    }
  }

  Block take(size_t bytes) {
    Block too_small;
    size_t size = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = largest(free_);
      if (it != free_.end() && it->bytes >= bytes) {
        Block block = std::move(*it);
        free_.erase(it);
        lent_.insert(block.bytes);
        return block;
      }
      if (it != free_.end()) {
        too_small = std::move(*it);
        free_.erase(it);
      }
      size = std::max(bytes, target());
      lent_.insert(size);
    }
    too_small = Block();  // freed before the larger block is made
    try {
      return allocate(size);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      lent_.erase(lent_.find(size));
      throw;
    }
  }

  void give_back(Block block) {
    std::lock_guard<std::mutex> lock(mutex_);
    lent_.erase(lent_.find(block.bytes));
    if (block.bytes <= target()) free_.push_back(std::move(block));
    // else: no live engine needs a block this large (its engine was destroyed during the call);
    // it is freed when `block` goes out of scope, after the lock is released
  }

  testing::ScratchPoolState state() {
    std::lock_guard<std::mutex> lock(mutex_);
    testing::ScratchPoolState s;
    for (const Block& block : free_) {
      ++s.free_blocks;
      s.free_bytes += block.bytes;
    }
    return s;
  }

 private:
  // The largest scratch a live engine needs (callers hold the lock).
  size_t target() const { return reserved_.empty() ? 0 : *reserved_.rbegin(); }
  // The largest block, free or lent (callers hold the lock).
  size_t largest_block() {
    auto it = largest(free_);
    const size_t free_bytes = it == free_.end() ? 0 : it->bytes;
    return std::max(free_bytes, lent_.empty() ? size_t{0} : *lent_.rbegin());
  }

  std::mutex mutex_;
  std::vector<Block> free_;         // populated blocks no call holds
  std::multiset<size_t> lent_;      // sizes of the blocks calls hold now
  std::multiset<size_t> reserved_;  // scratch sizes of the live engines
};

}  // namespace

ScratchReservation::ScratchReservation(size_t bytes) : bytes_(bytes) {
  if (bytes_ > 0) Pool::get().reserve(bytes_);
}

ScratchReservation::~ScratchReservation() {
  if (bytes_ > 0) Pool::get().unreserve(bytes_);
}

ScratchLease::ScratchLease(size_t bytes) {
  if (bytes == 0) return;
  Block block = Pool::get().take(bytes);
  block_ = std::move(block.data);
  bytes_ = block.bytes;
}

ScratchLease::~ScratchLease() {
  if (bytes_ > 0) Pool::get().give_back(Block{std::move(block_), bytes_});
}

namespace testing {
ScratchPoolState scratch_pool_state() { return Pool::get().state(); }
}  // namespace testing

}  // namespace blade
