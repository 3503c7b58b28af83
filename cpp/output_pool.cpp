#include "output_pool.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "scratch_pool.h"

namespace blade {
namespace {

struct Block {
  c10::DataPtr data;  // from the CPU allocator
  size_t bytes = 0;
};

class Pool final : public c10::Allocator {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: outputs may outlive static destructors
    return *pool;
  }

  c10::DataPtr allocate(size_t bytes) override {
    if (bytes == 0) return {nullptr, nullptr, nullptr, c10::Device(c10::DeviceType::CPU)};
    std::unique_ptr<Block> block = take(bytes);
    if (!block) block = make(bytes, false);
    void* data = block->data.get();
    return {data, block.release(), &Pool::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void reserve(const std::vector<size_t>& bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t b : bytes) cap_ += b;
    }
    // made and populated outside the lock (other threads' calls only need it to take a block)
    for (size_t b : bytes) {
      if (b > 0) give_back(make(b, true));
    }
  }

  void unreserve(const std::vector<size_t>& bytes) {
    std::vector<std::unique_ptr<Block>> dropped;
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t b : bytes) cap_ -= b;
    trim_locked(dropped);
  }  // `dropped` is freed after the lock is released (declared before the guard)

  testing::OutputPoolState state() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {free_.size(), free_bytes_, made_};
  }

 private:
  std::unique_ptr<Block> make(size_t bytes, bool resident) {
    auto block = std::make_unique<Block>();
    block->data = c10::GetCPUAllocator()->allocate(bytes);
    block->bytes = bytes;
    if (resident) populate(block->data.get(), bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    ++made_;
    return block;
  }

  // The smallest free block of at least `bytes`, or null.
  std::unique_ptr<Block> take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.lower_bound(bytes);
    if (it == free_.end()) return nullptr;
    std::unique_ptr<Block> block = std::move(it->second);
    free_.erase(it);
    free_bytes_ -= block->bytes;
    return block;
  }

  void give_back(std::unique_ptr<Block> block) {
    std::vector<std::unique_ptr<Block>> dropped;
    std::lock_guard<std::mutex> lock(mutex_);
    free_bytes_ += block->bytes;
    free_.emplace(block->bytes, std::move(block));
    trim_locked(dropped);
  }

  // Frees the smallest free blocks until the free bytes fit the live engines' reservations (a large
  // block serves any smaller output; small ones accumulate when a caller holds outputs of many sizes).
  void trim_locked(std::vector<std::unique_ptr<Block>>& dropped) {
    while (free_bytes_ > cap_ && !free_.empty()) {
      auto smallest = free_.begin();
      free_bytes_ -= smallest->first;
      dropped.push_back(std::move(smallest->second));
      free_.erase(smallest);
    }
  }

  static void release(void* context) { get().give_back(std::unique_ptr<Block>(static_cast<Block*>(context))); }

  std::mutex mutex_;
  std::multimap<size_t, std::unique_ptr<Block>> free_;  // by size
  size_t free_bytes_ = 0;
  size_t cap_ = 0;  // the live engines' reserved bytes: at most this much is kept free
  size_t made_ = 0;
};

}  // namespace

OutputReservation::OutputReservation(std::vector<size_t> output_bytes) {
  // Two blocks per output: a caller's loop `y = m(x)` holds the previous call's output while the
  // next call runs (with one block, every other call made a fresh block and faulted it in).
  for (size_t b : output_bytes) {
    if (b <= kOutputReserveLimit) bytes_.insert(bytes_.end(), 2, b);
  }
  Pool::get().reserve(bytes_);
}

OutputReservation::~OutputReservation() { Pool::get().unreserve(bytes_); }

c10::Allocator* output_allocator() { return &Pool::get(); }

namespace testing {
OutputPoolState output_pool_state() { return Pool::get().state(); }
}  // namespace testing

}  // namespace blade
