// src/cuda/gemm/grouped_gemm_prepare.cu — the device error word, check_device_errors, and the small
// kernels that prepare and complete a grouped GEMM without the host ever seeing the counts.
//
// The error word lives here, beside every kernel that sets bits in it, because without relocatable
// device code a __device__ variable is visible only inside its own translation unit.
#include "cuda/gemm/grouped_gemm_prepare.h"

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

#include "common/backend.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_info.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace {

/// Bits from gmoe::DeviceErrorBits, OR-ed in by kernels that clamp what only the device sees.
__device__ uint32_t g_device_error_word = 0;

constexpr int kPrepareThreads = 1024;

// row_chunk_rows()'s default (see there).
constexpr int32_t kDefaultRowChunk = 4096;

__device__ __forceinline__ int64_t read_count(const void* counts, bool is_i64, int64_t e) {
  return is_i64 ? static_cast<const int64_t*>(counts)[e]
                : static_cast<int64_t>(static_cast<const int32_t*>(counts)[e]);
}

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
  if (out.ptr_z != nullptr) {
    out.ptr_z[g] = const_cast<void*>(offset_ptr(p.rows_z.base, begin * p.rows_z.ld, p.rows_z.elem_bytes));
    out.stride_z[g] = p.rows_z.ld;
    if (out.ptr_probs != nullptr) out.ptr_probs[g] = p.probs + begin;
  }
  if (out.ptr_sfa != nullptr) {
    out.ptr_sfa[g] = scale_start(p.scale_a, e, begin);
    out.ptr_sfb[g] = scale_start(p.scale_b, e, begin);
  }
  if (out.alpha_ptr != nullptr) out.alpha_ptr[g] = out.alpha + e;
}

// One block: thread t owns experts [t*per, (t+1)*per). Counts are clamped to [0, capacity] before
// the scan so the 64-bit prefix cannot overflow (E * capacity < 2^63); offsets and group sizes are
// then clamped to capacity in closed form, min(prefix, capacity), so no thread depends on another
// thread's clamping. With row chunks (fprop/dgrad, p.row_chunk > 0), expert e's rows become
// ceil(rows_e / row_chunk) groups, numbered after the earlier experts' (a second scan), and the
// groups past the last (of p.num_groups) are empty.
__global__ void __launch_bounds__(kPrepareThreads)
    prepare_grouped_gemm_kernel(PrepareParams p, GroupedGemmArrays out) {
  using BlockScan = cub::BlockScan<int64_t, kPrepareThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;

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
  BlockScan(scan_storage).ExclusiveSum(local, prefix, sum_all);

  // Row chunks: this thread's first group.
  const bool chunked = p.row_chunk > 0 && p.pass != GemmPass::wgrad;
  int64_t group = 0;
  if (chunked) {
    int64_t chunks = 0;
    int64_t rows_before = prefix;  // the rows as the loop below clamps them
    for (int e = first; e < last; ++e) {
      const int64_t c = clamped_count(p, e);
      const int64_t rows = min(rows_before + c, p.capacity) - min(rows_before, p.capacity);
      rows_before += c;
      chunks += (rows + p.row_chunk - 1) / p.row_chunk;
    }
    __syncthreads();  // scan_storage is reused
    int64_t total_chunks = 0;
    BlockScan(scan_storage).ExclusiveSum(chunks, group, total_chunks);
    for (int64_t g = total_chunks + threadIdx.x; g < p.num_groups; g += kPrepareThreads) {
      write_rows_group(p, out, static_cast<int>(g), 0, 0, 0);  // empty: no tile is scheduled
    }
  }

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
      if (out.alpha_ptr != nullptr) out.alpha_ptr[e] = out.alpha + e;
      // Where group e's tokens start in A and B: row `begin` of grouped rows, or (FP8) a column
      // of a columnwise operand, clamped so the reduction never leaves it.
      int64_t a_start = begin * p.rows_a.ld, b_start = begin * p.rows_b.ld;
      int64_t a_col = begin, b_col = begin;
      int32_t k = rows;
      if (p.rows_a.padded_offsets != nullptr) {
        int64_t fit_a = rows, fit_b = rows;
        a_col = columnwise_start(p.rows_a, e, rows, &fit_a, &errors);
        b_col = columnwise_start(p.rows_b, e, rows, &fit_b, &errors);
        a_start = a_col;
        b_start = b_col;
        k = static_cast<int32_t>(min(fit_a, fit_b));
      }
      const bool write = p.mask == nullptr || p.mask[e] != 0;
      const bool active = write && k > 0;
      // An inactive expert gets M = 0: CUTLASS schedules no tile for it (a K = 0 group would be
      // scheduled and store uninitialised accumulators).
      out.shapes[e] = active ? GroupShape{p.gemm_m, p.gemm_n, k} : GroupShape{0, p.gemm_n, 0};
      out.zero_expert[e] = (write && k == 0 && !p.accumulate) ? 1 : 0;
      out.ptr_a[e] = offset_ptr(p.rows_a.base, a_start, p.rows_a.elem_bytes);
      out.stride_a[e] = p.rows_a.ld;
      out.ptr_b[e] = offset_ptr(p.rows_b.base, b_start, p.rows_b.elem_bytes);
      out.stride_b[e] = p.rows_b.ld;
      if (out.ptr_sfa != nullptr) {
        out.ptr_sfa[e] = scale_start(p.scale_a, e, a_col);
        out.ptr_sfb[e] = scale_start(p.scale_b, e, b_col);
      }
      if (p.expert_stacked) {
        const void* d = offset_ptr(p.expert.base, e * p.expert.expert_stride, p.expert.elem_bytes);
        out.ptr_d[e] = const_cast<void*>(d);
        out.stride_d[e] = p.expert.ld;
        out.ptr_c[e] = d;
        out.stride_c[e] = p.expert.ld;
      }
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

PreparedCall prepare_call(const CallPlan& plan, std::size_t cutlass_bytes, cudaStream_t stream, Allocator& alloc) {
  const int device = current_device();
  const int sms = sm_count(device);
  const int E = plan.prep.num_experts;
  const bool wgrad = plan.prep.pass == GemmPass::wgrad;
  // An empty reduction runs no GEMM, so a fused bias would never be added: the dispatchers send
  // such calls to the bias's second pass (y = 0 + bias).
  GMOE_CHECK(!plan.zero_all_rows || plan.bias == nullptr,
             "grouped GEMM: a fused bias with an empty reduction (K = 0)");
  // Lists of expert tensors or biases: their pointers are written per expert, by value, after the
  // preparation kernel (which computes stacked and grouped ones itself).
  const bool experts_list = plan.experts != nullptr && !plan.experts->is_stacked();
  const bool bias_list = plan.bias != nullptr && !plan.bias->is_grouped();
  // Row chunks (fprop/dgrad) need every group's pointers from the kernel: not with lists.
  PrepareParams prep = plan.prep;
  prep.row_chunk = wgrad || experts_list || bias_list || E == 0 ? 0 : row_chunk_rows();
  prep.num_groups = prep.row_chunk > 0 ? static_cast<int32_t>(E + (prep.capacity + prep.row_chunk - 1) / prep.row_chunk)
                                       : E;  // (capacity < 2^31, row_chunk >= 128: no overflow)
  LaunchRecord& record = last_launch_record();
  record = LaunchRecord{};
  record.ran = plan.run_gemm;
  record.num_groups = prep.num_groups;
  record.row_chunk = prep.row_chunk;
  const std::size_t g = static_cast<std::size_t>(prep.num_groups);  // per-group arrays
  const std::size_t e = static_cast<std::size_t>(E);                // per-expert arrays

  // One workspace for every array and for CUTLASS (its tensor maps, one set per SM), each part
  // 128-byte aligned.
  std::size_t offset = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t at = offset;
    offset = (offset + bytes + 127) / 128 * 128;
    return at;
  };
  const std::size_t o_shapes = take(g * sizeof(GroupShape));
  const std::size_t o_ptrs = take(4 * g * sizeof(void*));
  const std::size_t o_strides = take(4 * g * sizeof(int64_t));
  const std::size_t o_total = take(sizeof(int64_t));
  const std::size_t o_zero = take(e * sizeof(int32_t));
  const std::size_t o_bias = take(plan.bias != nullptr ? g * sizeof(void*) : 0);
  const bool probs = plan.glu && plan.prep.probs != nullptr;
  const std::size_t o_glu = take(plan.glu ? g * (sizeof(void*) + sizeof(int64_t)) : 0);
  const std::size_t o_probs = take(probs ? g * sizeof(float*) : 0);
  const std::size_t o_scale_ptrs = take(plan.block_scales ? 2 * g * sizeof(float*) : 0);
  const std::size_t o_alpha = take(plan.alpha ? e * sizeof(float) : 0);
  const std::size_t o_alpha_ptrs = take(plan.alpha ? g * sizeof(float*) : 0);
  const std::size_t o_cutlass = take(cutlass_bytes);
  PreparedCall call;
  call.workspace = Buffer(alloc, offset, stream);
  char* base = static_cast<char*>(call.workspace.data());

  GroupedGemmArrays& a = call.arrays;
  a.shapes = reinterpret_cast<GroupShape*>(base + o_shapes);
  auto** ptrs = reinterpret_cast<const void**>(base + o_ptrs);
  a.ptr_a = ptrs;
  a.ptr_b = ptrs + g;
  a.ptr_c = ptrs + 2 * g;
  a.ptr_d = const_cast<void**>(ptrs + 3 * g);
  auto* strides = reinterpret_cast<int64_t*>(base + o_strides);
  a.stride_a = strides;
  a.stride_b = strides + g;
  a.stride_c = strides + 2 * g;
  a.stride_d = strides + 3 * g;
  a.total = reinterpret_cast<int64_t*>(base + o_total);
  a.zero_expert = reinterpret_cast<int32_t*>(base + o_zero);
  if (plan.bias != nullptr) a.ptr_bias = reinterpret_cast<const void**>(base + o_bias);
  if (plan.glu) {
    a.ptr_z = reinterpret_cast<void**>(base + o_glu);
    a.stride_z = reinterpret_cast<int64_t*>(base + o_glu + g * sizeof(void*));
    if (probs) a.ptr_probs = reinterpret_cast<const float**>(base + o_probs);
  }
  if (plan.block_scales) {
    auto** sf = reinterpret_cast<const float**>(base + o_scale_ptrs);
    a.ptr_sfa = sf;
    a.ptr_sfb = sf + g;
  }
  if (plan.alpha) {
    a.alpha = reinterpret_cast<float*>(base + o_alpha);
    a.alpha_ptr = reinterpret_cast<const float**>(base + o_alpha_ptrs);
  }

  launch_prepare(prep, a, stream);
  if (bias_list) {  // its pointers, by value (one group per expert)
    std::vector<const void*> host_ptrs(e);
    for (std::size_t i = 0; i < e; ++i) host_ptrs[i] = plan.bias->list[i].data;
    launch_write_pointers(host_ptrs.data(), E, a.ptr_bias, stream);
  }
  if (experts_list) {  // one group per expert
    std::vector<const void*> host_ptrs(e);
    std::vector<int64_t> host_lds(e);
    for (std::size_t i = 0; i < e; ++i) {
      host_ptrs[i] = plan.experts->list[i].data;
      host_lds[i] = plan.experts->list[i].stride(0);
    }
    if (wgrad) {
      launch_write_expert_pointers(host_ptrs.data(), host_lds.data(), E, const_cast<const void**>(a.ptr_d),
                                   a.stride_d, a.ptr_c, a.stride_c, stream);
    } else {
      launch_write_expert_pointers(host_ptrs.data(), host_lds.data(), E, a.ptr_b, a.stride_b, nullptr, nullptr,
                                   stream);
    }
  }
  if (wgrad) {
    launch_zero_experts(a.ptr_d, a.stride_d, plan.dw_elem_bytes, plan.dw_rows, plan.dw_row_bytes, a.zero_expert, E,
                        sms, stream);
  } else {
    launch_zero_rows(plan.out_base, plan.out_ld_bytes, plan.out_row_bytes, plan.prep.capacity,
                     plan.zero_all_rows ? nullptr : a.total, sms, stream);
    if (plan.glu) {
      const RowsOperand& z = plan.prep.rows_z;
      launch_zero_rows(const_cast<void*>(z.base), z.ld * z.elem_bytes, plan.z_row_bytes, plan.prep.capacity,
                       plan.zero_all_rows ? nullptr : a.total, sms, stream);
    }
  }

  GroupedGemmLaunch& l = call.launch;
  l.num_groups = prep.num_groups;
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
  l.glu.ptr_z = a.ptr_z;
  l.glu.stride_z = a.stride_z;
  l.glu.ptr_probs = a.ptr_probs;
  l.workspace = base + o_cutlass;
  l.workspace_bytes = cutlass_bytes;
  return call;
}

// Row chunks. The group scheduler hands out an expert's tiles in order along M (its rows) and then
// N, so the ~132 tiles that run at once are up to ceil(rows_e / 128) tiles tall: an expert with
// many rows has its CTAs read as many different row strips of A (each 128 x K) for only one or two
// column strips of B, and A's strips are read again for every further column strip. Splitting the
// expert into groups of row_chunk rows bounds the strip count, as the uniform cases have it.
// Splitting changes no result (each output row is the same dot products in the same order).
//
// Measured on an H100 (2026-11-24, gemm mode of the public suite, fprop and dgrad, 4096 against
// none, each twice, interleaved): dsv3_fc2/skewed dgrad (an expert of 16026 rows) 1.08x bf16,
// 1.16x FP8 blockwise, 1.18x tensorwise; dsv3_fc1/skewed fprop 1.10x blockwise, 1.12x tensorwise;
// mixtral_fc1/skewed dgrad 1.03-1.12x; geometric means over every case 1.017x bf16, 1.010x
// blockwise, 1.019x tensorwise. Cases without an expert above 4096 rows do not change. The one
// loss: qwen3moe_fc2/skewed fprop (K = 768: short tiles, whose group switches weigh more) 0.97-0.99x.
// Chunks of 1024 or 2048 rows helped the skewed cases as much but split the uniform ones too, and
// lost up to 7% there (fprop of dsv3_fc2/uniform, qwen3moe_fc2/skewed). GroupedMLP dsv3_ep32/skewed
// forward+backward: bf16 1.016x, FP8 blockwise 1.025x, tensorwise 1.070x.
int32_t row_chunk_rows() {
  static const int32_t rows = [] {
    const char* env = std::getenv("GMOE_ROW_CHUNK");
    if (env == nullptr) return kDefaultRowChunk;
    const long v = std::strtol(env, nullptr, 10);
    return v > 0 ? static_cast<int32_t>((v + 127) / 128 * 128) : 0;
  }();
  return rows;
}

// The tile order of the weight gradient (M = the layer's N, N = its K, host-known; K = an expert's
// tokens, on the device only). Tiles along M share B's tile and re-read A (dy_e, M x tokens) once
// per N tile unless all of A stays in L2; along N they share A's tile and need all of B (x_e,
// N x tokens) to stay in L2 instead. So along N when, at the average tokens per expert, A does not
// fit in half the L2 and B does. Measured on an H100 (2026-11-23, wgrad of the public suite, both
// orders forced in one run): mixtral_fc1 (A 117 MB, B 17 MB) along N 675 vs 586 TFLOP/s (uniform;
// skewed, whose larger experts overflow, 579 vs 607), dsv3_fc2 (A 59 MB, B 17 MB) 758 vs 740 and
// 676 vs 657; dsv3_fc1 (A 34 MB, B 59 MB) along M 771 vs 623 and 735 vs 483; qwen3moe and small_m
// (both operands fit) within 5% either way, along M kept. Along M is also CUTLASS's default for
// grouped problems. GMOE_RASTER=m|n forces an order (benchmarks, tests). The FP8 weight gradient
// takes the same rule with its 1-byte operands, except the tensorwise one without a source, which
// walks along N (`along_n`; the call site has the measurements).
bool choose_wgrad_raster_along_n(int64_t m, int64_t n, int64_t capacity, int64_t num_experts, DType in,
                                 bool along_n) {
  static const int forced = env_option("GMOE_RASTER", {"m", "n"});
  if (forced >= 0) return forced == 1;
  if (along_n) return true;
  const int64_t tokens = capacity / std::max<int64_t>(num_experts, 1);
  const int64_t elem = static_cast<int64_t>(dtype_size(in));
  const int64_t half_l2 = l2_bytes(current_device()) / 2;
  return m * tokens * elem > half_l2 && n * tokens * elem <= half_l2;
}

int env_option(const char* name, std::initializer_list<const char*> values) {
  const char* env = std::getenv(name);
  if (env == nullptr) return -1;
  int i = 0;
  for (const char* v : values) {
    if (std::strcmp(env, v) == 0) return i;
    ++i;
  }
  return -1;
}

int forced_cluster() {
  static const int forced = env_option("GMOE_CLUSTER", {"1x1", "2x1", "2x2"});
  return forced;
}

int forced_fp8_rows_cluster() {
  static const int forced = env_option("GMOE_FP8_ROWS_CLUSTER", {"1x1", "2x1", "2x2"});
  return forced >= 0 ? forced : forced_cluster();
}

// A 2x1 cluster halves the L2-to-SM traffic of B's tiles (TMA multicast) but schedules tiles in
// pairs along M: a group whose M tiles are odd in number computes one all-out-of-range tile per N
// tile. The weight gradient's M is the layer's N, host-known. Measured on an H100 (2026-11-24,
// public suite, 2x1 forced against 1x1 in one session; M = 12 to 224 tiles, all even): bf16
// 0.99-1.18x (dsv3_fc2 1.11-1.15x, mixtral_fc1/skewed 1.18x), tensorwise FP8 1.02-1.20x; the
// blockwise FP8 weight gradient 0.98-1.00x (not compiled, fp8_grouped_gemm.cu). bf16 fprop/dgrad
// measured 0.89-1.03x (and the dsv3_ep32 MLP under sustained load 0.975x with every bf16 pass in
// 2x1, gpt-oss-20b 1.046x; 1.00x with this rule) and are not compiled in 2x1; FP8 fprop/dgrad
// have their own rule (fp8_grouped_gemm.cu, choose_rows_tile). The f32 (main_grad) kernels, A/B'd
// alone later (ba68eff): tensorwise FP8 1.12-1.13x on dsv3_fc2, 0.98-1.06x elsewhere; the bf16
// layer's forward+backward 1.00-1.04x.
bool wgrad_cluster_2x1(int64_t m) {
  if (forced_cluster() >= 0) return forced_cluster() >= 1;
  const int64_t tiles_m = (m + 127) / 128;
  return tiles_m >= 2 && (tiles_m % 2 == 0 || tiles_m >= 16);
}

}  // namespace gmoe::cuda_backend
