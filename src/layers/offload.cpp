// src/layers/offload.cpp — activation offloading (gmoe/offload.h): the pinned host pool, the four
// steps of a context (offload, release, prefetch, reload) over what its collect() lists, and the
// scheduler of a layer stack.
#include "gmoe/offload.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <unordered_map>
#include <utility>

#include "common/backend.h"
#include "gmoe/error.h"
#include "layers/offload_slots.h"

namespace gmoe {
namespace {

constexpr std::size_t kHostAlign = 256;
std::size_t align_up(std::size_t v) { return (v + kHostAlign - 1) / kHostAlign * kHostAlign; }

// Stream-ordered on CUDA (pinned host memory, so asynchronous); done on return on the CPU.
void copy_bytes(Device device, void* dst, const void* src, std::size_t bytes, Stream stream) {
  if (bytes == 0) return;
  if (device.is_cuda()) {
    cuda_backend::copy_bytes_async(dst, src, bytes, stream);
  } else {
    std::memcpy(dst, src, bytes);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// PinnedHostPool

struct PinnedHostPool::Chunk {
  char* base = nullptr;
  std::size_t size = 0;
  std::map<std::size_t, std::size_t> free_runs;  // offset -> length, coalesced
  std::unordered_map<std::size_t, std::size_t> live;  // offset -> length
};

PinnedHostPool::PinnedHostPool(Device device, std::size_t min_chunk_bytes)
    : device_(device), min_chunk_(std::max<std::size_t>(align_up(min_chunk_bytes), kHostAlign)) {
  if (device.is_cuda()) {
    GMOE_CHECK(cuda_backend::compiled(), "PinnedHostPool: device ", device.str(), " in a build without CUDA");
  }
}

PinnedHostPool::~PinnedHostPool() {
  for (auto& c : chunks_) {
    if (device_.is_cuda()) {
      cuda_backend::host_free_pinned(c->base);
    } else {
      std::free(c->base);
    }
  }
}

PinnedHostPool::Chunk& PinnedHostPool::grow(std::size_t bytes) {
  const std::size_t size = std::max(align_up(bytes), min_chunk_);
  auto c = std::make_unique<Chunk>();
  if (device_.is_cuda()) {
    c->base = static_cast<char*>(cuda_backend::host_alloc_pinned(size));
  } else {
    c->base = static_cast<char*>(std::aligned_alloc(kHostAlign, size));
    GMOE_CHECK(c->base != nullptr, "PinnedHostPool: host allocation of ", size, " bytes failed");
  }
  c->size = size;
  c->free_runs.emplace(0, size);
  chunks_.push_back(std::move(c));
  ++chunk_allocations_;
  return *chunks_.back();
}

void* PinnedHostPool::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  const std::size_t need = align_up(bytes);
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& c : chunks_) {
      for (auto it = c->free_runs.begin(); it != c->free_runs.end(); ++it) {
        if (it->second < need) continue;
        const std::size_t off = it->first, len = it->second;
        c->free_runs.erase(it);
        if (len > need) c->free_runs.emplace(off + need, len - need);
        c->live.emplace(off, need);
        used_ += need;
        peak_used_ = std::max(peak_used_, used_);
        return c->base + off;
      }
    }
    if (pass == 0) grow(need);
  }
  GMOE_FAIL("PinnedHostPool: no run of ", need, " bytes after growing");  // unreachable
}

void PinnedHostPool::free(void* ptr) {
  if (ptr == nullptr) return;
  char* p = static_cast<char*>(ptr);
  for (auto& c : chunks_) {
    if (p < c->base || p >= c->base + c->size) continue;
    const std::size_t off = static_cast<std::size_t>(p - c->base);
    auto live = c->live.find(off);
    GMOE_CHECK(live != c->live.end(), "PinnedHostPool::free: ", ptr, " is not a block of this pool");
    std::size_t start = off, len = live->second;
    c->live.erase(live);
    used_ -= len;
    auto next = c->free_runs.lower_bound(start);
    if (next != c->free_runs.end() && next->first == start + len) {
      len += next->second;
      next = c->free_runs.erase(next);
    }
    if (next != c->free_runs.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == start) {
        start = prev->first;
        len += prev->second;
        c->free_runs.erase(prev);
      }
    }
    c->free_runs.emplace(start, len);
    return;
  }
  GMOE_FAIL("PinnedHostPool::free: ", ptr, " is not a block of this pool");
}

void PinnedHostPool::reserve(std::size_t bytes) {
  const std::size_t need = align_up(bytes);
  for (auto& c : chunks_) {
    for (const auto& run : c->free_runs) {
      if (run.second >= need) return;
    }
  }
  grow(need);
}

std::size_t PinnedHostPool::capacity_bytes() const {
  std::size_t total = 0;
  for (const auto& c : chunks_) total += c->size;
  return total;
}

// ---------------------------------------------------------------------------------------------
// Offloader

Offloader::Offloader(Device device, Stream copy_stream, Allocator* allocator, std::size_t min_chunk_bytes)
    : device_(device), copy_stream_(copy_stream), allocator_(allocator), pool_(device, min_chunk_bytes) {
  if (allocator_ != nullptr) {
    GMOE_CHECK(allocator_->device().type == device.type, "allocator: for ", allocator_->device().str(),
               ", offloader for ", device.str());
  }
}

Allocator& Offloader::allocator() const { return allocator_ ? *allocator_ : default_allocator(device_); }

const char* offload_state_name(OffloadState state) {
  switch (state) {
    case OffloadState::resident: return "resident";
    case OffloadState::offloading: return "offloading";
    case OffloadState::offloaded: return "offloaded";
    case OffloadState::reloading: return "reloading";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------------------------
// OffloadSlots

void OffloadSlots::tensor(Tensor& t) {
  if (!t.owns_memory()) return;
  const TensorView& v = t.view();
  Slot s;
  s.tensor = &t;
  s.old_base = reinterpret_cast<std::uintptr_t>(v.data);
  s.bytes = static_cast<std::size_t>(v.nbytes());
  s.dtype = v.dtype;
  s.ndim = v.ndim;
  s.shape = v.shape;
  slots.push_back(s);
}

void OffloadSlots::storage(std::shared_ptr<Buffer>& b) {
  if (!b || b->data() == nullptr) return;
  Slot s;
  s.storage = &b;
  s.old_base = reinterpret_cast<std::uintptr_t>(b->data());
  s.bytes = b->bytes();
  slots.push_back(s);
}

void OffloadSlots::fp8(Fp8GroupedTensor& t) {
  storage(t.storage);
  for (TensorView* v : {&t.q.data, &t.q.scale_inv, &t.q.data_t, &t.q.scale_inv_t, &t.q.padded_offsets}) view(*v);
}

// ---------------------------------------------------------------------------------------------
// Offloadable

struct Offloadable::Record {
  OffloadState state = OffloadState::resident;
  Offloader* off = nullptr;
  OffloadSlots slots;
  struct Remap {
    TensorView* view;
    std::size_t slot;
    std::size_t offset;
  };
  std::vector<Remap> remaps;
  bool released = false;
  Event ready, copied, reloaded;  // made once per context and device, reused every step

  void ensure_events(Device device) {
    if (ready.defined() && ready.device() == device) return;
    ready = Event(device);
    copied = Event(device);
    reloaded = Event(device);
  }
  // Host blocks go back to the pool: every later copy into them runs on the same copy stream, after
  // the copies already issued from them.
  void free_host() {
    for (auto& s : slots.slots) {
      if (s.host != nullptr) off->pool().free(s.host);
      s.host = nullptr;
    }
  }
  void clear() {
    slots = OffloadSlots();
    remaps.clear();
    released = false;
    off = nullptr;
    state = OffloadState::resident;
  }
  ~Record() {
    if (off != nullptr) free_host();
  }
};

Offloadable::Offloadable() : record_(std::make_unique<Record>()) {}
Offloadable::~Offloadable() = default;
Offloadable::Offloadable(Offloadable&&) noexcept = default;
Offloadable& Offloadable::operator=(Offloadable&&) noexcept = default;

OffloadState Offloadable::offload_state() const { return record_ ? record_->state : OffloadState::resident; }

void Offloadable::check_resident(const char* what) const {
  const OffloadState s = offload_state();
  GMOE_CHECK(s == OffloadState::resident, "ctx: ", what, " needs the context's saved tensors on the device, but they ",
             "are ", offload_state_name(s), ": call reload(stream) first");
}

std::size_t Offloadable::offloadable_bytes() {
  OffloadSlots s;
  collect(s);
  std::size_t total = 0;
  for (const auto& slot : s.slots) total += slot.bytes;
  return total;
}

void Offloadable::offload(Offloader& off, Stream stream) {
  if (!record_) record_ = std::make_unique<Record>();
  Record& r = *record_;
  check_resident("offload");
  OffloadSlots slots;
  collect(slots);
  if (slots.slots.empty()) return;
  const Device dev = off.device();
  r.off = &off;
  r.slots = std::move(slots);
  r.remaps.clear();
  // Every view into an owned allocation is remembered as (allocation, offset): after reload the
  // allocation lives elsewhere. Views elsewhere (the caller's tensors) are not the context's.
  for (TensorView* v : r.slots.views) {
    if (v->data == nullptr) continue;
    const auto p = reinterpret_cast<std::uintptr_t>(v->data);
    const bool empty = v->ndim > 0 && v->numel() == 0;
    for (std::size_t i = 0; i < r.slots.slots.size(); ++i) {
      const auto& s = r.slots.slots[i];
      if (p >= s.old_base && (p < s.old_base + s.bytes || (empty && p == s.old_base + s.bytes))) {
        r.remaps.push_back({v, i, static_cast<std::size_t>(p - s.old_base)});
        break;
      }
    }
  }
  r.ensure_events(dev);
  const Stream copy = off.copy_stream();
  // The copies start once the work that wrote the saved tensors (enqueued on `stream`) is done.
  r.ready.record(stream);
  r.ready.wait(copy);
  std::size_t total = 0;
  for (auto& s : r.slots.slots) {
    s.host = off.pool().allocate(s.bytes);
    copy_bytes(dev, s.host, reinterpret_cast<const void*>(s.old_base), s.bytes, copy);
    total += s.bytes;
  }
  r.copied.record(copy);
  off.bytes_offloaded_ += static_cast<int64_t>(total);
  r.released = false;
  r.state = OffloadState::offloading;
}

void Offloadable::release(Stream stream) {
  GMOE_CHECK(offload_state() == OffloadState::offloading, "ctx: release needs an offloading context, got ",
             offload_state_name(offload_state()));
  Record& r = *record_;
  // The device memory is freed on the compute stream once it has waited for the copies that read
  // it, so that whatever allocator made it sees it idle on the stream it belongs to.
  r.copied.wait(stream);
  for (auto& s : r.slots.slots) {
    if (s.tensor != nullptr) {
      s.tensor->release_on(stream);
    } else {
      (*s.storage)->reset_on(stream);
    }
  }
  r.released = true;
  r.state = OffloadState::offloaded;
}

void Offloadable::prefetch(Stream stream) {
  const OffloadState st = offload_state();
  if (st == OffloadState::resident || st == OffloadState::reloading) return;
  Record& r = *record_;
  Offloader& off = *r.off;
  const Stream copy = off.copy_stream();
  if (!r.released) {
    // The device memory never left: nothing comes back. reload() still waits for the copies out,
    // so that nothing writes over a tensor while it is being read.
    r.free_host();
    r.reloaded.record(copy);
    r.state = OffloadState::reloading;
    return;
  }
  const Device dev = off.device();
  Allocator& alloc = off.allocator();
  // New device memory, stream-ordered on the compute stream that will read it; the copy stream
  // writes it once `stream` has reached this point.
  for (auto& s : r.slots.slots) {
    if (s.tensor != nullptr) {
      *s.tensor = Tensor::empty(s.shape.data(), s.ndim, s.dtype, alloc, stream);
    } else {
      *s.storage = std::make_shared<Buffer>(alloc, s.bytes, stream);
    }
  }
  r.ready.record(stream);
  r.ready.wait(copy);
  std::size_t total = 0;
  for (auto& s : r.slots.slots) {
    void* dst = s.tensor != nullptr ? s.tensor->view().data : (*s.storage)->data();
    copy_bytes(dev, dst, s.host, s.bytes, copy);
    total += s.bytes;
  }
  r.reloaded.record(copy);
  r.free_host();
  for (const auto& m : r.remaps) {
    const auto& s = r.slots.slots[m.slot];
    char* base = static_cast<char*>(s.tensor != nullptr ? s.tensor->view().data : (*s.storage)->data());
    m.view->data = base + m.offset;
  }
  off.bytes_reloaded_ += static_cast<int64_t>(total);
  r.state = OffloadState::reloading;
}

void Offloadable::reload(Stream stream) {
  if (offload_state() == OffloadState::resident) return;
  prefetch(stream);
  Record& r = *record_;
  r.reloaded.wait(stream);
  r.clear();
}

// ---------------------------------------------------------------------------------------------
// OffloadScheduler

OffloadScheduler::OffloadScheduler(Offloader& offloader, OffloadSchedulerOptions options)
    : offloader_(&offloader), options_(std::move(options)) {
  GMOE_CHECK(options_.num_layers >= 1, "options.num_layers: expected >= 1, got ", options_.num_layers);
  GMOE_CHECK(options_.reload_ahead >= 1, "options.reload_ahead: expected >= 1, got ", options_.reload_ahead);
  GMOE_CHECK(options_.offload_layer.empty() ||
                 options_.offload_layer.size() == static_cast<std::size_t>(options_.num_layers),
             "options.offload_layer: expected empty or ", options_.num_layers, " flags, got ",
             options_.offload_layer.size());
  ctx_.assign(options_.num_layers, nullptr);
}

bool OffloadScheduler::offloads(int layer) const {
  GMOE_CHECK(layer >= 0 && layer < options_.num_layers, "layer: expected 0..", options_.num_layers - 1, ", got ",
             layer);
  if (options_.keep_last_layer && layer == options_.num_layers - 1) return false;
  return options_.offload_layer.empty() || options_.offload_layer[layer];
}

void OffloadScheduler::forward_done(int layer, Offloadable& ctx, Stream stream) {
  const bool off = offloads(layer);
  ctx_[layer] = &ctx;
  // The previous layer's copies ran beside this layer's forward: its memory can go now.
  if (pending_release_ >= 0) {
    ctx_[pending_release_]->release(stream);
    pending_release_ = -1;
  }
  if (!off) return;
  ctx.offload(*offloader_, stream);
  if (ctx.offload_state() == OffloadState::offloading) pending_release_ = layer;
}

void OffloadScheduler::forward_end(Stream stream) {
  if (pending_release_ >= 0) ctx_[pending_release_]->release(stream);
  pending_release_ = -1;
}

void OffloadScheduler::backward_begin(int layer, Stream stream) {
  GMOE_CHECK(layer >= 0 && layer < options_.num_layers, "layer: expected 0..", options_.num_layers - 1, ", got ",
             layer);
  GMOE_CHECK(ctx_[layer] != nullptr, "backward_begin: layer ", layer, " had no forward_done this step");
  forward_end(stream);
  // This layer first (normally started by the previous call already), then the layers ahead, so
  // that their copies queue behind its own and run beside its backward.
  ctx_[layer]->prefetch(stream);
  for (int j = layer - 1; j >= 0 && j >= layer - options_.reload_ahead; --j) {
    if (ctx_[j] != nullptr) ctx_[j]->prefetch(stream);
  }
  ctx_[layer]->reload(stream);
  ctx_[layer] = nullptr;
}

}  // namespace gmoe
