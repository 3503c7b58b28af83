// Outputs of engines with run-time sizes: memory from one process-wide pool of blocks, reused from
// call to call, instead of from malloc.
//
// Why: such an engine's outputs change size with every new shape. glibc serves them from its heap
// (its mmap threshold rises to the size of the first large block freed), and small allocations made
// between calls split the free space, so a call at the largest shape again, after smaller ones, found
// no free run large enough and grew the heap: a served GPT-2 4L/256 grew by 8 MiB (one [16, 512, 256]
// output) after the largest shape had been seen. And the first call at a larger shape than any before
// faulted in its outputs' new pages (2048 at 16x512). torch's allocators offer no fix: the CPU
// allocator is malloc, and c10's CPUCachingAllocator (mobile) keys its cache by exact size, so with
// sizes that vary it would only grow.
//
// The pool: a live engine reserves two blocks per output at its largest size (the size symbols'
// maxima), made resident at load like its scratch (scratch_pool.h); a call takes the smallest free
// block that holds an output, and the tensor's storage gives it back when it dies. The pool keeps at
// most the live engines' reserved bytes free (the smallest blocks go first), so a caller that holds
// many outputs at once gets fresh blocks, and memory returns once it lets them go.
#pragma once
#include <c10/core/Allocator.h>

#include <cstddef>
#include <vector>

namespace blade {

// Outputs larger than this at their largest get no reserved blocks: a size left unbounded is capped
// only by Config.dynamic_memory_budget (1 GiB of live tensors by default), and two resident blocks of
// hundreds of MiB from load would cost more than the faults they save. Their blocks are made per call
// and freed when the tensor dies (the pool keeps only reserved bytes), as malloc would.
constexpr size_t kOutputReserveLimit = size_t{64} << 20;

// An engine's claim on the output pool while it lives: two resident blocks per output at its
// largest (outputs up to kOutputReserveLimit).
class OutputReservation {
 public:
  explicit OutputReservation(std::vector<size_t> output_bytes);
  ~OutputReservation();
  OutputReservation(const OutputReservation&) = delete;
  OutputReservation& operator=(const OutputReservation&) = delete;

 private:
  std::vector<size_t> bytes_;
};

// The allocator of the pool's blocks (64-byte aligned): for at::detail::empty_generic, so an output
// is an ordinary resizable CPU tensor whose memory returns to the pool.
c10::Allocator* output_allocator();

namespace testing {
struct OutputPoolState {
  size_t free_blocks = 0;
  size_t free_bytes = 0;
  size_t made_blocks = 0;  // blocks allocated since the process started
};
OutputPoolState output_pool_state();
}  // namespace testing

}  // namespace blade
