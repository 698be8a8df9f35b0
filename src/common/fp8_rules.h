// src/common/fp8_rules.h — the scalar rules of the FP8 format (gmoe/fp8.h), shared by the CPU
// reference and the CUDA kernels so both compute the very same scales, bit for bit: amax of a
// block (finite values only), scale / scale_inv from amax, the e8m0 exponent of an MXFP8 block.
//
// The element conversion itself is NOT shared: the CUDA kernels use the hardware conversion
// (cvt.rn.satfinite.e4m3x2.f32 / e5m2x2), the CPU backend the software one below
// (fp8_from_float); tests check that the two agree bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define GMOE_FP8_HD __host__ __device__ __forceinline__
#else
#define GMOE_FP8_HD inline
#endif

namespace gmoe::fp8_rules {

constexpr float kE4m3Max = 448.0f;
constexpr float kE5m2Max = 57344.0f;
constexpr float kFltMax = 3.40282346638528859812e+38f;
/// emax of the element format in the OCP MX spec: floor(log2(fp8_max)).
constexpr int kE4m3Emax = 8;
constexpr int kE5m2Emax = 15;
/// e8m0 byte of 1.0 (2^0): the scale of an all-zero MXFP8 block.
constexpr uint8_t kE8m0One = 127;

GMOE_FP8_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
GMOE_FP8_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

/// |x| if x is finite, else 0: NaN and ±inf never reach a scale.
GMOE_FP8_HD float finite_abs(float x) {
  const float a = f32_from_bits(f32_bits(x) & 0x7fffffffu);  // never -0: amax bits stay ordered
  return a <= kFltMax ? a : 0.0f;  // false for NaN and inf
}

/// The f32 quantization multiplier of a block with (finite, >= 0) amax: fp8_max / amax, FLT_MAX
/// when that overflows (tiny or subnormal amax), 1 when amax == 0; with pow2, rounded down to a
/// power of two. Always a finite normal number > 0.
GMOE_FP8_HD float scale_from_amax(float amax, float fp8_max, bool pow2) {
  if (amax == 0.0f) return 1.0f;
#if defined(__CUDA_ARCH__)
  float s = __fdiv_rn(fp8_max, amax);
#else
  float s = fp8_max / amax;
#endif
  if (!(s <= kFltMax)) s = kFltMax;
  if (pow2) s = f32_from_bits(f32_bits(s) & 0xff800000u);  // s is normal: drop the mantissa
  return s;
}

/// The dequantization multiplier of an f32 scale: 1 / scale, IEEE division.
GMOE_FP8_HD float scale_inv_from_scale(float scale) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(scale);
#else
  return 1.0f / scale;
#endif
}

/// floor(log2(a)) for a finite a > 0 (subnormals included).
GMOE_FP8_HD int floor_log2(float a) {
  const uint32_t u = f32_bits(a);
  const int biased = static_cast<int>(u >> 23);  // sign is 0
  if (biased != 0) return biased - 127;
  // Subnormal: value = m * 2^-149 with m in [1, 2^23).
  uint32_t m = u & 0x7fffffu;
  int top = 0;
  while (m >>= 1) ++top;
  return top - 149;
}

/// The e8m0 byte of an MXFP8 block: 2^(floor(log2 amax) - emax), exponent clamped to [-127, 127];
/// amax == 0 -> 127 (1.0).
GMOE_FP8_HD uint8_t e8m0_from_amax(float amax, int emax) {
  if (amax == 0.0f) return kE8m0One;
  int e = floor_log2(amax) - emax;
  if (e < -127) e = -127;
  if (e > 127) e = 127;
  return static_cast<uint8_t>(e + 127);
}

/// The value of an e8m0 byte (255 is NaN; 0 is 2^-127, an f32 subnormal).
GMOE_FP8_HD float e8m0_to_float(uint8_t b) {
  if (b == 255) return f32_from_bits(0x7fffffffu);
  if (b == 0) return f32_from_bits(0x00400000u);
  return f32_from_bits(static_cast<uint32_t>(b) << 23);
}

/// The quantization multiplier of an e8m0 scale_inv: its exact reciprocal 2^(127 - b), for the
/// bytes e8m0_from_amax makes (b in [0, 246]): a normal f32 in [2^-119, 2^127].
GMOE_FP8_HD float e8m0_quant_multiplier(uint8_t b) {
  return f32_from_bits(static_cast<uint32_t>(254 - b) << 23);
}

// ---------------------------------------------------------------------------------------------
// Software element conversion (the CPU backend's; the kernels use the hardware instruction).

/// f32 -> e4m3 (e5m2 when `e5m2`): round to nearest even, saturate to ±max (±inf too), NaN ->
/// 0x7F. The result of cvt.rn.satfinite.{e4m3,e5m2}x2.f32.
inline uint8_t fp8_from_float(float x, bool e5m2) {
  const uint32_t u = f32_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7f;  // NaN
  const int man_bits = e5m2 ? 2 : 3;
  const int bias = e5m2 ? 15 : 7;
  const uint8_t max_code = e5m2 ? 0x7b : 0x7e;
  const float maxv = e5m2 ? kE5m2Max : kE4m3Max;
  const float a = f32_from_bits(abs);
  if (a >= maxv) return static_cast<uint8_t>(sign | max_code);  // saturate (inf included)
  // Spacing of representable values around a: 2^(max(e, emin) - man_bits), where emin = 1 - bias
  // is the exponent of the smallest normal (subnormals share its spacing).
  const int e = abs == 0 ? -200 : floor_log2(a);
  const int q = (e < 1 - bias ? 1 - bias : e) - man_bits;
  // a / 2^q is exact in double (a has 24 significant bits, q >= -17); round it to an integer,
  // ties to even.
  double scaled = static_cast<double>(a);
  for (int i = 0; i < (q < 0 ? -q : q); ++i) scaled = q < 0 ? scaled * 2.0 : scaled * 0.5;
  double n = static_cast<double>(static_cast<int64_t>(scaled));
  const double rem = scaled - n;
  if (rem > 0.5 || (rem == 0.5 && (static_cast<int64_t>(n) & 1))) n += 1.0;
  // Encode n * 2^q: n <= 2^(man_bits+1) (a carry into the next binade gives exactly 2^(mb+1)).
  int64_t m = static_cast<int64_t>(n);
  int exp_field;  // biased exponent field
  if (m == 0) return sign;
  int qq = q;
  if (m >= (int64_t{1} << (man_bits + 1))) {  // carried into the next binade
    m >>= 1;
    ++qq;
  }
  if (m < (int64_t{1} << man_bits)) {
    exp_field = 0;  // subnormal (only possible when qq == 1 - bias - man_bits)
  } else {
    exp_field = qq + man_bits + bias;
    m -= int64_t{1} << man_bits;
  }
  const uint32_t code = (static_cast<uint32_t>(exp_field) << man_bits) | static_cast<uint32_t>(m);
  if (code > max_code) return static_cast<uint8_t>(sign | max_code);  // rounded past max
  return static_cast<uint8_t>(sign | code);
}

/// e4m3 / e5m2 byte -> f32 (exact).
GMOE_FP8_HD float fp8_to_float(uint8_t b, bool e5m2) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const int man_bits = e5m2 ? 2 : 3;
  const int bias = e5m2 ? 15 : 7;
  const uint32_t exp = (b & 0x7fu) >> man_bits;
  const uint32_t man = b & ((1u << man_bits) - 1u);
  if (e5m2 && exp == 31) return f32_from_bits(sign | 0x7f800000u | (man ? 0x400000u : 0u));
  if (!e5m2 && exp == 15 && man == 7) return f32_from_bits(0x7fffffffu);  // NaN
  if (exp == 0) {
    if (man == 0) return f32_from_bits(sign);
    // man * 2^(1 - bias - man_bits), normalised into f32 (always normal in f32).
    int e = 1 - bias - man_bits;
    uint32_t m = man;
    while (m < (1u << man_bits)) {
      m <<= 1;
      --e;
    }
    // m in [2^mb, 2^(mb+1)): value = m * 2^e = 1.f * 2^(e + mb)
    const uint32_t f32_exp = static_cast<uint32_t>(e + man_bits + 127);
    const uint32_t f32_man = (m - (1u << man_bits)) << (23 - man_bits);
    return f32_from_bits(sign | (f32_exp << 23) | f32_man);
  }
  const uint32_t f32_exp = exp - static_cast<uint32_t>(bias) + 127u;
  return f32_from_bits(sign | (f32_exp << 23) | (man << (23 - man_bits)));
}

}  // namespace gmoe::fp8_rules
