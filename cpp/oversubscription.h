// Noticing that this process's threads do not get the cores they count on (other processes hold
// them), and running engine calls on the calling thread alone until that passes.
//
// Why: every parallel region of ATen's OpenMP pool ends in a barrier. When another process holds
// one of the cores, the thread that finished its chunk first spins there (libgomp's default wait
// policy) while the other one waits for a scheduler slice, so each region costs milliseconds
// instead of microseconds, and an engine call has dozens of regions. Measured on this project's
// 2-core machine at load ~4: BERT's tt_infer calls took 50-180 ms instead of 4 (eager 70-200 ms
// instead of 14; with one thread 8.5 ms, and 6.7 ms with OMP_WAIT_POLICY=PASSIVE). libgomp reads
// its wait policy once, when it loads with torch, so the runtime decides per engine call instead:
// the runtime's parallel_for times its regions, and after a region whose team waited far longer
// than its work took, engine calls may run serially for a while (SerialScope), then try again.
//
// Whether they do is measured, per engine (CallModes): in a serial window each engine runs the
// mode whose recent calls took less time, and now and then the other one. Stalls alone said too
// little: with a neighbour process taking one of the 2 cores 20% of the time, MobileNetV2 b1's
// calls had stalls enough to stay serial for good, at 4.3 ms a call where its parallel calls took
// 2.6 (ONNX Runtime, whose pool never goes serial, 2.5); at 50% they were 6.2 serial against 4.9
// parallel; only at ~75% did serial calls win (4.7 against 6.2; ONNX Runtime 6.5).
#pragma once
#include <atomic>
#include <cstdint>

namespace blade {

// How long engine calls stay serial after a stall (doubling, up to the maximum, while stalls come
// back as soon as a window ends), and what counts as a stall: the region's threads
// waited for the last one more than kStallNs and more than kStallRatio times what the first
// thread to finish worked (a quiet machine's worker wakes in well under 0.1 ms, and the loops'
// chunks are about equal, so their times differ by a small factor at most).
constexpr int64_t kSerialWindowNs = 200'000'000;
constexpr int64_t kSerialWindowMaxNs = 10'000'000'000;
constexpr int64_t kStallNs = 1'000'000;
constexpr int64_t kStallRatio = 4;
// When stalls start serial mode: each adds its wait to a debt that the calm between stalls drains
// at 1 ns per kDebtDrain ns; a stall that finds earlier ones' debt not yet drained and brings it to
// kSerialDebtNs starts a window. So serial mode needs stalls that keep coming and whose waits are
// a large part of the time (more than a third: a serial call costs about twice a parallel one).
// Why not a count: a VM's host took a core for 1.3-5.4 ms about 4 times a second on a quiet AMD
// EPYC (T5 encoder b1 through blade.load, 37 stalls in 10 s, 14-1000 ms apart, under 1% of the
// time); "a second stall within 100 ms" made 10-15% of the calls serial at twice their time (median
// 3.7 ms, p10 2.95). Under load every region waits a slice (~4 ms) after ~0.2 ms of work, and
// the second such stall starts the window, as before.
constexpr int64_t kDebtDrain = 2;
constexpr int64_t kSerialDebtNs = 6'000'000;

// The steady clock in nanoseconds (what the region times below are differences of).
int64_t steady_ns();

// A parallel region's times: from its start until the first thread finished its chunk
// (`worked_ns`), and from then until the region ended (`waited_ns`). Returns whether that was a
// stall (stalls that keep coming, waiting much of the time, make engine calls run serially for a while).
bool note_region(int64_t worked_ns, int64_t waited_ns);

// Whether engine calls run serially now.
bool serial_now();

// An engine's recent call times in each mode, and its choice of mode in a serial window: the mode
// whose calls took less time per input element (so the sizes of an engine with run-time dims
// weigh little), the other one now and then (the machine's load changes; a mode's times go stale):
// after kExploreFirst calls, then at intervals that double while the choice stands (up to
// kExploreMax calls), back to kExploreFirst when it changes. A try at the other mode replaces that
// mode's average: one call must be able to show that the load has changed (an average of calls
// taken under a heavier load kept a lighter one's calls serial). An exploration costs a call in
// the slower mode, and under a heavy load parallel calls take up to 10x a serial one. A mode not
// timed yet is tried first. Calls are timed by the caller (Engine::run_engine); races between
// threads calling one engine only blur the averages.
class CallModes {
 public:
  // Whether a call starting now runs serially (only in a serial window).
  bool choose_serial();
  void record(bool serial, int64_t ns, int64_t elements);

 private:
  static constexpr int64_t kExploreFirst = 16, kExploreMax = 1024;
  std::atomic<int64_t> parallel_ns_{0}, serial_ns_{0};  // per 1024 input elements; 0: no call yet
  // the window call that tries the other mode next, and the gap after it (16, then 32, 64, ... calls)
  std::atomic<int64_t> window_calls_{0}, next_explore_{kExploreFirst}, explore_interval_{2 * kExploreFirst};
  std::atomic<bool> preferred_serial_{false};
  std::atomic<bool> exploring_{false};  // the call running now (or last) tries the other mode
};

// This thread's engine call's choice, which the SerialScopes of its GEMMs and convolutions and the
// runtime's parallel loops follow: kSerial or kParallel when the call started in a serial window
// (CallModes chose), kUndecided when it did not (a window starting within the call then makes the
// call's later GEMMs and convolutions serial).
enum class CallMode { kUndecided, kParallel, kSerial };
class CallModeScope {
 public:
  explicit CallModeScope(CallMode mode);
  ~CallModeScope();
  CallModeScope(const CallModeScope&) = delete;
  CallModeScope& operator=(const CallModeScope&) = delete;

 private:
  CallMode saved_;
};

// Whether work this thread starts now runs serially: its engine call's choice, else serial_now().
bool serial_here();

// For one engine call, and again for each of its GEMMs and convolutions (serial mode may start
// within a call): while serial_here(), this thread's OpenMP and MKL thread counts are 1, so the
// runtime's loops, its own kernels (at::parallel_for) and MKL run on the calling thread.
// (oneDNN primitives fix their team size when created and keep it.)
class SerialScope {
 public:
  SerialScope();
  ~SerialScope();
  SerialScope(const SerialScope&) = delete;
  SerialScope& operator=(const SerialScope&) = delete;

 private:
  bool active_;
  int saved_omp_threads_ = 0;
  int saved_mkl_threads_ = 0;
};

// For tests and benchmarks: stalls seen in this process, parallel regions timed (note_region's
// calls), serial mode set for `ms` milliseconds from now (0 ends it and forgets the last stall),
// and serial windows turned off (serial_now() false whatever the stalls) or back on.
int64_t stall_count();
int64_t noted_region_count();
void force_serial_for(int64_t ms);
void set_serial_windows(bool on);

}  // namespace blade
