// src/dist/ep_group_nccl.cu — the NCCL backend of expert parallelism: one rank per GPU, rows pushed
// by kernels straight into the peers' memory through NCCL's device API (nccl_device.h).
//
// Set-up, once per group: ncclCommInitRank; one buffer from ncclMemAlloc registered as a symmetric
// window (NCCL_WIN_COLL_SYMMETRIC) that holds the receive rows, their scalars and the plan's
// counts area; a device communicator with one LSA barrier per CTA of the push kernels. Only
// load/store-accessible peers (one NVLink domain) are supported: every rank of the group must be in
// the LSA team. Multimem (NVLink SHARP) is never requested.
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_errors.h"
#include "cuda/runtime/device_info.h"
#include "dist/ep_backend.h"
#include "dist/ep_kernels.h"
#include "gmoe/error.h"

/// Throws gmoe::Error with the NCCL error string when an NCCL call fails.
#define GMOE_NCCL_CHECK(call)                                                                          \
  do {                                                                                                 \
    const ncclResult_t gmoe_nccl_status_ = (call);                                                     \
    if (gmoe_nccl_status_ != ncclSuccess) {                                                            \
      ::gmoe::detail::throw_error(__FILE__, __LINE__, #call, "NCCL error ", static_cast<int>(gmoe_nccl_status_), \
                                  " (", ncclGetErrorString(gmoe_nccl_status_), ")");                   \
    }                                                                                                  \
  } while (0)

namespace gmoe {
namespace {

static_assert(sizeof(ncclUniqueId) == sizeof(EpUniqueId::bytes), "EpUniqueId holds an ncclUniqueId");

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

class NcclGroup final : public ep::GroupBackend {
 public:
  NcclGroup(const EpUniqueId& id, int rank, int size, Device device, const EpGroupOptions& options)
      : rank_(rank), size_(size), device_(device), options_(options) {
    GMOE_CUDA_CHECK(cudaSetDevice(device.index));
    sm_count_ = cuda_backend::sm_count(device.index);
    ncclUniqueId uid;
    std::memcpy(&uid, id.bytes, sizeof uid);
    GMOE_NCCL_CHECK(ncclCommInitRank(&comm_, size, uid, rank));
    try {
      const ncclTeam_t lsa = ncclTeamLsa(comm_);
        // The kernels address peer r's window as LSA rank r: the LSA team must be the whole group.
      GMOE_CHECK(lsa.nRanks == size && lsa.rank == rank, "make_ep_group_nccl: only ", lsa.nRanks, " of the group's ",
                 size, " ranks are load/store accessible from rank ", rank,
                 " (one NVLink domain); groups across nodes are not supported");
      ep::WindowLayout& l = win_.layout;
      l.row_bytes = static_cast<size_t>(options.hidden) * dtype_size(options.dtype);
      const size_t window_rows = static_cast<size_t>(std::max(recv_capacity(), options.max_rows));
      l.rows = 0;
      l.scalars = align_up(window_rows * l.row_bytes, 256);
      l.counts = align_up(l.scalars + window_rows * sizeof(float), 256);
      l.bytes = align_up(l.counts + static_cast<size_t>(size) * options.num_experts * sizeof(int32_t), 256);
      void* base = nullptr;
      GMOE_NCCL_CHECK(ncclMemAlloc(&base, l.bytes));
      win_.local = static_cast<unsigned char*>(base);
      // Rows nobody pushed read as zeros until the first exchange (set-up: a sync is fine here).
      GMOE_CUDA_CHECK(cudaMemset(base, 0, l.bytes));
      GMOE_CUDA_CHECK(cudaDeviceSynchronize());
      GMOE_NCCL_CHECK(ncclCommWindowRegister(comm_, base, l.bytes, &win_.handle, NCCL_WIN_COLL_SYMMETRIC));
      ncclDevCommRequirements reqs;
      std::memset(&reqs, 0, sizeof reqs);  // no multimem, no GIN: LSA barriers only
      reqs.lsaBarrierCount = ep::kPushCtas;
      GMOE_NCCL_CHECK(ncclDevCommCreate(comm_, &reqs, &win_.comm));
      has_dev_comm_ = true;
    } catch (...) {
      release();
      throw;
    }
  }
  ~NcclGroup() override { release(); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return device_; }
  const EpGroupOptions& options() const override { return options_; }

  void plan(const TensorView& counts, const TensorView& counts_all, const TensorView& local_counts,
            Stream stream) override {
    cuda_backend::DeviceGuard guard(device_.index);
    ep::launch_plan(counts.ptr<const int32_t>(), counts_all.ptr<int32_t>(), local_counts.ptr<int32_t>(), geometry(),
                    win_, cuda_backend::device_error_word(), stream);
  }

  void move(ep::Direction dir, const TensorView& counts_all, const TensorView& in_rows, const TensorView& in_scalars,
            const TensorView& out_rows, const TensorView& out_scalars, Stream stream) override {
    cuda_backend::DeviceGuard guard(device_.index);
    ep::launch_move(dir == ep::Direction::dispatch, counts_all.ptr<const int32_t>(), in_rows.data,
                    in_scalars.defined() ? in_scalars.ptr<const float>() : nullptr, out_rows.data,
                    out_scalars.defined() ? out_scalars.ptr<float>() : nullptr, geometry(), win_,
                    cuda_backend::device_error_word(), sm_count_, stream);
  }

 private:
  ep::Geometry geometry() const {
    ep::Geometry g;
    g.ranks = size_;
    g.me = rank_;
    g.experts = options_.num_experts;
    g.local = options_.num_experts / size_;
    g.max_rows = options_.max_rows;
    g.recv_cap = recv_capacity();
    return g;
  }

  // Collective with the peers' release(): NCCL's window and communicator teardown are. Kernels
  // still queued may read or write the window, so teardown waits for the device first (a
  // deliberate sync: a group is destroyed once, never under graph capture).
  void release() noexcept {
    cudaSetDevice(device_.index);
    cudaDeviceSynchronize();
    if (has_dev_comm_) ncclDevCommDestroy(comm_, &win_.comm);
    if (win_.handle != nullptr) ncclCommWindowDeregister(comm_, win_.handle);
    if (win_.local != nullptr) ncclMemFree(win_.local);
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    has_dev_comm_ = false;
    win_.handle = nullptr;
    win_.local = nullptr;
    comm_ = nullptr;
  }

  int rank_;
  int size_;
  Device device_;
  EpGroupOptions options_;
  int sm_count_ = 1;
  ncclComm_t comm_ = nullptr;
  ep::Window win_;
  bool has_dev_comm_ = false;
};

}  // namespace

EpUniqueId ep_unique_id() {
  ncclUniqueId uid;
  GMOE_NCCL_CHECK(ncclGetUniqueId(&uid));
  EpUniqueId id;
  std::memcpy(id.bytes, &uid, sizeof uid);
  return id;
}

std::unique_ptr<EpGroup> make_ep_group_nccl(const EpUniqueId& id, int rank, int size, Device device,
                                            const EpGroupOptions& options) {
  ep::check_group_options(size, options);
  GMOE_CHECK(rank >= 0 && rank < size, "rank: expected in [0, ", size, "), got ", rank);
  GMOE_CHECK(device.is_cuda(), "device: the NCCL backend needs a CUDA device, got ", device.str());
  int devices = 0;
  GMOE_CUDA_CHECK(cudaGetDeviceCount(&devices));
  GMOE_CHECK(device.index >= 0 && device.index < devices, "device: ", device.str(), " is not one of this process's ",
             devices, " CUDA devices");
  // The device API is header-inline: kernels compiled against one NCCL release read the structs of
  // the library loaded at run time, and a different patch release lays them out differently (an
  // illegal memory access at the first barrier). Refuse the mismatch up front.
  int loaded = 0;
  GMOE_NCCL_CHECK(ncclGetVersion(&loaded));
  GMOE_CHECK(loaded == NCCL_VERSION_CODE, "make_ep_group_nccl: the NCCL library loaded at run time is version ",
             loaded, " but gmoe was compiled against the headers of version ", NCCL_VERSION_CODE,
             "; the device API needs the same release: put the matching libnccl.so.2 first on LD_LIBRARY_PATH");
  GMOE_CHECK(options.num_experts <= ep::kMaxExperts, "options.num_experts: the NCCL backend handles at most ",
             ep::kMaxExperts, " experts (its offset tables live in shared memory), got ", options.num_experts);
  return std::make_unique<NcclGroup>(id, rank, size, device, options);
}

}  // namespace gmoe
