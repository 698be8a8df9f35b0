// tests/common/gemm_fixture.cpp — host-side grouped-GEMM problems for the test suites.
#include "common/gemm_fixture.h"

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

}  // namespace gmoe::test
