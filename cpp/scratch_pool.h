// Scratch memory of engine calls: one process-wide pool of blocks whose pages are made resident
// when the block is made, so an engine call never page-faults in its scratch.
//
// Why: an engine with run-time sizes plans its scratch arena at the size symbols' maxima
// (blade/engine/buffers.py plan_arena): every buffer's offset is fixed, and a call at a shape
// touches a prefix of each buffer. A block whose pages fault in on first touch therefore faults at
// every call at a shape larger than any before it: GPT-2 4L/256 (arena 172 MiB at 16x512), 1 thread,
// 2288 faults (7.5 ms of a 71 ms call) at the first 1x512 call, 37305 at the first 16x512. Making
// the whole arena resident once, when the engine is loaded, is what TensorRT does with its maximum
// workspace; laying the arena out by run-time sizes (smaller shapes sharing a compact prefix) would
// keep less memory resident at small shapes, but the first call at each larger shape would still
// fault in its new pages, and the peak after the largest shape is the same arena either way.
// Populating costs the faults once at load (about 1 ms per 4 MiB here) and holds the arena's pages
// from then on instead of from the largest shape on; above kPopulateLimit a block is populated only
// up to the limit (the rest faults in on first touch, as before), so an engine whose maxima were
// capped only by Config.dynamic_memory_budget does not hold a GiB it may never use.
//
// Blocks live in the pool, not per thread: a call borrows the largest free block (a nested or a
// concurrent call gets another one), so the pool holds one block per call that ever ran at the same
// time, shared by every engine and thread. Live engines reserve their scratch size: loading one
// makes a free block of that size ready, and blocks larger than any live engine needs are freed.
#pragma once
#include <c10/core/Allocator.h>

#include <cstddef>

namespace blade {

// Pages at most this many bytes of a new block in (the rest faults in on first touch).
constexpr size_t kPopulateLimit = size_t{256} << 20;

// Makes the first min(bytes, kPopulateLimit) bytes at `data` resident (writes a zero in each page).
void populate(void* data, size_t bytes);

// An engine's claim on the pool while it lives (one per Engine; 0 bytes claims nothing).
class ScratchReservation {
 public:
  explicit ScratchReservation(size_t bytes);
  ~ScratchReservation();
  ScratchReservation(const ScratchReservation&) = delete;
  ScratchReservation& operator=(const ScratchReservation&) = delete;

 private:
  size_t bytes_;
};

// Scratch of at least `bytes` bytes (64-byte aligned) for one engine call, borrowed from the pool
// and given back when the lease ends.
class ScratchLease {
 public:
  explicit ScratchLease(size_t bytes);
  ~ScratchLease();
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  void* data() const { return block_.get(); }

 private:
  c10::DataPtr block_;
  size_t bytes_ = 0;  // of the borrowed block
};

namespace testing {
// (blocks in the pool not lent to a call, their total bytes); for tests.
struct ScratchPoolState {
  size_t free_blocks = 0;
  size_t free_bytes = 0;
};
ScratchPoolState scratch_pool_state();
}  // namespace testing

}  // namespace blade
