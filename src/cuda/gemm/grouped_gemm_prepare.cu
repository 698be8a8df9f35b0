// src/cuda/gemm/grouped_gemm_prepare.cu — the device error word, check_device_errors, and the small
// kernels that prepare and complete a grouped GEMM without the host ever seeing the counts.
//
// The error word lives here, beside every kernel that sets bits in it, because without relocatable
// device code a __device__ variable is visible only inside its own translation unit.
#include "cuda/gemm/grouped_gemm_prepare.h"

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <sstream>
#include <vector>

#include "common/backend.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_info.h"
#include "cuda/runtime/group_offsets.cuh"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace {

/// Bits from gmoe::DeviceErrorBits, OR-ed in by kernels that clamp what only the device sees.
__device__ uint32_t g_device_error_word = 0;

constexpr int kPrepareThreads = 1024;


__device__ __forceinline__ const void* offset_ptr(const void* base, int64_t elems, int32_t bytes) {
  return static_cast<const char*>(base) + elems * static_cast<int64_t>(bytes);
}

// FP8 wgrad: group e of a columnwise operand starts at column padded_offsets[e], which must be a
// multiple of 128 with the group's `rows` tokens fitting below padded_offsets[e + 1] and the
// operand's padded_capacity. Anything else is recorded and clamped so that no read leaves the
// operand: the start is floored to a multiple of 128 inside [0, padded_capacity] and *fit gets
// the number of tokens that stay inside.
__device__ __forceinline__ int64_t columnwise_start(const RowsOperand& op, int e, int64_t rows,
                                                   int64_t* fit, uint32_t* errors) {
  const int64_t start = op.padded_offsets[e];
  const int64_t next = op.padded_offsets[e + 1];
  const int64_t pc = op.padded_capacity;
  if (start < 0 || start % 128 != 0 || next < start + rows || start + rows > pc) {
    *errors |= kDeviceErrorPaddedOffsets;
  }
  const int64_t clamped = min(max(start, int64_t{0}), pc) / 128 * 128;
  *fit = min(rows, pc - clamped);
  return clamped;
}

// FP8 blockwise: group e's first scale; `begin` is its first row (rows) or column (columns).
__device__ __forceinline__ const float* scale_start(const ScaleOperand& s, int e, int64_t begin) {
  switch (s.start) {
    case ScaleStart::rows: return s.base + begin * s.ld;
    case ScaleStart::columns: return s.base + begin / 128 * s.ld;
    case ScaleStart::expert: return s.base + e * s.expert_stride;
    default: return nullptr;
  }
}

// An expert's count read and clamped to [0, capacity] (before the scan: no overflow).
__device__ __forceinline__ int64_t clamped_count(const PrepareParams& p, int e) {
  return min(max(read_count(p.counts, p.counts_i64, e), int64_t{0}), p.capacity);
}

// fprop/dgrad: group g computes rows [begin, begin + rows) of expert e.
__device__ __forceinline__ void write_rows_group(const PrepareParams& p, const GroupedGemmArrays& out, int g, int e,
                                                 int64_t begin, int32_t rows) {
  out.shapes[g] = GroupShape{rows, p.gemm_n, p.gemm_k};
  out.ptr_a[g] = offset_ptr(p.rows_a.base, begin * p.rows_a.ld, p.rows_a.elem_bytes);
  out.stride_a[g] = p.rows_a.ld;
  out.ptr_d[g] = const_cast<void*>(offset_ptr(p.rows_d.base, begin * p.rows_d.ld, p.rows_d.elem_bytes));
  out.stride_d[g] = p.rows_d.ld;
  out.ptr_c[g] = nullptr;
  out.stride_c[g] = 0;
  if (p.expert_stacked) {
    out.ptr_b[g] = offset_ptr(p.expert.base, e * p.expert.expert_stride, p.expert.elem_bytes);
    out.stride_b[g] = p.expert.ld;
  }
  if (out.ptr_bias != nullptr && p.bias.base != nullptr) {
    out.ptr_bias[g] = offset_ptr(p.bias.base, e * p.bias.expert_stride, p.bias.elem_bytes);
  }
  if (out.ptr_sfa != nullptr) {
    out.ptr_sfa[g] = scale_start(p.scale_a, e, begin);
    out.ptr_sfb[g] = scale_start(p.scale_b, e, begin);
  }
  if (out.alpha_ptr != nullptr) out.alpha_ptr[g] = out.alpha + e;
}

// wgrad: expert e's group, its tokens [begin, begin + rows) the reduction. Where they start in A
// and B: row `begin` of grouped rows, or (FP8) a column of a columnwise operand, clamped so the
// reduction never leaves it.
__device__ __forceinline__ void write_wgrad_group(const PrepareParams& p, const GroupedGemmArrays& out, int e,
                                                  int64_t begin, int32_t rows, uint32_t* errors) {
  if (out.alpha_ptr != nullptr) out.alpha_ptr[e] = out.alpha + e;
  int64_t a_start = begin * p.rows_a.ld, b_start = begin * p.rows_b.ld;
  int64_t a_col = begin, b_col = begin;
  int32_t k = rows;
  if (p.rows_a.padded_offsets != nullptr) {
    int64_t fit_a = rows, fit_b = rows;
    a_col = columnwise_start(p.rows_a, e, rows, &fit_a, errors);
    b_col = columnwise_start(p.rows_b, e, rows, &fit_b, errors);
    a_start = a_col;
    b_start = b_col;
    k = static_cast<int32_t>(min(fit_a, fit_b));
  }
  const bool masked = p.mask != nullptr && p.mask[e] == 0;
  const bool to_fresh = masked && p.masked_off_fresh;
  const bool write = !masked || to_fresh;
  const bool active = write && k > 0;
  // An inactive expert gets M = 0: CUTLASS schedules no tile for it (a K = 0 group would be
  // scheduled and store uninitialised accumulators).
  out.shapes[e] = active ? GroupShape{p.gemm_m, p.gemm_n, k} : GroupShape{0, p.gemm_n, 0};
  // The launch has one beta for every group. When it accumulates (beta = 1, for the main_grad
  // experts), a fresh expert is zeroed first so that accumulating into it writes its gradient.
  out.zero_expert[e] = to_fresh ? ((k == 0 || p.accumulate) ? 1 : 0) : ((write && k == 0 && !p.accumulate) ? 1 : 0);
  out.ptr_a[e] = offset_ptr(p.rows_a.base, a_start, p.rows_a.elem_bytes);
  out.stride_a[e] = p.rows_a.ld;
  out.ptr_b[e] = offset_ptr(p.rows_b.base, b_start, p.rows_b.elem_bytes);
  out.stride_b[e] = p.rows_b.ld;
  if (out.ptr_sfa != nullptr) {
    out.ptr_sfa[e] = scale_start(p.scale_a, e, a_col);
    out.ptr_sfb[e] = scale_start(p.scale_b, e, b_col);
  }
  // A list dw's pointers are already in ptr_d/ptr_c (written by value before this kernel); a
  // masked-off expert's fresh destination replaces them.
  if (to_fresh || p.expert_stacked) {
    const void* d = nullptr;
    int64_t ld = 0;
    if (!to_fresh) {
      d = offset_ptr(p.expert.base, e * p.expert.expert_stride, p.expert.elem_bytes);
      ld = p.expert.ld;
    } else if (p.fresh_stacked) {
      d = offset_ptr(p.fresh.base, e * p.fresh.expert_stride, p.fresh.elem_bytes);
      ld = p.fresh.ld;
    } else {
      d = out.fresh_ptr[e];
      ld = out.fresh_ld[e];
    }
    out.ptr_d[e] = const_cast<void*>(d);
    out.stride_d[e] = ld;
    out.ptr_c[e] = d;
    out.stride_c[e] = ld;
  }
}

using PrepareScan = cub::BlockScan<int64_t, kPrepareThreads>;

// Row chunks: the number of this thread's first group (experts [first, last), whose rows start at
// `prefix`), from a second scan over the chunk counts; the groups past the last chunk (of
// p.num_groups) are written empty.
__device__ __forceinline__ int64_t first_chunk_group(const PrepareParams& p, const GroupedGemmArrays& out,
                                                     int first, int last, int64_t prefix,
                                                     typename PrepareScan::TempStorage& scan_storage) {
  int64_t chunks = 0;
  int64_t rows_before = prefix;  // the rows as prepare_grouped_gemm_kernel clamps them
  for (int e = first; e < last; ++e) {
    const int64_t c = clamped_count(p, e);
    const int64_t rows = min(rows_before + c, p.capacity) - min(rows_before, p.capacity);
    rows_before += c;
    chunks += (rows + p.row_chunk - 1) / p.row_chunk;
  }
  __syncthreads();  // scan_storage is reused
  int64_t group = 0, total_chunks = 0;
  PrepareScan(scan_storage).ExclusiveSum(chunks, group, total_chunks);
  for (int64_t g = total_chunks + threadIdx.x; g < p.num_groups; g += kPrepareThreads) {
    write_rows_group(p, out, static_cast<int>(g), 0, 0, 0);  // empty: no tile is scheduled
  }
  return group;
}

// One block: thread t owns experts [t*per, (t+1)*per). Counts are clamped to [0, capacity] before
// the scan so the 64-bit prefix cannot overflow (E * capacity < 2^63); offsets and group sizes are
// then clamped to capacity in closed form, min(prefix, capacity), so no thread depends on another
// thread's clamping. With row chunks (fprop/dgrad, p.row_chunk > 0), expert e's rows become
// ceil(rows_e / row_chunk) groups, numbered after the earlier experts' (first_chunk_group).
__global__ void __launch_bounds__(kPrepareThreads)
    prepare_grouped_gemm_kernel(PrepareParams p, GroupedGemmArrays out) {
  __shared__ typename PrepareScan::TempStorage scan_storage;

  const int E = p.num_experts;
  const int per = (E + kPrepareThreads - 1) / kPrepareThreads;
  const int first = threadIdx.x * per;
  const int last = min(first + per, E);

  uint32_t errors = 0;
  int64_t local = 0;
  for (int e = first; e < last; ++e) {
    int64_t c = read_count(p.counts, p.counts_i64, e);
    if (c < 0) errors |= kDeviceErrorNegativeCount;
    // A count past the capacity is clamped to it below, which the running total alone cannot
    // see when every earlier count is 0.
    if (c > p.capacity) errors |= kDeviceErrorCountsPastCapacity;
    local += min(max(c, int64_t{0}), p.capacity);
  }
  int64_t prefix = 0;
  int64_t sum_all = 0;
  PrepareScan(scan_storage).ExclusiveSum(local, prefix, sum_all);

  const bool chunked = p.row_chunk > 0 && p.pass != GemmPass::wgrad;
  int64_t group = chunked ? first_chunk_group(p, out, first, last, prefix, scan_storage) : 0;

  for (int e = first; e < last; ++e) {
    const int64_t c = clamped_count(p, e);
    const int64_t begin = min(prefix, p.capacity);
    const int64_t end = min(prefix + c, p.capacity);
    if (prefix + c > p.capacity) errors |= kDeviceErrorCountsPastCapacity;
    prefix += c;
    const int32_t rows = static_cast<int32_t>(end - begin);  // capacity < 2^31: host-checked

    if (p.alpha_a != nullptr) {  // FP8 tensorwise
      out.alpha[e] = p.alpha_a[e] * p.alpha_b[e];
    }
    if (p.pass == GemmPass::wgrad) {
      write_wgrad_group(p, out, e, begin, rows, &errors);
    } else if (chunked) {
      for (int64_t at = 0; at < rows; at += p.row_chunk, ++group) {
        write_rows_group(p, out, static_cast<int>(group), e, begin + at,
                         static_cast<int32_t>(min(int64_t{p.row_chunk}, rows - at)));
      }
    } else {
      write_rows_group(p, out, e, e, begin, rows);
    }
  }
  if (threadIdx.x == 0) *out.total = min(sum_all, p.capacity);
  if (errors != 0) atomicOr(&g_device_error_word, errors);
}

// Kernel parameters may hold 32 KB (CUDA >= 12.1); 256 experts per launch stays far below that.
constexpr int kPointerChunk = 256;

struct ExpertPointerChunk {
  int first = 0;
  int count = 0;
  const void* ptr[kPointerChunk];
  int64_t ld[kPointerChunk];
};

__global__ void write_expert_pointers_kernel(ExpertPointerChunk chunk, const void** ptr,
                                             int64_t* ld, const void** ptr2, int64_t* ld2) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= chunk.count) return;
  const int e = chunk.first + i;
  ptr[e] = chunk.ptr[i];
  if (ld != nullptr) ld[e] = chunk.ld[i];
  if (ptr2 != nullptr) {
    ptr2[e] = chunk.ptr[i];
    ld2[e] = chunk.ld[i];
  }
}

// Zeroes `row_bytes` bytes at `row` (16-byte aligned: pointers and row strides are checked on the
// host) with 16-byte stores, then the (2- or 4-byte element) remainder.
__device__ __forceinline__ void zero_row(char* row, int64_t row_bytes) {
  const int64_t vecs = row_bytes / 16;
  uint4* v = reinterpret_cast<uint4*>(row);
  for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) v[i] = make_uint4(0, 0, 0, 0);
  for (int64_t i = vecs * 16 + 2 * threadIdx.x; i < row_bytes; i += 2 * blockDim.x) {
    *reinterpret_cast<uint16_t*>(row + i) = 0;
  }
}

__global__ void zero_rows_kernel(char* base, int64_t ld_bytes, int64_t row_bytes,
                                 int64_t capacity, const int64_t* start_row) {
  const int64_t start = start_row == nullptr ? 0 : *start_row;
  for (int64_t r = start + blockIdx.x; r < capacity; r += gridDim.x) {
    zero_row(base + r * ld_bytes, row_bytes);
  }
}

__global__ void zero_experts_kernel(void* const* ptr_d, const int64_t* stride_d,
                                    int32_t elem_bytes, int64_t rows, int64_t row_bytes,
                                    const int32_t* zero_expert) {
  const int e = blockIdx.y;
  if (zero_expert[e] == 0) return;
  char* base = static_cast<char*>(ptr_d[e]);
  const int64_t ld_bytes = stride_d[e] * elem_bytes;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) zero_row(base + r * ld_bytes, row_bytes);
}

constexpr int kZeroThreads = 256;

}  // namespace

void launch_prepare(const PrepareParams& p, const GroupedGemmArrays& arrays, cudaStream_t stream) {
  GMOE_CHECK(p.num_experts >= 1 && p.num_experts <= kMaxExperts, "prepare: ", p.num_experts,
             " experts, supported 1..", kMaxExperts);
  prepare_grouped_gemm_kernel<<<1, kPrepareThreads, 0, stream>>>(p, arrays);
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_write_expert_pointers(const void* const* host_ptrs, const int64_t* host_lds, int count,
                                  const void** ptr, int64_t* ld, const void** ptr2, int64_t* ld2,
                                  cudaStream_t stream) {
  for (int first = 0; first < count; first += kPointerChunk) {
    ExpertPointerChunk chunk;
    chunk.first = first;
    chunk.count = std::min(kPointerChunk, count - first);
    for (int i = 0; i < chunk.count; ++i) {
      chunk.ptr[i] = host_ptrs[first + i];
      chunk.ld[i] = host_lds == nullptr ? 0 : host_lds[first + i];
    }
    write_expert_pointers_kernel<<<(chunk.count + 127) / 128, 128, 0, stream>>>(chunk, ptr, ld,
                                                                               ptr2, ld2);
    GMOE_CUDA_CHECK(cudaGetLastError());
  }
}

void launch_write_pointers(const void* const* host_ptrs, int count, const void** ptr, cudaStream_t stream) {
  launch_write_expert_pointers(host_ptrs, nullptr, count, ptr, nullptr, nullptr, nullptr, stream);
}

void launch_zero_rows(void* base, int64_t ld_bytes, int64_t row_bytes, int64_t capacity,
                      const int64_t* start_row, int sm_count, cudaStream_t stream) {
  if (capacity <= 0 || row_bytes <= 0) return;
  // The number of rows to zero is known only on the device: launch enough blocks for a large
  // tail and let blocks past it exit at once.
  const int64_t blocks = std::min<int64_t>(capacity, int64_t{4} * sm_count);
  zero_rows_kernel<<<static_cast<unsigned>(blocks), kZeroThreads, 0, stream>>>(
      static_cast<char*>(base), ld_bytes, row_bytes, capacity, start_row);
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_zero_experts(void* const* ptr_d, const int64_t* stride_d, int32_t elem_bytes,
                         int64_t rows, int64_t row_bytes, const int32_t* zero_expert,
                         int num_experts, int sm_count, cudaStream_t stream) {
  if (rows <= 0 || row_bytes <= 0 || num_experts <= 0) return;
  GMOE_CHECK(num_experts <= kMaxExperts, "zero experts: ", num_experts, " experts, supported up to ",
             kMaxExperts);
  // Which experts are empty is known only on the device. Give each expert enough blocks that
  // zeroing one large dW alone is fast, and enough in all that all experts empty fills the GPU;
  // blocks of non-empty experts exit at once.
  const int64_t per_expert =
      std::min<int64_t>(rows, std::max<int64_t>(8, int64_t{4} * sm_count / num_experts));
  const dim3 grid(static_cast<unsigned>(per_expert), static_cast<unsigned>(num_experts));
  zero_experts_kernel<<<grid, kZeroThreads, 0, stream>>>(ptr_d, stride_d, elem_bytes, rows,
                                                         row_bytes, zero_expert);
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void check_device_errors(Stream stream) {
  // A deliberate sync: read the word after all work on `stream`, then clear what was read.
  uint32_t* word = nullptr;
  GMOE_CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&word), g_device_error_word));
  uint32_t bits = 0;
  GMOE_CUDA_CHECK(cudaMemcpyAsync(&bits, word, sizeof(bits), cudaMemcpyDeviceToHost, stream));
  GMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (bits == 0) return;
  GMOE_CUDA_CHECK(cudaMemsetAsync(word, 0, sizeof(uint32_t), stream));
  GMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::ostringstream what;
  what << "device error word 0x" << std::hex << bits << std::dec << ":" << device_error_text(bits);
  GMOE_FAIL(what.str());
}

}  // namespace gmoe::cuda_backend

namespace gmoe::cuda_backend {

// For kernels in other translation units (see cuda/device_errors.h).
uint32_t* device_error_word() {
  uint32_t* word = nullptr;
  GMOE_CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&word), g_device_error_word));
  return word;
}

LaunchRecord& last_launch_record() {
  thread_local LaunchRecord record;
  return record;
}

namespace {

// The groups of one launch: with row chunks (fprop/dgrad, row_chunk_rows), an expert's rows are
// split into groups of at most row_chunk rows; chunks need every group's pointers from the
// preparation kernel, so not with lists of expert tensors or biases (written per expert).
PrepareParams plan_groups(const CallPlan& plan) {
  const bool experts_list = plan.experts != nullptr && !plan.experts->is_stacked();
  const bool bias_list = plan.bias != nullptr && !plan.bias->is_grouped();
  const int E = plan.prep.num_experts;
  PrepareParams prep = plan.prep;
  prep.row_chunk = plan.prep.pass == GemmPass::wgrad || experts_list || bias_list || E == 0 ? 0 : row_chunk_rows();
  prep.num_groups = prep.row_chunk > 0 ? static_cast<int32_t>(E + (prep.capacity + prep.row_chunk - 1) / prep.row_chunk)
                                       : E;  // (capacity < 2^31, row_chunk >= 128: no overflow)
  return prep;
}

// Where each array lies in the one workspace of a call, each part 128-byte aligned; `bytes` in all.
struct WorkspaceLayout {
  std::size_t shapes, ptrs, strides, total, zero, bias, fresh, scale_ptrs, alpha, alpha_ptrs, cutlass;
  std::size_t bytes = 0;

  WorkspaceLayout(const CallPlan& plan, std::size_t groups, std::size_t experts, std::size_t cutlass_bytes) {
    const std::size_t g = groups, e = experts;
    shapes = take(g * sizeof(GroupShape));
    ptrs = take(4 * g * sizeof(void*));
    strides = take(4 * g * sizeof(int64_t));
    total = take(sizeof(int64_t));
    zero = take(e * sizeof(int32_t));
    bias = take(plan.bias != nullptr ? g * sizeof(void*) : 0);
    fresh = take(plan.fresh != nullptr ? e * (sizeof(void*) + sizeof(int64_t)) : 0);
    scale_ptrs = take(plan.block_scales ? 2 * g * sizeof(float*) : 0);
    alpha = take(plan.alpha ? e * sizeof(float) : 0);
    alpha_ptrs = take(plan.alpha ? g * sizeof(float*) : 0);
    cutlass = take(cutlass_bytes);  // CUTLASS's tensor maps, one set per SM
  }

 private:
  std::size_t take(std::size_t n) {
    const std::size_t at = bytes;
    bytes = (bytes + n + 127) / 128 * 128;
    return at;
  }
};

// The arrays of `layout` in the workspace at `base`; those the call does not use stay nullptr.
GroupedGemmArrays bind_arrays(const CallPlan& plan, const WorkspaceLayout& layout, std::size_t g, char* base) {
  GroupedGemmArrays a;
  a.shapes = reinterpret_cast<GroupShape*>(base + layout.shapes);
  auto** ptrs = reinterpret_cast<const void**>(base + layout.ptrs);
  a.ptr_a = ptrs;
  a.ptr_b = ptrs + g;
  a.ptr_c = ptrs + 2 * g;
  a.ptr_d = const_cast<void**>(ptrs + 3 * g);
  auto* strides = reinterpret_cast<int64_t*>(base + layout.strides);
  a.stride_a = strides;
  a.stride_b = strides + g;
  a.stride_c = strides + 2 * g;
  a.stride_d = strides + 3 * g;
  a.total = reinterpret_cast<int64_t*>(base + layout.total);
  a.zero_expert = reinterpret_cast<int32_t*>(base + layout.zero);
  if (plan.bias != nullptr) a.ptr_bias = reinterpret_cast<const void**>(base + layout.bias);
  if (plan.fresh != nullptr) {
    a.fresh_ptr = reinterpret_cast<const void**>(base + layout.fresh);
    a.fresh_ld = reinterpret_cast<int64_t*>(base + layout.fresh + static_cast<std::size_t>(plan.prep.num_experts) * sizeof(void*));
  }
  if (plan.block_scales) {
    auto** sf = reinterpret_cast<const float**>(base + layout.scale_ptrs);
    a.ptr_sfa = sf;
    a.ptr_sfb = sf + g;
  }
  if (plan.alpha) {
    a.alpha = reinterpret_cast<float*>(base + layout.alpha);
    a.alpha_ptr = reinterpret_cast<const float**>(base + layout.alpha_ptrs);
  }
  return a;
}

// Pointers and row strides of a list of expert tensors, by value, into ptr/ld (and ptr2/ld2).
void write_list(const ExpertWeights& list, const void** ptr, int64_t* ld, const void** ptr2, int64_t* ld2,
                cudaStream_t stream) {
  const std::size_t e = list.list.size();
  std::vector<const void*> host_ptrs(e);
  std::vector<int64_t> host_lds(e);
  for (std::size_t i = 0; i < e; ++i) {
    host_ptrs[i] = list.list[i].data;
    host_lds[i] = list.list[i].stride(0);
  }
  launch_write_expert_pointers(host_ptrs.data(), host_lds.data(), static_cast<int>(e), ptr, ld, ptr2, ld2, stream);
}

// Lists of expert tensors or biases: their pointers, by value (the preparation kernel computes
// stacked and grouped ones itself); one group per expert. wgrad writes them BEFORE the preparation
// kernel, which replaces a masked-off expert's with its fresh destination (the lists' own included).
void write_list_pointers(const CallPlan& plan, const GroupedGemmArrays& a, cudaStream_t stream) {
  const int E = plan.prep.num_experts;
  const std::size_t e = static_cast<std::size_t>(E);
  if (plan.fresh != nullptr) write_list(*plan.fresh, a.fresh_ptr, a.fresh_ld, nullptr, nullptr, stream);
  if (plan.bias != nullptr && !plan.bias->is_grouped()) {
    std::vector<const void*> host_ptrs(e);
    for (std::size_t i = 0; i < e; ++i) host_ptrs[i] = plan.bias->list[i].data;
    launch_write_pointers(host_ptrs.data(), E, a.ptr_bias, stream);
  }
  if (plan.experts == nullptr || plan.experts->is_stacked()) return;
  if (plan.prep.pass == GemmPass::wgrad) {
    write_list(*plan.experts, const_cast<const void**>(a.ptr_d), a.stride_d, a.ptr_c, a.stride_c, stream);
  } else {
    write_list(*plan.experts, a.ptr_b, a.stride_b, nullptr, nullptr, stream);
  }
}

// Zeros where the GEMM writes nothing: empty experts' dW (wgrad), or the rows past the real total
// (fprop/dgrad; every row when the reduction is empty).
void write_zeros(const CallPlan& plan, const GroupedGemmArrays& a, int sms, cudaStream_t stream) {
  if (plan.prep.pass == GemmPass::wgrad) {
    launch_zero_experts(a.ptr_d, a.stride_d, plan.dw_elem_bytes, plan.dw_rows, plan.dw_row_bytes, a.zero_expert,
                        plan.prep.num_experts, sms, stream);
  } else {
    launch_zero_rows(plan.out_base, plan.out_ld_bytes, plan.out_row_bytes, plan.prep.capacity,
                     plan.zero_all_rows ? nullptr : a.total, sms, stream);
  }
}

GroupedGemmLaunch launch_arguments(const GroupedGemmArrays& a, int num_groups, int device, int sms,
                                   void* cutlass_workspace, std::size_t cutlass_bytes) {
  GroupedGemmLaunch l;
  l.num_groups = num_groups;
  l.device = device;
  l.sm_count = sms;
  l.shapes = a.shapes;
  l.ptr_a = a.ptr_a;
  l.ptr_b = a.ptr_b;
  l.ptr_c = a.ptr_c;
  l.ptr_d = a.ptr_d;
  l.stride_a = a.stride_a;
  l.stride_b = a.stride_b;
  l.stride_c = a.stride_c;
  l.stride_d = a.stride_d;
  l.ptr_bias = a.ptr_bias;
  l.workspace = cutlass_workspace;
  l.workspace_bytes = cutlass_bytes;
  return l;
}

}  // namespace

void set_wgrad_mask(CallPlan& plan, const WgradOptions& options) {
  plan.prep.mask = static_cast<const int32_t*>(options.expert_mask.data);
  plan.prep.accumulate = options.accumulate;
  if (options.masked_off != MaskedOffWgrad::fresh) return;
  const ExpertWeights& f = options.fresh_dw;
  plan.prep.masked_off_fresh = true;
  plan.prep.fresh_stacked = f.is_stacked();
  if (f.is_stacked()) {
    plan.prep.fresh = {f.stacked.data, f.stacked.stride(0), f.stacked.stride(1),
                       static_cast<int32_t>(dtype_size(f.dtype()))};
  } else {
    plan.fresh = &f;
  }
}

PreparedCall prepare_call(const CallPlan& plan, std::size_t cutlass_bytes, cudaStream_t stream, Allocator& alloc) {
  // An empty reduction runs no GEMM, so a fused bias would never be added: the dispatchers send
  // such calls to the bias's second pass (y = 0 + bias).
  GMOE_CHECK(!plan.zero_all_rows || plan.bias == nullptr,
             "grouped GEMM: a fused bias with an empty reduction (K = 0)");
  const int device = current_device();
  const int sms = sm_count(device);
  const PrepareParams prep = plan_groups(plan);
  LaunchRecord& record = last_launch_record();
  record = LaunchRecord{};
  record.ran = plan.run_gemm;
  record.num_groups = prep.num_groups;
  record.row_chunk = prep.row_chunk;

  const std::size_t g = static_cast<std::size_t>(prep.num_groups);
  const WorkspaceLayout layout(plan, g, static_cast<std::size_t>(prep.num_experts), cutlass_bytes);
  PreparedCall call;
  call.workspace = Buffer(alloc, layout.bytes, stream);
  char* base = static_cast<char*>(call.workspace.data());
  call.arrays = bind_arrays(plan, layout, g, base);

  if (prep.pass == GemmPass::wgrad) {
    write_list_pointers(plan, call.arrays, stream);  // read (and partly replaced) by the preparation
    launch_prepare(prep, call.arrays, stream);
  } else {
    launch_prepare(prep, call.arrays, stream);
    write_list_pointers(plan, call.arrays, stream);
  }
  write_zeros(plan, call.arrays, sms, stream);
  call.launch = launch_arguments(call.arrays, prep.num_groups, device, sms, base + layout.cutlass, cutlass_bytes);
  return call;
}

}  // namespace gmoe::cuda_backend
