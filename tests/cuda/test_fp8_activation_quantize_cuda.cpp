// tests/cuda/test_fp8_activation_quantize_cuda.cpp — FP8 quantization fused with GroupedMLP's
// activation (src/cuda/elementwise/fp8_quantize_activation.cu): the fused kernel's FP8 copies of z
// (rowwise and columnwise data, scales, padded offsets — every byte of every buffer, poisoned first)
// bitwise equal to grouped_activation_forward followed by quantize_grouped, for the blockwise and
// mxfp8 recipes, every activation, the gate/up layouts the kernel takes (concatenated, interleave
// blocks that are multiples of 8) and the ones it declines, tensorwise declined (all of which must
// say so, launching nothing), with and without probs, on splits with empty experts, ragged counts,
// zero total, many experts, zero capacity and slack rows. Also: f16 declined; one capture replayed
// under changing counts, bitwise the eager results.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/activation_internal.h"
#include "common/activation_oracle.h"
#include "common/backend.h"
#include "common/harness.h"
#include "cuda/cuda_test_util.h"
#include "gmoe/activation.h"
#include "gmoe/fp8.h"

namespace gmoe::test {
namespace {

struct Variant {
  ActivationOptions act;
  int64_t F;
};

std::vector<Variant> variants() {
  std::vector<Variant> v;
  const std::pair<GluFormat, int64_t> layouts[] = {
      {{GluLayout::concatenated, 1}, 384},  {{GluLayout::concatenated, 1}, 320},
      {{GluLayout::interleaved, 8}, 384},   {{GluLayout::interleaved, 16}, 320},
      {{GluLayout::interleaved, 32}, 384},  {{GluLayout::interleaved, 64}, 320},
      {{GluLayout::interleaved, 128}, 384}, {{GluLayout::interleaved, 192}, 384},
      {{GluLayout::interleaved, 1}, 384}};  // declined: a granule would straddle gate and up
  for (int k = 0; k < 4; ++k) {
    for (const auto& [glu, F] : layouts) {
      ActivationOptions o;
      o.kind = k == 0 ? ActivationKind::swiglu : k == 3 ? ActivationKind::clamped_swiglu : ActivationKind::geglu;
      o.gelu_tanh = k == 2;
      o.limit = 1.5f;
      o.glu = glu;
      v.push_back({o, F});
    }
  }
  ActivationOptions relu2;
  relu2.kind = ActivationKind::squared_relu;
  v.push_back({relu2, 384});
  v.push_back({relu2, 200});  // a partial column tile
  return v;
}

std::string variant_name(const Variant& v) { return activation_case_name(v.act) + "_F" + std::to_string(v.F); }

// Tensorwise is declined: its amax comes from the activation's own pass (activation_amax_for).
bool fusable(const Variant& v, Fp8Recipe r) {
  if (r == Fp8Recipe::tensorwise) return false;
  return !is_gated(v.act.kind) || v.act.glu.layout == GluLayout::concatenated || v.act.glu.block % 8 == 0;
}

struct Split {
  std::string name;
  std::vector<int64_t> counts;
  int64_t capacity;
};
std::vector<Split> splits(Rng& rng) {
  return {{"skewed_with_empty_experts", zipf_counts(8, 2000, 1.1, 3, rng), 2000 + rng.integer(1, 200)},
          {"ragged", {1, 7, 9, 15, 17, 31, 127, 129, 0, 255}, 600},
          {"zero_total", {0, 0, 0, 0}, 130},
          {"many_experts", zipf_counts(256, 3000, 1.0, 5, rng), 3000},
          {"zero_capacity", {0, 0, 0}, 0}};
}

// Device buffers for every view of a layout, filled with 0xA5 bytes.
struct DeviceQ {
  std::vector<std::unique_ptr<DeviceTensor>> mem;
  Fp8Grouped q;
  DeviceQ(int64_t cap, int64_t cols, int64_t E, const Fp8QuantizeOptions& o) {
    q = fp8_grouped_layout(cap, cols, E, o, Device::cuda(0));
    for (TensorView* v : {&q.data, &q.scale_inv, &q.data_t, &q.scale_inv_t, &q.padded_offsets}) {
      if (!v->defined()) continue;
      HostTensor h(v->dtype, std::vector<int64_t>(v->shape.begin(), v->shape.begin() + v->ndim));
      std::memset(h.data(), 0xA5, h.bytes().size());
      mem.push_back(std::make_unique<DeviceTensor>(h));
      v->data = mem.back()->data();
    }
  }
  std::vector<std::vector<uint8_t>> bytes() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& m : mem) out.push_back(m->download().bytes());
    return out;
  }
};

::testing::AssertionResult same_bytes(const DeviceQ& a, const DeviceQ& b) {
  const auto x = a.bytes(), y = b.bytes();
  const char* names[] = {"data", "scale_inv", "data_t", "scale_inv_t", "padded_offsets"};
  if (x.size() != y.size()) return ::testing::AssertionFailure() << "different views";
  for (size_t i = 0; i < x.size(); ++i) {
    for (size_t j = 0; j < x[i].size(); ++j) {
      if (x[i][j] != y[i][j]) {
        return ::testing::AssertionFailure() << "view " << i << " (" << names[std::min<size_t>(i, 4)]
                                             << " when all are present) differs first at byte " << j << ": "
                                             << int(x[i][j]) << " vs " << int(y[i][j]);
      }
    }
  }
  return ::testing::AssertionSuccess();
}

Fp8QuantizeOptions options_for(Fp8Recipe r, DType format) {
  Fp8QuantizeOptions o;
  o.recipe = r;
  o.format = format;
  o.rowwise = true;
  o.columnwise = true;
  return o;
}

using Param = std::tuple<int, Fp8Recipe>;
class CudaFp8ActivationQuantize : public ::testing::TestWithParam<Param> {
 protected:
  Variant variant() const { return variants()[std::get<0>(GetParam())]; }
  Fp8Recipe recipe() const { return std::get<1>(GetParam()); }
};

TEST_P(CudaFp8ActivationQuantize, BitwiseTheActivationThenTheQuantization) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const Variant v = variant();
  const ActivationOptions& act = v.act;
  const int64_t F = v.F;
  Allocator& alloc = default_allocator(Device::cuda(0));
  cudaStream_t s;
  GMOE_TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (const Split& sp : splits(rng)) {
    for (bool with_probs : {false, true}) {
      SCOPED_TRACE(sp.name + (with_probs ? " with probs" : " without probs"));
      const int64_t cap = sp.capacity, E = static_cast<int64_t>(sp.counts.size());
      int64_t total = 0;
      for (int64_t c : sp.counts) total += c;
      const DeviceTensor counts(make_counts(sp.counts, rng.integer(0, 1) ? DType::i32 : DType::i64));
      const HostTensor h_h = random_activation_input(act, DType::bf16, cap, total, F, rng);
      const DeviceTensor h(h_h);
      HostTensor pr_h(DType::f32, {cap});
      fill_random(pr_h, rng, 0.0, 1.0);
      const DeviceTensor probs(pr_h);
      const TensorView pv = with_probs ? probs.view() : TensorView();
      // z quantized in e4m3, the format of FC2's input.
      {
        const Fp8QuantizeOptions o = options_for(recipe(), DType::e4m3);
        DeviceQ fused(cap, F, E, o), composed(cap, F, E, o);
        const bool took = cuda_backend::quantize_activation_forward(h.view(), counts.view(), act, pv, o, fused.q, s,
                                                                    alloc);
        EXPECT_EQ(took, fusable(v, recipe())) << "fusion taken";
        quantize_activation_forward(h.view(), counts.view(), act, pv, o, composed.q, false, s, alloc);
        GMOE_TEST_CUDA(cudaStreamSynchronize(s));
        check_device_errors(s);
        if (took) EXPECT_TRUE(same_bytes(fused, composed));
      }
    }
  }
  GMOE_TEST_CUDA(cudaStreamDestroy(s));
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return variant_name(variants()[std::get<0>(info.param)]) + "_" + fp8_recipe_name(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Variants, CudaFp8ActivationQuantize,
                         ::testing::Combine(::testing::Range(0, int(variants().size())),
                                            ::testing::Values(Fp8Recipe::tensorwise, Fp8Recipe::blockwise,
                                                              Fp8Recipe::mxfp8)),
                         param_name);

// The fused kernel takes bf16 only (the FP8 layers' dtype): f16 is declined, nothing launched.
TEST(CudaFp8ActivationQuantizeDtypes, DeclinesF16) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  ActivationOptions act;
  const int64_t cap = 256, F = 128, E = 2;
  Allocator& alloc = default_allocator(Device::cuda(0));
  const Fp8QuantizeOptions o = options_for(Fp8Recipe::blockwise, DType::e4m3);
  HostTensor hh(DType::f16, {cap, 2 * F});
  fill_random(hh, rng);
  const DeviceTensor h(hh), counts(make_counts({100, 156}));
  DeviceQ zq(cap, F, E, o);
  EXPECT_FALSE(cuda_backend::quantize_activation_forward(h.view(), counts.view(), act, {}, o, zq.q, nullptr, alloc));
}

// One capture of the fused kernel (blockwise, probs), replayed under changing counts: each replay
// bitwise the eager run on the same counts.
TEST(CudaFp8ActivationQuantizeGraph, ReplaysUnderChangingCountsBitwiseEager) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  ActivationOptions act;
  act.kind = ActivationKind::swiglu;
  const int64_t E = 8, per = 200, slack = 37, F = 256;
  const std::vector<std::vector<int64_t>> routings = graph_routings(E, per, slack, rng);
  const int64_t cap = E * per + slack;
  Allocator& alloc = default_allocator(Device::cuda(0));
  const Fp8QuantizeOptions o = options_for(Fp8Recipe::blockwise, DType::e4m3);
  cudaStream_t s;
  GMOE_TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  DeviceTensor counts(make_counts(routings[0]));
  const DeviceTensor h(random_activation_input(act, DType::bf16, cap, cap, F, rng));
  HostTensor pr_h(DType::f32, {cap});
  fill_random(pr_h, rng, 0.0, 1.0);
  const DeviceTensor probs(pr_h);
  DeviceQ zq(cap, F, E, o);
  auto run = [&](DeviceQ& zq_) {
    ASSERT_TRUE(cuda_backend::quantize_activation_forward(h.view(), counts.view(), act, probs.view(), o, zq_.q, s,
                                                          alloc));
  };
  const CapturedGraph graph(s, [&] { run(zq); });
  for (const std::vector<int64_t>& r : routings) {
    counts.upload(make_counts(r));
    graph.replay(s);
    check_device_errors(s);
    DeviceQ zq_e(cap, F, E, o);
    run(zq_e);
    GMOE_TEST_CUDA(cudaStreamSynchronize(s));
    EXPECT_TRUE(same_bytes(zq, zq_e)) << "z";
  }
  GMOE_TEST_CUDA(cudaStreamDestroy(s));
}

}  // namespace
}  // namespace gmoe::test
