// tests/common/gemm_fixture.cpp — host-side grouped-GEMM problems for the test suites.
#include "common/gemm_fixture.h"

#include <cmath>

namespace gmoe::test {

GemmProblem::GemmProblem(const ShapeCase& c, DType dt, Rng& rng, DType counts_dtype)
    : shape(c), dtype(dt) {
  x = HostTensor(dtype, {c.capacity, c.K});
  dy = HostTensor(dtype, {c.capacity, c.N});
  fill_random(x, rng);
  fill_random(dy, rng);
  w_stacked = HostTensor(dtype, {c.E, c.N, c.K});
  fill_random(w_stacked, rng);
  const int64_t per = c.N * c.K;
  for (int64_t e = 0; e < c.E; ++e) {
    HostTensor we(dtype, {c.N, c.K});
    for (int64_t i = 0; i < per; ++i) we.set(i, w_stacked.get(e * per + i));
    w.push_back(std::move(we));
  }
  counts = make_counts(c.counts, counts_dtype);
}

ExpertWeights GemmProblem::weights(Layout layout) const {
  if (layout == Layout::kStacked) return ExpertWeights::from_stacked(w_stacked.view());
  std::vector<TensorView> views;
  for (const HostTensor& we : w) views.push_back(we.view());
  return ExpertWeights::from_list(std::move(views));
}

ExpertBias expert_bias(const TensorView& storage, Layout layout) {
  if (layout == Layout::kStacked) return ExpertBias::from_grouped(storage);
  std::vector<TensorView> rows;
  for (int64_t e = 0; e < storage.size(0); ++e) rows.push_back(storage.select0(e));
  return ExpertBias::from_list(std::move(rows));
}

std::string BiasForm::name() const {
  return std::string(dtype_name(dtype)) + (layout == Layout::kStacked ? " grouped" : " list");
}

std::vector<BiasForm> bias_forms(DType rows_dtype) {
  return {{rows_dtype, Layout::kStacked}, {rows_dtype, Layout::kList}, {DType::f32, Layout::kStacked},
          {DType::f32, Layout::kList}};
}

TensorView BiasGradCase::view() const {
  return TensorView(const_cast<void*>(storage.data()), storage.dtype(), Device::cpu(), {capacity, cols},
                    {cols + pad, 1});
}

std::vector<BiasGradCase> bias_grad_cases(DType dtype, Rng& rng) {
  auto random_counts = [&](int64_t E, int64_t hi) {
    std::vector<int64_t> c(static_cast<size_t>(E));
    for (int64_t& v : c) v = rng.integer(0, hi);
    return c;
  };
  std::vector<int64_t> one(6, 0);
  one[static_cast<size_t>(rng.integer(0, 5))] = 700;
  std::vector<int64_t> long_short = random_counts(5, 9);
  long_short[2] = 3000 + rng.integer(0, 200);
  std::vector<BiasGradCase> cases = {
      {"skewed_empty_slack", zipf_counts(8, 300, 1.2, 3, rng), 0, 64, 0},
      {"one_expert_all_rows", one, 0, 40, 8},
      {"zero_rows", {0, 0, 0, 0}, 0, 16, 0},
      {"all_empty_slack_rows", {0, 0, 0}, 0, 24, 0},
      {"width_1", random_counts(4, 40), 0, 1, 0},
      {"width_3", random_counts(5, 40), 0, 3, 2},
      {"width_33", random_counts(7, 60), 0, 33, 0},
      {"width_129", random_counts(3, 200), 0, 129, 5},
      {"e300", random_counts(300, 6), 0, 24, 0},
      {"e1000", random_counts(1000, 3), 0, 8, 0},
      {"long_beside_short", long_short, 0, 96, 0},
  };
  for (BiasGradCase& c : cases) {
    int64_t total = 0;
    for (int64_t v : c.counts) total += v;
    c.capacity = total + (c.name.find("slack") != std::string::npos ? 11 : 0);
    c.storage = HostTensor(dtype, {c.capacity, c.cols + c.pad});
    fill_random(c.storage, rng);
    c.dy = HostTensor(dtype, {c.capacity, c.cols});
    for (int64_t r = 0; r < c.capacity; ++r) {
      for (int64_t n = 0; n < c.cols; ++n) c.dy.set(r * c.cols + n, c.storage.get(r * (c.cols + c.pad) + n));
    }
  }
  return cases;
}

HostExpertTensor::HostExpertTensor(Layout l, DType dtype, int64_t E, int64_t N, int64_t K)
    : layout(l) {
  if (layout == Layout::kStacked) {
    stacked = HostTensor(dtype, {E, N, K});
  } else {
    for (int64_t e = 0; e < E; ++e) list.emplace_back(dtype, std::vector<int64_t>{N, K});
  }
}

ExpertWeights HostExpertTensor::view() const {
  if (layout == Layout::kStacked) return ExpertWeights::from_stacked(stacked.view());
  std::vector<TensorView> views;
  for (const HostTensor& t : list) views.push_back(t.view());
  return ExpertWeights::from_list(std::move(views));
}

std::vector<double> HostExpertTensor::to_double() const {
  if (layout == Layout::kStacked) return stacked.to_double();
  std::vector<double> out;
  for (const HostTensor& t : list) {
    const std::vector<double> v = t.to_double();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

void HostExpertTensor::poison_all() {
  if (layout == Layout::kStacked) poison(stacked);
  for (HostTensor& t : list) poison(t);
}

void HostExpertTensor::set_all(const std::vector<double>& values) {
  if (layout == Layout::kStacked) {
    for (int64_t i = 0; i < stacked.numel(); ++i) stacked.set(i, values[i]);
    return;
  }
  int64_t base = 0;
  for (HostTensor& t : list) {
    for (int64_t i = 0; i < t.numel(); ++i) t.set(i, values[base + i]);
    base += t.numel();
  }
}

MaskedOffDestinations::MaskedOffDestinations(int64_t E, int64_t N, int64_t K, Rng& rng)
    : mask(static_cast<size_t>(E)), mask_t(DType::i32, {E}) {
  for (int64_t e = 0; e < E; ++e) mask[e] = static_cast<int32_t>(rng.integer(0, 1));
  if (E >= 2) {  // both destinations in every case, at random places
    const int64_t one = rng.integer(0, E - 1);
    const int64_t zero = (one + rng.integer(1, E - 1)) % E;
    mask[one] = 1;
    mask[zero] = 0;
  }
  for (int64_t e = 0; e < E; ++e) mask_t.set(e, mask[e]);
  HostTensor init(DType::f32, {E, N, K});
  fill_random(init, rng, -4.0, 4.0);
  main_init = init.to_double();
  fill_random(init, rng, -4.0, 4.0);
  fresh_init = init.to_double();
}

MaskedOffBuffers::MaskedOffBuffers(const MaskedOffDestinations& d, Layout layout, int64_t E, int64_t N, int64_t K)
    : main(layout, DType::f32, E, N, K),
      fresh(layout == Layout::kStacked ? Layout::kList : Layout::kStacked, DType::f32, E, N, K) {
  main.set_all(d.main_init);
  fresh.set_all(d.fresh_init);
}

WgradOptions masked_off_wgrad_options(bool accumulate, const TensorView& mask, const ExpertWeights& fresh) {
  WgradOptions opt;
  opt.accumulate = accumulate;
  opt.expert_mask = mask;
  opt.masked_off = MaskedOffWgrad::fresh;
  opt.fresh_dw = fresh;
  return opt;
}

GroupedLinearOptions main_grad_options(LinearRecipe recipe, const ExpertWeights& main_grad, bool accumulate,
                                       bool delayed, Allocator* alloc, const TensorView& mask) {
  GroupedLinearOptions opt;
  opt.recipe = recipe;
  opt.main_grad = main_grad;
  opt.accumulate = accumulate;
  opt.delay_wgrad = delayed;
  opt.allocator = alloc;
  if (mask.defined()) {
    opt.expert_mask = mask;
    opt.masked_off = MaskedOffWgrad::fresh;
  }
  return opt;
}

void expect_masked_off_destinations(const MaskedOffDestinations& d, const HostTensor& dy, const HostTensor& x,
                                    const std::vector<int64_t>& counts, bool accumulate,
                                    const std::vector<double>& main, const std::vector<double>& fresh,
                                    const std::vector<double>* own_main, const std::vector<double>* own_fresh,
                                    const std::string& what, Fp8Accumulation fp8) {
  const int64_t E = static_cast<int64_t>(counts.size());
  const int64_t per = E == 0 ? 0 : static_cast<int64_t>(main.size()) / E;
  std::vector<int32_t> inverse(d.mask.size());
  for (size_t e = 0; e < d.mask.size(); ++e) inverse[e] = d.mask[e] == 0 ? 1 : 0;
  // The exact results of each destination; the experts it must not touch hold their init.
  ExactResult main_exact = exact_wgrad(dy, x, counts, accumulate ? &d.main_init : nullptr, &d.mask);
  ExactResult fresh_exact = exact_wgrad(dy, x, counts, nullptr, &inverse);
  for (int64_t e = 0; e < E; ++e) {
    const bool to_main = d.mask[e] != 0;
    const bool empty = counts[e] == 0;
    for (int64_t i = 0; i < per; ++i) {
      const int64_t at = e * per + i;
      if (to_main) {
        fresh_exact.value[at] = fresh_exact.f32[at] = d.fresh_init[at];
        ASSERT_EQ(fresh[at], d.fresh_init[at]) << what << ": expert " << e << " (mask 1) wrote the fresh buffer";
        if (empty && accumulate) {
          ASSERT_EQ(main[at], d.main_init[at]) << what << ": empty expert " << e << " changed main_grad";
        } else if (empty) {
          ASSERT_EQ(main[at], 0.0) << what << ": empty expert " << e << " not exactly zero in main_grad";
        }
      } else {
        main_exact.value[at] = main_exact.f32[at] = d.main_init[at];
        ASSERT_EQ(main[at], d.main_init[at]) << what << ": expert " << e << " (mask 0) wrote main_grad";
        if (empty) ASSERT_EQ(fresh[at], 0.0) << what << ": empty expert " << e << " not exactly zero in the fresh buffer";
      }
    }
  }
  if (own_main != nullptr) {
    EXPECT_TRUE(within_rule(main, *own_main, main_exact, DType::f32, what + " main_grad", fp8));
    EXPECT_TRUE(within_rule(fresh, *own_fresh, fresh_exact, DType::f32, what + " fresh", fp8));
  } else {
    EXPECT_TRUE(within_rule(main, main_exact, DType::f32, what + " main_grad", fp8));
    EXPECT_TRUE(within_rule(fresh, fresh_exact, DType::f32, what + " fresh", fp8));
  }
}

void expect_layer_masked_off(const std::vector<int32_t>& mask, bool accumulate, const std::vector<double>& main_init,
                             double untouched, const std::vector<double>& product, const std::vector<double>& main,
                             const std::vector<double>& fresh, double rel, const std::string& what) {
  const int64_t E = static_cast<int64_t>(mask.size());
  ASSERT_EQ(main.size(), product.size()) << what;
  ASSERT_EQ(fresh.size(), product.size()) << what;
  const int64_t per = E == 0 ? 0 : static_cast<int64_t>(product.size()) / E;
  // `scale`: the size of the terms summed into `want` (its error bound's scale under cancellation).
  const auto computed = [&](double got, double want, double scale, int64_t e, const char* where) {
    if (rel == 0.0) {
      ASSERT_EQ(got, want) << what << ": expert " << e << " " << where;
    } else {
      ASSERT_NEAR(got, want, rel * scale + 1e-30) << what << ": expert " << e << " " << where;
    }
  };
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < per; ++i) {
      const int64_t at = e * per + i;
      if (mask[e] != 0) {
        ASSERT_EQ(fresh[at], untouched) << what << ": expert " << e << " (mask 1) wrote its fresh view";
        const double want = accumulate ? static_cast<double>(static_cast<float>(main_init[at]) +
                                                             static_cast<float>(product[at]))
                                       : product[at];
        computed(main[at], want, std::abs(main_init[at]) + std::abs(product[at]), e, "(mask 1) in main_grad");
      } else {
        ASSERT_EQ(main[at], main_init[at]) << what << ": expert " << e << " (mask 0) wrote main_grad";
        computed(fresh[at], product[at], std::abs(product[at]), e, "(mask 0) in its fresh view");
      }
    }
  }
}

}  // namespace gmoe::test
