// The BladeRuntime table (blade_abi.h) this process hands to every engine call.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "blade_abi.h"

namespace blade {

// One static instance: GEMM through MKL's BLAS or libtorch's oneDNN, timed per call shape (gemm.h),
// convolution through oneDNN/ATen, loops on ATen's intra-op thread pool.
const BladeRuntime* runtime();

// Which GEMM kernels the runtime may time against each other and use (BLADE_GEMM's values: "auto",
// "mkl", "onednn", "onednn-matmul", "onednn-packed"; "" reads BLADE_GEMM again). Process-wide; forgets
// the choices made so far. Throws on an unknown value.
void set_gemm_backend(const std::string& mode);

// The GEMM kernel chosen per call shape so far in this process, and what each candidate took.
struct GemmChoice {
  std::string shape;
  std::string kernel;
  std::vector<std::pair<std::string, double>> microseconds;  // per candidate sampled: its best call (per flop)
  int timings;  // the calls sampled (each ran one candidate)
  bool settled;  // false: still sampling (its calls run the candidates in turn)
};
std::vector<GemmChoice> gemm_choices();

// A new engine call begins: GEMM shapes met from now on count as new (gemm_choice.cpp compiles a
// oneDNN primitive for a shape only from the second call that meets it).
void gemm_new_call();

// How many GEMMs each kernel ("mkl", "onednn-matmul", "onednn-packed", "panels") ran in this
// process: for tests of which kernel a call runs.
int64_t gemm_kernel_calls(const std::string& kernel);

// Weights packed into any engine's PackedWeights in this process so far: for tests of when packing happens.
int64_t packed_weight_count();

// Convolution shapes whose way (Winograd or not, the patch kernel or oneDNN) one timing decided in
// this process so far: for tests of when a shape is timed.
int64_t timed_conv_shapes();

// Whether the patch kernel is timed against oneDNN where it may lose (patch_marginal; default) or
// always taken where it applies: for tests of the patch kernel itself.
void set_patch_timing(bool on);

// Whether oneDNN's kernels (a primitive JIT-compiled and cached per exact shape) may run the GEMMs
// of engines with run-time sizes where the panels kernel can. Off by default: such an engine meets
// a new shape on almost every call and oneDNN's caches kept 1-5 MiB for each, so a server's memory
// grew with every new shape. Process-wide; forgets the choices made so far. For tests and A/B
// measurements.
void set_gemm_jit_at_run_time_sizes(bool allowed);

// Whether the runtime's conv may use its own kernel "winograd" (winograd.h), "depthwise"
// (depthwise.h) or "pointwise" (conv_gemm.h) where it applies (each on by default), and how often
// it ran one. Process-wide: for tests and A/B measurements against oneDNN's convolution.
void set_conv_kernel_enabled(const std::string& kernel, bool enabled);
int64_t conv_kernel_calls(const std::string& kernel);

// GEMMs with at most `max_rows` rows are split into column blocks across ATen's threads
// (runtime.cpp); 0 never splits, a negative value restores the default (32). Process-wide: for
// tests and A/B measurements against MKL's own threading.
void set_gemm_column_split_rows(int64_t max_rows);

// Weights the runtime re-laid out once for a faster kernel (e.g. oneDNN's blocked convolution
// weights), owned by one Engine and keyed by the constant's address and the call's arguments. The
// runtime only packs operands that lie inside the engine's constants: those never change, while
// scratch memory at the same address holds different values on every call. Engines whose
// constants share a storage share its packs (runtime.cpp, SharedPacks). Thread-safe.
class PackedWeights {
 public:
  using Key = std::vector<int64_t>;  // the operand's address first, then whatever shapes the packing

  PackedWeights() = default;
  ~PackedWeights();  // defined in the runtime library only (blade._C defines none of it)

  // Thread-safe: the runtime also registers buffers it derives from constants (a Winograd
  // weight) while other threads look up.
  void add_constant(const void* data, size_t bytes);
  bool is_constant(const void* data) const;
  // Whether the owning engine has run-time sizes: its GEMMs' shapes change from call to call.
  void set_shapes_vary(bool vary) { shapes_vary_ = vary; }
  bool shapes_vary() const { return shapes_vary_; }
  // The packed form under `key`, made by `pack` on first use.
  at::Tensor get(const Key& key, const std::function<at::Tensor()>& pack);
  // Whether a packed form under `key` exists already.
  bool has(const Key& key);

 private:
  std::vector<std::pair<uintptr_t, uintptr_t>> constant_ranges_;  // [begin, end) byte addresses
  mutable std::shared_mutex ranges_mutex_;
  std::mutex mutex_;
  std::map<Key, at::Tensor> packed_;
  bool shapes_vary_ = false;
};

// While alive, runtime callbacks made on this thread may pack weights into `weights` (nullptr: no
// packing). Restores the previous scope on exit, so nested engine calls are fine.
class PackingScope {
 public:
  explicit PackingScope(PackedWeights* weights);
  ~PackingScope();
  PackingScope(const PackingScope&) = delete;
  PackingScope& operator=(const PackingScope&) = delete;

 private:
  PackedWeights* previous_;
};

// Packs, as an engine with run-time sizes (weights->shapes_vary()) loads, its weight GEMMs' B
// (blade_engine_weight_gemms; each B lies inside the engine's constants) for the runtime's panels
// kernel where BLADE_GEMM lets it run them: such an engine's GEMMs run that kernel (a settled
// choice, or while a new bucket of shapes samples its candidates), and packing at first use made
// a first call at a new shape up to 3x a settled one. A static engine packs on first use, for the
// kernel its timing chose. Either way the GEMM runtime's one-time setup runs here, not in a call.
void pack_weight_gemms(const BladeWeightGemm* gemms, int32_t count, const void* const* constants,
                       PackedWeights* weights);

}  // namespace blade
