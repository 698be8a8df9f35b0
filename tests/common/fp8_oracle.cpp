// tests/common/fp8_oracle.cpp — the independent FP8 implementation of the test suites.
#include "common/fp8_oracle.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

namespace gmoe::test::fp8 {
namespace {

bool is_e5m2(DType f) { return f == DType::e5m2; }

// Positive finite codes 0 .. max_code and their values, increasing.
struct Table {
  std::vector<double> value;  // value[code]
  uint8_t max_code;
};
const Table& table(DType f) {
  static const Table e4m3 = [] {
    Table t;
    t.max_code = 0x7e;
    for (int c = 0; c <= t.max_code; ++c) t.value.push_back(decode(static_cast<uint8_t>(c), DType::e4m3));
    return t;
  }();
  static const Table e5m2 = [] {
    Table t;
    t.max_code = 0x7b;
    for (int c = 0; c <= t.max_code; ++c) t.value.push_back(decode(static_cast<uint8_t>(c), DType::e5m2));
    return t;
  }();
  return is_e5m2(f) ? e5m2 : e4m3;
}

float f32(double v) { return static_cast<float>(v); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The scale rule, written from the spec.
struct Scale {
  float mult;
  float inv;
  uint8_t e8m0;
};
Scale make_scale(float amax, const Fp8QuantizeOptions& o) {
  Scale s{};
  if (o.recipe == Fp8Recipe::mxfp8) {
    const int emax = is_e5m2(o.format) ? 15 : 8;
    int e = amax == 0.0f ? 0 : std::ilogb(amax) - emax;
    e = std::min(127, std::max(-127, e));
    s.e8m0 = static_cast<uint8_t>(e + 127);
    s.mult = std::ldexp(1.0f, -e);
    s.inv = std::ldexp(1.0f, e);
    return s;
  }
  const float fmax = f32(max_value(o.format));
  float m = 1.0f;
  if (amax != 0.0f) {
    m = fmax / amax;
    if (std::isinf(m)) m = FLT_MAX;
    if (o.pow2_scales) m = std::ldexp(1.0f, std::ilogb(m));
  }
  s.mult = m;
  s.inv = 1.0f / m;
  return s;
}
void put_scale(HostTensor& t, int64_t i, const Scale& s, Fp8Recipe r) {
  if (r == Fp8Recipe::mxfp8) {
    t.bytes()[static_cast<size_t>(i)] = s.e8m0;
  } else {
    std::memcpy(t.bytes().data() + 4 * i, &s.inv, 4);
  }
}
void put_one(HostTensor& t, int64_t i, Fp8Recipe r) {
  Scale one{1.0f, 1.0f, 127};
  put_scale(t, i, one, r);
}
float abs_finite(float v) { return std::isfinite(v) ? std::fabs(v) : 0.0f; }
uint8_t* bytes(HostTensor& t) { return t.bytes().data(); }

DType scale_dtype(Fp8Recipe r) { return r == Fp8Recipe::mxfp8 ? DType::e8m0 : DType::f32; }

}  // namespace

double max_value(DType f) { return is_e5m2(f) ? 57344.0 : 448.0; }
int mantissa_bits(DType f) { return is_e5m2(f) ? 2 : 3; }
int min_normal_exp(DType f) { return is_e5m2(f) ? -14 : -6; }

double decode(uint8_t b, DType f) {
  const int mb = mantissa_bits(f);
  const int bias = is_e5m2(f) ? 15 : 7;
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  const int exp = (b & 0x7f) >> mb;
  const int man = b & ((1 << mb) - 1);
  if (is_e5m2(f) && exp == 31) return man == 0 ? sign * INFINITY : NAN;
  if (!is_e5m2(f) && (b & 0x7f) == 0x7f) return NAN;
  if (exp == 0) return sign * std::ldexp(static_cast<double>(man), 1 - bias - mb);
  return sign * std::ldexp(static_cast<double>((1 << mb) + man), exp - bias - mb);
}

uint8_t encode(float y, DType f) {
  if (std::isnan(y)) return 0x7f;
  const Table& t = table(f);
  const uint8_t sign = std::signbit(y) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(y));
  if (a >= t.value[t.max_code]) return static_cast<uint8_t>(sign | t.max_code);
  // First code with value >= a; compare with the one below.
  const auto it = std::lower_bound(t.value.begin(), t.value.end(), a);
  int hi = static_cast<int>(it - t.value.begin());
  if (t.value[hi] == a) return static_cast<uint8_t>(sign | hi);
  const int lo = hi - 1;
  const double dlo = a - t.value[lo], dhi = t.value[hi] - a;
  int code;
  if (dlo < dhi) code = lo;
  else if (dhi < dlo) code = hi;
  else code = (lo % 2 == 0) ? lo : hi;  // tie: the even code (mantissa lsb 0)
  return static_cast<uint8_t>(sign | code);
}

Expected oracle_grouped(const HostTensor& x, const std::vector<int64_t>& counts,
                        const Fp8QuantizeOptions& o) {
  const int64_t cap = x.shape()[0], cols = x.shape()[1];
  const int64_t E = static_cast<int64_t>(counts.size());
  std::vector<int64_t> off(E + 1, 0), pad(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    off[e + 1] = off[e] + counts[e];
    pad[e + 1] = pad[e] + ceil_div(counts[e], 128) * 128;
  }
  const int64_t total = off[E];
  const int64_t P = ceil_div(cap, 128) * 128 + 128 * E;
  auto X = [&](int64_t r, int64_t c) { return f32(x.get(r * cols + c)); };
  const DType sd = scale_dtype(o.recipe);
  Expected ex;
  ex.padded_offsets = HostTensor(DType::i64, {E + 1});
  for (int64_t e = 0; e <= E; ++e) ex.padded_offsets.set(e, static_cast<double>(pad[e]));

  if (o.recipe == Fp8Recipe::tensorwise) {
    std::vector<Scale> s(E);
    for (int64_t e = 0; e < E; ++e) {
      float amax = 0.0f;
      for (int64_t r = off[e]; r < off[e + 1]; ++r) {
        for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, abs_finite(X(r, c)));
      }
      s[e] = make_scale(amax, o);
    }
    if (o.rowwise) {
      ex.data = HostTensor(o.format, {cap, cols});
      ex.scale_inv = HostTensor(sd, {E});
      for (int64_t e = 0; e < E; ++e) {
        put_scale(ex.scale_inv, e, s[e], o.recipe);
        for (int64_t r = off[e]; r < off[e + 1]; ++r) {
          for (int64_t c = 0; c < cols; ++c) bytes(ex.data)[r * cols + c] = encode(X(r, c) * s[e].mult, o.format);
        }
      }
    }
    if (o.columnwise) {
      ex.data_t = HostTensor(o.format, {cols, P});
      ex.scale_inv_t = HostTensor(sd, {E});
      for (int64_t e = 0; e < E; ++e) {
        put_scale(ex.scale_inv_t, e, s[e], o.recipe);
        for (int64_t i = 0; i < counts[e]; ++i) {
          for (int64_t c = 0; c < cols; ++c) {
            bytes(ex.data_t)[c * P + pad[e] + i] = encode(X(off[e] + i, c) * s[e].mult, o.format);
          }
        }
      }
    }
    return ex;
  }
  const int64_t B = o.recipe == Fp8Recipe::mxfp8 ? 32 : 128;
  if (o.rowwise) {
    const int64_t nb = ceil_div(cols, B);
    ex.data = HostTensor(o.format, {cap, cols});
    // blockwise: token-major [nb, cap]; mxfp8: [cap, nb]
    const bool token_major = o.recipe == Fp8Recipe::blockwise;
    ex.scale_inv = token_major ? HostTensor(sd, {nb, cap}) : HostTensor(sd, {cap, nb});
    auto scale_index = [&](int64_t r, int64_t b) { return token_major ? b * cap + r : r * nb + b; };
    for (int64_t r = 0; r < cap; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        if (r >= total) {
          put_one(ex.scale_inv, scale_index(r, b), o.recipe);
          continue;
        }
        float amax = 0.0f;
        for (int64_t c = b * B; c < std::min(cols, (b + 1) * B); ++c) amax = std::max(amax, abs_finite(X(r, c)));
        const Scale s = make_scale(amax, o);
        put_scale(ex.scale_inv, scale_index(r, b), s, o.recipe);
        for (int64_t c = b * B; c < std::min(cols, (b + 1) * B); ++c) {
          bytes(ex.data)[r * cols + c] = encode(X(r, c) * s.mult, o.format);
        }
      }
    }
  }
  if (o.columnwise) {
    const int64_t nb = P / B;
    ex.data_t = HostTensor(o.format, {cols, P});
    // blockwise: token-block-major [nb, cols]; mxfp8: [cols, nb]
    const bool block_major = o.recipe == Fp8Recipe::blockwise;
    auto scale_index = [&](int64_t c, int64_t b) { return block_major ? b * cols + c : c * nb + b; };
    ex.scale_inv_t = block_major ? HostTensor(sd, {nb, cols}) : HostTensor(sd, {cols, nb});
    for (int64_t c = 0; c < cols; ++c) {
      for (int64_t b = 0; b < nb; ++b) put_one(ex.scale_inv_t, scale_index(c, b), o.recipe);
    }
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t t0 = 0; t0 < counts[e]; t0 += B) {
        const int64_t t1 = std::min(counts[e], t0 + B);
        for (int64_t c = 0; c < cols; ++c) {
          float amax = 0.0f;
          for (int64_t t = t0; t < t1; ++t) amax = std::max(amax, abs_finite(X(off[e] + t, c)));
          const Scale s = make_scale(amax, o);
          put_scale(ex.scale_inv_t, scale_index(c, (pad[e] + t0) / B), s, o.recipe);
          for (int64_t t = t0; t < t1; ++t) {
            bytes(ex.data_t)[c * P + pad[e] + t] = encode(X(off[e] + t, c) * s.mult, o.format);
          }
        }
      }
    }
  }
  return ex;
}

Expected oracle_weights(const HostTensor& w, const Fp8QuantizeOptions& o) {
  const int64_t E = w.shape()[0], N = w.shape()[1], K = w.shape()[2];
  auto W = [&](int64_t e, int64_t n, int64_t k) { return f32(w.get((e * N + n) * K + k)); };
  const DType sd = scale_dtype(o.recipe);
  Expected ex;
  if (o.rowwise) ex.data = HostTensor(o.format, {E, N, K});
  if (o.columnwise) ex.data_t = HostTensor(o.format, {E, K, N});
  auto put = [&](int64_t e, int64_t n, int64_t k, const Scale& s) {
    const uint8_t b = encode(W(e, n, k) * s.mult, o.format);
    if (o.rowwise) bytes(ex.data)[(e * N + n) * K + k] = b;
    if (o.columnwise) bytes(ex.data_t)[(e * K + k) * N + n] = b;
  };
  if (o.recipe == Fp8Recipe::tensorwise || o.recipe == Fp8Recipe::blockwise) {
    const int64_t BN = o.recipe == Fp8Recipe::tensorwise ? std::max<int64_t>(N, 1) : 128;
    const int64_t BK = o.recipe == Fp8Recipe::tensorwise ? std::max<int64_t>(K, 1) : 128;
    const int64_t nbn = ceil_div(N, BN), nbk = ceil_div(K, BK);
    if (o.recipe == Fp8Recipe::tensorwise) {
      if (o.rowwise) ex.scale_inv = HostTensor(sd, {E});
      if (o.columnwise) ex.scale_inv_t = HostTensor(sd, {E});
    } else {
      if (o.rowwise) ex.scale_inv = HostTensor(sd, {E, nbn, nbk});
      if (o.columnwise) ex.scale_inv_t = HostTensor(sd, {E, nbk, nbn});
    }
    for (int64_t e = 0; e < E; ++e) {
      if (o.recipe == Fp8Recipe::tensorwise && N * K == 0) {  // no blocks: scale of amax 0
        const Scale s = make_scale(0.0f, o);
        if (o.rowwise) put_scale(ex.scale_inv, e, s, o.recipe);
        if (o.columnwise) put_scale(ex.scale_inv_t, e, s, o.recipe);
      }
      for (int64_t bn = 0; bn < nbn; ++bn) {
        for (int64_t bk = 0; bk < nbk; ++bk) {
          float amax = 0.0f;
          for (int64_t n = bn * BN; n < std::min(N, (bn + 1) * BN); ++n) {
            for (int64_t k = bk * BK; k < std::min(K, (bk + 1) * BK); ++k) amax = std::max(amax, abs_finite(W(e, n, k)));
          }
          const Scale s = make_scale(amax, o);
          const int64_t si = o.recipe == Fp8Recipe::tensorwise ? e : (e * nbn + bn) * nbk + bk;
          const int64_t sti = o.recipe == Fp8Recipe::tensorwise ? e : (e * nbk + bk) * nbn + bn;
          if (o.rowwise) put_scale(ex.scale_inv, si, s, o.recipe);
          if (o.columnwise) put_scale(ex.scale_inv_t, sti, s, o.recipe);
          for (int64_t n = bn * BN; n < std::min(N, (bn + 1) * BN); ++n) {
            for (int64_t k = bk * BK; k < std::min(K, (bk + 1) * BK); ++k) put(e, n, k, s);
          }
        }
      }
    }
    return ex;
  }
  // mxfp8: rowwise 1x32 along K, columnwise 1x32 along N.
  if (o.rowwise) {
    const int64_t nb = ceil_div(K, 32);
    ex.scale_inv = HostTensor(sd, {E, N, nb});
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t b = 0; b < nb; ++b) {
          float amax = 0.0f;
          for (int64_t k = b * 32; k < std::min(K, b * 32 + 32); ++k) amax = std::max(amax, abs_finite(W(e, n, k)));
          const Scale s = make_scale(amax, o);
          put_scale(ex.scale_inv, (e * N + n) * nb + b, s, o.recipe);
          for (int64_t k = b * 32; k < std::min(K, b * 32 + 32); ++k) {
            bytes(ex.data)[(e * N + n) * K + k] = encode(W(e, n, k) * s.mult, o.format);
          }
        }
      }
    }
  }
  if (o.columnwise) {
    const int64_t nb = ceil_div(N, 32);
    ex.scale_inv_t = HostTensor(sd, {E, K, nb});
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t b = 0; b < nb; ++b) {
          float amax = 0.0f;
          for (int64_t n = b * 32; n < std::min(N, b * 32 + 32); ++n) amax = std::max(amax, abs_finite(W(e, n, k)));
          const Scale s = make_scale(amax, o);
          put_scale(ex.scale_inv_t, (e * K + k) * nb + b, s, o.recipe);
          for (int64_t n = b * 32; n < std::min(N, b * 32 + 32); ++n) {
            bytes(ex.data_t)[(e * K + k) * N + n] = encode(W(e, n, k) * s.mult, o.format);
          }
        }
      }
    }
  }
  return ex;
}

HostTensor host_copy(const TensorView& v) {
  std::vector<int64_t> shape(v.shape.begin(), v.shape.begin() + v.ndim);
  HostTensor t(v.dtype, shape);
  if (t.numel() > 0) std::memcpy(t.data(), v.data, t.bytes().size());
  return t;
}

::testing::AssertionResult same_bytes(const HostTensor& got, const HostTensor& want,
                                      const std::string& what) {
  if (got.shape() != want.shape() || got.dtype() != want.dtype()) {
    return ::testing::AssertionFailure() << what << ": shape or dtype differs";
  }
  const size_t es = dtype_size(got.dtype());
  const auto& a = got.bytes();
  const auto& b = want.bytes();
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    const size_t elem = i / es;
    std::ostringstream msg;
    msg << what << ": element " << elem << " differs (byte " << i << ": got 0x" << std::hex
        << int(a[i]) << ", want 0x" << int(b[i]) << std::dec << ")";
    auto fail = ::testing::AssertionFailure();
    fail << msg.str();
    if (got.dtype() == DType::f32) {
      float x, y;
      std::memcpy(&x, a.data() + elem * 4, 4);
      std::memcpy(&y, b.data() + elem * 4, 4);
      fail << " got " << x << " want " << y;
    }
    return fail;
  }
  return ::testing::AssertionSuccess();
}

void poison_bytes(HostTensor& t) { std::fill(t.bytes().begin(), t.bytes().end(), uint8_t{0xa5}); }

bool within_round_trip_bound(double x, double deq, double scale_inv, DType format) {
  const double slack = std::ldexp(1.0, -20);
  const double tiny = std::ldexp(1.0, -140);
  if (std::isnan(x)) return std::isnan(deq);
  const double sat = max_value(format) * scale_inv;
  const bool saturated = std::isinf(x) || std::fabs(x) > sat * (1 + slack);
  const int m = mantissa_bits(format);
  const double want = saturated ? std::copysign(sat, x) : x;
  const double tol = saturated ? sat * slack + tiny
                               : std::ldexp(std::fabs(x), -(m + 1)) +
                                     std::ldexp(scale_inv, min_normal_exp(format) - m - 1) +
                                     slack * std::fabs(x) + tiny;
  if (std::isinf(deq)) {
    // Dequantizing into f32 overflows only where the rounded value may pass FLT_MAX (e.g. inf
    // saturated to 57344 * 2^113, or power-of-two scales rounding 254 * 2^120 up to 2^128).
    return std::fabs(want) + tol > static_cast<double>(FLT_MAX) && std::signbit(deq) == std::signbit(x);
  }
  return std::fabs(deq - want) <= tol;
}

}  // namespace gmoe::test::fp8
