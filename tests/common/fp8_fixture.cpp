// tests/common/fp8_fixture.cpp — host-side FP8 grouped-GEMM problems for the test suites.
#include "common/fp8_fixture.h"

#include "common/fp8_rules.h"
#include "gmoe/error.h"

namespace gmoe::test {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

const uint8_t* bytes(const TensorView& t) { return static_cast<const uint8_t*>(t.data); }

// Scale `i` of a scale tensor: f32, or e8m0 for mxfp8.
double scale_at(const TensorView& s, int64_t i) {
  if (s.dtype == DType::e8m0) return fp8_rules::e8m0_to_float(bytes(s)[i]);
  return static_cast<const float*>(s.data)[i];
}

double fp8_at(const TensorView& d, int64_t i, DType format) {
  return fp8_rules::fp8_to_float(bytes(d)[i], format == DType::e5m2);
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> off(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + counts[e];
  return off;
}

int64_t block_of(Fp8Recipe r) { return r == Fp8Recipe::mxfp8 ? kMxBlock : kFp8Block; }

}  // namespace

HostTensor decode_grouped(const Fp8Grouped& q, const std::vector<int64_t>& counts, Fp8Copy which) {
  const int64_t cap = q.capacity, cols = q.cols;
  const std::vector<int64_t> off = offsets_of(counts);
  const int64_t block = block_of(q.recipe);
  HostTensor out(DType::f32, {cap, cols});
  for (int64_t i = 0; i < out.numel(); ++i) out.set(i, 0.0);
  for (size_t e = 0; e < counts.size(); ++e) {
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        double v;
        if (which == Fp8Copy::rowwise) {
          const double s = q.recipe == Fp8Recipe::tensorwise
                               ? scale_at(q.scale_inv, static_cast<int64_t>(e))
                               : scale_at(q.scale_inv, q.recipe == Fp8Recipe::blockwise
                                                           ? c / block * cap + r  // token-major
                                                           : r * ceil_div(cols, block) + c / block);
          v = fp8_at(q.data, r * cols + c, q.format) * s;
        } else {
          const int64_t P = q.padded_capacity;
          const int64_t p = static_cast<const int64_t*>(q.padded_offsets.data)[e] + (r - off[e]);
          const double s = q.recipe == Fp8Recipe::tensorwise
                               ? scale_at(q.scale_inv_t, static_cast<int64_t>(e))
                           : q.recipe == Fp8Recipe::blockwise  // [P/128, cols]
                               ? scale_at(q.scale_inv_t, p / block * cols + c)
                               : scale_at(q.scale_inv_t, c * (P / block) + p / block);
          v = fp8_at(q.data_t, c * P + p, q.format) * s;
        }
        out.set(r * cols + c, v);
      }
    }
  }
  return out;
}

std::vector<HostTensor> decode_weights(const Fp8Weights& q, Fp8Copy which) {
  const int64_t E = q.experts, N = q.rows, K = q.cols;
  std::vector<HostTensor> out;
  for (int64_t e = 0; e < E; ++e) {
    HostTensor m(DType::f32, {N, K});
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        double v;
        if (which == Fp8Copy::rowwise) {
          int64_t si = e;  // tensorwise
          if (q.recipe == Fp8Recipe::blockwise) {
            si = (e * ceil_div(N, kFp8Block) + n / kFp8Block) * ceil_div(K, kFp8Block) +
                 k / kFp8Block;
          } else if (q.recipe == Fp8Recipe::mxfp8) {
            si = (e * N + n) * ceil_div(K, kMxBlock) + k / kMxBlock;
          }
          v = fp8_at(q.data, (e * N + n) * K + k, q.format) * scale_at(q.scale_inv, si);
        } else {
          int64_t si = e;
          if (q.recipe == Fp8Recipe::blockwise) {
            si = (e * ceil_div(K, kFp8Block) + k / kFp8Block) * ceil_div(N, kFp8Block) +
                 n / kFp8Block;
          } else if (q.recipe == Fp8Recipe::mxfp8) {
            si = (e * K + k) * ceil_div(N, kMxBlock) + n / kMxBlock;
          }
          v = fp8_at(q.data_t, (e * K + k) * N + n, q.format) * scale_at(q.scale_inv_t, si);
        }
        m.set(n * K + k, v);
      }
    }
    out.push_back(std::move(m));
  }
  return out;
}

Fp8Problem::Fp8Problem(const ShapeCase& c, Fp8Recipe r, Rng& rng, DType counts_dtype, DType fmt,
                       std::optional<DType> grad_fmt)
    : base(c, DType::bf16, rng, counts_dtype), recipe(r), format(fmt), grad_format(grad_fmt.value_or(fmt)) {
  Fp8QuantizeOptions o;
  o.recipe = r;
  o.format = fmt;
  o.rowwise = true;
  o.columnwise = true;
  Fp8QuantizeOptions og = o;
  og.format = grad_format;
  x = quantize_grouped(GroupedRows{base.x.view(), base.counts.view()}, o);
  dy = quantize_grouped(GroupedRows{base.dy.view(), base.counts.view()}, og);
  w = quantize_weights(base.weights(Layout::kStacked), o);
  x_rows = decode_grouped(x.q, c.counts, Fp8Copy::rowwise);
  dy_rows = decode_grouped(dy.q, c.counts, Fp8Copy::rowwise);
  x_cols = decode_grouped(x.q, c.counts, Fp8Copy::columnwise);
  dy_cols = decode_grouped(dy.q, c.counts, Fp8Copy::columnwise);
  w_data = decode_weights(w.q, Fp8Copy::rowwise);
  w_t = decode_weights(w.q, Fp8Copy::columnwise);
}

ExactResult against_source(const ExactResult& quantized, const ExactResult& source) {
  ExactResult r = quantized;
  r.value = source.value;
  return r;
}

}  // namespace gmoe::test
