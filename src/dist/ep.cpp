// src/dist/ep.cpp — the expert-parallel ops (gmoe/expert_parallel.h): edge checks naming the
// argument, output allocation, then the group's backend.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>

#include "common/checks.h"
#include "dist/ep_backend.h"
#include "gmoe/error.h"
#include "gmoe/expert_parallel.h"
#include "gmoe/grouped.h"

namespace gmoe {

EpGroup::~EpGroup() = default;

int64_t EpGroup::local_experts() const { return options().num_experts / size(); }

int64_t EpGroup::recv_capacity() const {
  const EpGroupOptions& o = options();
  return o.max_recv_rows > 0 ? o.max_recv_rows : static_cast<int64_t>(size()) * o.max_rows;
}

namespace ep {

void check_group_options(int size, const EpGroupOptions& o) {
  constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();
  GMOE_CHECK(size >= 1, "size: an EP group has at least 1 rank, got ", size);
  GMOE_CHECK(o.num_experts > 0 && o.num_experts % size == 0,
             "options.num_experts: expected a positive multiple of the group size ", size, ", got ",
             o.num_experts);
  GMOE_CHECK(o.hidden > 0, "options.hidden: expected > 0, got ", o.hidden);
  GMOE_CHECK(o.max_rows > 0, "options.max_rows: expected > 0, got ", o.max_rows);
  GMOE_CHECK(o.max_recv_rows >= 0, "options.max_recv_rows: expected >= 0 (0: size * max_rows), got ",
             o.max_recv_rows);
  // Counts are i32 on the device and local_counts sums a column over the ranks: every row count
  // a layout can hold must fit in int32, and so must the rows of all sources together.
  GMOE_CHECK(o.max_rows <= kI32 / size, "options.max_rows: ", o.max_rows, " rows from each of ", size,
             " ranks pass the i32 counts (at most ", kI32 / size, ")");
  GMOE_CHECK(o.max_recv_rows <= kI32, "options.max_recv_rows: ", o.max_recv_rows, " passes the i32 counts");
  const int64_t elt = static_cast<int64_t>(dtype_size(o.dtype));
  const int64_t rows = std::max(o.max_rows, o.max_recv_rows > 0 ? o.max_recv_rows : size * o.max_rows);
  GMOE_CHECK(o.hidden <= std::numeric_limits<int64_t>::max() / elt / rows, "options.hidden: ", rows,
             " rows of ", o.hidden, " ", dtype_name(o.dtype), " do not fit in int64 bytes");
}

}  // namespace ep

namespace {

ep::GroupBackend& backend_of(EpGroup& g) {
  auto* b = dynamic_cast<ep::GroupBackend*>(&g);
  GMOE_CHECK(b != nullptr, "g: not a group made by make_ep_group_nccl or make_ep_group_local");
  return *b;
}

// Debug mode (set_debug_sync): a CUDA op ends with check_device_errors, as every CUDA op does.
void debug_check(const EpGroup& g, Stream stream) {
  if (g.device().is_cuda() && debug_sync_enabled()) check_device_errors(stream);
}

Allocator& output_allocator(Allocator* alloc, Device device) {
  Allocator& a = pick_allocator(alloc, device);
  GMOE_CHECK(a.device() == device, "alloc: serves ", a.device().str(), ", the group's tensors live on ",
             device.str());
  return a;
}

// An i32 tensor of `shape` on the group's device, contiguous: counts and the plan's tensors.
void check_i32(const TensorView& t, const char* name, std::initializer_list<int64_t> shape, Device device) {
  TensorView want(nullptr, DType::i32, device, shape);
  bool same_shape = t.ndim == want.ndim;
  for (int d = 0; same_shape && d < t.ndim; ++d) same_shape = t.shape[d] == want.shape[d];
  GMOE_CHECK(t.defined(), name, ": absent (expected i32", want.shape_str(), ")");
  GMOE_CHECK(t.dtype == DType::i32, name, ": expected dtype i32, got ", dtype_name(t.dtype));
  GMOE_CHECK(same_shape, name, ": expected shape ", want.shape_str(), ", got ", t.shape_str());
  GMOE_CHECK(t.is_contiguous(), name, ": must be contiguous, got ", t.str());
  GMOE_CHECK(t.data != nullptr || t.numel() == 0, name, ": null data for ", t.shape_str());
  check_same_device(t.device, device, name);
}

void check_plan(const EpGroup& g, const EpPlan& plan) {
  check_i32(plan.counts_all.view(), "plan.counts_all", {g.size(), g.options().num_experts}, g.device());
  check_i32(plan.local_counts.view(), "plan.local_counts", {g.local_experts()}, g.device());
}

// rows [cap, H] of the group's dtype, contiguous, on its device; scalars absent or f32 [cap].
void check_moved(const EpGroup& g, const TensorView& rows, const TensorView& scalars, int64_t cap,
                 const char* cap_name) {
  const EpGroupOptions& o = g.options();
  GMOE_CHECK(rows.defined(), "rows: absent (expected ", dtype_name(o.dtype), "[", cap, ", ", o.hidden, "])");
  GMOE_CHECK(rows.dtype == o.dtype, "rows: expected dtype ", dtype_name(o.dtype), " (the group's), got ",
             dtype_name(rows.dtype));
  GMOE_CHECK(rows.ndim == 2 && rows.size(0) == cap && rows.size(1) == o.hidden, "rows: expected shape [", cap,
             ", ", o.hidden, "] ([", cap_name, ", hidden]), got ", rows.shape_str());
  GMOE_CHECK(rows.is_contiguous(), "rows: must be contiguous, got ", rows.str());
  GMOE_CHECK(rows.data != nullptr, "rows: null data for ", rows.shape_str());
  check_same_device(rows.device, g.device(), "rows");
  if (scalars.defined()) {
    check_f32_vector(scalars, "scalars", cap, "one per row", g.device());
    check_disjoint(rows, "rows", scalars, "scalars");
  }
}

EpRows move(EpGroup& g, const EpPlan& plan, const TensorView& rows, const TensorView& scalars, Allocator* alloc,
            Stream stream, ep::Direction dir) {
  ep::GroupBackend& b = backend_of(g);
  check_plan(g, plan);
  const bool dispatch = dir == ep::Direction::dispatch;
  const int64_t in_cap = dispatch ? g.options().max_rows : g.recv_capacity();
  const int64_t out_cap = dispatch ? g.recv_capacity() : g.options().max_rows;
  check_moved(g, rows, scalars, in_cap, dispatch ? "max_rows" : "recv_capacity");
  Allocator& a = output_allocator(alloc, g.device());
  EpRows out;
  out.rows = Tensor::empty({out_cap, g.options().hidden}, g.options().dtype, a, stream);
  if (scalars.defined()) out.scalars = Tensor::empty({out_cap}, DType::f32, a, stream);
  b.move(dir, plan.counts_all, rows, scalars, out.rows, out.scalars, stream);
  debug_check(g, stream);
  return out;
}

}  // namespace

EpPlan ep_plan(EpGroup& g, const TensorView& counts, Allocator* alloc, Stream stream) {
  ep::GroupBackend& b = backend_of(g);
  check_i32(counts, "counts", {g.options().num_experts}, g.device());
  Allocator& a = output_allocator(alloc, g.device());
  EpPlan plan;
  plan.counts_all = Tensor::empty({g.size(), g.options().num_experts}, DType::i32, a, stream);
  plan.local_counts = Tensor::empty({g.local_experts()}, DType::i32, a, stream);
  b.plan(counts, plan.counts_all, plan.local_counts, stream);
  debug_check(g, stream);
  return plan;
}

EpRows ep_dispatch(EpGroup& g, const EpPlan& plan, const TensorView& rows, const TensorView& scalars,
                   Allocator* alloc, Stream stream) {
  return move(g, plan, rows, scalars, alloc, stream, ep::Direction::dispatch);
}

EpRows ep_combine(EpGroup& g, const EpPlan& plan, const TensorView& rows, const TensorView& scalars,
                  Allocator* alloc, Stream stream) {
  return move(g, plan, rows, scalars, alloc, stream, ep::Direction::combine);
}

}  // namespace gmoe
