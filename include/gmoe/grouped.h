// gmoe/grouped.h — grouped rows and expert weights: the two shapes every expert op takes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// Grouped rows: a 2-D tensor `data` of shape [capacity, cols] whose rows are split into E
/// contiguous groups by `counts`, a 1-D int32 or int64 tensor of length E on the same device.
/// Group e holds rows [offset_e, offset_e + counts[e]) with offset_e = counts[0] + ... + counts[e-1].
///
/// `capacity` is host-known (the buffer size); the real total sum(counts) lives on the device and
/// is never read on the host by CUDA ops. Rows past the real total are a defined contract: ops write
/// zeros there. On the device, a negative count is treated as 0 and counts past `capacity` are
/// clamped; both are recorded in the device error word (see check_device_errors). The CPU backend
/// can see the counts and throws instead, describing the same clamping (host_group_offsets).
struct GroupedRows {
  TensorView data;    ///< [capacity, cols]; rows contiguous (stride(1) == 1), stride(0) >= cols.
  TensorView counts;  ///< [E], i32 or i64, same device as data.

  int64_t capacity() const { return data.size(0); }   ///< rows of the buffer (host-known)
  int64_t cols() const { return data.size(1); }       ///< columns of every row
  int64_t num_groups() const { return counts.size(0); }  ///< E
};

/// Expert weights in either layout: one stacked tensor [E, N, K], or a list of E tensors [N, K]
/// (e.g. separate parameters). Exactly one of the two is set. All experts share dtype and device.
struct ExpertWeights {
  TensorView stacked;            ///< [E, N, K], or absent.
  std::vector<TensorView> list;  ///< E views of [N, K], or empty.

  /// Neither layout (absent weights).
  ExpertWeights() = default;
  /// The stacked layout.
  static ExpertWeights from_stacked(const TensorView& stacked);
  /// The per-expert layout.
  static ExpertWeights from_list(std::vector<TensorView> list);

  /// True for the stacked layout.
  bool is_stacked() const { return stacked.defined(); }
  /// E.
  int64_t num_experts() const;
  /// Rows of each expert matrix (N for [E, N, K]).
  int64_t rows() const;
  /// Columns of each expert matrix (K for [E, N, K]).
  int64_t cols() const;
  /// The experts' dtype.
  DType dtype() const;
  /// The experts' device.
  Device device() const;
  /// The [N, K] view of expert e, in either layout.
  TensorView expert(int64_t e) const;
};

/// Device-side error bits recorded by kernels that clamp what only the device can see.
enum DeviceErrorBits : uint32_t {
  kDeviceErrorNegativeCount = 1u << 0,   ///< a count was negative (treated as 0)
  kDeviceErrorCountsPastCapacity = 1u << 1,  ///< counts summed past capacity (clamped)
  kDeviceErrorPaddedOffsets = 1u << 2,  ///< FP8 columnwise padded_offsets inconsistent (clamped)
  kDeviceErrorRoutingIndexOutOfRange = 1u << 3,  ///< an expert id or a routing-map row out of range (slot dropped)
};

/// Group offsets of host-side counts, clamped exactly as the device clamps them.
struct ClampedGroupOffsets {
  std::vector<int64_t> offsets;    ///< [E + 1], non-decreasing, offsets[E] <= capacity
  uint32_t errors = 0;             ///< DeviceErrorBits the device would record
  int64_t first_negative = -1;     ///< the first negative count's expert, or -1
  int64_t first_past_capacity = -1;  ///< the expert whose count passes the capacity, or -1
};

/// The device's semantics on the host: each count clamped to [0, capacity] first, then
/// offsets[e + 1] = min(offsets[e] + clamped count e, capacity); the bits record what was clamped.
/// No sum can overflow, whatever the counts. `counts` must be a CPU i32/i64 tensor.
ClampedGroupOffsets clamped_group_offsets(const TensorView& counts, int64_t capacity,
                                          const char* what = "counts");

/// Exclusive prefix sums of host-side counts: offsets[e] = sum of counts[0..e), offsets[E] = total.
/// Where the device would clamp (a negative count, a total past `capacity`; see
/// clamped_group_offsets), throws gmoe::Error naming `what` with the device's description of the
/// error bits (device_error_text). Used by the CPU backend and by tools that know the counts.
std::vector<int64_t> host_group_offsets(const TensorView& counts, int64_t capacity,
                                        const char* what = "counts");

/// What device error bits mean, as check_device_errors reports them ("; "-separated clauses).
std::string device_error_text(uint32_t bits);

/// Reads and clears the device error word of the current CUDA device. This is a deliberate sync
/// on `stream` (never call it on the hot path; debug mode calls it after every op). Throws
/// gmoe::Error describing each recorded problem. A no-op in a CPU-only build.
void check_device_errors(Stream stream);

/// Debug mode: when enabled, every CUDA op ends with check_device_errors(stream). Off by default;
/// never enable it under graph capture.
void set_debug_sync(bool enabled);
/// Whether debug mode (set_debug_sync) is on.
bool debug_sync_enabled();

}  // namespace gmoe
