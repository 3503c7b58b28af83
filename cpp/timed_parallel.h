// timed_parallel_for: the parallel loop of every parallel region of the runtime: its parallel_for
// (the generated loops) and its own kernels (convolutions, the panels GEMM, the fused attention,
// the MKL column and head splits). Its threads claim the range in chunks as they go, each from its
// own share first (Shares), and its team's times go to the oversubscription check
// (oversubscription.h). A region that runs on one thread is not timed. (MKL's own threaded GEMMs cannot be timed: their regions are MKL's.)
//
// Why claimed chunks: ATen's parallel_for gives each thread one fixed share, so a thread that
// loses its core for a while (another process runs there; on this VM also the host) delays the
// whole region by its share, and an engine call has dozens of regions: T5 b8 fell to 0.85-0.88 of
// ONNX Runtime with one neighbour process, whose pool shards loops in more pieces than threads
// and whose calling thread takes what is left. Here the threads claim about kClaimsPerThread
// chunks each from an atomic counter, so the thread that has its core does the share of the one
// that has not. Which thread runs a chunk changes nothing in its result: every caller's chunk
// computes its outputs whole (a GEMM task its rows' whole k), so results stay bitwise the same.
//
// Why the kernels are timed too: serial mode starts from stalls seen in timed regions, and an
// engine of convolutions only (MobileNetV2's: 52 convolutions, no loop big enough for a team) had
// none, so it never went serial on a loaded machine: 76 ms a call at 2 threads instead of 3-5
// (load ~2.5, its regions waiting for a descheduled worker), against ONNX Runtime's 5 there.
// Likewise a GEMM-only engine (the MLP block [8,256]): 24 ms a call at load 4-5, 0 stalls counted,
// 0.13-0.16 ms serial.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "oversubscription.h"

namespace blade {

// Chunks a thread claims in a region with enough work: a thread that stops for a while leaves
// (about) its later chunks to the others. More would make a chunk smaller than a wake-up is worth
// on small regions; `grain` bounds a chunk from below anyway.
constexpr int64_t kClaimsPerThread = 4;

// The size of the chunks [begin, end) is claimed in by `threads` threads: at least `grain`, about
// 1/kClaimsPerThread of a thread's share, in whole `unit`s (a caller whose items share a setup,
// e.g. a head's packed K and V, passes the items per setup) unless that would leave a thread
// without a chunk.
inline int64_t claim_size(int64_t count, int64_t grain, int64_t threads, int64_t unit) {
  const int64_t claim = std::max(grain, (count + threads * kClaimsPerThread - 1) / (threads * kClaimsPerThread));
  const int64_t in_units = (claim + unit - 1) / unit * unit;
  return (count + in_units - 1) / in_units >= threads ? in_units : claim;
}

// The range in contiguous shares of whole chunks, one per team member (up to kMaxShares), each
// with its own claim counter: a member claims its own share's chunks first, in order, then what is
// left of the others'. Without a stall each member runs the same share on every call (an engine's
// regions repeat), so the outputs it wrote and the operands it read in the last call are still in
// its core's cache; one shared counter dealt the chunks out anew on every call. A member that
// loses its core still has its chunks taken by the others.
class Shares {
 public:
  Shares(int64_t begin, int64_t end, int64_t claim, int64_t members)
      : count_(std::min(members, kMaxShares)), claim_(claim) {
    const int64_t chunks = (end - begin + claim - 1) / claim;
    int64_t at = begin;
    for (int64_t s = 0; s < count_; ++s) {  // the first chunks % count_ shares take one chunk more
      share_[s].next.store(at, std::memory_order_relaxed);
      at = std::min(end, at + (chunks / count_ + (s < chunks % count_ ? 1 : 0)) * claim);
      share_[s].end = at;
    }
  }

  template <typename F>
  void run(int64_t member, const F& f) {
    for (int64_t k = 0; k < count_; ++k) {
      Share& share = share_[(member + k) % count_];
      for (int64_t chunk; (chunk = share.next.fetch_add(claim_, std::memory_order_relaxed)) < share.end;) {
        f(chunk, std::min(share.end, chunk + claim_));
      }
    }
  }

 private:
  static constexpr int64_t kMaxShares = 16;  // more members start in the shares in turn
  struct alignas(64) Share {                 // a cache line each: the members' claims do not collide
    std::atomic<int64_t> next;
    int64_t end;
  };
  Share share_[kMaxShares];
  int64_t count_, claim_;
};

template <typename F>
void timed_parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f, int64_t unit = 1) {
  grain = grain < 1 ? 1 : grain;  // ATen divides by it
  unit = unit < 1 ? 1 : unit;
  if (begin >= end) return;
  if (serial_here()) {  // the machine is oversubscribed and serial calls are faster: this thread alone
    f(begin, end);
    return;
  }
  // ATen's own test for running the range inline, on this thread: then there is no team to time.
  const int64_t threads = at::get_num_threads();
  const bool team = end - begin > grain && threads > 1 && !at::in_parallel_region();
  if (!team) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t claim = claim_size(end - begin, grain, threads, unit);
  const int64_t members = std::min(threads, (end - begin + claim - 1) / claim);
  // When the first thread found nothing left to claim: what the others then make it wait (their
  // last chunks, or a thread that has not started yet) shows whether they have cores.
  const int64_t start = steady_ns();
  Shares shares(begin, end, claim, members);
  std::atomic<int64_t> first_done{0};
  at::parallel_for(0, members, 1, [&](int64_t member_begin, int64_t member_end) {
    for (int64_t member = member_begin; member < member_end; ++member) shares.run(member, f);
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
