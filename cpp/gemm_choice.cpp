// Which kernel runs a GEMM: chosen per process and call shape by timing the candidates on the
// call's own operands, not by CPU vendor (MKL 2024 is 2x slower than oneDNN on AMD EPYC with
// AVX-512, and may well win on Intel; a few-row GEMM may prefer MKL's column split either way).
// BLADE_GEMM narrows the candidates (README "GEMM backend"); gemm_choices() reports the choices.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>

#include "gemm.h"

namespace blade {
namespace {

enum Kernel { kMkl, kOnednnMatmul, kOnednnPacked, kPanels, kKernels };
constexpr std::array<const char*, kKernels> kKernelNames = {"mkl", "onednn-matmul", "onednn-packed", "panels"};
constexpr unsigned bit(Kernel k) { return 1u << k; }

// BLADE_GEMM's values: the kernels each lets the runtime time against each other.
struct Mode {
  const char* name;
  unsigned kernels;
};
constexpr unsigned kOnednnKernels = bit(kOnednnMatmul) | bit(kOnednnPacked);
constexpr std::array<Mode, 6> kModes = {{{"auto", bit(kMkl) | kOnednnKernels | bit(kPanels)},
                                         {"mkl", bit(kMkl)},
                                         {"onednn", kOnednnKernels},
                                         {"onednn-matmul", bit(kOnednnMatmul)},
                                         {"onednn-packed", bit(kOnednnPacked)},
                                         {"panels", bit(kPanels)}}};

unsigned parse_mode(const std::string& value) {
  std::string known;
  for (const Mode& mode : kModes) {
    if (value == mode.name) return mode.kernels;
    known += known.empty() ? mode.name : std::string(", ") + mode.name;
  }
  TORCH_CHECK(false, "BLADE_GEMM=", value, ": expected one of ", known);
}

unsigned mode_from_env() {
  const char* value = std::getenv("BLADE_GEMM");
  return parse_mode(value != nullptr && *value != '\0' ? value : "auto");
}

// Everything about a call that can change which kernel is fastest; not its pointers, alpha or
// beta. Whether B is an engine constant decides whether it can be packed; the thread count and
// whether the call comes from inside a parallel region (kernels then run serially) decide how the
// kernels thread.
using ShapeKey = std::array<int64_t, 15>;

// What was timed for one shape. The kernel is read without the table's lock on every call.
struct Choice {
  std::atomic<int> kernel{kMkl};
  std::array<double, kKernels> us;  // per candidate: its best call over all timings, us; NaN: not timed
  unsigned kernels = 0;             // the candidates timed
  int timings = 0;
  std::atomic<bool> settled{false};  // false: the timing looked disturbed, time again (retime_due)
  std::atomic<int64_t> calls{0};     // calls since the first timing, while not settled
};

struct Table {
  std::shared_mutex mutex;
  std::optional<unsigned> mode;  // allowed kernels; read from BLADE_GEMM on first use
  std::map<ShapeKey, std::unique_ptr<Choice>> choices;
  std::mutex measuring;  // one timing at a time: two at once would slow each other down
};

Table& table() {
  static Table t;
  return t;
}

unsigned allowed_kernels() {
  Table& t = table();
  {
    std::shared_lock<std::shared_mutex> lock(t.mutex);
    if (t.mode) return *t.mode;
  }
  const unsigned mode = mode_from_env();
  std::unique_lock<std::shared_mutex> lock(t.mutex);
  if (!t.mode) t.mode = mode;
  return *t.mode;
}

// oneDNN through libtorch costs 10-15 us a call (torch re-creates its primitive descriptor every
// call), the time MKL needs for about 2 MFLOP even on its slow path: below that "auto" takes MKL
// untimed. That also spares tiny GEMMs a timing whose outcome would be noise, and keeps their
// rounding the same in every process.
constexpr double kTinyFlops = 2e6;

// The kernels that can run g (k > 0 and alpha != 0 here), narrowed to `allowed`. A oneDNN mode
// falls back to oneDNN's matmul where its kernel does not apply, and to MKL where oneDNN does not
// run on this CPU.
unsigned candidates(const GemmArgs& g, bool b_constant, unsigned allowed) {
  unsigned applicable = bit(kMkl);
  const bool tiny = 2.0 * g.batch * g.m * g.n * g.k < kTinyFlops;
  if (tiny && (allowed & bit(kMkl))) return bit(kMkl);
  if (onednn_usable()) {
    applicable |= bit(kOnednnMatmul);
    if (g.batch == 1 && b_constant) applicable |= bit(kOnednnPacked);
  }
  if (b_constant && panels_applies(g)) applicable |= bit(kPanels);
  unsigned chosen = applicable & allowed;
  if (chosen == 0) chosen = applicable & (allowed & kOnednnKernels ? bit(kOnednnMatmul) : bit(kMkl));
  return chosen != 0 ? chosen : bit(kMkl);
}

void run(Kernel kernel, const GemmArgs& g, PackedWeights* weights) {
  switch (kernel) {
    case kOnednnMatmul:
      onednn_matmul(g);
      return;
    case kOnednnPacked:
      onednn_packed(g, weights);
      return;
    case kPanels:
      panels_gemm(g, weights);
      return;
    default:
      mkl_gemm(g, weights);
  }
}

// The floats an operand spans: [batch, rows, cols] with leading dimension ld and batch stride.
int64_t extent(int64_t batch, int64_t stride, int64_t rows, int64_t cols, int64_t ld, bool transposed) {
  return (batch - 1) * stride + (transposed ? (cols - 1) * ld + rows : (rows - 1) * ld + cols);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Times each candidate on g's operands into `best` (per kernel, its best call in microseconds,
// kept when lower than what `best` holds). The timed calls write a scratch C of C's layout with
// beta = 0 (with beta != 0 each call would accumulate into C), and pack B into a PackedWeights of
// their own, dropped afterwards: only the winner's pack stays with the engine. Rounds alternate the
// candidates and each keeps its best call, so a neighbour process stealing the CPU for a while
// (the machine is shared) does not decide the choice. Returns the candidates that ran (a oneDNN
// kernel that throws is dropped; MKL's errors are real ones and propagate).
unsigned measure(const GemmArgs& g, bool b_constant, unsigned kernels, std::array<double, kKernels>& best) {
  // One sample repeats a tiny GEMM up to about kTargetSampleS. Rounds go on past kMinRounds while
  // the timing took under kBudgetS: on a loaded 2-core machine a parallel call now and then waits
  // 4-8 ms for a preempted thread, so a few-hundred-microsecond GEMM needs many samples for every
  // candidate to have a clean one; a GEMM of many milliseconds gets kMinRounds.
  constexpr double kTargetSampleS = 100e-6;
  constexpr int kMinRounds = 3, kMaxRounds = 30;
  constexpr double kBudgetS = 0.05;
  PackedWeights probe;
  if (b_constant) {
    probe.add_constant(g.b, sizeof(float) * extent(1, 0, g.k, g.n, g.ldb, g.trans_b != 0));
  }
  at::Tensor scratch = at::empty({extent(g.batch, g.stride_c, g.m, g.n, g.ldc, false)}, at::kFloat);
  GemmArgs timed = g;
  timed.c = scratch.mutable_data_ptr<float>();
  timed.beta = 0.0f;

  double fastest_first = std::numeric_limits<double>::infinity();
  for (int k = 0; k < kKernels; ++k) {
    if (!(kernels & bit(Kernel(k)))) continue;
    const auto start = std::chrono::steady_clock::now();
    try {
      run(Kernel(k), timed, &probe);  // packs, warms caches and thread pools
    } catch (const c10::Error&) {
      if (k == kMkl) throw;  // MKL/ATen take every GEMM of the contract: a real error
      kernels &= ~bit(Kernel(k));  // a oneDNN refusal: the others still run it
      continue;
    }
    fastest_first = std::min(fastest_first, seconds_since(start));
  }
  const int repeats = static_cast<int>(std::clamp(kTargetSampleS / std::max(fastest_first, 1e-9), 1.0, 64.0));
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < kMaxRounds && (round < kMinRounds || seconds_since(start) < kBudgetS); ++round) {
    for (int step = 0; step < kKernels; ++step) {
      const Kernel k = Kernel((round + step) % kKernels);  // rotate who goes first
      if (!(kernels & bit(k))) continue;
      const auto sample = std::chrono::steady_clock::now();
      for (int r = 0; r < repeats; ++r) run(k, timed, &probe);
      const double us = seconds_since(sample) / repeats * 1e6;
      if (!(best[k] <= us)) best[k] = us;  // also replaces NaN (not timed yet)
    }
  }
  return kernels;
}

// The fastest kernel timed, and whether that timing can be trusted: a best call over 1 ms at under
// 20 GFLOP/s is a stall (every sample of a candidate waited on a preempted thread, as on a 2-core
// machine whose other jobs hold both cores), not the kernel's speed; the shape is timed again later.
void decide(Choice& choice, const GemmArgs& g) {
  constexpr double kSuspectUs = 1000, kSuspectGflops = 20;
  constexpr int kMaxTimings = 5;
  int winner = -1;
  for (int k = 0; k < kKernels; ++k) {
    if ((choice.kernels & bit(Kernel(k))) && (winner < 0 || choice.us[k] < choice.us[winner])) winner = k;
  }
  choice.kernel.store(winner, std::memory_order_relaxed);
  const double gflops = 2e-3 * static_cast<double>(g.batch) * g.m * g.n * g.k / choice.us[winner];
  const bool suspect = choice.us[winner] > kSuspectUs && gflops < kSuspectGflops;
  choice.settled.store(!suspect || choice.timings >= kMaxTimings, std::memory_order_release);
}

// A shape whose timing looked disturbed is timed again on its 4th, 8th, 16th and 32nd call after it.
bool retime_due(Choice& choice) {
  if (choice.settled.load(std::memory_order_acquire)) return false;
  const int64_t calls = choice.calls.fetch_add(1, std::memory_order_relaxed) + 1;
  return calls >= 4 && (calls & (calls - 1)) == 0;
}

Kernel choose(const GemmArgs& g, bool b_constant) {
  const unsigned allowed = allowed_kernels();
  const unsigned kernels = candidates(g, b_constant, allowed);
  if ((kernels & (kernels - 1)) == 0) {  // one candidate: nothing to time
    for (int k = 0; k < kKernels; ++k) {
      if (kernels & bit(Kernel(k))) return Kernel(k);
    }
  }
  const ShapeKey key = {g.batch, g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.stride_a, g.stride_b, g.stride_c,
                        g.trans_a != 0, g.trans_b != 0, b_constant, at::get_num_threads(),
                        at::in_parallel_region()};
  Table& t = table();
  bool retime = false;
  {
    std::shared_lock<std::shared_mutex> lock(t.mutex);  // entries are only dropped under its unique lock
    const auto it = t.choices.find(key);
    if (it != t.choices.end()) {
      if (!retime_due(*it->second)) return Kernel(it->second->kernel.load(std::memory_order_relaxed));
      retime = true;
    }
  }
  std::lock_guard<std::mutex> measuring(t.measuring);  // set_gemm_backend also takes it: entries stay
  Choice* entry = nullptr;
  {
    std::shared_lock<std::shared_mutex> lock(t.mutex);
    const auto it = t.choices.find(key);
    if (it != t.choices.end()) entry = it->second.get();
  }
  if (entry != nullptr && !retime) return Kernel(entry->kernel.load(std::memory_order_relaxed));  // timed meanwhile
  std::unique_ptr<Choice> fresh;
  if (entry == nullptr) {
    fresh = std::make_unique<Choice>();
    fresh->us.fill(std::numeric_limits<double>::quiet_NaN());
    fresh->kernels = kernels;
    entry = fresh.get();
  }
  entry->kernels = measure(g, b_constant, entry->kernels, entry->us);
  ++entry->timings;
  decide(*entry, g);
  const Kernel kernel = Kernel(entry->kernel.load(std::memory_order_relaxed));
  if (fresh) {
    std::unique_lock<std::shared_mutex> lock(t.mutex);
    if (t.mode == allowed) t.choices.emplace(key, std::move(fresh));  // unless set_gemm_backend changed the rules meanwhile
  }
  return kernel;
}

std::string describe(const ShapeKey& key) {
  const auto [batch, m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c, trans_a, trans_b, b_constant, threads,
              nested] = key;
  std::string text = batch > 1 ? std::to_string(batch) + " x " : "";
  text += "[" + std::to_string(m) + ", " + std::to_string(k) + "]" + (trans_a ? "^T" : "") + " @ [" +
          std::to_string(k) + ", " + std::to_string(n) + "]" + (trans_b ? "^T" : "");
  text += " lda " + std::to_string(lda) + " ldb " + std::to_string(ldb) + " ldc " + std::to_string(ldc);
  if (batch > 1) {
    text += " strides " + std::to_string(stride_a) + "/" + std::to_string(stride_b) + "/" + std::to_string(stride_c);
  }
  text += b_constant ? ", B constant" : "";
  text += ", " + std::to_string(threads) + (threads == 1 ? " thread" : " threads");
  return text + (nested ? ", in a parallel region" : "");
}

// A batch of GEMMs that share B and whose A and C rows run on from one batch into the next is one
// GEMM of batch * m rows: codegen passes a Linear on [batch, rows, features] that way (the weight
// with batch stride 0). One call threads better and packs B once, for any kernel.
GemmArgs fold_shared_b(GemmArgs g) {
  if (g.batch > 1 && g.stride_b == 0 && g.trans_a == 0 && g.stride_a == g.m * g.lda && g.stride_c == g.m * g.ldc) {
    g.m *= g.batch;
    g.batch = 1;
    g.stride_a = g.stride_c = 0;
  }
  return g;
}

}  // namespace

void gemm(GemmArgs g, PackedWeights* weights) {
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0) return;
  g = fold_shared_b(g);
  // k == 0 and alpha == 0 leave C = beta * C, BLAS's reading (A and B unread, so a NaN in them
  // stays out); oneDNN's matmul would return early without touching C.
  if (g.k == 0 || g.alpha == 0.0f) {
    mkl_gemm(g, weights);
    return;
  }
  const bool b_constant = weights != nullptr && (g.batch == 1 || g.stride_b == 0) && weights->is_constant(g.b);
  run(choose(g, b_constant), g, weights);
}

void set_gemm_backend(const std::string& mode) {
  const unsigned kernels = mode.empty() ? mode_from_env() : parse_mode(mode);
  Table& t = table();
  std::lock_guard<std::mutex> measuring(t.measuring);  // no timing is writing into an entry
  std::unique_lock<std::shared_mutex> lock(t.mutex);
  t.mode = kernels;
  t.choices.clear();
}

std::vector<GemmChoice> gemm_choices() {
  Table& t = table();
  std::lock_guard<std::mutex> measuring(t.measuring);  // the timings are written under this lock
  std::shared_lock<std::shared_mutex> lock(t.mutex);
  std::vector<GemmChoice> result;
  for (const auto& [key, choice] : t.choices) {
    GemmChoice entry{describe(key), kKernelNames[choice->kernel.load(std::memory_order_relaxed)], {},
                     choice->timings};
    for (int k = 0; k < kKernels; ++k) {
      if (!std::isnan(choice->us[k])) entry.microseconds.emplace_back(kKernelNames[k], choice->us[k]);
    }
    result.push_back(std::move(entry));
  }
  return result;
}

}  // namespace blade
