// src/common/float_convert.h — host conversions between f32 and the 16-bit float formats, and
// element load/store by runtime dtype. Round-to-nearest-even, NaN preserved, as the GPU converts.
#pragma once

#include <cstdint>
#include <cstring>

#include "gmoe/dtype.h"
#include "gmoe/error.h"

namespace gmoe {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // qNaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_bits_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_f16_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // below the smallest normal f16 (2^-14): subnormal or zero
    // Scale so that the subnormal step 2^-24 becomes 1, round to nearest even by the FPU.
    const float scaled = bits_float(abs) * 16777216.0f;  // 2^24, exact
    uint32_t m = static_cast<uint32_t>(scaled);
    const float rem = scaled - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return static_cast<uint16_t>(sign | m);
  }
  uint32_t v = abs - 0x38000000u;  // rebias exponent 127 -> 15
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<uint16_t>(sign | (v >> 13));
}
inline float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    const float mag = static_cast<float>(man) * (1.0f / 16777216.0f);  // man · 2^-24
    return sign ? -mag : mag;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

/// Rounds an f32 to the precision of `t` (bf16/f16/f32) and back.
inline float round_to(DType t, float f) {
  switch (t) {
    case DType::bf16: return bf16_bits_to_float(float_to_bf16_bits(f));
    case DType::f16: return f16_bits_to_float(float_to_f16_bits(f));
    default: return f;
  }
}

/// Element `i` (flat, elements) of a buffer of dtype f32/bf16/f16, as f32.
inline float load_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::bf16: return bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::f16: return f16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    default: GMOE_FAIL("load_float: dtype ", dtype_name(t), " is not a 16/32-bit float");
  }
}

/// Stores an f32 at element `i` of a buffer of dtype f32/bf16/f16 (rounding to nearest even).
inline void store_float(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = v; return;
    case DType::bf16: static_cast<uint16_t*>(p)[i] = float_to_bf16_bits(v); return;
    case DType::f16: static_cast<uint16_t*>(p)[i] = float_to_f16_bits(v); return;
    default: GMOE_FAIL("store_float: dtype ", dtype_name(t), " is not a 16/32-bit float");
  }
}

}  // namespace gmoe
