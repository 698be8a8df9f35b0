// src/layers/offload_slots.h — OffloadSlots: what one context saved, as each context's collect()
// lists it for gmoe/offload.h: the allocations it owns (moved to the host and back) and every view
// that may point into them (re-pointed at the reloaded memory).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "gmoe/allocator.h"
#include "gmoe/fp8.h"
#include "gmoe/offload.h"

namespace gmoe {

struct OffloadSlots {
  /// One owned allocation: a Tensor made by Tensor::empty, or the Buffer behind FP8 copies.
  struct Slot {
    Tensor* tensor = nullptr;
    std::shared_ptr<Buffer>* storage = nullptr;
    std::uintptr_t old_base = 0;  // its address when offloaded (views are matched against it)
    std::size_t bytes = 0;
    DType dtype = DType::f32;     // Tensor: what to remake it as
    int ndim = 0;
    std::array<int64_t, TensorView::kMaxDims> shape{};
    void* host = nullptr;         // the pool block while away
  };
  std::vector<Slot> slots;
  std::vector<TensorView*> views;

  /// An owned Tensor (wraps and empty tensors are skipped: nothing of theirs is the context's).
  void tensor(Tensor& t);
  /// The Buffer behind FP8 copies (null or empty: skipped).
  void storage(std::shared_ptr<Buffer>& b);
  /// A view that may point into an owned allocation (or anywhere else: then it is left alone).
  void view(TensorView& v) { views.push_back(&v); }
  /// An FP8 quantization: its storage and every view of it.
  void fp8(Fp8GroupedTensor& t);
  /// A nested context (GroupedMLP's FCs, MoELayer's experts).
  void child(Offloadable& c) { c.collect(*this); }
};

}  // namespace gmoe
