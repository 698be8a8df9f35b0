// tools/bench/moe_runner_cpu.cpp — moe mode on the CPU reference backend (see moe_common.h):
// MoELayer forward and backward (and the layer keeping its permuted rows, checked bitwise against
// it), the block's phases alone, and the routing ops alone beside a memcpy, wall-clock. A run here
// is long, so the forward of a forward+backward is the timed forward itself, and the first
// iteration is the checked one. No graph rows (there is no graph on the CPU).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "bench/mlp_common.h"
#include "bench/moe_common.h"
#include "bench/wall_clock.h"
#include "common/float_convert.h"

namespace gmoe::bench {

std::vector<ResultRow> run_moe_case_cpu(const BenchCase& c, const BenchOptions& o) {
  const DType dt = o.dtype;
  const size_t es = dtype_size(dt);
  const int64_t T = c.tokens, E = c.E, k = c.top_k, H = c.hidden, F = c.ffn, R1 = mlp_fc1_rows(c);
  std::vector<uint8_t> x(T * H * es), dout(T * H * es), w1(E * R1 * H * es), w2(E * H * F * es), logits(T * E * es);
  fill_uniform_host(x.data(), dt, T * H, o.seed);
  fill_uniform_host(dout.data(), dt, T * H, o.seed + 1);
  // Weights scaled so that h and y are about unit size (x, dout uniform in [-1, 1)).
  fill_uniform_scaled_host(w1.data(), dt, E * R1 * H, 3.0 / std::sqrt(double(H)), o.seed + 2);
  fill_uniform_scaled_host(w2.data(), dt, E * H * F, 3.0 / std::sqrt(double(F)), o.seed + 3);
  const std::vector<float> l32 = moe_logits(c, o.seed + 4);
  for (int64_t i = 0; i < T * E; ++i) store_float(logits.data(), dt, i, l32[i]);

  const Device cpu = Device::cpu();
  const TensorView xv(x.data(), dt, cpu, {T, H}), dv(dout.data(), dt, cpu, {T, H}), lv(logits.data(), dt, cpu, {T, E});
  CountingAllocator alloc(host_allocator());
  GroupedMLP experts = make_bench_moe_experts(c, TensorView(w1.data(), dt, cpu, {E, R1, H}),
                                              TensorView(w2.data(), dt, cpu, {E, H, F}), alloc);
  MoELayer layer = make_bench_moe(c, experts, alloc);
  MoELayer keep_layer = make_bench_moe(c, experts, alloc, false);

  MoeTimes t;
  MoeCheck chk;
  std::vector<double> fwd, bwd, fb, keep_fb;
  for (int i = 0; i < std::max(1, o.iters); ++i) {
    const size_t before = alloc.live();
    alloc.reset_peak();
    MoELayerContext ctx;
    MoEForward f;
    fwd.push_back(wall_ms([&] { f = layer.forward(xv, lv, ctx); }));
    // What forward leaves for backward: everything live but its output.
    const size_t kept = alloc.live() - before - (f.out.owns_memory() ? size_t(T * H) * es : 0);
    MoEBackward b;
    bwd.push_back(wall_ms([&] { b = layer.backward(ctx, dv); }));
    fb.push_back(fwd.back() + bwd.back());
    {
      const size_t keep_before = alloc.live();
      alloc.reset_peak();
      MoELayerContext keep_ctx;
      MoEForward kf;
      MoEBackward kb;
      keep_fb.push_back(wall_ms([&] {
        kf = keep_layer.forward(xv, lv, keep_ctx);
        if (i == 0) {
          const size_t keep_kept = alloc.live() - keep_before - (kf.out.owns_memory() ? size_t(T * H) * es : 0);
          t.keep_kept_bytes = double(keep_kept + x.size() + logits.size());
          t.keep_kept_detail =
              std::to_string(keep_kept / std::max<int64_t>(T, 1)) + " B/token owned + x and logits by reference";
        }
        kb = keep_layer.backward(keep_ctx, dv);
      }));
      if (i == 0) {
        t.keep_peak_bytes = double(alloc.peak() - keep_before);
        t.keep_mismatch = moe_bitwise_mismatch(b, kb, [](const void* p, size_t n) {
          return std::vector<uint8_t>(static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
        });
      }
    }
    if (i > 0) continue;
    t.peak_bytes = double(alloc.peak() - before);
    t.kept_bytes = double(kept + x.size() + logits.size());
    t.kept_detail = std::to_string(kept / std::max<int64_t>(T, 1)) + " B/token owned + x and logits by reference";
    MoeSample s;
    MoeGot got;
    moe_gather(c, dt, o.samples, o.seed + 7, x.data(), dout.data(), logits.data(),
               static_cast<const int32_t*>(f.ids.view().data), f.out.view().data, b.dx.view().data,
               static_cast<const float*>(b.dlogits.view().data), &s, &got);
    s.w1 = w1;  // every expert, in place: slot e is expert e
    s.w2 = w2;
    s.slot.resize(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) s.slot[e] = e;
    chk = check_moe(s, got);
  }
  t.forward_ms = median(fwd);
  t.backward_ms = median(bwd);
  t.forward_backward_ms = median(fb);
  t.keep_forward_backward_ms = median(keep_fb);

  // The block's phases alone.
  {
    MoePhases ph(c, experts, xv, lv, dv, alloc, nullptr);
    std::vector<double> rm, pm, em, cm;
    for (int i = 0; i < std::max(1, o.iters); ++i) {
      rm.push_back(wall_ms([&] { ph.router(lv, nullptr); }));
      pm.push_back(wall_ms([&] { ph.permute(xv, nullptr); }));
      em.push_back(wall_ms([&] { ph.experts(nullptr); }));
      cm.push_back(wall_ms([&] { ph.combine(dv, nullptr); }));
    }
    t.router_fb_ms = median(rm);
    t.permute_fb_ms = median(pm);
    t.experts_fb_ms = median(em);
    t.combine_fb_ms = median(cm);
  }

  // The routing ops alone on the layer's routing, beside a memcpy of the permuted rows.
  const int64_t rows = permuted_rows(T, k, E, {});
  std::vector<int32_t> ids(T * k), counts(E), pcounts(E), row_of(T * k), src(rows);
  std::vector<float> probs(T * k), dprobs(T * k);
  std::vector<uint8_t> permuted(rows * H * es), copy(rows * H * es), out(T * H * es), dpermuted(rows * H * es);
  const TensorView idv(ids.data(), DType::i32, cpu, {T, k}), pv(probs.data(), DType::f32, cpu, {T, k});
  const TensorView perm(permuted.data(), dt, cpu, {rows, H}), outv(out.data(), dt, cpu, {T, H});
  const TensorView dperm(dpermuted.data(), dt, cpu, {rows, H}), dpv(dprobs.data(), DType::f32, cpu, {T, k});
  const RoutingMap map{TensorView(row_of.data(), DType::i32, cpu, {T, k}), TensorView(src.data(), DType::i32, cpu, {rows})};
  router_topk(lv, moe_router(c), idv, pv, TensorView(counts.data(), DType::i32, cpu, {E}));
  std::vector<double> pm, cm, pbm, cbm, cp;
  for (int i = 0; i < std::max(1, o.iters); ++i) {
    pm.push_back(wall_ms([&] {
      permute(xv, idv, {}, perm, TensorView(pcounts.data(), DType::i32, cpu, {E}), map);
    }));
    cm.push_back(wall_ms([&] { combine(perm, map, pv, outv); }));
    pbm.push_back(wall_ms([&] { permute_backward(perm, map, outv); }));
    cbm.push_back(wall_ms([&] { combine_backward(dv, map, pv, perm, dperm, dpv); }));
    cp.push_back(wall_ms([&] { std::memcpy(copy.data(), permuted.data(), permuted.size()); }));
  }
  t.permute_ms = median(pm);
  t.combine_ms = median(cm);
  t.permute_backward_ms = median(pbm);
  t.combine_backward_ms = median(cbm);
  t.copy_ms = median(cp);
  return moe_rows(c, dt, t, chk);
}

}  // namespace gmoe::bench
