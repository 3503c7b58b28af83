// The C++ prelude of every generated engine (blade/engine/codegen.py includes it after
// blade_abi.h): float32 transcendentals that vectorize, integer pow, and the profiling macros.
// Engines are compiled against the copy beside blade_abi.h (cpp/, or blade/include/ when
// installed), and its content is part of the engine cache key (blade/engine/cache.py).
#ifndef BLADE_ENGINE_PRELUDE_H_
#define BLADE_ENGINE_PRELUDE_H_

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {
// Float32 transcendentals written so that g++ vectorizes the loops calling them (std::exp, std::erf
// etc. are library calls it cannot vectorize without -ffast-math). With 512-bit vectors only two
// ports execute vector instructions, so these loops are bound by instruction count: every select
// and clamp costs as much as an FMA, and the helpers below skip the range handling their callers'
// known argument ranges make unnecessary. Their accuracy (max ulp vs double libm) is the table in
// README "Numerics": bench/ulp_table.py measures it, tests/engine/test_ulp.py holds them to it, and
// tests/engine/test_vectorized.py checks that each op's loop vectorizes.

// e^(c - n ln2) for |c - n ln2| <= ln2 / 2 (Cephes coefficients, ~1 ulp).
inline float blade_exp_reduced(float c, float n) {
  float r = std::fma(n, -0.693359375f, c);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  return std::fma(p * r, r, r) + 1.0f;
}

inline float blade_pow2i(int32_t n) { return __builtin_bit_cast(float, (n + 127) << 23); }  // n in [-126, 127]

// e^x for x in [-87.33, 88.0] only (2^n is then one normal float): no range handling.
inline float blade_exp_inrange(float x) {
  const float n = std::nearbyint(x * 1.44269504088896341f);
  return blade_exp_reduced(x, n) * blade_pow2i(static_cast<int32_t>(n));
}

// e^x for every x; inf/NaN behave like std::exp. Above 88.72 (AVX-512 version) the two 2^k factors overflow
// to inf by themselves. Results below FLT_MIN (x < -87.34) flush to 0 instead of being subnormal:
// a subnormal costs ~100 cycles in every multiply or add it meets, and a masked softmax
// (exp(-inf - max) for half of a causal attention) would pay it per element (measured: 25x
// slower). The absolute error of the flush is < 1.2e-38.
#if defined(__AVX512F__)
inline float blade_expf(float x) {
  const float above = x < -87.3365448f ? -87.3365448f : x;  // NaN passes both clamps
  const float c = above > 89.0f ? 89.0f : above;
  const float n = std::nearbyint(c * 1.44269504088896341f);
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t half = ni >> 1;
  const float result = blade_exp_reduced(c, n) * blade_pow2i(half) * blade_pow2i(ni - half);
  return x < -87.3365448f ? 0.0f : result;
}
#else
// Without AVX-512 (x86-64-v3: 8 lanes, selects are blends competing with the FMAs) the version
// above spent ~37 vector instructions per 8 elements (g++ applied each clamp to both x and
// x * log2 e as blends, then round, convert and two 2^k factors); this one is blade_exp_inrange's
// core and two selects, no clamps. In [lo, hi], the arguments whose e^x is a normal float (lo the
// float just above -126 ln2, hi the float just below ln FLT_MAX), n is in [-126, 128] and e^r in
// [1, sqrt 2] for n = -126 (r >= 0 there) and below 1 for n = 128 (r < 0), so 2^n is an integer
// add of n to e^r's exponent; n comes from the bits of a sum that rounds it (as in blade_geluf).
// Outside [lo, hi] (and for NaN) that arithmetic is garbage the selects replace: 0 below lo (the
// AVX-512 version's flush, here also at -87.3365479, whose e^x is 0.99999 FLT_MIN), x + inf above
// (inf, and NaN for NaN). exp [64, 4096], one thread, EPYC Zen 3: 180 -> 124 us.
inline float blade_expf(float x) {
  constexpr float lo = -87.3365402222f, hi = 88.7228317261f;
  const float shifted = std::fma(x, 1.44269504088896341f, 12582912.0f);   // 1.5 2^23: n in the low bits
  const float n = shifted - 12582912.0f;
  const float e = blade_exp_reduced(x, n);
  const float scaled = __builtin_bit_cast(float, __builtin_bit_cast(int32_t, e) + (__builtin_bit_cast(int32_t, shifted) << 23));
  return x < lo ? 0.0f : (x <= hi ? scaled : x + std::numeric_limits<float>::infinity());
}
#endif

// sigmoid 1 / (1 + e^-x); 0 below -87.33 (like blade_expf's flush). -x is clamped to
// blade_exp_inrange's range; NaN passes the clamps. A true divide, as ATen does: its unit runs beside
// the FMAs, and the loop ([64, 4096], one thread, x86-64-v4) took 53 us with it against 73 us with
// a Newton reciprocal's seven FMAs (eager 54 us), and the quotient is correctly rounded.
#if defined(__AVX512F__)
inline float blade_sigmoidf(float x) {
  const float capped = -x > 87.3365448f ? 87.3365448f : -x;
  const float minus_x = capped < -87.3365448f ? -87.3365448f : capped;
  const float r = 1.0f / (1.0f + blade_exp_inrange(minus_x));
  return x < -87.3365448f ? 0.0f : r;
}
#else
// Without AVX-512 the two clamps above became blends (g++ also applied them to -x log2 e) beside
// exp_inrange's round and convert. Here e^-x is exp_inrange's arithmetic unclamped: n rounded by a
// magic-number sum, 2^n made from that sum's bits; valid for |x| <= 87.34, beyond it the selects
// give 0 and 1 (NaN propagates through the product). Same results bit for bit as the AVX-512
// version; [64, 4096] one thread, EPYC Zen 3: 172 -> 140 us.
inline float blade_sigmoidf(float x) {
  const float shifted = std::fma(x, -1.44269504088896341f, 12582912.0f);   // 1.5 2^23: n = round(-x log2 e) in the low bits
  const float n = shifted - 12582912.0f;
  const float two_n = __builtin_bit_cast(float, (__builtin_bit_cast(int32_t, shifted) + 127) << 23);
  const float r = 1.0f / (1.0f + blade_exp_reduced(-x, n) * two_n);
  return x < -87.3365448f ? 0.0f : (x > 87.3365448f ? 1.0f : r);
}
#endif

// tanh: odd polynomial near 0 (no cancellation), 1 - 2 / (e^2|x| + 1) elsewhere (Cephes);
// |x| is capped at 9.1, where tanh already rounds to 1 in float32. A true divide, as in sigmoid: a
// Newton reciprocal (an integer-trick estimate and three steps, seven FMAs) competed with the two
// branches' FMAs for the same ports; GPT-2's gelu_new loop ([128, 1024], one thread, x86-64-v3)
// took 160 us with the divide against 187 us, at the same 1.32 ulp worst error.
inline float blade_tanhf(float x) {
  const float ax = std::fabs(x);
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = std::fma(p, z, 2.06390887954e-2f);
  p = std::fma(p, z, -5.37397155531e-2f);
  p = std::fma(p, z, 1.33314422036e-1f);
  p = std::fma(p, z, -3.33332819422e-1f);
  const float small = std::fma(p * z, x, x);
  const float large = 1.0f - 2.0f / (blade_exp_inrange(2.0f * (ax < 9.1f ? ax : 9.1f)) + 1.0f);
  // x's sign on both (small is +0 for x = -0: -0 * -0 + -0 = +0)
  return x != x ? x : std::copysign(ax < 0.625f ? small : large, x);
}

// erf: x * S(x^2) for |x| < 0.875; 1 - e^P(|x|) up to |x| = 4, with P a fit of log(erfc) (beyond
// 4, erf rounds to +-1 in float32). Weighted least-squares fits, made here; <= 2.3 ulp, abs error
// <= 1.1e-7 over [-7, 7] (tests/engine/test_ops.py: Erf-dense). No reciprocal and one exp: ~40
// vector instructions per 16 elements (the exact GELU has its own cheaper function, blade_geluf).
inline float blade_erff(float x) {
  const float ax = std::fabs(x);
  const float z = x * x;
  float s = -5.631409585475922e-04f;
  s = std::fma(s, z, 4.9175480380654335e-03f);
  s = std::fma(s, z, -2.671130932867527e-02f);
  s = std::fma(s, z, 1.1280179768800735e-01f);
  s = std::fma(s, z, -3.7612324953079224e-01f);
  s = std::fma(s, z, 1.1283791065216064f);
  const float small = x * s;
  // t = clamp(ax, 0.875, 4) as integer max/min of the bits (two instructions; float selects cost
  // g++ four compares here): a non-negative float orders like its bits. A NaN clamps to 4 and
  // takes the small branch below, whose x * s is NaN.
  const int32_t bits = __builtin_bit_cast(int32_t, ax);
  const int32_t above = bits < 0x3f600000 ? 0x3f600000 : bits;
  const float t = __builtin_bit_cast(float, above > 0x40800000 ? 0x40800000 : above);
  // P in Estrin's form: the loop is bound by the latency of this polynomial feeding the exp
  // (Horner's 6 dependent FMAs: gelu [64,4096] 1 thread 74 us against 66), not by its FMAs.
  const float t2 = t * t;
  const float p01 = std::fma(-1.1278890371322632f, t, -1.4429383736569434e-4f);
  const float p23 = std::fma(-1.0424964874982834e-1f, t, -6.368212699890137e-1f);
  const float p45 = std::fma(-3.081925678998232e-3f, t, 2.2380756214261055e-2f);
  const float p = std::fma(std::fma(1.998941006604582e-4f, t2, p45), t2 * t2, std::fma(p23, t2, p01));
  const float large = 1.0f - blade_exp_inrange(p);  // p in [-16.8, -0.25]
  return ax >= 0.875f ? std::copysign(large, x) : small;
}

// Exact GELU x Phi(x) as one function (ir._gelu), ~26 vector instructions per 16 elements where
// 0.5 x (1 + erf(x / sqrt 2)) through blade_erff took ~45 (two branches of erf, both computed):
// [64, 4096] one thread 80 us against eager's 54. Q = Phi(-|x|) = t R(t) e^(-x^2 / 2) with
// t = 1 / (1 + 0.39 |x|) (a divide, as ATen's erf has: its unit runs beside the FMAs) and R a
// degree-4 fit made here (least squares, reweighted to minimax the absolute error of Q); Phi(x) is
// 1 - Q for x > 0, else Q. Error of Phi <= 1.1e-7 absolute, so GELU's <= 1.1e-7 |x| + its rounding
// (eager's A&S erf in float32: 2.4e-7 |x|); far below 0 it is x Q without eager's cancellation in
// 1 + erf. The exponent is clamped at -80 so no product is subnormal for |x| below 1e10 (Q there
// is < 2e-35 either way); t = 0 at x = -inf gives Q = 0 and -inf * 0 = NaN, as eager's GELU;
// +inf gives inf, -0 gives -0. 2^n is made from the bits of the sum that rounds n (magic-number
// rounding, no round/convert instructions).
inline float blade_geluf(float x) {
  const float ax = std::fabs(x);
  const float t = 1.0f / std::fma(0.39f, ax, 1.0f);
  float r = 0.053849443793296814f;
  r = std::fma(r, t, -0.25825339555740356f);
  r = std::fma(r, t, 0.3751836121082306f);
  r = std::fma(r, t, -0.01664738729596138f);
  r = std::fma(r, t, 0.19444139301776886f);
  r = std::fma(r, t, 0.15142634510993958f);
  // -x^2 / 2 (-0 or below, or NaN) clamped at -80 as the integer min of its bits (one instruction;
  // a negative float's bits grow with its magnitude); a NaN clamps too, but x * ... is NaN then
  const int32_t square_bits = __builtin_bit_cast(int32_t, (x * -0.5f) * x);
  const float z = __builtin_bit_cast(float, square_bits < int32_t(0xc2a00000) ? square_bits : int32_t(0xc2a00000));
  // e^z = 2^n e^c, n = round(z / ln2) from the bits of a sum that rounds it (no round or convert
  // instructions), c = z - n ln2 with ln2 in one float (error <= 116 * 1.9e-9 at the clamp)
  const float shifted = std::fma(z, 1.44269504088896341f, 12582912.0f);   // 1.5 2^23: n in the low bits
  const float n = shifted - 12582912.0f;
  const float c = std::fma(n, -0.693147182464599609375f, z);
  float e = 0.001383659546263516f;   // e^c for |c| <= ln2 / 2: a degree-6 fit made here, 1e-7 absolute
  e = std::fma(e, c, 0.008374864235520363f);
  e = std::fma(e, c, 0.041668232530355453f);
  e = std::fma(e, c, 0.16666419804096222f);
  e = std::fma(e, c, 0.49999991059303284f);
  e = std::fma(e, c, 1.0f);
  e = std::fma(e, c, 1.0f);
  // times 2^n as an integer add of n to the exponent (the result is >= 2^-116, normal): the
  // multiplies and FMAs share two ports, the integer add does not
  const float scaled = __builtin_bit_cast(float, __builtin_bit_cast(int32_t, e) + (__builtin_bit_cast(int32_t, shifted) << 23));
  const float q = scaled * (r * t);
  return x * (x > 0.0f ? 1.0f - q : q);
}

// log: x = 2^e * m with m in [sqrt(1/2), sqrt(2)) (bit arithmetic relative to sqrt(1/2)'s bits),
// log(x) = e ln2 + log1p(f), f = m - 1 exact; log1p(f) = f - f^2/2 + f^3 P(f), P a weighted
// least-squares fit made here (degree 8: 0.04 ulp of fit error with float32 coefficients). ln2 in
// two parts so that e * ln2_hi is exact. Subnormals are scaled by 2^23 first; 0, negatives, +inf
// and NaN are selected at the end (like std::log: -inf, NaN, +inf, NaN).
inline float blade_logf(float x) {
  const bool subnormal = x < 1.17549435e-38f;   // also 0 and negatives: their result is replaced
  const float scaled = subnormal ? x * 8388608.0f : x;
  const int32_t from_sqrt_half = __builtin_bit_cast(int32_t, scaled) - 0x3f3504f3;
  const float e = static_cast<float>((from_sqrt_half >> 23) - (subnormal ? 23 : 0));
  const float f = __builtin_bit_cast(float, (from_sqrt_half & 0x007fffff) + 0x3f3504f3) - 1.0f;
  float p = 0.06607358157634735f;
  p = std::fma(p, f, -0.11506462097167969f);
  p = std::fma(p, f, 0.11857376247644424f);
  p = std::fma(p, f, -0.12429631501436234f);
  p = std::fma(p, f, 0.14226478338241577f);
  p = std::fma(p, f, -0.16667000949382782f);
  p = std::fma(p, f, 0.2000177949666977f);
  p = std::fma(p, f, -0.2500002086162567f);
  p = std::fma(p, f, 0.33333316445350647f);
  const float f2 = f * f;
  const float tail = std::fma(e, 1.42860682030941723212e-6f, std::fma(f2 * f, p, -0.5f * f2));
  float r = std::fma(e, 0.693145751953125f, f + tail);
  r = x == 0.0f ? -std::numeric_limits<float>::infinity() : r;
  r = x < 0.0f ? std::numeric_limits<float>::quiet_NaN() : r;
  return x <= 3.40282347e+38f ? r : x;   // +inf and NaN return themselves
}

// sin and cos of |x| < 2^24 (the loop versions, and the full ones' values there): ax = |x| = m pi/2 + r
// with m = 2j for sin and 2j + 1 for cos, |r| <= pi/2, so that both are (-1)^j or (-1)^(j+1) times
// sin r: one odd polynomial in double (r + r^3 P(r^2), P of degree 4, a relative least-squares fit
// made here, Lawson-reweighted toward minimax on |r| <= 1.5718: 2^-35.3, so the float result is
// rounded once to within 0.0005 ulp). Cody-Waite with pi/2 in three doubles (m < 2^25, each fma
// nearly exact); j from the bits of a sum that rounds it (magic number 1.5 2^52), its parity XORed
// into the sign. It replaced a reduction to |r| <= pi/4 that evaluated both a sin and a cos
// polynomial and selected by quadrant: [64, 4096] (randn * 3) through blade.load, one thread, CPU
// time, EPYC Zen 3 (AVX2): sin 475 -> 335 us, cos 471 -> 346 (eager 401, 423).
inline double blade_sin_half_pi(double r) {   // sin r for |r| <= pi/2 (+ 1e-3)
  const double z = r * r;
  double p = -2.388589575262612e-08;
  p = std::fma(p, z, 2.752520289158941e-06);
  p = std::fma(p, z, -1.9840864371817356e-04);
  p = std::fma(p, z, 8.33333107558871e-03);
  p = std::fma(p, z, -1.6666666625209897e-01);
  return std::fma(p * z, r, r);
}

// (-1)^(j + odd) sin(ax - (2j + odd) pi/2) for ax in [0, 2^24) (a larger ax, inf or NaN gives
// garbage its callers replace): odd = 0 gives sin ax, odd = 1 cos ax.
template <int odd>
inline float blade_sin_cos_small(float ax) {
  const double xd = ax < 16777216.0f ? ax : 0.0;
  constexpr double magic = 6755399441055744.0;   // 1.5 2^52: j in the low bits of the sum
  const double shifted = (odd ? xd * 0.31830988618379067 - 0.5 : xd * 0.31830988618379067) + magic;
  const double m = 2.0 * (shifted - magic) + odd;   // exact: |j| < 2^23
  double r = std::fma(-m, 1.5707963267948966, xd);
  r = std::fma(-m, 6.123233995736766e-17, r);
  r = std::fma(-m, -1.4973849048591698e-33, r);
  const uint64_t sign = (__builtin_bit_cast(uint64_t, shifted) + odd) << 63;
  return static_cast<float>(__builtin_bit_cast(double, __builtin_bit_cast(uint64_t, blade_sin_half_pi(r)) ^ sign));
}

// Payne-Hanek range reduction of ax = |x| >= 2^24 (finite): ax = (4k + quadrant) pi/2 + r,
// |r| <= pi/4, r in double. Every such float is m 2^k, m a 24-bit integer: ax 2/pi mod 4 is m times
// a 96-bit window of the bits of 2/pi starting at bit k - 1 (the window's words picked by selects, so
// no table lookup stops vectorization), summed in double from exact partial products.
struct BladeReduced { double r; int32_t quadrant; };

// Bits 32i .. 32i + 31 of 2/pi (bit 0: the ones), i in 0..6. A window of the bit string starts in
// word w in 0..3 (exponents up to 254), so its word w + j is one of words j .. j + 3: picked as masks
// ORed together (a ?: chain would become a switch table, a load g++ does not vectorize), each of
// the four words once, in 32-bit lanes.
constexpr uint32_t kBladeTwoOverPi[7] = {0x517cc1b7u, 0x27220a94u, 0xfe13abe8u, 0xfa9a6ee0u, 0x6db14accu, 0x9e21c820u,
                                         0xff28b1d5u};

inline uint32_t blade_two_over_pi_word(int32_t w, int32_t j) {   // word w + j of 2/pi, w in 0..3
  uint32_t word = 0;
  for (int32_t k = 0; k < 4; ++k) word |= kBladeTwoOverPi[j + k] & (0u - static_cast<uint32_t>(w == k));
  return word;
}

// 32 bits of the string from bit 32 w + shift, shift in 0..31: word a's low bits then word b's high
// ones (b >> 1 >> 31 - shift, as b >> 32 - shift is undefined for shift 0).
inline uint32_t blade_window_word(uint32_t a, uint32_t b, int32_t shift) {
  return (a << shift) | ((b >> 1) >> (31 - shift));
}

inline BladeReduced blade_reduce_large(float ax) {   // (only meaningful for ax >= 2^24: the bit offset k - 1 is then >= 0)
  const int32_t bits = __builtin_bit_cast(int32_t, ax);
  const int32_t offset = ((bits >> 23) & 255) - 151 < 0 ? 0 : ((bits >> 23) & 255) - 151;
  const uint32_t m = static_cast<uint32_t>((bits & 0x007fffff) | 0x00800000);
  const int32_t word = offset >> 5, shift = offset & 31;
  const uint32_t w0 = blade_two_over_pi_word(word, 0), w1 = blade_two_over_pi_word(word, 1);
  const uint32_t w2 = blade_two_over_pi_word(word, 2), w3 = blade_two_over_pi_word(word, 3);
  const uint32_t v0 = blade_window_word(w0, w1, shift), v1 = blade_window_word(w1, w2, shift);
  const uint32_t v2 = blade_window_word(w2, w3, shift);
  // ax 2/pi mod 4 = m (v0 2^64 + v1 2^32 + v2) / 2^94 (the quadrant is the integer part), summed
  // in double over pieces of the 96-bit window of at most 29 bits: m has 24, so every m * piece is
  // exact (no 64-bit integer multiplies or carries). t0 < 2^26 (a multiple of 2^-27), t1 < 2^-3,
  // t2 < 2^-32, t3 < 2^-61. t0 - k0 + t1 is exact below 1/8 (its bits 2^-4 .. 2^-56); above it
  // rounds by < 2^-56 where the fraction is >= 3/8, so the fraction is accurate to ~2^-53 relative.
  const double md = static_cast<double>(static_cast<int32_t>(m));
  const double t0 = md * static_cast<double>(static_cast<int32_t>(v0 >> 3)) * 0x1p-27;
  const double t1 = md * static_cast<double>(static_cast<int32_t>(((v0 & 7u) << 26) | (v1 >> 6))) * 0x1p-56;
  const double t2 = md * static_cast<double>(static_cast<int32_t>(((v1 & 63u) << 23) | (v2 >> 9))) * 0x1p-85;
  const double t3 = md * static_cast<double>(static_cast<int32_t>(v2 & 511u)) * 0x1p-94;
  const double k0 = std::nearbyint(t0);
  const double s = (t0 - k0) + t1;
  const double k1 = std::nearbyint(s);   // s - k1 is exact (Sterbenz), in [-1/2, 1/2]
  const double r = ((s - k1) + (t2 + t3)) * 1.5707963267948966;
  return {r, static_cast<int32_t>(k0 + k1) & 3};   // k0 + k1 < 2^27
}

// sin and cos of |r| <= pi/4 in double (Taylor terms to r^11 / r^12: truncation < 2^-40), so the
// float result is rounded once.
inline double blade_sin_kernel(double r) {
  const double z = r * r;
  double p = -2.5052108385441720e-08;      // -1/11!
  p = std::fma(p, z, 2.7557319223985893e-06);   // 1/9!
  p = std::fma(p, z, -1.9841269841269841e-04);  // -1/7!
  p = std::fma(p, z, 8.3333333333333333e-03);   // 1/5!
  p = std::fma(p, z, -1.6666666666666667e-01);  // -1/3!
  return std::fma(p * z, r, r);
}

inline double blade_cos_kernel(double r) {
  const double z = r * r;
  double p = 2.0876756987868099e-09;       // 1/12!
  p = std::fma(p, z, -2.7557319223985888e-07);  // -1/10!
  p = std::fma(p, z, 2.4801587301587302e-05);   // 1/8!
  p = std::fma(p, z, -1.3888888888888889e-03);  // -1/6!
  p = std::fma(p, z, 4.1666666666666667e-02);   // 1/4!
  p = std::fma(p, z, -0.5);
  return std::fma(p, z, 1.0);
}

// sin(quadrant pi/2 + r) for quadrant 0..3 is sin r, cos r, -sin r, -cos r; cos is one quadrant on.
inline float blade_quadrant_value(BladeReduced red, int32_t start) {
  const int32_t q = (red.quadrant + start) & 3;
  const double s = blade_sin_kernel(red.r), c = blade_cos_kernel(red.r);
  const double v = (q & 1) ? c : s;
  return static_cast<float>((q & 2) ? -v : v);
}

// The full sin and cos: the small path below 2^24, Payne-Hanek above, both computed and one selected
// (no branch). sin is odd: it reduces |x| and gives the result x's sign (so sin(-0) = -0). inf and
// NaN give NaN.
inline float blade_sinf(float x) {
  const float ax = std::fabs(x);
  const float v = ax < 16777216.0f ? blade_sin_cos_small<0>(ax) : blade_quadrant_value(blade_reduce_large(ax), 0);
  const float r = __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, v) ^
                                             (__builtin_bit_cast(uint32_t, x) & 0x80000000u));
  return ax <= 3.40282347e+38f ? r : x - x;
}

inline float blade_cosf(float x) {
  const float ax = std::fabs(x);
  const float r = ax < 16777216.0f ? blade_sin_cos_small<1>(ax) : blade_quadrant_value(blade_reduce_large(ax), 1);
  return ax <= 3.40282347e+38f ? r : x - x;
}

// The loop versions of sin and cos (blade/engine/versioning.py): the small path only, which is right
// for |x| < 2^24; any other x sets `wide`, and the loop then runs again with blade_sinf/blade_cosf.
// The Payne-Hanek part is most of the full versions' work: [64, 4096] one thread 144 us without it
// against 373 us (x86-64-v4).
inline float blade_sinf_fast(int32_t& wide, float x) {
  const float ax = std::fabs(x);
  wide |= static_cast<int32_t>(!(ax < 16777216.0f));
  const float v = blade_sin_cos_small<0>(ax);
  return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, v) ^ (__builtin_bit_cast(uint32_t, x) & 0x80000000u));
}

inline float blade_cosf_fast(int32_t& wide, float x) {
  const float ax = std::fabs(x);
  wide |= static_cast<int32_t>(!(ax < 16777216.0f));
  return blade_sin_cos_small<1>(ax);
}

// pow in double: log|x| (x = 2^e m, m in [sqrt(1/2), sqrt(2)) split in float32 bits as blade_logf
// does, so no int64 <-> double conversion (AVX-512 only) is needed; log m = 2 atanh(s),
// s = (m - 1) / (m + 1), |s| <= 0.172, 2 (s + s^3 P(s^2)), P of degree 4: relative error 2^-44.9)
// times y, then e^t (t = n ln2 + r, |r| <= ln2 / 2, 1 + r Q(r), Q of degree 6: 2^-34.3), rounded to
// float once (overflow to inf and underflow through the subnormals as the conversion rounds them):
// t's error (<= 104 * 2^-44.9) and e^r's leave <= 0.5 + 2^-9 ulp (bench/ulp_table.py measures
// 0.50). P and Q are minimax fits made here (Lawson's iteration; Q keeps e^0 = 1 exact); they
// replaced Taylor series to s^13 and r^9 (2^-39.5, 2^-36.5), one and two FMAs more per element:
// [64,4096] one thread x^1.7 338 -> 303 us, x^y 356 -> 334 (eager, Sleef's 1-ulp powf, ~390).
// The special cases of C's pow (and torch's) are selects at the end.
inline double blade_log_d(float x) {   // log x for x > 0 finite; any x >= +0, inf or NaN (no sign bit) is defined
  const bool subnormal = x < 1.17549435e-38f;
  // x times 2^(23 subnormal) made from integer bits, not `subnormal ? x * 2^23 : x`: g++ if-converts
  // that select (and a select of the factor) by computing the whole logarithm, its two divides
  // included, for both operands (pow [64,4096]: 4 vdivpd per 16 elements instead of 2).
  const int32_t subnormal_mask = -static_cast<int32_t>(subnormal);
  const float scaled = x * __builtin_bit_cast(float, 0x3f800000 + (subnormal_mask & (23 << 23)));
  const int32_t from_sqrt_half = __builtin_bit_cast(int32_t, scaled) - 0x3f3504f3;
  const double e = static_cast<double>((from_sqrt_half >> 23) - (subnormal ? 23 : 0));
  const double m = __builtin_bit_cast(float, (from_sqrt_half & 0x007fffff) + 0x3f3504f3);
  const double s = (m - 1.0) / (m + 1.0);
  const double z = s * s;
  double p = 0.09791709309166949;
  p = std::fma(p, z, 0.11088120264403577);
  p = std::fma(p, z, 0.14286053945987445);
  p = std::fma(p, z, 0.1999999781704268);
  p = std::fma(p, z, 0.33333333337881876);
  return std::fma(e, 0.69314718055994531, 2.0 * std::fma(p * z, s, s));
}

inline double blade_exp_d(double t) {   // t in [-300, 300]
  const double n = std::nearbyint(t * 1.4426950408889634);
  const double r = std::fma(-n, 2.319046813846299558e-17, std::fma(-n, 0.69314718055994529, t));
  double p = 0.0001976780156561522;
  p = std::fma(p, r, 0.001394589603535521);
  p = std::fma(p, r, 0.00833356861448886);
  p = std::fma(p, r, 0.0416662725832156);
  p = std::fma(p, r, 0.16666665165605077);
  p = std::fma(p, r, 0.5000000077132888);
  p = std::fma(p, r, 1.0000000002083016);
  p = std::fma(p, r, 1.0);   // e^0 = 1 exactly (x^0, 1^y)
  return p * __builtin_bit_cast(double, (static_cast<int64_t>(static_cast<int32_t>(n)) + 1023) << 52);
}

// blade_powf for the usual inputs, x > 0 finite (subnormal too) and y finite, where none of C's
// special cases applies but y = 0 and x = 1, for which the computed value is already 1 (log 1 = 0,
// e^0 = 1 exactly): its result equals blade_powf's. Any other input sets `wide`, and the loop
// (blade/engine/versioning.py) then runs again with blade_powf. The special cases' selects are
// a third of blade_powf's work: [64,4096] one thread, the engine's loop, x^y 458 -> 315 us, x^1.7
// 392 -> 303 (eager ~390). The tests are on the bits (x in (0, FLT_MAX] is bits 1 .. 0x7f7fffff,
// y finite is |bits| <= 0x7f7fffff): written as float compares joined by &&, g++ did not vectorize
// the loop of a tensor exponent (2.4 ms a call).
inline float blade_powf_fast(int32_t& wide, float x, float y) {
  const uint32_t x_bits = __builtin_bit_cast(uint32_t, x), y_bits = __builtin_bit_cast(uint32_t, y);
  wide |= static_cast<int32_t>(x_bits - 1u >= 0x7f7fffffu) | static_cast<int32_t>((y_bits & 0x7fffffffu) > 0x7f7fffffu);
  // |x|, not `usual ? x : 1`: any non-negative float's bits keep blade_log_d's integer arithmetic
  // defined (its result for 0, inf or NaN is discarded), and g++ turned that select into masked
  // operations through the whole logarithm (the engine's loop: 454 us instead of 310)
  const double t = static_cast<double>(y) * blade_log_d(__builtin_bit_cast(float, x_bits & 0x7fffffffu));
  const double bounded = t >= -300.0 ? (t <= 300.0 ? t : 300.0) : -300.0;
  return static_cast<float>(blade_exp_d(bounded));
}

inline float blade_powf(float x, float y) {
  const float ax = std::fabs(x);
  const bool finite_nonzero = ax > 0.0f && ax <= 3.40282347e+38f;
  const double log_ax = blade_log_d(ax);   // (for 0, inf and NaN replaced below; not a select: see blade_powf_fast)
  const double t = static_cast<double>(y) * log_ax;
  const double bounded = t >= -300.0 ? (t <= 300.0 ? t : 300.0) : -300.0;   // NaN too: it is selected away below
  float r = static_cast<float>(blade_exp_d(bounded));
  // |x| = 0 or inf: 0 or inf by the sign of y (times log's sign: log 0 < 0 < log inf)
  const bool big = (ax == 0.0f) == (y < 0.0f);
  r = finite_nonzero ? r : (big ? std::numeric_limits<float>::infinity() : 0.0f);
  // |y| = inf: 1 for |x| = 1, else 0 or inf by whether |x| < 1 and y's sign
  const bool y_inf = std::fabs(y) > 3.40282347e+38f;
  r = y_inf ? (ax == 1.0f ? 1.0f : ((ax < 1.0f) == (y < 0.0f) ? std::numeric_limits<float>::infinity() : 0.0f)) : r;
  // a negative base: odd integer y gives the odd sign, a non-integer y a NaN (finite x only). y is
  // an odd integer when y / 2 (exact) is not one: from 2^24 on every float is even, and +-inf
  // counts as an even integer here (its results were selected above).
  const bool y_int = std::trunc(y) == y;
  const float y_half = 0.5f * y;
  const bool y_odd = y_int && std::trunc(y_half) != y_half;
  const bool x_negative = __builtin_bit_cast(int32_t, x) < 0;
  r = x_negative && y_odd ? -r : r;
  r = x < 0.0f && ax <= 3.40282347e+38f && !y_int ? std::numeric_limits<float>::quiet_NaN() : r;
  r = x != x || y != y ? x + y : r;
  return y == 0.0f || x == 1.0f ? 1.0f : r;   // even pow(NaN, 0) and pow(1, NaN)
}
}  // namespace

namespace {
// Integer base ** exponent as torch computes it: square-and-multiply wrapping modulo 2^bits (in
// unsigned arithmetic, where wrapping is defined); a negative exponent truncates 1 / base^-e.
template <typename T, typename U>
inline T blade_ipow_wrapping(T base, T exponent) {
  if (exponent < 0) {
    if (base == 1) return 1;
    return base == -1 ? ((exponent & 1) ? -1 : 1) : 0;
  }
  U result = 1, factor = static_cast<U>(base);
  for (U e = static_cast<U>(exponent); e != 0; e >>= 1) {
    if (e & 1) result *= factor;
    factor *= factor;
  }
  return static_cast<T>(result);
}

inline int32_t blade_ipow(int32_t base, int32_t exponent) { return blade_ipow_wrapping<int32_t, uint32_t>(base, exponent); }
inline int64_t blade_ipow(int64_t base, int64_t exponent) { return blade_ipow_wrapping<int64_t, uint64_t>(base, exponent); }

// The NaN-propagating max/min combines of a reduction: v when it is NaN, else the larger (smaller)
// of acc and v, acc on a tie; a NaN acc stays. Two statements, where one `(v != v || v > acc) ? v :
// acc` after an inline select (a ReLU) left a branch g++ did not if-convert, and the loop stayed
// scalar (BiT's max pool over its stem's group norm and ReLU, channels innermost: 9.4 ms).
template <typename T>
inline T blade_max_nan(T acc, T v) {
  const T larger = v > acc ? v : acc;
  return v != v ? v : larger;
}
template <typename T>
inline T blade_min_nan(T acc, T v) {
  const T smaller = v < acc ? v : acc;
  return v != v ? v : smaller;
}
}  // namespace

// Compiled with -DBLADE_PROFILE (Config.profile), every kernel adds its wall time to a counter and
// the .so exports blade_engine_profile() (optional: the Engine looks it up, the ABI does not need
// it). The counters and kernel names are per engine: the generated code defines blade_profile_ns.
#ifdef BLADE_PROFILE
#include <chrono>
namespace {
std::atomic<int64_t> blade_profile_runs{0};
inline int64_t blade_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace
#define BLADE_PROFILE_BEGIN(k) const int64_t blade_start_##k = blade_now_ns()
#define BLADE_PROFILE_END(k) \
  blade_profile_ns[k].fetch_add(blade_now_ns() - blade_start_##k, std::memory_order_relaxed)
#define BLADE_PROFILE_RUN() blade_profile_runs.fetch_add(1, std::memory_order_relaxed)
#else
#define BLADE_PROFILE_BEGIN(k) (void)0
#define BLADE_PROFILE_END(k) (void)0
#define BLADE_PROFILE_RUN() (void)0
#endif

#endif  // BLADE_ENGINE_PRELUDE_H_
