// Which kernel runs a GEMM: chosen per process and bucket of call shapes by timing the candidates
// on the calls' own operands, not by CPU vendor (MKL 2024 is 2x slower than oneDNN on AMD EPYC
// with AVX-512, and may well win on Intel; a few-row GEMM may prefer MKL's column split either
// way). A bucket is sizes rounded up to powers of two, and its choice is made by timing its first
// calls themselves, each running one candidate: an engine with run-time sizes meets a new row
// count on almost every call, and a separate timing per shape (50-300 ms for a model's GEMMs)
// made every first call at a new shape a stall. BLADE_GEMM narrows the candidates (README "GEMM
// backend"); gemm_choices() reports the choices.
#include <ATen/Parallel.h>
#include <ATen/ops/full.h>

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
#include <set>
#include <shared_mutex>
#include <string>
#include <vector>

#include "gemm.h"

namespace blade {
namespace {

enum Kernel { kMkl, kOnednnMatmul, kOnednnPacked, kPanels, kKernels };
constexpr std::array<const char*, kKernels> kKernelNames = {"mkl", "onednn-matmul", "onednn-packed", "panels"};
constexpr unsigned bit(Kernel k) { return 1u << k; }
// Kernels whose first call at an exact shape JIT-compiles (oneDNN makes a primitive per shape, a
// few hundred us to ms each): they run at a shape only from the second engine call that meets it,
// so a call at a new shape never waits on a compiler. MKL and the panels kernel have no per-shape
// setup (their weight packing is per weight, once).
constexpr unsigned kJitKernels = bit(kOnednnMatmul) | bit(kOnednnPacked);
constexpr bool jits(int k) { return (kJitKernels >> k) & 1u; }

std::array<std::atomic<int64_t>, kKernels> kernel_calls{};  // per kernel, for tests (gemm_kernel_calls)

// Engine calls so far (gemm_new_call): a shape met in an earlier call is one a JIT kernel may compile for.
std::atomic<uint64_t> call_epoch{1};

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
// kernels thread; the candidates (last) differ between engines with and without run-time sizes.
using ShapeKey = std::array<int64_t, 16>;

ShapeKey exact_key(const GemmArgs& g, bool b_constant, unsigned kernels) {
  return {g.batch, g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.stride_a, g.stride_b, g.stride_c,
          g.trans_a != 0, g.trans_b != 0, b_constant, at::get_num_threads(), at::in_parallel_region(), kernels};
}

// The smallest power of two >= x (x >= 1).
int64_t bucket(int64_t x) {
  int64_t b = 1;
  while (b < x) b <<= 1;
  return b;
}

// The bucket of shapes one choice serves: batch, m, n and k rounded up to powers of two (a
// kernel's speed ranking changes over factors of the size, not from one row count to the next),
// a leading dimension or batch stride as "dense" (-1: rows packed edge to edge, which is what
// changes with the sizes in an engine with run-time dims) or else rounded up too. The shapes of a
// bucket share its calls' samples and its choice (a static engine's shape is the only one of its
// buckets, so its choice is its own).
ShapeKey bucket_key(const GemmArgs& g, bool b_constant, unsigned kernels) {
  const auto ld_class = [](int64_t ld, int64_t natural) { return ld == natural ? -1 : bucket(ld); };
  const auto stride_class = [](int64_t stride, int64_t dense) {
    return stride == 0 ? 0 : stride == dense ? -1 : bucket(stride);
  };
  const int64_t a_rows = g.trans_a ? g.k : g.m, b_rows = g.trans_b ? g.n : g.k;
  return {bucket(g.batch), bucket(g.m), bucket(g.n), bucket(g.k),
          ld_class(g.lda, g.trans_a ? g.m : g.k), ld_class(g.ldb, g.trans_b ? g.k : g.n), ld_class(g.ldc, g.n),
          stride_class(g.stride_a, a_rows * g.lda), stride_class(g.stride_b, b_rows * g.ldb),
          stride_class(g.stride_c, g.m * g.ldc), g.trans_a != 0, g.trans_b != 0, b_constant,
          at::get_num_threads(), at::in_parallel_region(), kernels};
}

// B constant: the weight whose calls sample one candidate. Each candidate samples on a weight of
// its own where the bucket has several, so one engine call samples every candidate and each
// candidate packs one weight only (the others wait for the winner). One weight sampling them all in
// turn settled a bucket in 4x the engine calls, and meanwhile the other weights ran a pack-free
// kernel: GPT-2 small's 24 weights of [128, 768] @ [768, 2304|3072] ran 23 of them 2x slower for
// its first 24 calls (102 ms a call, 65 ms settled).
struct Sampler {
  const float* b = nullptr;        // the weight
  uint64_t call = 0;               // the engine call (call_epoch) that last ran it
  std::set<const float*> since;    // the bucket's other weights called since it last ran
};

// What the calls of one bucket of shapes measured, and the kernel they chose. The kernel is read
// without any lock on every call once settled; until then `mutex` guards the samples.
struct Choice {
  std::atomic<int> kernel{kMkl};
  std::atomic<bool> settled{false};
  std::mutex mutex;
  unsigned kernels = 0;                     // the candidates still sampled (a oneDNN kernel that refused is dropped)
  unsigned rejected = 0;                    // candidates sampled no more for trailing the leader; they still run
  int first = kMkl;                         // sampled first: a neighbouring bucket's choice
  int neighbours_without_jit = -1;          // that bucket's best kernel without JIT (-1: no settled neighbour)
  std::array<int, kKernels> issued{};       // calls handed to each candidate to sample
  std::array<int, kKernels> samples{};      // of those, recorded (first calls at a shape are not)
  std::array<double, kKernels> ns_per_flop;  // per candidate: its best sample; NaN: none yet
  std::array<double, kKernels> us;          // that sample's call, us
  double bytes_per_flop = 0;                // of the latest sample: operand bytes / flops
  ShapeKey sampled{};                       // the exact shape of the latest sample
  std::array<Sampler, kKernels> samplers;   // B constant: per candidate, the weight whose calls sample it
  std::set<std::array<int64_t, 4>> ran;     // (kernel, m, n, k) run so far: a repeat is warm
  std::array<int, kKernels> cold{};         // first calls (packing, JIT-compiling) left unrecorded
  std::map<ShapeKey, uint64_t> met;         // exact shapes of the bucket -> the engine call that first met it
};

// At most this many exact shapes a bucket remembers (a bucket spans up to 2x per dim); when full it
// forgets them all, which only makes the next calls at them run a kernel that needs no JIT once more.
constexpr size_t kMaxShapesMet = 512;

// Whether a JIT kernel may run at this exact shape: an earlier engine call met it (choice.mutex held).
bool met_before_locked(Choice& choice, const ShapeKey& exact) {
  const uint64_t now = call_epoch.load(std::memory_order_relaxed);
  if (choice.met.size() >= kMaxShapesMet && choice.met.count(exact) == 0) choice.met.clear();
  const auto [it, fresh] = choice.met.try_emplace(exact, now);
  return !fresh && it->second < now;
}

// The nearest settled neighbour's best kernel without JIT, if it can run here; else -1.
int settled_neighbours_locked(const Choice& choice) {
  const int neighbours = choice.neighbours_without_jit;
  return neighbours >= 0 && ((choice.kernels | choice.rejected) & bit(Kernel(neighbours))) ? neighbours : -1;
}

// The kernel among `among` with the best sample per flop; -1 when none of them sampled.
int fastest_sampled_locked(const Choice& choice, unsigned among) {
  int best = -1;
  for (int k = 0; k < kKernels; ++k) {
    if (!(among & bit(Kernel(k))) || std::isnan(choice.ns_per_flop[k])) continue;
    if (best < 0 || choice.ns_per_flop[k] < choice.ns_per_flop[best]) best = k;
  }
  return best;
}

// The fastest kernel without JIT by the bucket's samples, else by its nearest settled neighbour's;
// -1 when neither sampled one.
int measured_without_jit_locked(const Choice& choice) {
  const int best = fastest_sampled_locked(choice, (choice.kernels | choice.rejected) & ~kJitKernels);
  return best >= 0 ? best : settled_neighbours_locked(choice);
}

// The kernel that needs no JIT a call at a new exact shape runs: the measured one, else the one
// sampled first, the panels kernel, MKL; -1 when every candidate JITs (BLADE_GEMM=onednn). A
// candidate rejected for trailing a JIT leader still counts: it is slower, not unable (it was
// once left out, and a new shape in a bucket whose MKL and panels lost by 1.5x JIT-compiled).
int without_jit_locked(const Choice& choice) {
  const int measured = measured_without_jit_locked(choice);
  if (measured >= 0) return measured;
  const unsigned runnable = choice.kernels | choice.rejected;
  if (!jits(choice.first) && (runnable & bit(Kernel(choice.first)))) return choice.first;
  for (const Kernel k : {kPanels, kMkl}) {
    if (runnable & bit(k)) return k;
  }
  return -1;
}

struct Table {
  std::shared_mutex mutex;
  std::optional<unsigned> mode;  // allowed kernels; read from BLADE_GEMM on first use
  std::map<ShapeKey, std::unique_ptr<Choice>> choices;
  // set_gemm_backend's forgotten entries: a call may still be sampling into one (calls hold an
  // entry without the table's lock), so they are kept, not freed. Tests and A/B runs only.
  std::vector<std::unique_ptr<Choice>> forgotten;
  std::atomic<bool> jit_at_run_time_sizes{false};  // set_gemm_jit_at_run_time_sizes
};

Table& table() {
  static Table t;
  return t;
}

bool table_jit_at_run_time_sizes() { return table().jit_at_run_time_sizes.load(std::memory_order_relaxed); }

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
// call), the time MKL needs for about 2 MFLOP even on its slow path: below that "auto" takes a
// kernel untimed. That also spares tiny GEMMs a timing whose outcome would be noise, and keeps their
// rounding the same in every process. The kernel is the panels one where B is a constant it can
// run, else MKL: on GPT-2/BERT's weights ([256|1024, 256|768]) at 1-8 rows the panels kernel took
// 0.4-1.0x MKL's time (packed or unpacked; 1 thread CPU time, 2 threads wall), except 1 row of
// [256, 256] at 2 threads (up to 1.15x, about 0.5 us), and
// in an engine with run-time sizes its pack exists from load, while MKL's first call on a weight
// packed it once more (5.5-6.8 MiB allocated per weight, whatever its size: a served GPT-2 4L/256's
// first seq-1 call grew the heap by 85 MiB).
constexpr double kTinyFlops = 2e6;

// The kernels that can run g (k > 0 and alpha != 0 here), narrowed to `allowed`. A oneDNN mode
// falls back to oneDNN's matmul where its kernel does not apply, and to MKL where oneDNN does not
// run on this CPU.
unsigned candidates(const GemmArgs& g, bool b_constant, bool shapes_vary, unsigned allowed) {
  unsigned applicable = bit(kMkl);
  const bool tiny = 2.0 * g.batch * g.m * g.n * g.k < kTinyFlops;
  if (tiny && b_constant && (allowed & bit(kPanels)) && panels_applies(g, true)) return bit(kPanels);
  if (tiny && (allowed & bit(kMkl))) return bit(kMkl);
  if (onednn_usable()) {
    applicable |= bit(kOnednnMatmul);
    if (g.batch == 1 && b_constant) applicable |= bit(kOnednnPacked);
  }
  if (panels_applies(g, b_constant)) applicable |= bit(kPanels);
  // An engine with run-time sizes meets a new exact shape on almost every call, and oneDNN's
  // caches keep a primitive (1-5 MiB with its JIT code) for each: a server's memory grew with every
  // new shape. Where the panels kernel (no per-shape state) can run the GEMM and the mode allows it,
  // oneDNN is no candidate there. Measured on BERT/GPT-2's GEMMs with run-time rows (1 thread), the
  // panels kernel matched or beat oneDNN on the constant weights; on attention's computed operands
  // (B^T packed per call in 16x16 register transposes) it was 0-7% behind oneDNN on QK^T and 5-30%
  // ahead on P @ V at GPT-2's 4x512 and 16x128; the whole models within noise.
  if (shapes_vary && (applicable & allowed & bit(kPanels)) && !table_jit_at_run_time_sizes()) {
    applicable &= ~kJitKernels;
  }
  unsigned chosen = applicable & allowed;
  if (chosen == 0) chosen = applicable & (allowed & kOnednnKernels ? bit(kOnednnMatmul) : bit(kMkl));
  return chosen != 0 ? chosen : bit(kMkl);
}

// MKL packs a constant B for one row count (its packed format is made for the GEMM's exact
// sizes), so an engine with run-time sizes would keep a copy of every weight for each row count
// it meets. In a static engine MKL packs a weight for the row count of its first MKL call (its
// shape's); other row counts run unpacked. An engine with run-time sizes never lets MKL pack: its
// weights' one packed copy is the panels kernel's, made at load (pack_weight_gemms), which serves
// every row count; an MKL pack beside it would be a second copy for one row count (5.5-6.8 MiB
// allocated per weight), made by whichever call first ran MKL on the weight (a tiny GEMM, a bucket's
// sample). MKL ran every other row count unpacked anyway, and its samples now time what it runs.
// A GEMV (one row) packs nothing either, nor claims the weight's pack: it reads each weight element
// once, and MKL's packed path streamed a decode step's [1, 896] @ [896, 9728]^T 13% slower than its
// unpacked one (0.85 vs 0.75 ms, 2 threads), which already runs at the memory's speed.
constexpr int64_t kPackRowsTag = -3;  // PackedWeights key slot 1 (MKL: trans_b, Winograd: -1, oneDNN: -2)

PackedWeights* mkl_packing(const GemmArgs& g, PackedWeights* weights) {
  if (weights == nullptr || !weights->is_constant(g.b)) return weights;
  if (weights->shapes_vary() || (g.batch == 1 && g.m == 1)) return nullptr;
  const PackedWeights::Key key = {reinterpret_cast<int64_t>(g.b), kPackRowsTag, g.trans_b, g.n, g.k, g.ldb};
  const at::Tensor rows = weights->get(key, [&] { return at::full({1}, g.m, at::kLong); });
  return rows.const_data_ptr<int64_t>()[0] == g.m ? weights : nullptr;
}

void run(Kernel kernel, const GemmArgs& g, PackedWeights* weights) {
  kernel_calls[kernel].fetch_add(1, std::memory_order_relaxed);
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
      mkl_gemm(g, mkl_packing(g, weights));
  }
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The choice is made on the calls themselves: until a bucket is settled, each call runs the
// candidate with the fewest samples on its own operands and times it (the result is the call's
// result, every candidate computes the same GEMM), so no call waits on a timing. A kernel's first
// call at a shape packs B or JIT-compiles: it is not a sample (unless every call is a new shape:
// after kMaxSamples such calls, they count). With a constant B each candidate samples on one
// weight (Sampler), and the bucket's other weights run pack-free kernels until it settles: a
// weight is packed by its candidate and the winner only, not by each candidate. Each candidate
// keeps its best call per flop (shapes of a bucket differ in size; the best of several drops a call
// that waited on a thread preempted by another process). kSamples calls each settle the bucket
// unless the winner's best looks like a stall (over 1 ms at under 20 GFLOP/s and under 10 GB/s of
// operands read and written, as when other jobs hold every core): then sampling goes on, up to
// kMaxSamples calls each. A GEMV is memory-bound: a decode step's [1, 2048] @ [2048, 11264]^T
// streams its 92 MB weight at ~35 GB/s, 20 GFLOP/s, and without the bandwidth test it sampled 12
// calls a candidate, its other weights running pack-free meanwhile.
constexpr int kSamples = 5, kMaxSamples = 12;
// Engine calls (of any engine, process-wide) after which a sampling weight that did not run is
// replaced: far more than the engine calls one model call makes.
constexpr uint64_t kSamplerIdleCalls = 64;
// A weight of the bucket called a second time since the sampling weight last ran shows the
// calls cycling without it: gone (its pack freed, a new one made at another address) even where
// no engine call is counted (a conv's packs in _testing.conv lived for one call: which process
// then settled depended on whether the next pack landed at the old address, 1 in 3 ran MKL's
// pack-free kernel on every Winograd GEMM for good, 2x slower). At most this many weights noted.
constexpr size_t kMaxWeightsNoted = 512;
constexpr double kSuspectUs = 1000, kSuspectGflops = 20, kSuspectGBps = 10;
// A candidate whose best of kRejectSamples calls is over kRejectRatio times the leader's best cannot
// win: it is sampled no more. Sampled to kSamples, such a candidate (MKL on attention's batched
// GEMMs trails the panels kernel 2-5x) made a new bucket's first calls 2-2.5x the settled call.
constexpr int kRejectSamples = 2;
constexpr double kRejectRatio = 1.5;

double flops(const GemmArgs& g) { return 2.0 * g.batch * g.m * g.n * g.k; }

// The candidates whose sampling weight b is (choice.mutex held). A sampling weight's engine may
// never run again (its module was freed, or dynamo recompiled the graph into a new one with its own
// weights): after kSamplerIdleCalls engine calls without it, or once another weight ran twice since
// it last did, the weight at hand samples its candidate instead, or the bucket would never settle
// and every weight would run the unmeasured pack-free kernel for good. A weight that samples
// nothing takes a candidate from a weight that samples several (the first weight met takes them
// all, the bucket's next weights one each), the one that weight has issued the fewest calls to.
unsigned samples_on_locked(Choice& choice, const float* b) {
  const uint64_t now = call_epoch.load(std::memory_order_relaxed);
  std::map<const float*, int> shared;  // sampling weight -> how many candidates it samples
  unsigned held = 0;
  for (int k = 0; k < kKernels; ++k) {
    if (!(choice.kernels & bit(Kernel(k)))) continue;
    Sampler& sampler = choice.samplers[k];
    if (sampler.b != b) {
      if (sampler.since.size() >= kMaxWeightsNoted) sampler.since.clear();
      const bool cycled = !sampler.since.insert(b).second;
      if (sampler.b == nullptr || now - sampler.call > kSamplerIdleCalls || cycled) sampler.b = b;
    }
    if (sampler.b == b) {
      sampler.call = now;
      sampler.since.clear();
      held |= bit(Kernel(k));
    }
    ++shared[sampler.b];
  }
  if (held != 0) return held;
  int taken = -1;
  for (int k = 0; k < kKernels; ++k) {
    if ((choice.kernels & bit(Kernel(k))) && shared[choice.samplers[k].b] > 1 &&
        (taken < 0 || choice.issued[k] < choice.issued[taken])) {
      taken = k;
    }
  }
  if (taken < 0) return 0;
  Sampler& sampler = choice.samplers[taken];
  sampler.b = b;
  sampler.call = now;
  sampler.since.clear();
  return bit(Kernel(taken));
}

// The kernel this call samples; -1: the bucket has settled meanwhile, -2: the call is not on a
// weight that samples (samples_on_locked), at a shape met before: run a pack-free kernel, of the
// library of `measured`, the leader so far (-1: none yet). A pack-free MKL call ran GPT-2's
// [128, 768] @ [768, 3072] in 1.5 ms, oneDNN's matmul in 3.1 (an Intel Xeon; on an AMD EPYC oneDNN
// leads).
// -3: the call is not on such a weight and its shape is new to the bucket: run `measured` (the
// measured kernel without JIT, -1: none), which packs that weight only as the likely winner.
// `shapes_vary`: an engine with run-time sizes. Where none of its candidates JITs (oneDNN is no
// candidate there where the panels kernel runs), whether an earlier call met the exact shape decides
// nothing (its non-sampling weights run the panels kernel either way, run_chosen), so the bucket does
// not remember the shapes: a server's new row counts filled each bucket's `met` with up to
// kMaxShapesMet entries (about 90 KiB) for nothing.
int next_sample(Choice& choice, const GemmArgs& g, bool b_constant, bool shapes_vary, const ShapeKey& exact,
                int& measured) {
  std::lock_guard<std::mutex> lock(choice.mutex);
  if (choice.settled.load(std::memory_order_relaxed)) return -1;
  const bool any_jit = ((choice.kernels | choice.rejected) & kJitKernels) != 0;
  const bool met = !shapes_vary || any_jit ? met_before_locked(choice, exact) : false;
  unsigned held = choice.kernels;  // the candidates this call may sample
  if (b_constant) {
    held = samples_on_locked(choice, g.b);
    // At a new shape a weight whose candidates all JIT samples nothing (the call compiles nothing).
    const bool runnable = met || (held & ~kJitKernels) != 0;
    if (held == 0 || !runnable) {
      // In an engine with run-time sizes the evidence for the other weights is a settled neighbour's
      // (its samples are many; the bucket's own first ones are single calls, see run_chosen).
      if (met) {
        measured = fastest_sampled_locked(choice, (1u << kKernels) - 1);  // the leader so far, any kernel
        return -2;
      }
      measured = shapes_vary ? settled_neighbours_locked(choice) : measured_without_jit_locked(choice);
      return -3;
    }
  }
  int pick = -1;
  const auto fewer = [&](int k, int than) {
    return choice.samples[k] != choice.samples[than] ? choice.samples[k] < choice.samples[than]
                                                     : choice.issued[k] < choice.issued[than];
  };
  for (const bool allow_jit : {met, true}) {  // at a new shape the kernels without JIT, if any
    for (int i = 0; i < kKernels; ++i) {
      const int k = (choice.first + i) % kKernels;  // ties: the likely winner first, the call's own result
      if ((held & bit(Kernel(k))) && (allow_jit || !jits(k)) && (pick < 0 || fewer(k, pick))) pick = k;
    }
    if (pick >= 0) break;
  }
  ++choice.issued[pick];
  return pick;
}

void settle_if_sampled(Choice& choice) {
  const int winner = fastest_sampled_locked(choice, choice.kernels);
  int fewest = kMaxSamples;
  if (winner < 0) return;
  for (int k = 0; k < kKernels; ++k) {
    if (!(choice.kernels & bit(Kernel(k)))) continue;
    if (choice.samples[k] >= kRejectSamples && choice.ns_per_flop[k] > kRejectRatio * choice.ns_per_flop[winner]) {
      choice.kernels &= ~bit(Kernel(k));
      choice.rejected |= bit(Kernel(k));
      continue;
    }
    fewest = std::min(fewest, choice.samples[k]);
  }
  choice.kernel.store(winner, std::memory_order_relaxed);  // the leader so far serves other threads meanwhile
  const double gflops = 1.0 / choice.ns_per_flop[winner];
  const bool suspect = choice.us[winner] > kSuspectUs && gflops < kSuspectGflops &&
                       gflops * choice.bytes_per_flop < kSuspectGBps;
  if (fewest >= kMaxSamples || (fewest >= kSamples && !suspect)) {
    choice.ran.clear();
    choice.settled.store(true, std::memory_order_release);
  }
}

// `shapes_vary`: the call is an engine's with run-time sizes. There a kernel without JIT has no setup
// per shape (MKL never packs, the panels kernel's pack was made at load), so only its first call in
// the bucket is cold: its first call at each new row count was not a sample either, and a server
// meets a new row count on almost every call, so a bucket ran up to kMaxSamples cold calls per
// candidate before its first sample (a served GPT-2 recorded no sample but at 16x512 over the grid
// and 30 random shapes), running MKL, 1.4-2.2x slower there, in half of its sampling calls.
void record(Choice& choice, int kernel, const GemmArgs& g, const ShapeKey& exact, double seconds, bool shapes_vary) {
  std::lock_guard<std::mutex> lock(choice.mutex);
  const bool setup_per_shape = !shapes_vary || jits(kernel);
  const std::array<int64_t, 4> ran = {kernel, setup_per_shape ? g.m : -1, g.n, g.k};
  if (choice.ran.insert(ran).second && choice.cold[kernel] < kMaxSamples) {
    ++choice.cold[kernel];
    return;
  }
  const double ns_per_flop = seconds * 1e9 / flops(g);
  choice.bytes_per_flop = sizeof(float) * static_cast<double>(g.batch) * (g.m * g.k + g.k * g.n + g.m * g.n) / flops(g);
  ++choice.samples[kernel];
  if (!(choice.ns_per_flop[kernel] <= ns_per_flop)) {  // also replaces NaN (no sample yet)
    choice.ns_per_flop[kernel] = ns_per_flop;
    choice.us[kernel] = seconds * 1e6;
  }
  choice.sampled = exact;
  settle_if_sampled(choice);
}

// A candidate that threw: oneDNN's refusals are argument checks made before it writes C, so the
// call can go on with the others; MKL/ATen take every GEMM of the contract, their errors are real.
void drop(Choice& choice, int kernel) {
  std::lock_guard<std::mutex> lock(choice.mutex);
  choice.kernels &= ~bit(Kernel(kernel));
  if (choice.kernels == 0) choice.kernels = bit(kMkl);
  settle_if_sampled(choice);
}

// The nearest settled bucket of the same GEMM but for the row count (half or twice the rows, then
// a quarter or four times, ...): the nearest evidence of which kernel wins at these sizes. Sets
// choice.first to its kernel (else the panels kernel, the one written for a constant B, else the
// first candidate) and choice.neighbours_without_jit to its best kernel without JIT.
constexpr int kNeighbourOctaves = 12;

void take_neighbours_choice(const Table& t, ShapeKey key, Choice& choice) {
  const int64_t rows = key[1];
  for (int octave = 1; octave <= kNeighbourOctaves; ++octave) {
    for (const int64_t neighbour : {rows >> octave, rows << octave}) {
      key[1] = neighbour;
      const auto it = neighbour >= 1 ? t.choices.find(key) : t.choices.end();
      if (it == t.choices.end() || !it->second->settled.load(std::memory_order_acquire)) continue;
      const int kernel = it->second->kernel.load(std::memory_order_relaxed);
      if (!(choice.kernels & bit(Kernel(kernel)))) continue;
      std::lock_guard<std::mutex> lock(it->second->mutex);  // order: the table's lock, then a bucket's
      choice.first = kernel;
      choice.neighbours_without_jit = measured_without_jit_locked(*it->second);
      return;
    }
  }
  choice.first = kMkl;
  if (choice.kernels & bit(kPanels)) {
    choice.first = kPanels;
    return;
  }
  for (int k = kKernels - 1; k >= 0; --k) {
    if (choice.kernels & bit(Kernel(k))) choice.first = k;
  }
}

// The bucket's entry, made on its first call; nullptr when set_gemm_backend changed the rules.
Choice* entry_for(const ShapeKey& key, unsigned kernels, unsigned allowed) {
  Table& t = table();
  {
    std::shared_lock<std::shared_mutex> lock(t.mutex);
    const auto it = t.choices.find(key);
    if (it != t.choices.end()) return it->second.get();
  }
  std::unique_lock<std::shared_mutex> lock(t.mutex);
  if (t.mode != allowed) return nullptr;
  auto& slot = t.choices[key];
  if (!slot) {
    slot = std::make_unique<Choice>();
    slot->kernels = kernels;
    take_neighbours_choice(t, key, *slot);
    slot->ns_per_flop.fill(std::numeric_limits<double>::quiet_NaN());
    slot->us.fill(std::numeric_limits<double>::quiet_NaN());
  }
  return slot.get();
}

// Runs g with `kernel`; a oneDNN kernel that refuses these operands (its checks come before it
// writes C; a bucket's choice was made on other shapes of the bucket) leaves the call to MKL.
void run_or_mkl(Kernel kernel, const GemmArgs& g, PackedWeights* weights) {
  if (kernel == kMkl) return run(kMkl, g, weights);
  try {
    run(kernel, g, weights);
  } catch (const c10::Error&) {
    run(kMkl, g, weights);
  }
}

// A settled bucket's kernel for this call: at an exact shape no earlier engine call met, a JIT
// winner gives way to the best kernel without JIT (the next call at the shape compiles).
Kernel settled_kernel(Choice& choice, const ShapeKey& exact) {
  const int kernel = choice.kernel.load(std::memory_order_relaxed);
  if (!jits(kernel)) return Kernel(kernel);
  std::lock_guard<std::mutex> lock(choice.mutex);
  if (met_before_locked(choice, exact)) return Kernel(kernel);
  const int instead = without_jit_locked(choice);
  return Kernel(instead >= 0 ? instead : kernel);
}

// Runs g with the bucket's kernel, or as one of its samples while it is not settled.
void run_chosen(const GemmArgs& g, bool b_constant, bool shapes_vary, PackedWeights* weights) {
  const unsigned allowed = allowed_kernels();
  const unsigned kernels = candidates(g, b_constant, shapes_vary, allowed);
  if ((kernels & (kernels - 1)) == 0) {  // one candidate: nothing to choose
    for (int k = 0; k < kKernels; ++k) {
      if (kernels & bit(Kernel(k))) return run(Kernel(k), g, weights);
    }
  }
  Choice* choice = entry_for(bucket_key(g, b_constant, kernels), kernels, allowed);
  if (choice == nullptr) return run(kMkl, g, weights);  // the mode changed under this call
  const ShapeKey exact = exact_key(g, b_constant, kernels);
  if (choice->settled.load(std::memory_order_acquire)) {
    return run_or_mkl(settled_kernel(*choice, exact), g, weights);
  }
  int measured = -1;
  const int kernel = next_sample(*choice, g, b_constant, shapes_vary, exact, measured);
  if (kernel == -1) return run_or_mkl(settled_kernel(*choice, exact), g, weights);
  // A weight that samples no candidate, already packed for the panels kernel (at load,
  // in an engine with run-time sizes; else by another bucket): panels packs nothing more and trails
  // MKL's pack-free kernel by 2-2.5x on BERT's row counts, so it runs there until the bucket
  // settles, unless the evidence says otherwise. In an engine with run-time sizes that evidence is
  // a settled neighbouring bucket's winner only (next_sample), not the bucket's own first samples:
  // single calls, where one noisy panels sample made MKL "measured" and every other weight ran it
  // until the bucket settled (1.4-2.2x slower on an AMD EPYC). Where MKL wins the neighbours (an
  // Intel Xeon, by 1.3x), the other weights ran the panels kernel through every new bucket's
  // sampling calls: a server's first ~10 calls at each new row bucket took up to 1.25x the settled call.
  const bool panels_ready = (kernels & bit(kPanels)) && panels_packed(g, weights);
  if ((kernel == -2 || (kernel == -3 && measured < 0)) && panels_ready) {
    return run(kPanels, g, weights);
  }
  if (kernel == -2) {  // packs nothing: oneDNN's matmul where oneDNN leads (or nothing sampled yet), else MKL
    const bool onednn = (kernels & bit(kOnednnMatmul)) && (measured < 0 || jits(measured));
    return run_or_mkl(onednn ? kOnednnMatmul : kMkl, g, nullptr);
  }
  if (kernel == -3) return measured >= 0 ? run(Kernel(measured), g, weights) : run(kMkl, g, nullptr);  // compiles nothing
  const auto start = std::chrono::steady_clock::now();
  try {
    run(Kernel(kernel), g, weights);
  } catch (const c10::Error&) {
    if (kernel == kMkl) throw;
    drop(*choice, kernel);
    return run(kMkl, g, weights);
  }
  record(*choice, kernel, g, exact, seconds_since(start), shapes_vary);
}

std::string describe(const ShapeKey& key, const ShapeKey& bucketed) {
  [[maybe_unused]] const auto [batch, m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c, trans_a, trans_b,
                               b_constant, threads, nested, kernels] = key;
  std::string text = batch > 1 ? std::to_string(batch) + " x " : "";
  text += "[" + std::to_string(m) + ", " + std::to_string(k) + "]" + (trans_a ? "^T" : "") + " @ [" +
          std::to_string(k) + ", " + std::to_string(n) + "]" + (trans_b ? "^T" : "");
  text += " lda " + std::to_string(lda) + " ldb " + std::to_string(ldb) + " ldc " + std::to_string(ldc);
  if (batch > 1) {
    text += " strides " + std::to_string(stride_a) + "/" + std::to_string(stride_b) + "/" + std::to_string(stride_c);
  }
  text += b_constant ? ", B constant" : "";
  text += ", " + std::to_string(threads) + (threads == 1 ? " thread" : " threads");
  text += nested ? ", in a parallel region" : "";
  std::string range;
  const char* names[] = {"batch", "rows", "columns", "depth"};
  for (int d = 0; d < 4; ++d) {
    const int64_t top = bucketed[d];
    range += std::string(range.empty() ? "" : ", ") + names[d] + " " +
             (top == 1 ? "1" : std::to_string(top / 2 + 1) + "-" + std::to_string(top));
  }
  return text + "; serves " + range;
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
  run_chosen(g, b_constant, weights != nullptr && weights->shapes_vary(), weights);
}

void pack_weight_gemms(const BladeWeightGemm* gemms, int32_t count, const void* const* constants,
                       PackedWeights* weights) {
  // The one-time probe whether oneDNN runs here (a oneDNN matmul and inner product, ~2 ms of setup)
  // happens at load too, not inside the process's first engine call (its first non-tiny GEMM).
  if (count > 0) onednn_usable();
  if (!weights->shapes_vary() || !(allowed_kernels() & bit(kPanels))) return;
  for (int32_t i = 0; i < count; ++i) {
    const BladeWeightGemm& w = gemms[i];
    GemmArgs g{};
    g.batch = g.m = 1;  // the pack is the same for any row count
    g.n = w.n;
    g.k = w.k;
    g.alpha = w.alpha;
    g.b = static_cast<const float*>(constants[w.constant]) + w.offset;
    g.ldb = w.ldb;
    g.trans_b = w.trans_b;
    if (panels_applies(g, true)) panels_pack(g, weights);
  }
}

void gemm_new_call() { call_epoch.fetch_add(1, std::memory_order_relaxed); }

int64_t gemm_kernel_calls(const std::string& kernel) {
  for (int k = 0; k < kKernels; ++k) {
    if (kernel == kKernelNames[k]) return kernel_calls[k].load(std::memory_order_relaxed);
  }
  TORCH_CHECK(false, "gemm_kernel_calls: unknown kernel ", kernel);
}

void set_gemm_backend(const std::string& mode) {
  const unsigned kernels = mode.empty() ? mode_from_env() : parse_mode(mode);
  Table& t = table();
  std::unique_lock<std::shared_mutex> lock(t.mutex);
  t.mode = kernels;
  for (auto& [key, choice] : t.choices) t.forgotten.push_back(std::move(choice));
  t.choices.clear();
}

void set_gemm_jit_at_run_time_sizes(bool allowed) {
  Table& t = table();
  std::unique_lock<std::shared_mutex> lock(t.mutex);
  t.jit_at_run_time_sizes.store(allowed, std::memory_order_relaxed);
  for (auto& [key, choice] : t.choices) t.forgotten.push_back(std::move(choice));
  t.choices.clear();
}

std::vector<GemmChoice> gemm_choices() {
  Table& t = table();
  std::shared_lock<std::shared_mutex> lock(t.mutex);
  std::vector<GemmChoice> result;
  for (const auto& [key, choice] : t.choices) {
    std::lock_guard<std::mutex> sampling(choice->mutex);
    int calls = 0;
    for (int k = 0; k < kKernels; ++k) calls += choice->samples[k];
    if (calls == 0) continue;  // its first call is still running
    GemmChoice entry{describe(choice->sampled, key), kKernelNames[choice->kernel.load(std::memory_order_relaxed)],
                     {}, calls, choice->settled.load(std::memory_order_acquire)};
    for (int k = 0; k < kKernels; ++k) {
      if (!std::isnan(choice->us[k])) entry.microseconds.emplace_back(kKernelNames[k], choice->us[k]);
    }
    result.push_back(std::move(entry));
  }
  return result;
}

}  // namespace blade
