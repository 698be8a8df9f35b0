// tests/common/offload_fixture.cpp — see offload_fixture.h.
#include "common/offload_fixture.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <utility>

#include "gmoe/grouped_mlp.h"

namespace gmoe::test {

void* CountingAllocator::allocate(std::size_t bytes, Stream stream) {
  void* p = base_->allocate(bytes, stream);
  if (p != nullptr) {
    live_[p] = bytes;
    in_use_ += bytes;
    if (in_use_ > peak_) peak_ = in_use_;
  }
  return p;
}

void CountingAllocator::free(void* ptr, Stream stream) {
  if (ptr == nullptr) return;
  auto it = live_.find(ptr);
  if (it != live_.end()) {
    in_use_ -= it->second;
    if (device().is_cpu()) {
      std::memset(ptr, 0xa5, it->second);
      quarantine_.push_back(ptr);
      live_.erase(it);
      return;
    }
    live_.erase(it);
  }
  base_->free(ptr, stream);
}

CountingAllocator::~CountingAllocator() {
  for (void* p : quarantine_) base_->free(p, nullptr);
}

DeviceIO cpu_io(std::deque<HostTensor>& storage) {
  DeviceIO io;
  io.device = Device::cpu();
  io.upload = [&storage](const HostTensor& t) {
    storage.push_back(t);
    return storage.back().view();
  };
  io.download = [](const TensorView& v) {
    std::vector<int64_t> shape(v.shape.begin(), v.shape.begin() + v.ndim);
    HostTensor t(v.dtype, shape);
    if (!t.bytes().empty()) std::memcpy(t.data(), v.data, t.bytes().size());
    return t;
  };
  io.sync = [] {};
  return io;
}

std::vector<StackSpec> offload_stack_specs() {
  std::vector<StackSpec> specs;
  for (LinearRecipe r : {LinearRecipe::native, LinearRecipe::fp8_tensorwise, LinearRecipe::fp8_blockwise,
                         LinearRecipe::mxfp8}) {
    StackSpec s;
    s.name = linear_recipe_name(r);
    s.recipe = r;
    specs.push_back(s);
    s.name += "_probs_bias_delayed";
    s.probs = s.bias = s.delay_wgrad = true;
    specs.push_back(s);
  }
  StackSpec recompute;
  recompute.name = "native_recompute_probs";
  recompute.recompute = recompute.probs = true;
  specs.push_back(recompute);
  StackSpec by_reference;
  by_reference.name = "native_save_original_input_delayed_ahead2";
  by_reference.save_original_input = by_reference.delay_wgrad = true;
  by_reference.reload_ahead = 2;
  specs.push_back(by_reference);
  StackSpec fp8_recompute;
  fp8_recompute.name = "fp8_blockwise_recompute_delayed";
  fp8_recompute.recipe = LinearRecipe::fp8_blockwise;
  fp8_recompute.recompute = fp8_recompute.delay_wgrad = true;
  specs.push_back(fp8_recompute);
  StackSpec empty;
  empty.name = "native_all_experts_empty";
  empty.counts = {0, 0, 0, 0};
  specs.push_back(empty);
  return specs;
}

StackInputs::StackInputs(const StackSpec& s, Rng& rng)
    : x(DType::bf16, {s.cap, s.H}), dy(DType::bf16, {s.cap, s.H}), probs(DType::f32, {s.cap}),
      counts(make_counts(s.counts)) {
  fill_random(x, rng);
  fill_random(dy, rng);
  fill_random(probs, rng, 0.1, 1.0);
  // Weights scaled so that every layer's output stays about unit size down the stack.
  const double a1 = 1.0 / std::sqrt(double(s.H)), a2 = 1.0 / std::sqrt(double(s.F));
  for (int l = 0; l < s.layers; ++l) {
    w1.emplace_back(DType::bf16, std::vector<int64_t>{s.E, 2 * s.F, s.H});
    w2.emplace_back(DType::bf16, std::vector<int64_t>{s.E, s.H, s.F});
    b1.emplace_back(DType::bf16, std::vector<int64_t>{s.E, 2 * s.F});
    b2.emplace_back(DType::bf16, std::vector<int64_t>{s.E, s.H});
    fill_random(w1.back(), rng, -2 * a1, 2 * a1);
    fill_random(w2.back(), rng, -2 * a2, 2 * a2);
    fill_random(b1.back(), rng, -0.1, 0.1);
    fill_random(b2.back(), rng, -0.1, 0.1);
  }
}

StackRun run_mlp_stack(const StackSpec& spec, const StackInputs& in, OffloadMode mode, DeviceIO& io,
                       Stream compute, Stream copy, int steps,
                       const std::function<void(Allocator&, Stream)>& between) {
  const Device dev = io.device;
  CountingAllocator counting(default_allocator(dev));
  const int L = spec.layers;
  std::vector<std::unique_ptr<GroupedMLP>> mlp;
  for (int l = 0; l < L; ++l) {
    GroupedMLPOptions o;
    o.recipe = spec.recipe;
    o.recompute_activation = spec.recompute;
    o.fc1.delay_wgrad = o.fc2.delay_wgrad = spec.delay_wgrad;
    o.fc1.save_original_input = spec.save_original_input;
    o.allocator = &counting;
    ExpertBias b1, b2;
    if (spec.bias) {
      b1 = ExpertBias::from_grouped(io.upload(in.b1[l]));
      b2 = ExpertBias::from_grouped(io.upload(in.b2[l]));
    }
    mlp.push_back(std::make_unique<GroupedMLP>(ExpertWeights::from_stacked(io.upload(in.w1[l])),
                                               ExpertWeights::from_stacked(io.upload(in.w2[l])), b1, b2, o));
  }
  const TensorView x = io.upload(in.x), dy = io.upload(in.dy), counts = io.upload(in.counts);
  const TensorView probs = spec.probs ? io.upload(in.probs) : TensorView();
  io.sync();

  Offloader off(dev, copy, &counting, std::size_t(1) << 20);
  OffloadSchedulerOptions so;
  so.num_layers = L;
  so.reload_ahead = spec.reload_ahead;
  so.keep_last_layer = mode != OffloadMode::everything;
  OffloadScheduler sched(off, so);
  StackRun run;
  for (int step = 0; step < steps; ++step) {
    run = StackRun();
    std::vector<GroupedMLPContext> ctx(L);
    std::vector<Tensor> ys;
    TensorView cur = x;
    for (int l = 0; l < L; ++l) {
      ys.push_back(mlp[l]->forward(cur, counts, probs, ctx[l], compute));
      cur = ys.back().view();
      if (mode == OffloadMode::none) continue;
      if (sched.offloads(l)) run.offloaded_bytes += ctx[l].offloadable_bytes();
      sched.forward_done(l, ctx[l], compute);
    }
    if (mode != OffloadMode::none) sched.forward_end(compute);
    io.sync();
    run.in_use_after_forward = counting.in_use();
    if (between) between(counting, compute);

    std::vector<GroupedMLPBackward> back(L);
    TensorView g = dy;
    for (int l = L - 1; l >= 0; --l) {
      if (mode != OffloadMode::none) sched.backward_begin(l, compute);
      back[l] = mlp[l]->backward(ctx[l], g, compute);
      g = back[l].dx.view();
    }
    std::vector<GroupedMLPGrads> dw(L);
    if (spec.delay_wgrad) {
      if (mode == OffloadMode::everything) {
        // What backward_dw reads goes to the host and comes back, layer by layer.
        for (int l = 0; l < L; ++l) {
          ctx[l].offload(off, compute);
          ctx[l].release(compute);
        }
        for (int l = L - 1; l >= 0; --l) {
          ctx[l].reload(compute);
          dw[l] = mlp[l]->backward_dw(ctx[l], compute);
        }
      } else {
        for (int l = L - 1; l >= 0; --l) dw[l] = mlp[l]->backward_dw(ctx[l], compute);
      }
    }
    io.sync();
    auto add = [&](const std::string& name, const TensorView& v) {
      if (!v.defined()) return;
      run.names.push_back(name);
      run.outputs.push_back(io.download(v));
    };
    for (int l = 0; l < L; ++l) add("y" + std::to_string(l), ys[l].view());
    add("dx", g);
    for (int l = 0; l < L; ++l) {
      const std::string p = "layer" + std::to_string(l) + ".";
      add(p + "dprobs", back[l].dprobs.view());
      const GroupedMLPGrads& gr = spec.delay_wgrad ? dw[l] : back[l].grads;
      add(p + "dw1", gr.fc1.weight.stacked);
      add(p + "dw2", gr.fc2.weight.stacked);
      add(p + "db1", back[l].grads.fc1.bias.grouped);
      add(p + "db2", back[l].grads.fc2.bias.grouped);
    }
  }
  run.pool_chunks = off.pool().chunk_allocations();
  return run;
}

::testing::AssertionResult runs_bitwise_equal(const StackRun& a, const StackRun& b) {
  if (a.names != b.names) return ::testing::AssertionFailure() << "the runs gave different outputs";
  for (std::size_t i = 0; i < a.outputs.size(); ++i) {
    auto r = bitwise_equal(a.outputs[i], b.outputs[i], a.names[i]);
    if (!r) return r;
  }
  return ::testing::AssertionSuccess() << a.outputs.size() << " outputs bitwise equal";
}

}  // namespace gmoe::test
