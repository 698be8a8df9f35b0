// src/common/grouped.cpp — ExpertWeights, host-side group offsets, device error reporting.
#include "gmoe/grouped.h"

#include <algorithm>
#include <atomic>
#include <cstdio>

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

ClampedGroupOffsets clamped_group_offsets(const TensorView& counts, int64_t capacity,
                                          const char* what) {
  GMOE_CHECK(counts.device.is_cpu(), what, ": host offsets need counts on the CPU, got ",
             counts.str());
  GMOE_CHECK(counts.ndim == 1, what, ": expected a 1-D tensor, got ", counts.str());
  GMOE_CHECK(counts.dtype == DType::i32 || counts.dtype == DType::i64, what,
             ": expected dtype i32 or i64, got ", dtype_name(counts.dtype));
  GMOE_CHECK(capacity >= 0, what, ": capacity ", capacity, " is negative");
  const int64_t E = counts.size(0);
  GMOE_CHECK(E == 0 || counts.data != nullptr, what, ": ", counts.str(), " has no data");
  ClampedGroupOffsets r;
  r.offsets.assign(static_cast<size_t>(E) + 1, 0);
  // The device's order (src/cuda/runtime/group_offsets.cu): each count clamped to [0, capacity]
  // first, then the running total, itself clamped to capacity. Clamping before adding keeps every
  // sum below 2 * capacity, so counts such as {1, INT64_MAX, 2} cannot wrap it past the check.
  int64_t total = 0;  // min(exact prefix of clamped counts, capacity)
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = counts.dtype == DType::i32
                          ? static_cast<const int32_t*>(counts.data)[e * counts.stride(0)]
                          : static_cast<const int64_t*>(counts.data)[e * counts.stride(0)];
    if (c < 0) {
      if (!(r.errors & kDeviceErrorNegativeCount)) r.first_negative = e;
      r.errors |= kDeviceErrorNegativeCount;
    }
    const int64_t clamped = std::min(std::max<int64_t>(c, 0), capacity);
    if (c > capacity || clamped > capacity - total) {  // the first: {0, capacity + 1} too
      if (!(r.errors & kDeviceErrorCountsPastCapacity)) r.first_past_capacity = e;
      r.errors |= kDeviceErrorCountsPastCapacity;
    }
    total += std::min(clamped, capacity - total);
    r.offsets[static_cast<size_t>(e) + 1] = total;
  }
  return r;
}

std::vector<int64_t> host_group_offsets(const TensorView& counts, int64_t capacity,
                                        const char* what) {
  ClampedGroupOffsets r = clamped_group_offsets(counts, capacity, what);
  if (r.errors != 0) {
    // What the device would record in its error word, in check_device_errors' words, plus where.
    std::string where;
    if (r.errors & kDeviceErrorNegativeCount) {
      where += " first negative: " + std::string(what) + "[" + std::to_string(r.first_negative) + "];";
    }
    if (r.errors & kDeviceErrorCountsPastCapacity) {
      where += " the running total passes the capacity " + std::to_string(capacity) + " at " +
               what + "[" + std::to_string(r.first_past_capacity) + "];";
    }
    GMOE_FAIL(what, ": the CPU backend refuses what the device would clamp:", device_error_text(r.errors),
              where);
  }
  return std::move(r.offsets);
}

std::string device_error_text(uint32_t bits) {
  std::string what;
  if (bits & kDeviceErrorNegativeCount) what += " a count was negative (treated as 0);";
  if (bits & kDeviceErrorCountsPastCapacity) {
    what += " counts summed past the capacity (clamped: rows past it were not computed);";
  }
  if (bits & kDeviceErrorPaddedOffsets) {
    what += " FP8 padded_offsets did not match the counts or the padded capacity (clamped);";
  }
  if (bits & kDeviceErrorRoutingIndexOutOfRange) {
    what += " an expert id or a routing-map row was out of range (that slot was dropped);";
  }
  const uint32_t unknown = bits & ~(kDeviceErrorNegativeCount | kDeviceErrorCountsPastCapacity |
                                    kDeviceErrorPaddedOffsets | kDeviceErrorRoutingIndexOutOfRange);
  if (unknown != 0) {
    char hex[16];
    std::snprintf(hex, sizeof hex, "%x", unknown);
    what += std::string(" unknown bits 0x") + hex + ";";
  }
  return what;
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
