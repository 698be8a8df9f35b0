// src/dist/ep_group_cpu.cpp — the CPU backend of expert parallelism: R ranks in one process, each
// rank's ops called from its own thread.
//
// The algorithm is the NCCL backend's, with host memory for the symmetric window: every rank owns
// a window (rows, their scalars, and an all-gather area for counts) that its peers write into. An
// op is barrier (the peers have finished reading their windows from the previous op) -> push this
// rank's rows into the peers' windows at the computed offsets -> barrier (every push has landed)
// -> copy this rank's window out. What the device would record in its error word (a negative
// count, counts past max_rows, rows past recv_capacity) the CPU backend throws as gmoe::Error, on
// every rank alike and only once the collective is over, so that no rank is left waiting at a
// barrier of an op that its peers abandoned.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dist/ep_backend.h"
#include "dist/ep_plan_math.h"
#include "gmoe/error.h"
#include "gmoe/grouped.h"

namespace gmoe {
namespace {

// A reusable barrier for a fixed number of threads: the generation count lets a thread that leaves
// one barrier enter the next before the slowest has woken from the first.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t gen = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != gen; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  const int n_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

// What all ranks of a local group share: the windows, the all-gather areas and the barrier.
struct Shared {
  Shared(int size, const EpGroupOptions& o, int64_t recv_cap)
      : options(o), ranks(size), barrier(size) {
    row_bytes = static_cast<size_t>(o.hidden) * dtype_size(o.dtype);
    // Dispatch lands up to recv_cap rows in a window, combine up to max_rows.
    window_rows = std::max(recv_cap, o.max_rows);
    rows.resize(size);
    scalars.resize(size);
    counts.resize(size);
    for (int r = 0; r < size; ++r) {
      rows[r].assign(static_cast<size_t>(window_rows) * row_bytes, 0);
      scalars[r].assign(static_cast<size_t>(window_rows), 0.0f);
      // R x E counts, then one word of error flags per source rank.
      counts[r].assign(static_cast<size_t>(size) * (o.num_experts + 1), 0);
    }
  }
  EpGroupOptions options;
  int ranks;
  size_t row_bytes = 0;
  int64_t window_rows = 0;
  std::vector<std::vector<unsigned char>> rows;
  std::vector<std::vector<float>> scalars;
  std::vector<std::vector<int32_t>> counts;
  Barrier barrier;
};

constexpr int32_t kNegative = 1, kPastCapacity = 2;

class LocalGroup final : public ep::GroupBackend {
 public:
  LocalGroup(std::shared_ptr<Shared> shared, int rank) : shared_(std::move(shared)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return shared_->ranks; }
  Device device() const override { return Device::cpu(); }
  const EpGroupOptions& options() const override { return shared_->options; }

  void plan(const TensorView& counts, const TensorView& counts_all, const TensorView& local_counts,
            Stream) override {
    Shared& sh = *shared_;
    const int R = sh.ranks;
    const int64_t E = sh.options.num_experts;
    std::vector<int32_t> mine(static_cast<size_t>(E));
    bool negative = false, past = false;
    ep::sanitize_counts(counts.ptr<const int32_t>(), E, sh.options.max_rows, mine.data(), &negative, &past);
    const int32_t flags = (negative ? kNegative : 0) | (past ? kPastCapacity : 0);

    sh.barrier.arrive_and_wait();
    for (int p = 0; p < R; ++p) {
      std::copy(mine.begin(), mine.end(), sh.counts[p].begin() + rank_ * E);
      sh.counts[p][static_cast<size_t>(R * E + rank_)] = flags;
    }
    sh.barrier.arrive_and_wait();
    const std::vector<int32_t>& area = sh.counts[rank_];
    std::copy(area.begin(), area.begin() + R * E, counts_all.ptr<int32_t>());
    const int64_t El = E / R;
    int32_t* lc = local_counts.ptr<int32_t>();
    for (int64_t e = 0; e < El; ++e) {
      int64_t sum = 0;
      for (int s = 0; s < R; ++s) sum += area[static_cast<size_t>(s * E + rank_ * El + e)];
      lc[e] = static_cast<int32_t>(sum);
    }
    // Every rank sees every rank's flags: all throw the same error, or none does.
    std::string what;
    uint32_t bits = 0;
    for (int s = 0; s < R; ++s) {
      const int32_t f = area[static_cast<size_t>(R * E + s)];
      if (f == 0) continue;
      if (f & kNegative) bits |= kDeviceErrorNegativeCount;
      if (f & kPastCapacity) bits |= kDeviceErrorCountsPastCapacity;
      what += " rank " + std::to_string(s) + "'s counts" + ((f & kNegative) ? " hold a negative count" : "") +
              ((f & kPastCapacity) ? " sum past max_rows " + std::to_string(sh.options.max_rows) : "") + ";";
    }
    GMOE_CHECK(bits == 0, "ep_plan: counts: the CPU backend refuses what the device would clamp:",
               device_error_text(bits), what);
  }

  void move(ep::Direction dir, const TensorView& counts_all, const TensorView& in_rows, const TensorView& in_scalars,
            const TensorView& out_rows, const TensorView& out_scalars, Stream) override {
    Shared& sh = *shared_;
    ep::Geometry geo;
    geo.ranks = sh.ranks;
    geo.me = rank_;
    geo.experts = sh.options.num_experts;
    geo.local = geo.experts / geo.ranks;
    geo.max_rows = sh.options.max_rows;
    geo.recv_cap = recv_capacity();
    const int32_t* ca = counts_all.ptr<const int32_t>();
    const bool dispatch = dir == ep::Direction::dispatch;
    const ep::SegmentTable source = ep::source_table(ca, geo);
    const ep::SegmentTable receive = ep::receive_table(ca, geo);
    const ep::SegmentTable& push = dispatch ? source : receive;
    const ep::SegmentTable& keep = dispatch ? receive : source;
    const size_t rb = sh.row_bytes;
    const auto* in = static_cast<const unsigned char*>(in_rows.data);
    const float* in_s = in_scalars.defined() ? in_scalars.ptr<const float>() : nullptr;

    sh.barrier.arrive_and_wait();
    int64_t dropped = 0;
    for (int64_t i = 0; i < push.valid_rows(); ++i) {
      int to = 0;
      int64_t row = 0;
      push.place(i, &to, &row);
      if (row >= push.remote_cap) {
        ++dropped;
        continue;
      }
      std::memcpy(sh.rows[to].data() + row * rb, in + i * rb, rb);
      if (in_s != nullptr) sh.scalars[to][static_cast<size_t>(row)] = in_s[i];
    }
    sh.barrier.arrive_and_wait();

    const int64_t out_cap = out_rows.size(0);
    auto* out = static_cast<unsigned char*>(out_rows.data);
    float* out_s = out_scalars.defined() ? out_scalars.ptr<float>() : nullptr;
    for (int64_t i = 0; i < out_cap; ++i) {
      bool valid = i < keep.valid_rows();
      if (valid) {
        int from = 0;
        int64_t row = 0;
        keep.place(i, &from, &row);
        valid = row < keep.remote_cap;  // combine: the row dispatch dropped never came back
      }
      if (valid) {
        std::memcpy(out + i * rb, sh.rows[rank_].data() + i * rb, rb);
      } else {
        std::memset(out + i * rb, 0, rb);
      }
      if (out_s != nullptr) out_s[i] = valid ? sh.scalars[rank_][static_cast<size_t>(i)] : 0.0f;
    }

    // The plan is the same on every rank, so every rank finds the same overflowing receivers.
    std::string what;
    if (dispatch) {
      for (int r = 0; r < sh.ranks; ++r) {
        const int64_t got = ep::received_rows(ca, geo, r);
        if (got > geo.recv_cap) {
          what += " rank " + std::to_string(r) + " receives " + std::to_string(got) + " rows;";
        }
      }
    }
    if (dropped > 0 && what.empty()) {
      what = " rank " + std::to_string(rank_) + " dropped " + std::to_string(dropped) + " rows of its plan;";
    }
    GMOE_CHECK(what.empty(), dispatch ? "ep_dispatch" : "ep_combine", ": rows past the receive capacity ",
               geo.recv_cap, " (options.max_recv_rows) were dropped, not written:", what, " the device records:",
               device_error_text(kDeviceErrorCountsPastCapacity));
  }

 private:
  std::shared_ptr<Shared> shared_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<EpGroup>> make_ep_group_local(int size, const EpGroupOptions& options) {
  ep::check_group_options(size, options);
  const int64_t recv_cap = options.max_recv_rows > 0 ? options.max_recv_rows : size * options.max_rows;
  auto shared = std::make_shared<Shared>(size, options, recv_cap);
  std::vector<std::unique_ptr<EpGroup>> groups;
  for (int r = 0; r < size; ++r) groups.push_back(std::make_unique<LocalGroup>(shared, r));
  return groups;
}

}  // namespace gmoe
