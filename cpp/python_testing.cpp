#include "python_testing.h"

#include <ATen/Parallel.h>
#include <torch/python.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "conv_patch.h"
#include "depthwise.h"
#include "expand_depthwise.h"
#include "gemm.h"
#include "oversubscription.h"
#include "runtime.h"
#include "output_pool.h"
#include "scratch_pool.h"

namespace blade {
namespace {

// The last element an operand of the runtime's sgemm reads or writes, checked against the tensor
// so a wrong argument in a test raises instead of touching memory outside it.
void check_extent(const char* what, const at::Tensor& t, int64_t batch, int64_t stride, int64_t rows,
                  int64_t cols, int64_t ld, bool transposed) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              " must be a contiguous float32 CPU tensor");
  if (batch <= 0 || rows <= 0 || cols <= 0) return;
  int64_t last = (batch - 1) * stride + (transposed ? (cols - 1) * ld + rows - 1 : (rows - 1) * ld + cols - 1);
  TORCH_CHECK(stride >= 0 && ld >= 0 && last < t.numel(), what, " is too small for these strides");
}

// `repeat` calls in one packing scope (pack: B packed once, as in an engine), each an engine call's
// GEMM: what "auto" needs to sample and settle a shape's choice (bench/gemm.py).
void sgemm(int64_t batch, int64_t m, int64_t n, int64_t k, double alpha, const at::Tensor& a, int64_t lda,
           int64_t stride_a, bool trans_a, const at::Tensor& b, int64_t ldb, int64_t stride_b, bool trans_b,
           double beta, at::Tensor& c, int64_t ldc, int64_t stride_c, bool pack, int64_t repeat) {
  check_extent("a", a, batch, stride_a, m, k, lda, trans_a);
  check_extent("b", b, batch, stride_b, k, n, ldb, trans_b);
  check_extent("c", c, batch, stride_c, m, n, ldc, false);
  PackedWeights weights;  // with pack, b counts as an engine constant (packs live for this call's repeats)
  if (pack) weights.add_constant(b.const_data_ptr(), b.nbytes());
  const PackingScope scope(pack ? &weights : nullptr);
  pybind11::gil_scoped_release no_gil;  // column blocks run on ATen's pool
  for (int64_t i = 0; i < repeat; ++i) {
    gemm_new_call();  // each call is one engine call's GEMM
    runtime()->sgemm(batch, m, n, k, static_cast<float>(alpha), a.const_data_ptr<float>(), lda, stride_a,
                     trans_a, b.const_data_ptr<float>(), ldb, stride_b, trans_b, static_cast<float>(beta),
                     c.mutable_data_ptr<float>(), ldc, stride_c);
  }
}

// The chunks the runtime's parallel_for calls back with, sorted.
std::vector<std::pair<int64_t, int64_t>> parallel_for_chunks(int64_t begin, int64_t end, int64_t grain) {
  struct Recorder {
    std::mutex mutex;
    std::vector<std::pair<int64_t, int64_t>> chunks;
  } recorder;
  auto record = [](void* ctx, int64_t chunk_begin, int64_t chunk_end) {
    auto* r = static_cast<Recorder*>(ctx);
    std::lock_guard<std::mutex> lock(r->mutex);
    r->chunks.emplace_back(chunk_begin, chunk_end);
  };
  {
    pybind11::gil_scoped_release no_gil;
    runtime()->parallel_for(begin, end, grain, record, &recorder);
  }
  std::sort(recorder.chunks.begin(), recorder.chunks.end());
  return recorder.chunks;
}

// The chunks the runtime's parallel_for calls back with, sorted, each with the team thread that ran
// it (at::get_thread_num); threads other than the calling one sleep `slow_ms` before their first
// chunk, as a thread whose core another process holds.
std::vector<std::tuple<int64_t, int64_t, int64_t>> parallel_for_threads(int64_t begin, int64_t end, int64_t grain,
                                                                        int64_t slow_ms) {
  struct Recorder {
    std::mutex mutex;
    std::vector<std::tuple<int64_t, int64_t, int64_t>> chunks;
    std::vector<int64_t> slept;
    int64_t slow_ms;
  } recorder;
  recorder.slow_ms = slow_ms;
  auto record = [](void* ctx, int64_t chunk_begin, int64_t chunk_end) {
    auto* r = static_cast<Recorder*>(ctx);
    const int64_t thread = at::get_thread_num();
    bool sleep = false;
    {
      std::lock_guard<std::mutex> lock(r->mutex);
      if (thread != 0 && std::find(r->slept.begin(), r->slept.end(), thread) == r->slept.end()) {
        r->slept.push_back(thread);
        sleep = true;
      }
    }
    if (sleep) std::this_thread::sleep_for(std::chrono::milliseconds(r->slow_ms));
    std::lock_guard<std::mutex> lock(r->mutex);
    r->chunks.emplace_back(chunk_begin, chunk_end, thread);
  };
  {
    pybind11::gil_scoped_release no_gil;
    runtime()->parallel_for(begin, end, grain, record, &recorder);
  }
  std::sort(recorder.chunks.begin(), recorder.chunks.end());
  return recorder.chunks;
}

// Calls the runtime table's conv (with its sum/activation epilogue). x and out must be dense in the layout the `layout` bits declare
// (channels-last tensors for the BLADE_CONV_*_CHANNELS_LAST bits). With pack, the weight counts as
// an engine constant (so the runtime may pre-pack it, as inside an engine); packs live for one call.
// `repeat` calls in one packing scope (pack: the weight packed once, as in an engine), for A/B timing
// of the kernels on one convolution.
void conv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, std::vector<int64_t> strides,
          std::vector<int64_t> pads, std::vector<int64_t> dilations, int64_t groups, at::Tensor& out, int64_t layout,
          bool pack, const std::optional<at::Tensor>& sum, int64_t activation, double lo, double hi, int64_t repeat) {
  const auto dense_in = [](const at::Tensor& t, bool channels_last) {  // channels-last: [n, *spatial, c] (1-D, 2-D)
    if (!channels_last) return t.is_contiguous();
    return t.dim() == 4 ? t.is_contiguous(at::MemoryFormat::ChannelsLast) : t.dim() == 3 && t.transpose(1, 2).is_contiguous();
  };
  TORCH_CHECK(dense_in(x, layout & BLADE_CONV_INPUT_CHANNELS_LAST) && x.scalar_type() == at::kFloat,
              "x must be float32 and dense in the declared layout");
  TORCH_CHECK(dense_in(out, layout & BLADE_CONV_OUTPUT_CHANNELS_LAST) && out.scalar_type() == at::kFloat,
              "out must be float32 and dense in the declared layout");
  TORCH_CHECK(w.is_contiguous() && (!b || b->is_contiguous()), "w and b must be contiguous");
  TORCH_CHECK(!sum || (sum->sizes() == out.sizes() && sum->strides() == out.strides()),
              "sum must have out's shape and layout");
  const int32_t spatial = static_cast<int32_t>(x.dim()) - 2;
  TORCH_CHECK(static_cast<int64_t>(strides.size()) == spatial && static_cast<int64_t>(dilations.size()) == spatial &&
              static_cast<int64_t>(pads.size()) == 2 * spatial, "strides/dilations need one entry a spatial dim, pads two");
  PackedWeights weights;
  if (pack) weights.add_constant(w.const_data_ptr(), w.nbytes());
  const PackingScope scope(pack ? &weights : nullptr);
  const BladeActivation act{static_cast<int32_t>(activation), static_cast<float>(lo), static_cast<float>(hi)};
  for (int64_t i = 0; i < repeat; ++i) {
    gemm_new_call();  // each repetition is one engine call's conv (a GEMM's JIT kernels run from its second)
    runtime()->conv(spatial, x.sizes().data(), x.const_data_ptr<float>(), w.sizes().data(), w.const_data_ptr<float>(),
                    b ? b->const_data_ptr<float>() : nullptr, strides.data(), pads.data(), dilations.data(), groups,
                    out.mutable_data_ptr<float>(), static_cast<int32_t>(layout),
                    sum ? sum->const_data_ptr<float>() : nullptr, &act);
  }
}

// A 1x1 convolution (w1, b1, clamped to [lo1, hi1]) then a depthwise one (w2, b2, plus sum,
// clamped to [lo2, hi2]) on channels-last tensors (with `activation` BLADE_ACTIVATION_SILU or
// _GELU: that function after each instead of the clamps): together (expand_depthwise.h, whether or not
// that pays) or as the runtime table's two convs through an expanded tensor, `repeat` times with
// the weights packed once.
void expand_depthwise(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, double lo1, double hi1,
                      const at::Tensor& w2, const at::Tensor& b2, std::vector<int64_t> strides, std::vector<int64_t> pads,
                      std::vector<int64_t> dilations, at::Tensor& out, double lo2, double hi2, bool together,
                      int64_t repeat, const std::optional<at::Tensor>& sum, int64_t activation) {
  const auto nhwc = at::MemoryFormat::ChannelsLast;
  TORCH_CHECK(x.dim() == 4 && x.is_contiguous(nhwc) && out.is_contiguous(nhwc) && w1.is_contiguous() &&
                  w2.is_contiguous() && b1.is_contiguous() && b2.is_contiguous(),
              "channels-last x and out, contiguous weights");
  TORCH_CHECK(!sum || (sum->sizes() == out.sizes() && sum->strides() == out.strides()),
              "sum must have out's shape and layout");
  const float* sum_data = sum ? sum->const_data_ptr<float>() : nullptr;
  const int64_t expanded_shape[] = {x.size(0), w1.size(0), x.size(2), x.size(3)};
  const int64_t ones[] = {1, 1}, zeros[] = {0, 0, 0, 0};
  const int32_t nhwc_bits = BLADE_CONV_INPUT_CHANNELS_LAST | BLADE_CONV_OUTPUT_CHANNELS_LAST;
  const auto e = patch_conv_shape(2, x.sizes().data(), w1.sizes().data(), ones, zeros, ones, 1, nhwc_bits);
  const int32_t kind = static_cast<int32_t>(activation);
  const BladeActivation act1{kind, static_cast<float>(lo1), static_cast<float>(hi1)};
  const BladeActivation act2{kind, static_cast<float>(lo2), static_cast<float>(hi2)};
  if (together) {
    const DepthwiseShape d{x.size(0), x.size(2), x.size(3), w1.size(0), w2.size(2), w2.size(3), strides[0], strides[1],
                           dilations[0], dilations[1], pads[0], pads[1], out.size(2), out.size(3)};
    TORCH_CHECK(e && e->direct(), "w1 must be a 1x1 convolution's weight");
    const at::Tensor panels = patch_conv_weight(w1.const_data_ptr<float>(), *e);
    const at::Tensor taps = depthwise_tap_weight(w2.const_data_ptr<float>(), d.channels, d.kernel_h * d.kernel_w);
    for (int64_t i = 0; i < repeat; ++i) {
      expand_depthwise_conv2d(*e, x.const_data_ptr<float>(), panels.const_data_ptr<float>(), b1.const_data_ptr<float>(),
                              activation_of(&act1), d, taps.const_data_ptr<float>(), b2.const_data_ptr<float>(), sum_data,
                              activation_of(&act2), out.mutable_data_ptr<float>());
    }
    return;
  }
  at::Tensor expanded = at::empty({expanded_shape[0], expanded_shape[1], expanded_shape[2], expanded_shape[3]},
                                  x.options().memory_format(nhwc));
  PackedWeights weights;
  weights.add_constant(w1.const_data_ptr(), w1.nbytes());
  weights.add_constant(w2.const_data_ptr(), w2.nbytes());
  const PackingScope scope(&weights);
  for (int64_t i = 0; i < repeat; ++i) {
    gemm_new_call();
    runtime()->conv(2, x.sizes().data(), x.const_data_ptr<float>(), w1.sizes().data(), w1.const_data_ptr<float>(),
                    b1.const_data_ptr<float>(), ones, zeros, ones, 1, expanded.mutable_data_ptr<float>(), nhwc_bits,
                    nullptr, &act1);
    runtime()->conv(2, expanded_shape, expanded.const_data_ptr<float>(), w2.sizes().data(), w2.const_data_ptr<float>(),
                    b2.const_data_ptr<float>(), strides.data(), pads.data(), dilations.data(), w1.size(0),
                    out.mutable_data_ptr<float>(), nhwc_bits, sum_data, &act2);
  }
}

}  // namespace

void bind_testing(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("sgemm", &sgemm, "Calls the runtime table's sgemm on float32 tensors (C is updated in place).",
        py::arg("batch"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("alpha"), py::arg("a"),
        py::arg("lda"), py::arg("stride_a"), py::arg("trans_a"), py::arg("b"), py::arg("ldb"),
        py::arg("stride_b"), py::arg("trans_b"), py::arg("beta"), py::arg("c"), py::arg("ldc"),
        py::arg("stride_c"), py::arg("pack") = false, py::arg("repeat") = 1);
  m.def("conv", &conv, "Calls the runtime table's conv (out is written in place).", py::arg("x"), py::arg("w"),
        py::arg("b"), py::arg("strides"), py::arg("pads"), py::arg("dilations"), py::arg("groups"), py::arg("out"),
        py::arg("layout"), py::arg("pack"), py::arg("sum") = py::none(), py::arg("activation") = 0,
        py::arg("lo") = 0.0, py::arg("hi") = 0.0, py::arg("repeat") = 1);
  m.def("expand_depthwise", &expand_depthwise,
        "A 1x1 then a depthwise convolution, channels-last, together or as two runtime convs (out written in place).",
        py::arg("x"), py::arg("w1"), py::arg("b1"), py::arg("lo1"), py::arg("hi1"), py::arg("w2"), py::arg("b2"),
        py::arg("strides"), py::arg("pads"), py::arg("dilations"), py::arg("out"), py::arg("lo2"), py::arg("hi2"),
        py::arg("together"), py::arg("repeat") = 1, py::arg("sum") = py::none(),
        py::arg("activation") = BLADE_ACTIVATION_CLAMP);
  m.def("set_conv_kernel_enabled", &set_conv_kernel_enabled,
        "Lets the runtime's conv use its kernel ('winograd', 'depthwise', 'grouped', 'pointwise', 'patch', 'expand_depthwise')"
        " where it applies (default), or never.",
        py::arg("kernel"), py::arg("enabled"));
  m.def("conv_kernel_calls", &conv_kernel_calls, "How many convolutions the runtime's kernel has computed.",
        py::arg("kernel"));
  m.def("set_l2_cache_bytes", &set_l2_cache_bytes,
        "Sets the L2 size per core the runtime's patch kernel decides its deepest convolutions by (-1: sysconf's).",
        py::arg("bytes"));
  m.def("set_patch_isa", &set_patch_isa,
        "Runs the patch kernel's block functions of ISA level isa ('x86-64', 'x86-64-v3', 'x86-64-v4'; '': this CPU's "
        "best); False when this CPU lacks it.",
        py::arg("isa"));
  m.def("set_patch_pair_tiles", &set_patch_pair_tiles,
        "Lets the patch kernel's AVX-512 block functions sum two weight panels at a time (default) or not.",
        py::arg("on"));
  m.def("patch_pair_tile_panels", &patch_pair_tile_panels,
        "How many weight panels the patch kernel has summed two at a time in this process.");
  m.def("set_gemm_column_split_rows", &set_gemm_column_split_rows,
        "GEMMs with at most max_rows rows run in column blocks across threads (0: never, -1: the default).",
        py::arg("max_rows"));
  m.def("set_gemm_backend", &set_gemm_backend,
        "The GEMM kernels the runtime may choose from (BLADE_GEMM's values; '' reads BLADE_GEMM again); "
        "forgets the choices made so far.", py::arg("mode"));
  m.def("gemm_kernel_calls", &gemm_kernel_calls,
        "How many GEMMs the kernel ('mkl', 'onednn-matmul', 'onednn-packed', 'panels') ran in this process.",
        py::arg("kernel"));
  m.def("set_gemm_jit_at_run_time_sizes", &set_gemm_jit_at_run_time_sizes,
        "Lets oneDNN's kernels (a primitive per exact shape) run the GEMMs of engines with run-time sizes "
        "(off by default); forgets the choices made so far.", py::arg("allowed"));
  m.def("packed_weight_count", &packed_weight_count,
        "How many weights engines packed (GEMM, convolution) in this process so far.");
  m.def("set_patch_timing", &set_patch_timing,
        "Times the patch kernel against oneDNN where it may lose (default), or always takes it where it applies.",
        py::arg("on"));
  m.def("timed_conv_shapes", &timed_conv_shapes,
        "How many convolution shapes a timing has decided the way of in this process so far.");
  m.def("gemm_onednn_usable", &onednn_usable,
        "Whether libtorch's oneDNN matmul runs on this CPU (else the oneDNN GEMM modes fall back to MKL).");
  m.def("parallel_for_chunks", &parallel_for_chunks,
        "The [begin, end) chunks the runtime's parallel_for hands out, sorted.", py::arg("begin"),
        py::arg("end"), py::arg("grain"));
  m.def("parallel_for_threads", &parallel_for_threads,
        "(begin, end, thread) of each chunk the runtime's parallel_for hands out, sorted; team threads other "
        "than the caller sleep slow_ms before their first chunk.", py::arg("begin"), py::arg("end"),
        py::arg("grain"), py::arg("slow_ms"));
  m.def("note_region", &note_region,
        "Reports a parallel region's times (ns) to the oversubscription check; returns whether it was a stall.",
        py::arg("worked_ns"), py::arg("waited_ns"));
  m.def("force_serial_for", &force_serial_for,
        "Engine calls run serially for the next `ms` milliseconds, as after a stall (0 ends it).", py::arg("ms"));
  m.def("noted_region_count", &noted_region_count,
        "How many parallel regions reported their times to the oversubscription check in this process.");
  m.def("call_mode_choices",
        [](const std::vector<std::tuple<bool, int64_t, int64_t>>& records, int64_t calls, int64_t serial_ns,
           int64_t parallel_ns) {
          CallModes modes;
          for (const auto& [serial, ns, elements] : records) modes.record(serial, ns, elements);
          std::vector<bool> serial;
          for (int64_t i = 0; i < calls; ++i) {
            serial.push_back(modes.choose_serial());
            if (serial_ns > 0 && parallel_ns > 0) modes.record(serial.back(), serial.back() ? serial_ns : parallel_ns, 1024);
          }
          return serial;
        },
        "An engine's choices (true: serial) for its next `calls` calls in a serial window, after the calls "
        "`records` lists as (serial, ns, input elements) (CallModes, oversubscription.h); with serial_ns and "
        "parallel_ns, each of those calls then takes that long (1024 input elements).",
        py::arg("records"), py::arg("calls"), py::arg("serial_ns") = 0, py::arg("parallel_ns") = 0);
  m.def("set_serial_windows", &set_serial_windows,
        "False: serial windows never start, whatever the stalls (for A/B measurements); True: as by default.",
        py::arg("on"));
  m.def("serial_now", &serial_now, "Whether engine calls run serially now (oversubscription.h).");
  m.def("scratch_pool", [] {
        const testing::ScratchPoolState s = testing::scratch_pool_state();
        return std::make_pair(s.free_blocks, s.free_bytes);
      },
      "(blocks, bytes) of the engines' scratch pool that no call holds now (scratch_pool.h).");
  m.def("output_pool", [] {
        const testing::OutputPoolState s = testing::output_pool_state();
        return std::make_tuple(s.free_blocks, s.free_bytes, s.made_blocks);
      },
      "(free blocks, their bytes, blocks made so far) of the output pool of engines with run-time sizes (output_pool.h).");
}

}  // namespace blade
