// blade runtime ABI: the one header that generated engine code includes (besides the C++ standard
// library). An engine .so never links against torch: everything heavy (GEMM, convolution, threads) it asks of
// the runtime through the function table below, which the Engine (cpp/engine.cpp) fills with
// MKL/oneDNN/ATen-backed implementations (cpp/runtime.cpp). Test harnesses may fill it with their
// own (e.g. a serial, naive one).
//
// Operands that point into the engine's constants are read-only and never change: the runtime may
// re-lay them out once (packed GEMM weights, blocked convolution weights) and reuse that copy on
// every later call of the engine. Operands anywhere else (inputs, scratch) are read afresh each call.
//
// Bump BLADE_ABI_VERSION whenever BladeRuntime or the entry signature changes; the Engine refuses
// to load a .so whose blade_engine_abi_version() differs.
#pragma once
#include <cstdint>

#define BLADE_ABI_VERSION 10

extern "C" {

// A chunk [begin, end) of a parallel loop; ctx is the caller's closure.
typedef void (*blade_range_fn)(void* ctx, int64_t begin, int64_t end);

// The activation a convolution applies to its result (after bias and sum): `kind` is one of
// BLADE_ACTIVATION_*, and `lo`, `hi` are BLADE_ACTIVATION_CLAMP's bounds (unused by the others).
// Each computes exactly what the engine's unfused elementwise code computes for the same op.
struct BladeActivation {
  int32_t kind;
  float lo, hi;
};

// One step of a fused attention's score expression (BladeAttention): applied in order to each score
// s = q . k, exactly as the engine's unfused elementwise code computes it (BLADE_SCORE_* below).
// KEEP and ADD read `mask` (KEEP: bool as uint8, ADD: float32) at element (o, i, r, c), i.e. (outer
// batch, inner batch, query row, key), at mask + o * strides[0] + i * strides[1] + r * strides[2] +
// c * strides[3] (elements; a stride 0 broadcasts).
struct BladeScoreStep {
  int32_t kind;
  float value;
  const void* mask;
  int64_t strides[4];
};

// A fused attention (BladeRuntime::attention), per (o, i) in [0, outer) x [0, inner):
//   scores [m, n] = the steps applied to Q [m, d] @ K^T [d, n] (alpha 1)
//   P [m, n]      = per row x: e = exp(x - max(x)), e * (1 / sum(e)) (the engine's Softmax), a row
//                   whose max equals zero_rows_max set to 0 instead when zero_rows != 0
//   out [m, dv]   = P @ V [n, dv]
// Each operand is read like sgemm's A/B (ld, trans; kt is K^T's op(B) [d, n], v is op(B) [n, dv])
// at ptr + o * strides[0] + i * strides[1]; out's rows are ldo apart, its columns dense.
struct BladeAttention {
  int64_t outer, inner, m, n, d, dv;
  const float* q;
  int64_t ldq, q_strides[2];
  int32_t trans_q;
  const float* kt;
  int64_t ldk, k_strides[2];
  int32_t trans_k;
  const float* v;
  int64_t ldv, v_strides[2];
  int32_t trans_v;
  float* out;
  int64_t ldo, out_strides[2];
  int32_t step_count;  // <= BLADE_ATTENTION_MAX_STEPS
  BladeScoreStep steps[4];
  int32_t zero_rows;
  float zero_rows_max;
};

// One BladeRuntime::conv call's arguments, in its parameter order (BladeRuntime::conv_pair).
struct BladeConv {
  int32_t spatial;
  const int64_t* input_shape;
  const float* input;
  const int64_t* weight_shape;
  const float* weight;
  const float* bias;
  const int64_t* strides;
  const int64_t* pads;
  const int64_t* dilations;
  int64_t groups;
  float* output;
  int32_t layout;
  const float* sum;
  const BladeActivation* activation;
};

struct BladeRuntime {
  int32_t abi_version;  // == BLADE_ABI_VERSION
  // Row-major batched SGEMM: for b in [0, batch):
  //   C_b = alpha * op(A_b) @ op(B_b) + beta * C_b,   op(A_b) is [m, k], op(B_b) is [k, n], C_b is [m, n]
  // X_b starts at X + b * stride_x (elements). trans_a == 0: A_b[i][p] = A_b[i * lda + p];
  // trans_a != 0: A_b[i][p] = A_b[p * lda + i]. Same for B. C_b[i][j] = C_b[i * ldc + j].
  // stride_a / stride_b may be 0 (a shared operand, e.g. a weight broadcast over the batch).
  void (*sgemm)(int64_t batch, int64_t m, int64_t n, int64_t k, float alpha,
                const float* a, int64_t lda, int64_t stride_a, int32_t trans_a,
                const float* b, int64_t ldb, int64_t stride_b, int32_t trans_b,
                float beta, float* c, int64_t ldc, int64_t stride_c);
  // Calls fn(ctx, b, e) over disjoint chunks covering [begin, end), possibly from several threads
  // (the runtime's pool: ATen's intra-op pool, so torch.set_num_threads is honoured). Chunks are at
  // least `grain` long except the last; a loop shorter than grain runs inline on the caller.
  void (*parallel_for)(int64_t begin, int64_t end, int64_t grain, blade_range_fn fn, void* ctx);
  // Float32 convolution (cross-correlation, like torch's conv) over `spatial` (1..3) dims:
  //   input [n, c_in, *in_size], weight [c_out, c_in / groups, *kernel], bias [c_out] or nullptr,
  //   output [n, c_out, *out_size]. Weight and bias are dense row-major; input and output are too
  //   unless `layout` says channels-last (BLADE_CONV_*_CHANNELS_LAST bits, 1-D or 2-D): then the
  //   tensor [n, c, h, w] is stored as dense [n, h, w, c] ([n, c, l] as [n, l, c]). input_shape has 2 + spatial entries
  //   (logical order n, c, ...), weight_shape too; strides and dilations have `spatial` entries;
  //   pads has 2 * spatial (all begins, then all ends; they may differ, e.g. "same" with an even
  //   kernel: the runtime zero-pads first). out_size[d] = (in + begin + end - dilation * (k - 1) - 1)
  //   / stride + 1.
  //   Epilogue, fused into the convolution: `sum` (nullptr, or a tensor of the output's shape and
  //   layout, e.g. a residual) is added to the result, then `activation` (nullptr: none).
  void (*conv)(int32_t spatial, const int64_t* input_shape, const float* input,
               const int64_t* weight_shape, const float* weight, const float* bias,
               const int64_t* strides, const int64_t* pads, const int64_t* dilations, int64_t groups,
               float* output, int32_t layout, const float* sum, const BladeActivation* activation);
  // Fused attention (BladeAttention above): each block of query rows computes its score rows, their
  // softmax and their product with V while the rows are in cache (no [m, n] score matrix in memory).
  void (*attention)(const BladeAttention* attention);
  // conv(*first) then conv(*second), where second reads first's output as its input and nothing
  // else reads that output: the runtime may compute the two together without writing it (a 1x1
  // convolution expanding the channels, then a depthwise one: cpp/expand_depthwise.h), else it
  // makes the two calls.
  void (*conv_pair)(const BladeConv* first, const BladeConv* second);
};

// Every engine .so exports these two symbols.
//   blade_engine_abi_version(): the BLADE_ABI_VERSION it was compiled against.
//   blade_engine_run(): computes the cluster. inputs/outputs/constants are data pointers of
//     contiguous, densely packed tensors in the manifest's order, with the manifest's dtypes and
//     shapes; outputs are allocated by the caller. sizes holds the values of the manifest's size
//     symbols (the run-time dims, in manifest.symbols order; none for a static engine), bound by the
//     caller from the inputs' shapes and checked against the symbols' ranges and each other.
//     scratch points to manifest.scratch_bytes bytes (planned at the symbols' upper bounds),
//     64-byte aligned, owned by this call alone (concurrent calls get distinct scratch).
//     Returns 0 on success; otherwise a BLADE_ERR_* code (no exceptions cross this boundary).
int32_t blade_engine_abi_version(void);
int32_t blade_engine_run(const BladeRuntime* rt, const void* const* inputs, void* const* outputs,
                         const void* const* constants, const int64_t* sizes, void* scratch);

// A GEMM of the engine whose B is (part of) one of its constants, with sizes that are the same on
// every call (only m may be a run-time size): sgemm's B = constants[constant] + offset elements,
// read as op(B) [k, n] with ldb and trans_b, scaled by alpha.
struct BladeWeightGemm {
  int64_t constant, offset, n, k, ldb;
  int32_t trans_b;
  float alpha;
};
// Optionally exported (engines of run-time sizes list their weight GEMMs here; absent: none listed):
//   blade_engine_weight_gemms(&gemms) points gemms at that many BladeWeightGemm, the count returned.
//   The runtime may re-lay those weights out when it loads the engine, so no call has to.
int32_t blade_engine_weight_gemms(const BladeWeightGemm** gemms);

// Optionally exported by engines with derived size symbols: output dims no input binds (e.g. a
// concatenation's 2 * seq), listed after the bound symbols in manifest.symbols. Given sizes with the
// bound symbols filled in, blade_engine_derived_sizes(sizes) fills the derived ones after them and
// returns how many it filled. A runtime without it refuses such an engine when it loads it (a
// symbol that no input binds), so this is no ABI version change.
int32_t blade_engine_derived_sizes(int64_t* sizes);

}  // extern "C"

#define BLADE_CONV_INPUT_CHANNELS_LAST 1   // BladeRuntime::conv layout bits
#define BLADE_CONV_OUTPUT_CHANNELS_LAST 2
#define BLADE_ACTIVATION_NONE 0            // BladeActivation::kind
#define BLADE_ACTIVATION_RELU 1            // v < 0 ? 0 : v (NaN stays NaN)
// v = (v != v || v >= lo) ? v : lo, then (v != v || v <= hi) ? v : hi: the engine's Max then Min
// (NaN stays NaN; a tie keeps v, so -0 stays -0). ReLU6 and hardtanh; lo = -inf or hi = +inf for
// a one-sided clamp. The bounds must not be NaN.
#define BLADE_ACTIVATION_CLAMP 2
// v * sigmoid(v) (SiLU, swish), with sigmoid as engine_prelude.h's blade_sigmoidf: what the engine's
// unfused Mul(v, Sigmoid(v)) computes (EfficientNet, MobileNetV3, YOLO).
#define BLADE_ACTIVATION_SILU 3
// The exact GELU v * Phi(v) as engine_prelude.h's blade_geluf: what the engine's unfused Gelu
// computes (PoolFormer's and SegFormer's convolution MLPs).
#define BLADE_ACTIVATION_GELU 4

#define BLADE_ATTENTION_MAX_STEPS 4
#define BLADE_SCORE_MUL 1   // s * value
#define BLADE_SCORE_DIV 2   // s / value
#define BLADE_SCORE_KEEP 3  // mask ? s : value
#define BLADE_SCORE_ADD 4   // s + mask

#define BLADE_OK 0
#define BLADE_ERR_INDEX_OUT_OF_RANGE 1  // a gather/embedding index outside its dimension
#define BLADE_ERR_DIVISION_BY_ZERO 2    // an integer division by zero (eager raises ZeroDivisionError)
#define BLADE_ERR_SIZE_MISMATCH 3       // an input dim differs from the size expression the engine was compiled for

#ifdef __cplusplus
#include <type_traits>

namespace blade {
// parallel_for over a C++ callable: blade::parallel_for(rt, 0, n, grain, [&](int64_t b, int64_t e) {...});
// The callable runs through one out-of-line trampoline on both paths. Inlined into the small-loop
// path as well, a kernel's loops were compiled twice wherever its trip count is a run-time size
// (the branch folds only for constant sizes): a quarter of g++'s time on a dynamic BERT engine.
template <class F>
__attribute__((noinline)) void run_range(void* ctx, int64_t b, int64_t e) { (*static_cast<F*>(ctx))(b, e); }

template <class F>
inline void parallel_for(const BladeRuntime* rt, int64_t begin, int64_t end, int64_t grain, F&& f) {
  using Fn = std::remove_reference_t<F>;
  if (end - begin <= grain) {  // skip the runtime round trip for small loops
    if (end > begin) run_range<Fn>(static_cast<void*>(&f), begin, end);
    return;
  }
  rt->parallel_for(begin, end, grain, &run_range<Fn>, static_cast<void*>(&f));
}
}  // namespace blade
#endif
