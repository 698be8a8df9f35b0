// tools/bench/moe_common.cpp — moe mode: configuration, logits, counting allocator, the sampled
// reference, bytes moved and rows (see moe_common.h).
#include "bench/moe_common.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

#include "bench/mlp_common.h"
#include "common/float_convert.h"
#include "gmoe/error.h"

namespace gmoe::bench {

void* CountingAllocator::allocate(std::size_t bytes, Stream stream) {
  void* p = base_->allocate(bytes, stream);
  if (p != nullptr) {
    sizes_[p] = bytes;
    live_ += bytes;
    peak_ = std::max(peak_, live_);
  }
  return p;
}

void CountingAllocator::free(void* ptr, Stream stream) {
  if (ptr == nullptr) return;
  auto it = sizes_.find(ptr);
  GMOE_CHECK(it != sizes_.end(), "CountingAllocator: freeing a pointer it did not allocate");
  live_ -= it->second;
  sizes_.erase(it);
  base_->free(ptr, stream);
}

std::vector<float> moe_logits(const BenchCase& c, uint64_t seed) {
  std::vector<float> l(static_cast<size_t>(c.tokens * c.E));
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t e = 0; e < c.E; ++e) l[t * c.E + e] = static_cast<float>(c.logit_std * normal(rng) + c.logit_bias[e]);
  }
  return l;
}

RouterOptions moe_router(const BenchCase& c) {
  RouterOptions r;
  r.top_k = c.top_k;
  r.score = RouterScore::softmax;
  r.normalize = true;
  return r;
}

GroupedMLP make_bench_moe_experts(const BenchCase& c, const TensorView& w1, const TensorView& w2, Allocator& alloc) {
  GroupedMLPOptions o;
  o.activation = mlp_activation(c);
  o.fc1.save_original_input = true;  // the permuted rows, which the MoE layer's context keeps anyway
  o.fc2.save_original_input = true;
  // z = act(h)·p is rebuilt in backward from h, which is kept anyway: with the probabilities
  // inside the experts (MoELayer: no FC2 bias) the block then keeps the permuted rows and h, and
  // neither z nor the experts' output.
  o.recompute_activation = true;
  o.allocator = &alloc;
  return GroupedMLP(ExpertWeights::from_stacked(w1), ExpertWeights::from_stacked(w2), {}, {}, o);
}

MoELayer make_bench_moe(const BenchCase& c, GroupedMLP& experts, Allocator& alloc, bool regather) {
  MoELayerOptions o;
  o.router = moe_router(c);
  o.allocator = &alloc;
  o.regather_expert_input = regather;
  return MoELayer(experts, o);
}

MoePhases::MoePhases(const BenchCase& c, GroupedMLP& experts, const TensorView& x, const TensorView& logits,
                     const TensorView& dout, Allocator& alloc, Stream stream)
    : router_(moe_router(c)), experts_(&experts), alloc_(&alloc) {
  const int64_t T = c.tokens, E = c.E, k = c.top_k, H = c.hidden, rows = permuted_rows(T, k, E, permute_);
  const DType dt = x.dtype;
  ids_ = Tensor::empty({T, k}, DType::i32, alloc, stream);
  probs_ = Tensor::empty({T, k}, DType::f32, alloc, stream);
  counts_ = Tensor::empty({E}, DType::i32, alloc, stream);
  dlogits_ = Tensor::empty({T, E}, DType::f32, alloc, stream);
  route_ids_ = Tensor::empty({T, k}, DType::i32, alloc, stream);
  route_probs_ = Tensor::empty({T, k}, DType::f32, alloc, stream);
  route_counts_ = Tensor::empty({E}, DType::i32, alloc, stream);
  permuted_ = Tensor::empty({rows, H}, dt, alloc, stream);
  pcounts_ = Tensor::empty({E}, DType::i32, alloc, stream);
  row_of_ = Tensor::empty({T, k}, DType::i32, alloc, stream);
  src_token_ = Tensor::empty({rows}, DType::i32, alloc, stream);
  pprobs_ = Tensor::empty({rows}, DType::f32, alloc, stream);
  dx_ = Tensor::empty({T, H}, dt, alloc, stream);
  dprobs_ = Tensor::empty({T, k}, DType::f32, alloc, stream);
  dpermuted_ = Tensor::empty({rows, H}, dt, alloc, stream);
  out_ = Tensor::empty({T, H}, dt, alloc, stream);
  // The routing, the permuted rows and their gradient rows, so that every phase reads finite values
  // whatever runs first; the router's backward takes its own probabilities as dprobs.
  router_topk(logits, router_, route_ids_, route_probs_, route_counts_, {}, stream, &alloc);
  router(logits, stream);
  permute(x, stream);
  combine(dout, stream);
}

void MoePhases::router(const TensorView& logits, Stream stream) {
  router_topk(logits, router_, ids_, probs_, counts_, {}, stream, alloc_);
  router_topk_backward(logits, ids_, probs_, router_, dlogits_, false, stream, alloc_);
}

void MoePhases::permute(const TensorView& x, Stream stream) {
  gmoe::permute(x, route_ids_, permute_, permuted_, pcounts_, map(), route_probs_, pprobs_, {}, stream, alloc_);
  // The layer's permute_backward: the rows' gradients summed into tokens, the rows' probabilities'
  // gradients gathered (pprobs stands in for them).
  permute_backward(dpermuted_, map(), dx_, pprobs_, dprobs_, stream, alloc_);
}

void MoePhases::experts(Stream stream) {
  GroupedMLPContext ctx;
  Tensor y = experts_->forward(permuted_, pcounts_, pprobs_, ctx, stream);
  y.release_on(stream);
  experts_->backward(ctx, dpermuted_, stream);
}

void MoePhases::combine(const TensorView& dout, Stream stream) {
  // out = Σ_j rows (weights 1: the probabilities are inside the experts), and its backward.
  gmoe::combine(permuted_, map(), {}, out_, stream, alloc_);
  combine_backward(dout, map(), {}, {}, dpermuted_, {}, stream, alloc_);
}

std::vector<int64_t> moe_sample_tokens(int64_t tokens, int samples, uint64_t seed) {
  std::vector<int64_t> out;
  if (tokens == 0) return out;
  const int64_t n = std::min<int64_t>(tokens, std::clamp(samples / 32, 4, 16));
  std::mt19937_64 rng(seed);
  while (static_cast<int64_t>(out.size()) < n) {
    const int64_t t = std::uniform_int_distribution<int64_t>(0, tokens - 1)(rng);
    if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  }
  return out;
}

std::vector<int64_t> moe_chosen_experts(const std::vector<int32_t>& ids, int64_t E, std::vector<int64_t>* slot) {
  slot->assign(static_cast<size_t>(E), -1);
  std::vector<int64_t> chosen;
  for (int32_t e : ids) {
    if (e >= 0 && e < E && (*slot)[e] < 0) {
      (*slot)[e] = static_cast<int64_t>(chosen.size());
      chosen.push_back(e);
    }
  }
  return chosen;
}

namespace {

// Whether ids[t, :] are k distinct experts in range whose logits are all at least every other
// expert's (ties either way are a valid choice).
bool valid_top_k(const MoeSample& s, size_t i, std::string* why) {
  const float* l = &s.logits[i * size_t(s.E)];
  const int32_t* id = &s.ids[i * size_t(s.k)];
  std::vector<bool> chosen(static_cast<size_t>(s.E), false);
  float lowest = INFINITY;
  for (int64_t j = 0; j < s.k; ++j) {
    if (id[j] < 0 || id[j] >= s.E || chosen[id[j]]) {
      *why = "token " + std::to_string(s.tokens[i]) + ": expert id " + std::to_string(id[j]) +
             " out of range or repeated";
      return false;
    }
    chosen[id[j]] = true;
    lowest = std::min(lowest, l[id[j]]);
  }
  for (int64_t e = 0; e < s.E; ++e) {
    if (!chosen[e] && l[e] > lowest) {
      *why = "token " + std::to_string(s.tokens[i]) + ": expert " + std::to_string(e) + " (logit " +
             std::to_string(l[e]) + ") not chosen over one of logit " + std::to_string(lowest);
      return false;
    }
  }
  return true;
}

}  // namespace

MoeCheck check_moe(const MoeSample& s, const MoeGot& got) {
  const size_t n = s.tokens.size(), H = size_t(s.H), E = size_t(s.E), k = size_t(s.k);
  MlpHostData d;
  d.dtype = s.dtype;
  d.E = static_cast<int64_t>(s.w1.size() / (size_t(s.R1) * H * dtype_size(s.dtype)));
  d.H = s.H;
  d.F = s.F;
  d.R1 = s.R1;
  d.act = s.act;
  d.w1 = s.w1.data();
  d.w2 = s.w2.data();

  std::string why;
  bool ids_ok = true;
  for (size_t i = 0; i < n && ids_ok; ++i) ids_ok = valid_top_k(s, i, &why);
  MoeCheck chk;
  if (!ids_ok) {
    chk.forward = {false, "ids: " + why};
    chk.backward = chk.forward;
    return chk;
  }

  // Each (token, slot) pair through its expert, in parallel: the costly part.
  std::vector<double> p64(n * k);
  std::vector<float> p32(n * k);
  for (size_t i = 0; i < n; ++i) {
    const float* l = &s.logits[i * E];
    const int32_t* id = &s.ids[i * k];
    float m = -INFINITY;
    for (size_t j = 0; j < k; ++j) m = std::max(m, l[id[j]]);
    double sum64 = 0;
    float sum32 = 0;
    for (size_t j = 0; j < k; ++j) {
      p64[i * k + j] = std::exp(double(l[id[j]]) - double(m));
      p32[i * k + j] = std::exp(l[id[j]] - m);
      sum64 += p64[i * k + j];
      sum32 += p32[i * k + j];
    }
    for (size_t j = 0; j < k; ++j) {
      p64[i * k + j] /= sum64;
      p32[i * k + j] /= sum32;
    }
  }
  std::vector<MlpRowReference> rows(n * k);
#pragma omp parallel for schedule(dynamic)
  for (int64_t pair = 0; pair < static_cast<int64_t>(n * k); ++pair) {
    const size_t i = size_t(pair) / k;
    std::vector<double> dy64(H);
    std::vector<float> dy32(H);
    for (size_t h = 0; h < H; ++h) {
      dy64[h] = p64[pair] * double(s.dout[i * H + h]);
      dy32[h] = round_to(s.dtype, p32[pair] * s.dout[i * H + h]);
    }
    rows[pair] = mlp_row_reference(d, s.slot[s.ids[pair]], &s.x[i * H], dy64.data(), dy32.data());
  }

  std::vector<double> out64(n * H, 0.0), out_own(n * H), dx64(n * H, 0.0), dx_own(n * H);
  std::vector<double> dl64(n * E, 0.0), dl_own(n * E, 0.0);
  for (size_t i = 0; i < n; ++i) {
    std::vector<float> out32(H, 0.0f), dx32(H, 0.0f);
    std::vector<double> dp64(k, 0.0);
    std::vector<float> dp32(k, 0.0f);
    for (size_t j = 0; j < k; ++j) {
      const MlpRowReference& r = rows[i * k + j];
      for (size_t h = 0; h < H; ++h) {
        out64[i * H + h] += p64[i * k + j] * r.y_exact[h];
        out32[h] += p32[i * k + j] * float(r.y_own[h]);
        dx64[i * H + h] += r.dx_exact[h];
        dx32[h] += float(r.dx_own[h]);
        dp64[j] += double(s.dout[i * H + h]) * r.y_exact[h];
        dp32[j] += s.dout[i * H + h] * float(r.y_own[h]);
      }
    }
    for (size_t h = 0; h < H; ++h) {
      out_own[i * H + h] = round_to(s.dtype, out32[h]);
      dx_own[i * H + h] = round_to(s.dtype, dx32[h]);
    }
    // Softmax over the chosen k (= softmax, top-k, renormalised): dl_e = p_e·(dp_e − Σ_j p_j·dp_j).
    double dot64 = 0;
    float dot32 = 0;
    for (size_t j = 0; j < k; ++j) {
      dot64 += p64[i * k + j] * dp64[j];
      dot32 += p32[i * k + j] * dp32[j];
    }
    for (size_t j = 0; j < k; ++j) {
      const size_t e = size_t(s.ids[i * k + j]);
      dl64[i * E + e] = p64[i * k + j] * (dp64[j] - dot64);
      dl_own[i * E + e] = p32[i * k + j] * (dp32[j] - dot32);
    }
  }
  auto gathered = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  auto label = [&](size_t cols) {
    return [&, cols](size_t i) {
      return "[" + std::to_string(s.tokens[i / cols]) + ", " + std::to_string(i % cols) + "]";
    };
  };
  const double u = s.dtype == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  chk.forward = check_gathered(out64, out_own, gathered(got.out), u, "out", got.nonfinite_out, label(H));
  const CheckResult cdx = check_gathered(dx64, dx_own, gathered(got.dx), u, "dx", got.nonfinite_dx, label(H));
  // dlogits is f32, but made of the bf16/f16 expert rows (dprobs): one rounding unit of theirs.
  const CheckResult cdl = check_gathered(dl64, dl_own, gathered(got.dlogits), u, "dlogits", got.nonfinite_dlogits,
                                         label(E));
  chk.forward.detail += " over " + std::to_string(n) + " tokens";
  chk.backward.ok = chk.forward.ok && cdx.ok && cdl.ok;
  chk.backward.detail = chk.forward.detail + "; " + cdx.detail + "; " + cdl.detail;
  return chk;
}

void moe_gather(const BenchCase& c, DType dt, int samples, uint64_t seed, const void* x, const void* dout,
                const void* logits, const int32_t* ids, const void* out, const void* dx, const float* dlogits,
                MoeSample* s, MoeGot* got) {
  const int64_t T = c.tokens, E = c.E, k = c.top_k, H = c.hidden;
  s->dtype = dt;
  s->E = E;
  s->k = k;
  s->H = H;
  s->F = c.ffn;
  s->R1 = mlp_fc1_rows(c);
  s->act = mlp_activation(c);
  s->tokens = moe_sample_tokens(T, samples, seed);
  auto append = [dt](std::vector<float>& to, const void* p, int64_t offset, int64_t n) {
    for (int64_t i = 0; i < n; ++i) to.push_back(load_float(p, dt, offset + i));
  };
  for (int64_t t : s->tokens) {
    append(s->x, x, t * H, H);
    append(s->dout, dout, t * H, H);
    append(s->logits, logits, t * E, E);
    s->ids.insert(s->ids.end(), ids + t * k, ids + (t + 1) * k);
    append(got->out, out, t * H, H);
    append(got->dx, dx, t * H, H);
    got->dlogits.insert(got->dlogits.end(), dlogits + t * E, dlogits + (t + 1) * E);
  }
  got->nonfinite_out = count_nonfinite(out, dt, T * H);
  got->nonfinite_dx = count_nonfinite(dx, dt, T * H);
  got->nonfinite_dlogits = count_nonfinite(dlogits, DType::f32, T * E);
}

std::string moe_bitwise_mismatch(const MoEBackward& a, const MoEBackward& b,
                                 const std::function<std::vector<uint8_t>(const void*, size_t)>& host_bytes) {
  // Contiguous rows, or a stacked gradient's experts one by one (its expert stride may be padded).
  auto bytes_of = [&](const TensorView& v) {
    std::vector<uint8_t> out;
    if (!v.defined() || v.numel() == 0) return out;
    const size_t es = dtype_size(v.dtype), per = size_t(v.numel() / v.size(0)) * es;
    if (size_t(v.stride(0)) * es == per) return host_bytes(v.data, size_t(v.numel()) * es);
    for (int64_t i = 0; i < v.size(0); ++i) {
      const std::vector<uint8_t> part = host_bytes(static_cast<const uint8_t*>(v.data) + i * v.stride(0) * es, per);
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  };
  std::string what;
  auto compare = [&](const TensorView& x, const TensorView& y, const char* name) {
    if (bytes_of(x) != bytes_of(y)) what += std::string(what.empty() ? "" : ", ") + name;
  };
  compare(a.dx.view(), b.dx.view(), "dx");
  compare(a.dlogits.view(), b.dlogits.view(), "dlogits");
  compare(a.grads.fc1.weight.stacked, b.grads.fc1.weight.stacked, "dW1");
  compare(a.grads.fc2.weight.stacked, b.grads.fc2.weight.stacked, "dW2");
  return what;
}

MoeOpBytes moe_op_bytes(const BenchCase& c, DType dt) {
  const double es = double(dtype_size(dt)), T = double(c.tokens), k = double(c.top_k), H = double(c.hidden);
  const double rows = T * k, idx = 4.0 * rows;  // an i32 per (token, slot)
  MoeOpBytes b;
  // x read once per token, the permuted rows written; ids read, row_of and src_token written.
  b.permute = (T + rows) * H * es + 3 * idx;
  // the expert rows and the probabilities read, the tokens written.
  b.combine = (rows + T) * H * es + 2 * idx;
  // the gradient rows read, summed into the tokens.
  b.permute_backward = (rows + T) * H * es + idx;
  // dout read once per token, the expert rows read (for dprobs), their gradients written; dprobs.
  b.combine_backward = (T + 2 * rows) * H * es + 3 * idx;
  b.copy = 2 * rows * H * es;
  return b;
}

std::vector<ResultRow> moe_rows(const BenchCase& c, DType dt, const MoeTimes& t, const MoeCheck& chk) {
  const double flops = mlp_flops(c);
  const std::string dtn = dtype_name(dt);
  const double kept = c.tokens > 0 ? t.kept_bytes / double(c.tokens) : 0;
  std::vector<ResultRow> rows;
  auto layer_row = [&](const char* impl, const char* pass, double pass_flops, double ms, const CheckResult& check,
                       const std::optional<GraphNodeCounts>& nodes) {
    ResultRow r = timed_row(c.name, pass, impl, dtn, ms, pass_flops, check.ok, check.detail);
    r.kind = "moe";
    r.launches = nodes;
    r.kept_bytes_per_token = kept;
    if (std::string(pass) == "forward_backward") {
      r.peak_mib = t.peak_bytes / (1024.0 * 1024.0);
      r.note += "; kept for backward: " + t.kept_detail;
      if (!t.graph_note.empty()) r.note += "; " + t.graph_note;
    }
    rows.push_back(r);
  };
  layer_row("gmoe", "forward", flops, t.forward_ms, chk.forward, t.forward_nodes);
  layer_row("gmoe", "backward", 2 * flops, t.backward_ms, chk.backward, std::nullopt);
  layer_row("gmoe", "forward_backward", 3 * flops, t.forward_backward_ms, chk.backward, t.forward_backward_nodes);
  {
    // The layer that keeps its permuted rows: correct when gmoe is and its results are gmoe's bits.
    const bool same = t.keep_mismatch.empty();
    ResultRow r = timed_row(c.name, "forward_backward", "gmoe_keep_input", dtn, t.keep_forward_backward_ms, 3 * flops,
                            chk.backward.ok && same,
                            same ? "regather_expert_input = false: dx, dlogits, dW1, dW2 bitwise gmoe's"
                                 : "regather_expert_input = false: NOT bitwise gmoe's: " + t.keep_mismatch);
    r.kind = "moe";
    r.kept_bytes_per_token = c.tokens > 0 ? t.keep_kept_bytes / double(c.tokens) : 0;
    r.peak_mib = t.keep_peak_bytes / (1024.0 * 1024.0);
    r.note += "; kept for backward: " + t.keep_kept_detail;
    rows.push_back(r);
  }
  auto phase_row = [&](const char* impl, double ms, double pass_flops, const char* what) {
    ResultRow r = timed_row(c.name, "forward_backward", impl, dtn, ms, pass_flops, std::nullopt, what);
    r.kind = "moe";
    rows.push_back(r);
  };
  phase_row("gmoe_router", t.router_fb_ms, 0, "phase alone: router_topk + router_topk_backward");
  phase_row("gmoe_permute", t.permute_fb_ms, 0, "phase alone: permute (with probs) + permute_backward");
  phase_row("gmoe_experts", t.experts_fb_ms, 3 * flops,
            "phase alone: GroupedMLP forward + backward on the block's rows (the GEMM floor)");
  phase_row("gmoe_combine", t.combine_fb_ms, 0, "phase alone: combine + combine_backward (weights 1)");
  if (t.graph_forward_ms) layer_row("gmoe_graph", "forward", flops, *t.graph_forward_ms, chk.forward, t.forward_nodes);
  if (t.graph_forward_backward_ms) {
    layer_row("gmoe_graph", "forward_backward", 3 * flops, *t.graph_forward_backward_ms, chk.backward,
              t.forward_backward_nodes);
  }
  const MoeOpBytes b = moe_op_bytes(c, dt);
  const double copy_gbps = t.copy_ms > 0 ? b.copy / (t.copy_ms * 1e6) : 0;
  auto op_row = [&](const char* impl, const char* pass, double ms, double bytes) {
    ResultRow r = timed_row(c.name, pass, impl, dtn, ms, 0, std::nullopt,
                            "bytes read + written: " + std::to_string(static_cast<int64_t>(bytes)));
    r.kind = "moe";
    r.gbps = ms > 0 ? bytes / (ms * 1e6) : 0;
    r.copy_gbps = copy_gbps;
    rows.push_back(r);
  };
  op_row("gmoe_permute", "forward", t.permute_ms, b.permute);
  op_row("gmoe_permute", "backward", t.permute_backward_ms, b.permute_backward);
  op_row("gmoe_combine", "forward", t.combine_ms, b.combine);
  op_row("gmoe_combine", "backward", t.combine_backward_ms, b.combine_backward);
  op_row("device_copy", "copy", t.copy_ms, b.copy);
  rows.back().copy_gbps.reset();
  return rows;
}

}  // namespace gmoe::bench
