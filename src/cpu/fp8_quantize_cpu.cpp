// src/cpu/fp8_quantize_cpu.cpp — reference FP8 quantization and dequantization: plain loops over
// blocks, the format's rules from common/fp8_rules.h, the software element conversion. The CUDA
// kernels must match it bit for bit (data and scales).
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/backend.h"
#include "common/float_convert.h"
#include "common/fp8_rules.h"

namespace gmoe::cpu_backend {
namespace {

using namespace fp8_rules;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The scale rule of one recipe/format, and the conversion.
struct Rule {
  Fp8Recipe recipe;
  bool e5m2;
  float fmax;
  int emax;
  bool pow2;

  Rule(Fp8Recipe r, DType format, bool pow2_scales)
      : recipe(r),
        e5m2(format == DType::e5m2),
        fmax(e5m2 ? kE5m2Max : kE4m3Max),
        emax(e5m2 ? kE5m2Emax : kE4m3Emax),
        pow2(pow2_scales) {}

  // Scale of a block: the quantization multiplier, and what is stored (f32 bits or an e8m0 byte).
  struct Scale {
    float mult;
    float inv;     // f32 recipes
    uint8_t e8m0;  // mxfp8
  };
  Scale from_amax(float amax) const {
    Scale s{};
    if (recipe == Fp8Recipe::mxfp8) {
      s.e8m0 = e8m0_from_amax(amax, emax);
      s.mult = e8m0_quant_multiplier(s.e8m0);
    } else {
      s.mult = scale_from_amax(amax, fmax, pow2);
      s.inv = scale_inv_from_scale(s.mult);
    }
    return s;
  }
  uint8_t quantize(float x, const Scale& s) const { return fp8_from_float(x * s.mult, e5m2); }
  // Stores a block's scale at element index i of a scale tensor.
  void store(const TensorView& t, int64_t i, const Scale& s) const {
    if (recipe == Fp8Recipe::mxfp8) {
      static_cast<uint8_t*>(t.data)[i] = s.e8m0;
    } else {
      static_cast<float*>(t.data)[i] = s.inv;
    }
  }
  // The "1.0" scale of padding blocks.
  void store_one(const TensorView& t, int64_t i) const {
    if (recipe == Fp8Recipe::mxfp8) {
      static_cast<uint8_t*>(t.data)[i] = kE8m0One;
    } else {
      static_cast<float*>(t.data)[i] = 1.0f;
    }
  }
  // The dequantization multiplier at element index i of a scale tensor.
  float load_inv(const TensorView& t, int64_t i) const {
    if (recipe == Fp8Recipe::mxfp8) return e8m0_to_float(static_cast<const uint8_t*>(t.data)[i]);
    return static_cast<const float*>(t.data)[i];
  }
};

uint8_t* bytes(const TensorView& t) { return static_cast<uint8_t*>(t.data); }

void zero(const TensorView& t) {
  if (t.data != nullptr) std::memset(t.data, 0, static_cast<size_t>(t.nbytes()));
}

}  // namespace

void quantize_grouped(const GroupedRows& x, const Fp8QuantizeOptions& o, const Fp8Grouped& q) {
  const std::vector<int64_t> off = host_group_offsets(x.counts, x.capacity(), "x.counts");
  const int64_t E = x.num_groups(), cap = x.capacity(), cols = x.cols();
  const int64_t total = off[E];
  const Rule rule(o.recipe, o.format, o.pow2_scales);
  const DType xt = x.data.dtype;
  const int64_t ld = x.data.stride(0);
  auto X = [&](int64_t r, int64_t c) { return load_float(x.data.data, xt, r * ld + c); };

  std::vector<int64_t> padded(static_cast<size_t>(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    padded[e + 1] = padded[e] + ceil_div(off[e + 1] - off[e], kFp8TokenPad) * kFp8TokenPad;
  }
  std::memcpy(q.padded_offsets.data, padded.data(), padded.size() * sizeof(int64_t));
  const int64_t P = q.padded_capacity;

  if (o.recipe == Fp8Recipe::tensorwise) {
    std::vector<Rule::Scale> scale(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      float amax = 0.0f;
      if (o.amax.defined()) {
        amax = static_cast<const float*>(o.amax.data)[e];  // the caller's (Fp8QuantizeOptions::amax)
      } else {
        for (int64_t r = off[e]; r < off[e + 1]; ++r) {
          for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, finite_abs(X(r, c)));
        }
      }
      scale[e] = rule.from_amax(amax);
      if (q.scale_inv.defined()) rule.store(q.scale_inv, e, scale[e]);
      if (q.scale_inv_t.defined()) rule.store(q.scale_inv_t, e, scale[e]);
    }
    if (q.data.defined()) {
      zero(q.data);
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t r = off[e]; r < off[e + 1]; ++r) {
          for (int64_t c = 0; c < cols; ++c) bytes(q.data)[r * cols + c] = rule.quantize(X(r, c), scale[e]);
        }
      }
    }
    if (q.data_t.defined()) {
      zero(q.data_t);
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t i = 0; i < off[e + 1] - off[e]; ++i) {
          for (int64_t c = 0; c < cols; ++c) {
            bytes(q.data_t)[c * P + padded[e] + i] = rule.quantize(X(off[e] + i, c), scale[e]);
          }
        }
      }
    }
    return;
  }

  const int64_t block = o.recipe == Fp8Recipe::mxfp8 ? kMxBlock : kFp8Block;
  if (q.data.defined()) {
    // 1 x block along the columns; rows past the total: zeros, scale 1.
    const int64_t nb = ceil_div(cols, block);
    zero(q.data);
    for (int64_t r = 0; r < cap; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t si = fp8_rows_scale_index(o.recipe, r, b, cap, cols);
        if (r >= total) {
          rule.store_one(q.scale_inv, si);
          continue;
        }
        const int64_t c0 = b * block, c1 = std::min(cols, c0 + block);
        float amax = 0.0f;
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, finite_abs(X(r, c)));
        const Rule::Scale s = rule.from_amax(amax);
        rule.store(q.scale_inv, si, s);
        for (int64_t c = c0; c < c1; ++c) bytes(q.data)[r * cols + c] = rule.quantize(X(r, c), s);
      }
    }
  }
  if (q.data_t.defined()) {
    // block x 1 along each expert's tokens, from its padded start; padding: zeros, scale 1.
    const int64_t nb = P / block;
    zero(q.data_t);
    for (int64_t c = 0; c < cols; ++c) {
      for (int64_t b = 0; b < nb; ++b) {
        rule.store_one(q.scale_inv_t, fp8_cols_scale_index(o.recipe, c, b, cols, P));
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      const int64_t count = off[e + 1] - off[e];
      for (int64_t t0 = 0; t0 < count; t0 += block) {
        const int64_t t1 = std::min(count, t0 + block);
        const int64_t b = (padded[e] + t0) / block;
        for (int64_t c = 0; c < cols; ++c) {
          float amax = 0.0f;
          for (int64_t t = t0; t < t1; ++t) amax = std::max(amax, finite_abs(X(off[e] + t, c)));
          const Rule::Scale s = rule.from_amax(amax);
          rule.store(q.scale_inv_t, fp8_cols_scale_index(o.recipe, c, b, cols, P), s);
          for (int64_t t = t0; t < t1; ++t) {
            bytes(q.data_t)[c * P + padded[e] + t] = rule.quantize(X(off[e] + t, c), s);
          }
        }
      }
    }
  }
}

void quantize_weights(const ExpertWeights& w, const Fp8QuantizeOptions& o, const Fp8Weights& q) {
  const int64_t E = w.num_experts(), N = w.rows(), K = w.cols();
  const Rule rule(o.recipe, o.format, o.pow2_scales);
  const DType wt = w.dtype();
  for (int64_t e = 0; e < E; ++e) {
    const TensorView m = w.expert(e);
    auto W = [&](int64_t n, int64_t k) { return load_float(m.data, wt, n * m.stride(0) + k); };
    uint8_t* d = q.data.defined() ? bytes(q.data) + e * N * K : nullptr;
    uint8_t* dt = q.data_t.defined() ? bytes(q.data_t) + e * K * N : nullptr;
    auto put = [&](int64_t n, int64_t k, uint8_t v) {
      if (d) d[n * K + k] = v;
      if (dt) dt[k * N + n] = v;
    };
    switch (o.recipe) {
      case Fp8Recipe::tensorwise: {
        float amax = 0.0f;
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t k = 0; k < K; ++k) amax = std::max(amax, finite_abs(W(n, k)));
        }
        const Rule::Scale s = rule.from_amax(amax);
        if (q.scale_inv.defined()) rule.store(q.scale_inv, e, s);
        if (q.scale_inv_t.defined()) rule.store(q.scale_inv_t, e, s);
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t k = 0; k < K; ++k) put(n, k, rule.quantize(W(n, k), s));
        }
        break;
      }
      case Fp8Recipe::blockwise: {
        const int64_t nbn = ceil_div(N, kFp8Block), nbk = ceil_div(K, kFp8Block);
        for (int64_t bn = 0; bn < nbn; ++bn) {
          for (int64_t bk = 0; bk < nbk; ++bk) {
            const int64_t n0 = bn * kFp8Block, n1 = std::min(N, n0 + kFp8Block);
            const int64_t k0 = bk * kFp8Block, k1 = std::min(K, k0 + kFp8Block);
            float amax = 0.0f;
            for (int64_t n = n0; n < n1; ++n) {
              for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, finite_abs(W(n, k)));
            }
            const Rule::Scale s = rule.from_amax(amax);
            if (q.scale_inv.defined()) rule.store(q.scale_inv, (e * nbn + bn) * nbk + bk, s);
            if (q.scale_inv_t.defined()) rule.store(q.scale_inv_t, (e * nbk + bk) * nbn + bn, s);
            for (int64_t n = n0; n < n1; ++n) {
              for (int64_t k = k0; k < k1; ++k) put(n, k, rule.quantize(W(n, k), s));
            }
          }
        }
        break;
      }
      case Fp8Recipe::mxfp8: {
        if (d) {  // 1x32 along K
          const int64_t nb = ceil_div(K, kMxBlock);
          for (int64_t n = 0; n < N; ++n) {
            for (int64_t b = 0; b < nb; ++b) {
              const int64_t k0 = b * kMxBlock, k1 = std::min(K, k0 + kMxBlock);
              float amax = 0.0f;
              for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, finite_abs(W(n, k)));
              const Rule::Scale s = rule.from_amax(amax);
              rule.store(q.scale_inv, (e * N + n) * nb + b, s);
              for (int64_t k = k0; k < k1; ++k) d[n * K + k] = rule.quantize(W(n, k), s);
            }
          }
        }
        if (dt) {  // 1x32 along N, of Wᵀ
          const int64_t nb = ceil_div(N, kMxBlock);
          for (int64_t k = 0; k < K; ++k) {
            for (int64_t b = 0; b < nb; ++b) {
              const int64_t n0 = b * kMxBlock, n1 = std::min(N, n0 + kMxBlock);
              float amax = 0.0f;
              for (int64_t n = n0; n < n1; ++n) amax = std::max(amax, finite_abs(W(n, k)));
              const Rule::Scale s = rule.from_amax(amax);
              rule.store(q.scale_inv_t, (e * K + k) * nb + b, s);
              for (int64_t n = n0; n < n1; ++n) dt[k * N + n] = rule.quantize(W(n, k), s);
            }
          }
        }
        break;
      }
    }
  }
}

void dequantize_grouped(const Fp8Grouped& q, const TensorView& counts, const TensorView& out,
                        Fp8Copy which) {
  const std::vector<int64_t> off = host_group_offsets(counts, q.capacity, "counts");
  const int64_t E = counts.size(0), cap = q.capacity, cols = q.cols;
  const Rule rule(q.recipe, q.format, false);
  const int64_t ld = out.stride(0);
  auto put = [&](int64_t r, int64_t c, float v) { store_float(out.data, out.dtype, r * ld + c, v); };
  for (int64_t r = off[E]; r < cap; ++r) {
    for (int64_t c = 0; c < cols; ++c) put(r, c, 0.0f);
  }
  const int64_t block = q.recipe == Fp8Recipe::mxfp8 ? kMxBlock : kFp8Block;
  if (which == Fp8Copy::rowwise) {
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = off[e]; r < off[e + 1]; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const float inv =
              q.recipe == Fp8Recipe::tensorwise
                  ? rule.load_inv(q.scale_inv, e)
                  : rule.load_inv(q.scale_inv, fp8_rows_scale_index(q.recipe, r, c / block, cap, cols));
          put(r, c, fp8_to_float(bytes(q.data)[r * cols + c], rule.e5m2) * inv);
        }
      }
    }
    return;
  }
  const int64_t P = q.padded_capacity;
  const int64_t* padded = static_cast<const int64_t*>(q.padded_offsets.data);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      const int64_t p = padded[e] + (r - off[e]);
      for (int64_t c = 0; c < cols; ++c) {
        const float inv =
            q.recipe == Fp8Recipe::tensorwise
                ? rule.load_inv(q.scale_inv_t, e)
                : rule.load_inv(q.scale_inv_t, fp8_cols_scale_index(q.recipe, c, p / block, cols, P));
        put(r, c, fp8_to_float(bytes(q.data_t)[c * P + p], rule.e5m2) * inv);
      }
    }
  }
}

void dequantize_weights(const Fp8Weights& q, const ExpertWeights& out, Fp8Copy which) {
  const int64_t E = q.experts, N = q.rows, K = q.cols;
  const Rule rule(q.recipe, q.format, false);
  const int64_t nbn = ceil_div(N, kFp8Block), nbk = ceil_div(K, kFp8Block);
  const int64_t mbn = ceil_div(N, kMxBlock), mbk = ceil_div(K, kMxBlock);
  for (int64_t e = 0; e < E; ++e) {
    const TensorView m = out.expert(e);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        float v;
        if (which == Fp8Copy::rowwise) {
          const uint8_t b = bytes(q.data)[(e * N + n) * K + k];
          int64_t si = e;
          if (q.recipe == Fp8Recipe::blockwise) si = (e * nbn + n / kFp8Block) * nbk + k / kFp8Block;
          if (q.recipe == Fp8Recipe::mxfp8) si = (e * N + n) * mbk + k / kMxBlock;
          v = fp8_to_float(b, rule.e5m2) * rule.load_inv(q.scale_inv, si);
        } else {
          const uint8_t b = bytes(q.data_t)[(e * K + k) * N + n];
          int64_t si = e;
          if (q.recipe == Fp8Recipe::blockwise) si = (e * nbk + k / kFp8Block) * nbn + n / kFp8Block;
          if (q.recipe == Fp8Recipe::mxfp8) si = (e * K + k) * mbn + n / kMxBlock;
          v = fp8_to_float(b, rule.e5m2) * rule.load_inv(q.scale_inv_t, si);
        }
        store_float(m.data, m.dtype, n * m.stride(0) + k, v);
      }
    }
  }
}

}  // namespace gmoe::cpu_backend
