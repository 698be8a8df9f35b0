// tools/bench/mlp_common.cpp — mlp mode: configuration, the unfused composition, checks and rows
// (see mlp_common.h).
#include "bench/mlp_common.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

#include "bench/layer_common.h"
#include "common/activation_math.h"
#include "common/float_convert.h"
#include "gmoe/error.h"

namespace gmoe::bench {

ActivationOptions mlp_activation(const BenchCase& c, int64_t glu_block) {
  ActivationOptions o;
  o.kind = activation_from_name(c.activation.empty() ? "swiglu" : c.activation);
  if (is_gated(o.kind) && glu_block > 0 && c.ffn % glu_block == 0) o.glu = {GluLayout::interleaved, glu_block};
  return o;  // alpha 1.702, limit 7: gpt-oss's (docs/benchmarks.md)
}

int64_t mlp_fc1_rows(const BenchCase& c) { return activation_input_cols(mlp_activation(c).kind, c.ffn); }

namespace {

GroupedLinearOptions fc_options(const TensorView& main_grad, bool keep_input_reference) {
  GroupedLinearOptions o;
  if (main_grad.defined()) {  // else fresh gradients
    o.main_grad = ExpertWeights::from_stacked(main_grad);
    o.accumulate = true;
  }
  o.save_original_input = keep_input_reference;
  return o;
}

}  // namespace

GroupedMLP make_bench_mlp(const BenchCase& c, const MlpParams& p, LinearRecipe recipe, bool fp8_wgrad,
                          bool quant_in_act, bool requant_input, bool pow2,
                          bool fast_accum) {
  GroupedMLPOptions o;
  o.activation = mlp_activation(c, p.glu_block);
  o.recipe = recipe;
  o.fc1 = fc_options(p.mg1, bench_keeps_input_reference(recipe, fp8_wgrad, requant_input, false));
  o.fc2 = fc_options(p.mg2, true);
  o.fc1.fp8_wgrad = o.fc2.fp8_wgrad = fp8_wgrad;
  o.fc1.fp8_pow2_scales = o.fc2.fp8_pow2_scales = pow2;
  o.fc1.fp8_fast_accumulation = o.fc2.fp8_fast_accumulation = fast_accum;
  o.fp8_quantize_in_activation = quant_in_act;
  return GroupedMLP(ExpertWeights::from_stacked(p.w1), ExpertWeights::from_stacked(p.w2), {}, {}, o);
}

UnfusedMlp::UnfusedMlp(const BenchCase& c, const MlpParams& p)
    : act_(mlp_activation(c, p.glu_block)),
      fc1_(ExpertWeights::from_stacked(p.w1), {}, fc_options(p.mg1, true)),
      fc2_(ExpertWeights::from_stacked(p.w2), {}, fc_options(p.mg2, true)) {}

void UnfusedMlp::forward(const TensorView& x, const TensorView& counts, Context& ctx, Stream stream,
                         const TensorView& y) {
  Allocator& alloc = default_allocator(x.device);
  ctx.h = fc1_.forward(x, counts, ctx.fc1, stream);
  ctx.z = Tensor::empty({x.size(0), fc2_.in_features()}, x.dtype, alloc, stream);
  grouped_activation_forward(ctx.h, counts, ctx.z, act_, {}, stream);
  fc2_.forward(ctx.z, counts, ctx.fc2, stream, y);
  ctx.counts = counts;
}

void UnfusedMlp::backward(Context& ctx, const TensorView& dy, Stream stream, const TensorView& dx) {
  GroupedLinearBackward b2 = fc2_.backward(ctx.fc2, dy, stream);
  grouped_activation_backward(ctx.h, b2.dx, ctx.counts, ctx.h, act_, {}, {}, {}, stream);
  b2.dx.release_on(stream);
  ctx.z.release_on(stream);
  fc1_.backward(ctx.fc1, ctx.h, stream, dx);
  ctx.h.release_on(stream);
}

// ---------------------------------------------------------------------------------------------
// Sampled reference

namespace {

// The activation in fp64: value and partial derivatives (the formulas of gmoe/activation.h).
struct Act64 {
  double value = 0, d_gate = 0, d_up = 0;
};
constexpr double kPi = 3.14159265358979323846;
double sigmoid64(double x) { return 1.0 / (1.0 + std::exp(-x)); }
Act64 act64(const ActivationOptions& o, double g, double u) {
  Act64 r;
  switch (o.kind) {
    case ActivationKind::swiglu: {
      const double s = sigmoid64(g);
      return {g * s * u, u * s * (1 + g * (1 - s)), g * s};
    }
    case ActivationKind::geglu: {
      double ge, d;
      if (o.gelu_tanh) {
        const double k = std::sqrt(2.0 / kPi), t = std::tanh(k * (g + 0.044715 * g * g * g));
        ge = 0.5 * g * (1 + t);
        d = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g);
      } else {
        const double cdf = 0.5 * (1 + std::erf(g / std::sqrt(2.0)));
        ge = g * cdf;
        d = cdf + g * std::exp(-0.5 * g * g) / std::sqrt(2 * kPi);
      }
      return {ge * u, u * d, ge};
    }
    case ActivationKind::clamped_swiglu: {
      const double L = o.limit, a = o.alpha;
      const double gc = std::min(g, L), uc = std::clamp(u, -L, L), s = sigmoid64(a * gc);
      return {gc * s * (uc + 1), g <= L ? (uc + 1) * s * (1 + a * gc * (1 - s)) : 0.0,
              (u >= -L && u <= L) ? gc * s : 0.0};
    }
    case ActivationKind::squared_relu: {
      const double rl = g > 0 ? g : 0.0;
      return {rl * rl, 2 * rl, 0.0};
    }
  }
  return r;
}

// The same in f32 with the library's formulas (the layer's own precision).
act::Eval act32(const ActivationOptions& o, float g, float u) {
  const act::Params prm{o.alpha, o.limit, o.gelu_tanh};
  switch (o.kind) {
    case ActivationKind::swiglu: return act::gated_eval<ActivationKind::swiglu>(g, u, prm);
    case ActivationKind::geglu: return act::gated_eval<ActivationKind::geglu>(g, u, prm);
    case ActivationKind::clamped_swiglu: return act::gated_eval<ActivationKind::clamped_swiglu>(g, u, prm);
    case ActivationKind::squared_relu: break;
  }
  return {act::squared_relu_value(g), act::squared_relu_derivative(g), 0.0f};
}

}  // namespace

MlpRowReference mlp_row_reference(const MlpHostData& d, int64_t e, const float* x, const double* dy_exact,
                                  const float* dy_own) {
  const int64_t H = d.H, F = d.F, R1 = d.R1;
  const bool gated = is_gated(d.act.kind);
  const int64_t block = d.act.glu.layout == GluLayout::interleaved ? d.act.glu.block : 0;
  auto in = [&](const void* p, int64_t i) { return load_float(p, d.dtype, i); };
  const DType dt = d.dtype;
  const size_t r1 = static_cast<size_t>(R1), f = static_cast<size_t>(F), hh = static_cast<size_t>(H);
  std::vector<double> h64(r1), z64(f), dz64(f, 0.0), dh64(r1);
  std::vector<float> h32(r1), z32(f), dz32(f, 0.0f), dh32(r1), w(hh);
  const int64_t w1e = e * R1 * H, w2e = e * H * F;
  MlpRowReference ref;
  ref.y_exact.assign(hh, 0.0);
  ref.y_own = ref.dx_exact = ref.dx_own = ref.y_exact;
  // h = x·W1ᵀ
  for (int64_t c = 0; c < R1; ++c) {
    double acc64 = 0;
    float acc32 = 0;
    for (int64_t k = 0; k < H; ++k) {
      const float a = x[k], b = in(d.w1, w1e + c * H + k);
      acc64 += double(a) * double(b);
      acc32 += a * b;
    }
    h64[c] = acc64;
    h32[c] = round_to(dt, acc32);
  }
  // dz = dy·W2 (needs only dy and W2)
  for (int64_t n = 0; n < H; ++n) {
    for (int64_t j = 0; j < F; ++j) {
      const float b = in(d.w2, w2e + n * F + j);
      dz64[j] += dy_exact[n] * double(b);
      dz32[j] += dy_own[n] * b;
    }
  }
  for (int64_t j = 0; j < F; ++j) dz32[j] = round_to(dt, dz32[j]);
  // z = act(h), dh = act'(h)·dz
  for (int64_t j = 0; j < F; ++j) {
    const int64_t gc = gated ? act::gate_column(j, block) : j;
    const int64_t uc = gated ? gc + act::up_offset(F, block) : j;
    const Act64 a = act64(d.act, h64[gc], gated ? h64[uc] : 0.0);
    const act::Eval b = act32(d.act, h32[gc], gated ? h32[uc] : 0.0f);
    z64[j] = a.value;
    z32[j] = round_to(dt, b.value);
    dh64[gc] = dz64[j] * a.d_gate;
    dh32[gc] = round_to(dt, dz32[j] * b.d_gate);
    if (gated) {
      dh64[uc] = dz64[j] * a.d_up;
      dh32[uc] = round_to(dt, dz32[j] * b.d_up);
    }
  }
  // y = z·W2ᵀ, dx = dh·W1
  for (int64_t n = 0; n < H; ++n) {
    double acc64 = 0;
    float acc32 = 0;
    for (int64_t j = 0; j < F; ++j) {
      const float b = in(d.w2, w2e + n * F + j);
      acc64 += z64[j] * double(b);
      acc32 += z32[j] * b;
    }
    ref.y_exact[n] = acc64;
    ref.y_own[n] = round_to(dt, acc32);
  }
  std::vector<double> dx64(hh, 0.0);
  std::vector<float> dx32(hh, 0.0f);
  for (int64_t c = 0; c < R1; ++c) {
    for (int64_t k = 0; k < H; ++k) w[k] = in(d.w1, w1e + c * H + k);
    for (int64_t k = 0; k < H; ++k) {
      dx64[k] += dh64[c] * double(w[k]);
      dx32[k] += dh32[c] * w[k];
    }
  }
  for (int64_t k = 0; k < H; ++k) {
    ref.dx_exact[k] = dx64[k];
    ref.dx_own[k] = round_to(dt, dx32[k]);
  }
  return ref;
}

MlpReference mlp_reference(const MlpHostData& d, int samples, uint64_t seed) {
  MlpReference ref;
  if (d.rows == 0) return ref;
  const int64_t n_rows = std::clamp<int64_t>(samples / 32, 4, 64);
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < n_rows; ++i) {
    ref.rows.push_back(std::uniform_int_distribution<int64_t>(0, d.offsets.back() - 1)(rng));
  }
  const int64_t H = d.H;
  ref.y_exact.assign(size_t(n_rows * H), 0.0);
  ref.y_own = ref.dx_exact = ref.dx_own = ref.y_exact;
  std::vector<float> x(static_cast<size_t>(H)), dy_own(static_cast<size_t>(H));
  std::vector<double> dy_exact(static_cast<size_t>(H));
  for (int64_t s = 0; s < n_rows; ++s) {
    const int64_t r = ref.rows[s];
    const int64_t e = std::upper_bound(d.offsets.begin(), d.offsets.end(), r) - d.offsets.begin() - 1;
    for (int64_t k = 0; k < H; ++k) {
      x[k] = load_float(d.x, d.dtype, r * H + k);
      dy_own[k] = load_float(d.dy, d.dtype, r * H + k);
      dy_exact[k] = dy_own[k];
    }
    const MlpRowReference row = mlp_row_reference(d, e, x.data(), dy_exact.data(), dy_own.data());
    std::copy(row.y_exact.begin(), row.y_exact.end(), ref.y_exact.begin() + s * H);
    std::copy(row.y_own.begin(), row.y_own.end(), ref.y_own.begin() + s * H);
    std::copy(row.dx_exact.begin(), row.dx_exact.end(), ref.dx_exact.begin() + s * H);
    std::copy(row.dx_own.begin(), row.dx_own.end(), ref.dx_own.begin() + s * H);
  }
  return ref;
}

namespace {

CheckResult check_rows_against(const MlpHostData& d, const MlpReference& ref, const std::vector<double>& exact,
                               const std::vector<double>& own, const void* out, const char* name) {
  const double u = d.dtype == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  std::vector<double> got(exact.size());
  for (size_t s = 0; s < ref.rows.size(); ++s) {
    for (int64_t n = 0; n < d.H; ++n) got[s * size_t(d.H) + size_t(n)] = load_float(out, d.dtype, ref.rows[s] * d.H + n);
  }
  const std::string rows = " over " + std::to_string(ref.rows.size()) + " rows";
  CheckResult r = check_gathered(exact, own, got, u, name, count_nonfinite(out, d.dtype, d.rows * d.H), [&](size_t i) {
    return "[" + std::to_string(ref.rows[i / size_t(d.H)]) + ", " + std::to_string(i % size_t(d.H)) + "]";
  });
  const size_t at = r.detail.find(')');
  r.detail.insert(at + 1, rows);
  return r;
}

}  // namespace

namespace {

CheckResult check_rows_relative(const MlpHostData& d, const MlpReference& ref, const std::vector<double>& exact,
                                const void* out, const char* name, double max_rel) {
  const int64_t nonfinite = count_nonfinite(out, d.dtype, d.rows * d.H);
  double err_sq = 0, ref_sq = 0;
  for (size_t s = 0; s < ref.rows.size(); ++s) {
    for (int64_t n = 0; n < d.H; ++n) {
      const size_t i = s * size_t(d.H) + size_t(n);
      const double e = load_float(out, d.dtype, ref.rows[s] * d.H + n) - exact[i];
      err_sq += e * e;
      ref_sq += exact[i] * exact[i];
    }
  }
  const double rel = ref_sq > 0 ? std::sqrt(err_sq / ref_sq) : std::sqrt(err_sq);
  CheckResult r;
  r.ok = nonfinite == 0 && rel <= max_rel;
  std::ostringstream os;
  os << name << ": relative Frobenius error " << rel << " (bound " << max_rel << ") over " << ref.rows.size()
     << " rows";
  if (nonfinite) os << ", " << nonfinite << " non-finite outputs";
  r.detail = os.str();
  return r;
}

}  // namespace

CheckResult check_gathered(const std::vector<double>& exact, const std::vector<double>& own,
                           const std::vector<double>& got, double u, const char* name, int64_t nonfinite_elsewhere,
                           const std::function<std::string(size_t)>& label) {
  double max_err = 0, max_ref_err = 0, sum_sq = 0;
  const int64_t nonfinite = nonfinite_elsewhere;  // a non-finite sample fails by its infinite error
  size_t worst = exact.size();
  for (size_t i = 0; i < exact.size(); ++i) {
    const double err = std::isfinite(got[i]) ? std::abs(got[i] - exact[i]) : INFINITY;
    max_ref_err = std::max(max_ref_err, std::abs(own[i] - exact[i]));
    sum_sq += exact[i] * exact[i];
    if (err > max_err || worst == exact.size()) {
      max_err = std::max(max_err, err);
      worst = i;
    }
  }
  const double rms = exact.empty() ? 0 : std::sqrt(sum_sq / double(exact.size()));
  const double limit = 2 * max_ref_err + u * rms + 1e-30;
  CheckResult r;
  r.ok = nonfinite == 0 && max_err <= limit;
  std::ostringstream os;
  os << name << ": max err " << max_err << " (limit " << limit << ")";
  if (nonfinite) os << ", " << nonfinite << " non-finite outputs";
  if (!r.ok && worst < exact.size()) os << ", worst " << label(worst) << " got " << got[worst] << " exact " << exact[worst];
  r.detail = os.str();
  return r;
}

MlpCheck check_mlp_quantized(const MlpHostData& d, const MlpReference& ref, const void* y, const void* dx,
                             double max_rel) {
  MlpCheck chk;
  chk.forward = check_rows_relative(d, ref, ref.y_exact, y, "y", max_rel);
  const CheckResult cdx = check_rows_relative(d, ref, ref.dx_exact, dx, "dx", max_rel);
  chk.backward.ok = chk.forward.ok && cdx.ok;
  chk.backward.detail = chk.forward.detail + "; " + cdx.detail;
  return chk;
}

MlpCheck check_mlp(const MlpHostData& d, const MlpReference& ref, const void* y, const void* dx) {
  MlpCheck chk;
  chk.forward = check_rows_against(d, ref, ref.y_exact, ref.y_own, y, "y");
  const CheckResult cdx = check_rows_against(d, ref, ref.dx_exact, ref.dx_own, dx, "dx");
  chk.backward.ok = chk.forward.ok && cdx.ok;
  chk.backward.detail = chk.forward.detail + "; " + cdx.detail;
  return chk;
}

std::vector<ResultRow> mlp_rows(const BenchCase& c, DType dt, const std::string& impl, const MlpTimes& t,
                                const MlpCheck& chk, bool main_grad) {
  const double flops = mlp_flops(c);
  const std::string config = main_grad ? "; dW accumulated in f32 main_grads" : "; dW fresh bf16";
  auto row = [&](const char* pass, double pass_flops, double ms, const CheckResult& check) {
    return timed_row(c.name, pass, impl, dtype_name(dt), ms, pass_flops, check.ok, check.detail + config);
  };
  return {row("forward", flops, t.forward_ms, chk.forward),
          row("forward_backward", 3 * flops, t.forward_backward_ms, chk.backward)};
}

}  // namespace gmoe::bench
