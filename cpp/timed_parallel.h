// timed_parallel_for: at::parallel_for whose team's times go to the oversubscription check
// (oversubscription.h), for every parallel region of the runtime: its parallel_for (the generated
// loops) and its own kernels (convolutions, the panels GEMM, the MKL column and head splits). A
// region that runs on one thread is not timed. (MKL's own threaded GEMMs cannot be timed: their
// regions are MKL's.)
//
// Why the kernels too: serial mode starts from stalls seen in timed regions, and an engine of
// convolutions only (MobileNetV2's: 52 convolutions, no loop big enough for a team) had none, so it
// never went serial on a loaded machine: 76 ms a call at 2 threads instead of 3-5 (load ~2.5, its
// regions waiting for a descheduled worker), against ONNX Runtime's 5 there. Likewise a GEMM-only
// engine (the MLP block [8,256]): 24 ms a call at load 4-5, 0 stalls counted, 0.13-0.16 ms serial.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

#include "oversubscription.h"

namespace blade {

template <typename F>
void timed_parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  grain = grain < 1 ? 1 : grain;  // ATen divides by it
  if (begin >= end) return;
  if (serial_now()) {  // the machine is oversubscribed: this thread alone
    f(begin, end);
    return;
  }
  // ATen's own test for running the range inline, on this thread: then there is no team to time.
  const bool team = end - begin > grain && at::get_num_threads() > 1 && !at::in_parallel_region();
  if (!team) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  // When the first thread finished its chunk: what the others then make it wait shows whether
  // they have cores.
  const int64_t start = steady_ns();
  std::atomic<int64_t> first_done{0};
  at::parallel_for(begin, end, grain, [&f, &first_done](int64_t chunk_begin, int64_t chunk_end) {
    f(chunk_begin, chunk_end);
    // the clock is read by the first to finish only (a read costs 40 ns in this VM: 4 a region
    // were 1-2% of a 9 us elementwise call at 2 threads)
    if (first_done.load(std::memory_order_relaxed) != 0) return;
    int64_t none = 0;
    first_done.compare_exchange_strong(none, steady_ns(), std::memory_order_relaxed);
  });
  const int64_t done = first_done.load(std::memory_order_relaxed);
  note_region(done - start, steady_ns() - done);
}

}  // namespace blade
