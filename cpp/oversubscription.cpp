#include "oversubscription.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>

#include "gemm.h"

namespace blade {
namespace {

std::atomic<int64_t> serial_until_ns{0};  // steady-clock time until which engine calls run serially
std::atomic<int64_t> window_ns{kSerialWindowNs};  // the length of the current (or last) serial window
std::atomic<int64_t> stalls{0};
std::atomic<int64_t> last_stall_ns{0};
std::atomic<int64_t> stall_debt_ns{0};  // kDebtDrain: the stalls' waits, net of the calm since
std::atomic<int64_t> regions_noted{0};
std::atomic<bool> windows_on{true};  // set_serial_windows

}  // namespace

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool note_region(int64_t worked_ns, int64_t waited_ns) {
  regions_noted.fetch_add(1, std::memory_order_relaxed);
  if (waited_ns <= kStallNs || waited_ns <= kStallRatio * worked_ns) return false;
  stalls.fetch_add(1, std::memory_order_relaxed);
  // One stall alone may be a passing job (a VM's host taking a core for a few ms): serial mode starts
  // only when earlier stalls' debt is still there. The calm counts from the previous stall's end to
  // this region's start: a region's own wait is not calm time, and stalls of more than 100 ms
  // each (seen at load ~3: whole rounds of 430 ms calls) must still add up.
  const int64_t now = steady_ns();
  const int64_t region_start = now - waited_ns - worked_ns;
  const int64_t previous = last_stall_ns.exchange(now, std::memory_order_relaxed);
  const int64_t calm = std::max<int64_t>(0, region_start - previous);
  const int64_t left =
      previous == 0 ? 0 : std::max<int64_t>(0, stall_debt_ns.load(std::memory_order_relaxed) - calm / kDebtDrain);
  stall_debt_ns.store(left + waited_ns, std::memory_order_relaxed);
  if (left == 0 || left + waited_ns < kSerialDebtNs) return true;
  // A stall soon after a serial window ended: the load lasts, so the next window is twice as long
  // (each try costs a stall); after a longer calm, the first window again.
  const int64_t last_until = serial_until_ns.load(std::memory_order_relaxed);
  const int64_t last_window = window_ns.load(std::memory_order_relaxed);
  const bool lasting = last_until != 0 && now - last_until < last_window;
  const int64_t window = lasting ? std::min(2 * last_window, kSerialWindowMaxNs) : kSerialWindowNs;
  window_ns.store(window, std::memory_order_relaxed);
  serial_until_ns.store(now + window, std::memory_order_relaxed);
  return true;
}

// The coarse clock (a jiffy's resolution, no hardware counter read) is precise enough for a window
// of 200 ms or more, and this runs on every parallel region.
int64_t coarse_ns() {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &now);
  return now.tv_sec * 1'000'000'000 + now.tv_nsec;
}

bool serial_now() {
  if (!windows_on.load(std::memory_order_relaxed)) return false;
  const int64_t until = serial_until_ns.load(std::memory_order_relaxed);
  return until != 0 && coarse_ns() < until;
}

namespace {
thread_local CallMode call_mode = CallMode::kUndecided;
}  // namespace

bool CallModes::choose_serial() {
  const int64_t parallel = parallel_ns_.load(std::memory_order_relaxed);
  const int64_t serial = serial_ns_.load(std::memory_order_relaxed);
  if (serial == 0 || parallel == 0) return serial == 0;
  const bool preferred = serial < parallel;
  if (preferred != preferred_serial_.exchange(preferred, std::memory_order_relaxed)) {
    explore_interval_.store(2 * kExploreFirst, std::memory_order_relaxed);  // the choice changed: look again soon
    next_explore_.store(window_calls_.load(std::memory_order_relaxed) + kExploreFirst, std::memory_order_relaxed);
  }
  const int64_t call = window_calls_.fetch_add(1, std::memory_order_relaxed);
  int64_t next = next_explore_.load(std::memory_order_relaxed);
  const int64_t interval = explore_interval_.load(std::memory_order_relaxed);
  const bool explore = call >= next && next_explore_.compare_exchange_strong(next, call + interval, std::memory_order_relaxed);
  if (explore) explore_interval_.store(std::min(2 * interval, kExploreMax), std::memory_order_relaxed);
  exploring_.store(explore, std::memory_order_relaxed);
  return preferred != explore;
}

void CallModes::record(bool serial, int64_t ns, int64_t elements) {
  std::atomic<int64_t>& average = serial ? serial_ns_ : parallel_ns_;
  const int64_t sample = std::max<int64_t>(1, ns * 1024 / std::max<int64_t>(1, elements));
  const int64_t before = average.load(std::memory_order_relaxed);
  // A try at the other mode replaces its average; the chosen mode's calls average over about 8.
  const bool replace = before == 0 || exploring_.exchange(false, std::memory_order_relaxed);
  average.store(replace ? sample : before + (sample - before) / 8, std::memory_order_relaxed);
}

CallModeScope::CallModeScope(CallMode mode) : saved_(call_mode) { call_mode = mode; }

CallModeScope::~CallModeScope() { call_mode = saved_; }

bool serial_here() {
  return call_mode == CallMode::kUndecided ? serial_now() : call_mode == CallMode::kSerial;
}

SerialScope::SerialScope() : active_(serial_here()) {
  if (!active_) return;
  // Per thread: omp_set_num_threads sets the calling thread's ICV, which at::get_num_threads reads.
  saved_omp_threads_ = omp_get_max_threads();
  omp_set_num_threads(1);
  saved_mkl_threads_ = mkl_set_local_threads(1);
}

SerialScope::~SerialScope() {
  if (!active_) return;
  omp_set_num_threads(saved_omp_threads_);
  mkl_set_local_threads(saved_mkl_threads_);
}

int64_t stall_count() { return stalls.load(std::memory_order_relaxed); }

int64_t noted_region_count() { return regions_noted.load(std::memory_order_relaxed); }

void set_serial_windows(bool on) { windows_on.store(on, std::memory_order_relaxed); }

void force_serial_for(int64_t ms) {
  last_stall_ns.store(0, std::memory_order_relaxed);
  stall_debt_ns.store(0, std::memory_order_relaxed);
  serial_until_ns.store(ms > 0 ? steady_ns() + ms * 1'000'000 : 0, std::memory_order_relaxed);
}

}  // namespace blade
