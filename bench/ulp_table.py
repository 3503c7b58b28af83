"""Measures the float32 transcendentals of the engine prelude against double-precision libm.

    python bench/ulp_table.py                 # every 61st float32 bit pattern (70M inputs per function)
    python bench/ulp_table.py --stride 1      # all 2^32 inputs (a minute or more per function)
    python bench/ulp_table.py --only log,sin  # some functions

It compiles one C++ program that includes the prelude exactly as engines do (render.HEADER) and
prints a markdown table: the largest error in float32 ulps of the correctly rounded result (over
inputs whose result is a normal float), the input where it occurs, how many inputs got a different
NaN / infinity / sign of zero than libm, and the largest absolute error where the result is below
FLT_MIN (the prelude's exp family flushes those to 0: see blade_expf). pow is binary: it runs on
pseudo-random pairs instead (x over all finite floats with y chosen so that x^y spans the float
range, and small integer y for negative x).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from blade.engine import compiler, render  # noqa: E402  (torch-free)

# name -> (the prelude's float32 expression of x, the double reference expression of xd)
UNARY = {
    "exp": ("blade_expf(x)", "std::exp(xd)"),
    "log": ("blade_logf(x)", "std::log(xd)"),
    "tanh": ("blade_tanhf(x)", "std::tanh(xd)"),
    "sigmoid": ("blade_sigmoidf(x)", "1.0 / (1.0 + std::exp(-xd))"),
    "erf": ("blade_erff(x)", "std::erf(xd)"),
    "sin": ("blade_sinf(x)", "std::sin(xd)"),
    "cos": ("blade_cosf(x)", "std::cos(xd)"),
}
BINARY = {"pow": ("blade_powf(x, y)", "std::pow(xd, yd)")}

HARNESS = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {
constexpr double kNoY = -1234.5;   // worst_y of unary functions

struct Stats {
  double max_ulp = 0, worst_x = 0, worst_y = kNoY, max_subnormal_abs = 0;
  long long specials = 0, count = 0;
};

// Error of got in ulps of the float32 result closest to ref (a double); specials counted apart.
void account(Stats& s, float got, double ref, double x, double y) {
  ++s.count;
  const float want = static_cast<float>(ref);
  if (std::isnan(ref) || std::isinf(want) || want == 0.0f) {
    const bool same = std::isnan(ref) ? std::isnan(got)
                    : want == 0.0f ? (std::fabs(got) < 1.2e-38f && (got != 0.0f || std::signbit(got) == std::signbit(want)))
                    : got == want;
    if (!same) ++s.specials;
    if (want == 0.0f && !std::isnan(got)) s.max_subnormal_abs = std::fmax(s.max_subnormal_abs, std::fabs(got - ref));
    return;
  }
  if (std::isnan(got) || std::isinf(got)) { ++s.specials; return; }
  if (std::fabs(ref) < 1.1754943508222875e-38) {
    s.max_subnormal_abs = std::fmax(s.max_subnormal_abs, std::fabs(got - ref));
    return;
  }
  const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
  const double err = std::fabs(static_cast<double>(got) - ref) / ulp;
  if (err > s.max_ulp) { s.max_ulp = err; s.worst_x = x; s.worst_y = y; }
}

void report(const char* name, const Stats& s) {
  char at[64];
  if (s.worst_y == kNoY) std::snprintf(at, sizeof at, "%.9g", s.worst_x);
  else std::snprintf(at, sizeof at, "%.9g, %.9g", s.worst_x, s.worst_y);
  std::printf("| %s | %.2f | %s | %lld | %.3g | %lld |\n", name, s.max_ulp, at, s.specials, s.max_subnormal_abs,
              s.count);
}

constexpr int64_t CHUNK = 4096;
float xs[CHUNK], ys[CHUNK], outs[CHUNK];

uint64_t rng_state = 0x9e3779b97f4a7c15ull;
uint64_t next_random() {   // xorshift64*
  rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
  return rng_state * 0x2545f4914f6cdd1dull;
}
double uniform() { return (next_random() >> 11) * (1.0 / 9007199254740992.0); }
}  // namespace

@FUNCTIONS@

int main(int argc, char** argv) {
  const uint64_t stride = std::strtoull(argv[1], nullptr, 10);
  const int64_t pairs = std::strtoll(argv[2], nullptr, 10);
  (void)stride; (void)pairs;
@CALLS@
  return 0;
}
"""

UNARY_TEMPLATE = r"""
void sweep_@NAME@(uint64_t stride) {
  Stats s;
  for (uint64_t base = 0; base < (1ull << 32); base += stride * CHUNK) {
    int64_t n = 0;
    for (; n < CHUNK && base + n * stride < (1ull << 32); ++n) {
      const uint32_t bits = static_cast<uint32_t>(base + n * stride);
      std::memcpy(&xs[n], &bits, 4);
    }
    for (int64_t i = 0; i < n; ++i) { const float x = xs[i]; outs[i] = @EXPR@; }   // the vector loop
    for (int64_t i = 0; i < n; ++i) { const double xd = xs[i]; account(s, outs[i], @REF@, xs[i], kNoY); }
  }
  report("@NAME@", s);
}
"""

BINARY_TEMPLATE = r"""
void sweep_@NAME@(int64_t pairs) {
  Stats s;
  for (int64_t done = 0; done < pairs; done += CHUNK) {
    for (int64_t i = 0; i < CHUNK; ++i) {
      if (i % 4 == 3) {   // a negative or positive base with a small integer exponent
        const uint32_t bits = static_cast<uint32_t>(next_random());
        std::memcpy(&xs[i], &bits, 4);
        ys[i] = static_cast<float>(static_cast<int64_t>(next_random() % 61) - 30);
      } else {            // x^y spanning the float range: y = t / log2|x|, t in [-160, 140]
        const uint32_t bits = static_cast<uint32_t>(next_random()) & 0x7fffffffu;
        std::memcpy(&xs[i], &bits, 4);
        const double l = std::log2(static_cast<double>(xs[i]));
        ys[i] = static_cast<float>((uniform() * 300.0 - 160.0) / (l == 0 ? 1.0 : l));
      }
    }
    for (int64_t i = 0; i < CHUNK; ++i) { const float x = xs[i], y = ys[i]; outs[i] = @EXPR@; }
    for (int64_t i = 0; i < CHUNK; ++i) {
      const double xd = xs[i], yd = ys[i];
      account(s, outs[i], @REF@, xs[i], ys[i]);
    }
  }
  report("@NAME@", s);
}
"""


def program(names) -> str:
    functions, calls = [], []
    for name in names:
        if name in UNARY:
            expr, ref = UNARY[name]
            functions.append(UNARY_TEMPLATE.replace("@NAME@", name).replace("@EXPR@", expr).replace("@REF@", ref))
            calls.append(f"  sweep_{name}(stride); std::fflush(stdout);")
        else:
            expr, ref = BINARY[name]
            functions.append(BINARY_TEMPLATE.replace("@NAME@", name).replace("@EXPR@", expr).replace("@REF@", ref))
            calls.append(f"  sweep_{name}(pairs); std::fflush(stdout);")
    return render.HEADER + HARNESS.replace("@FUNCTIONS@", "\n".join(functions)).replace("@CALLS@", "\n".join(calls))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stride", type=int, default=61, help="test every n-th float32 bit pattern (1: all)")
    parser.add_argument("--pairs", type=int, default=1 << 26, help="random (x, y) pairs for pow")
    parser.add_argument("--only", default="", help="comma-separated function names")
    args = parser.parse_args(argv)
    names = [n for n in [*UNARY, *BINARY] if not args.only or n in args.only.split(",")]
    options = compiler.resolve_options({})
    with tempfile.TemporaryDirectory(prefix="blade-ulp-") as tmp:
        source, binary = Path(tmp) / "ulp.cpp", Path(tmp) / "ulp"
        source.write_text(program(names))
        flags = [f for f in compiler.BASE_FLAGS if f not in ("-fPIC", "-shared")]
        subprocess.run([options["cxx"], options["opt_level"], f"-march={options['isa']}", *flags,
                        f"-I{compiler.include_dir()}", str(source), "-o", str(binary)], check=True)
        print(f"float32 inputs: every {args.stride}. bit pattern; pow: {args.pairs} pairs; ISA {options['isa']}\n")
        print("| function | max ulp | at input | NaN/inf/zero-sign mismatches | max abs err, result < FLT_MIN | inputs |")
        print("|---|---|---|---|---|---|", flush=True)
        subprocess.run([str(binary), str(args.stride), str(args.pairs)], check=True)


if __name__ == "__main__":
    main()
