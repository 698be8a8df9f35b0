// src/common/grouped.cpp — ExpertWeights, host-side group offsets, device error reporting.
#include "gmoe/grouped.h"

#include <atomic>

#include "common/backend.h"
#include "common/checks.h"
#include "gmoe/error.h"

namespace gmoe {

ExpertWeights ExpertWeights::from_stacked(const TensorView& stacked) {
  GMOE_CHECK(stacked.defined() && stacked.ndim == 3,
             "expert weights: stacked layout must be [E, N, K], got ", stacked.str());
  ExpertWeights w;
  w.stacked = stacked;
  return w;
}

ExpertWeights ExpertWeights::from_list(std::vector<TensorView> list) {
  GMOE_CHECK(!list.empty(), "expert weights: the per-expert list is empty");
  for (size_t e = 0; e < list.size(); ++e) {
    GMOE_CHECK(list[e].defined() && list[e].ndim == 2, "expert weights: list[", e,
               "] must be [N, K], got ", list[e].str());
  }
  ExpertWeights w;
  w.list = std::move(list);
  return w;
}

int64_t ExpertWeights::num_experts() const {
  return is_stacked() ? stacked.size(0) : static_cast<int64_t>(list.size());
}
int64_t ExpertWeights::rows() const {
  return is_stacked() ? stacked.size(1) : (list.empty() ? 0 : list[0].size(0));
}
int64_t ExpertWeights::cols() const {
  return is_stacked() ? stacked.size(2) : (list.empty() ? 0 : list[0].size(1));
}
DType ExpertWeights::dtype() const {
  return is_stacked() ? stacked.dtype : (list.empty() ? DType::f32 : list[0].dtype);
}
Device ExpertWeights::device() const {
  return is_stacked() ? stacked.device : (list.empty() ? Device::cpu() : list[0].device);
}
TensorView ExpertWeights::expert(int64_t e) const {
  GMOE_CHECK(e >= 0 && e < num_experts(), "expert index ", e, " out of range [0, ",
             num_experts(), ")");
  return is_stacked() ? stacked.select0(e) : list[static_cast<size_t>(e)];
}

std::vector<int64_t> host_group_offsets(const TensorView& counts, int64_t capacity,
                                        const char* what) {
  GMOE_CHECK(counts.device.is_cpu(), what, ": host offsets need counts on the CPU, got ",
             counts.str());
  GMOE_CHECK(counts.ndim == 1, what, ": expected a 1-D tensor, got ", counts.str());
  GMOE_CHECK(counts.dtype == DType::i32 || counts.dtype == DType::i64, what,
             ": expected dtype i32 or i64, got ", dtype_name(counts.dtype));
  const int64_t E = counts.size(0);
  std::vector<int64_t> offsets(static_cast<size_t>(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = counts.dtype == DType::i32
                          ? static_cast<const int32_t*>(counts.data)[e * counts.stride(0)]
                          : static_cast<const int64_t*>(counts.data)[e * counts.stride(0)];
    GMOE_CHECK(c >= 0, what, "[", e, "] is negative: ", c);
    offsets[e + 1] = offsets[e] + c;
    GMOE_CHECK(offsets[e + 1] <= capacity, what, ": counts sum past the capacity ", capacity,
               " (running total ", offsets[e + 1], " at expert ", e, ")");
  }
  return offsets;
}

void check_device_errors(Stream stream) {
  if (cuda_backend::compiled()) cuda_backend::check_device_errors(stream);
}

namespace {
std::atomic<bool>& debug_sync_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}
}  // namespace

void set_debug_sync(bool enabled) { debug_sync_flag().store(enabled); }
bool debug_sync_enabled() { return debug_sync_flag().load(); }

}  // namespace gmoe
