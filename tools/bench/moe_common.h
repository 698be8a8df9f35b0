// tools/bench/moe_common.h — what the moe mode's CPU and CUDA runners share: the layer's
// configuration, the router logits of a case, an allocator that counts what the layer holds, the
// sampled fp64 check of one forward + backward, the bytes the routing ops move, and the result rows.
//
// A moe run times MoELayer (gmoe/moe_layer.h) on a moe case: bf16 x [tokens, hidden], bf16 router
// logits [tokens, E] (the gate projection is the caller's, as in the layer's contract: logits[t, e]
// = logit_std · N(0, 1) + logit_bias[e], drawn once per case), the router softmax → top-k →
// renormalised over the k (Mixtral, Qwen3, gpt-oss), no padding, no capacity, no auxiliary
// losses; the experts a GroupedMLP of the case's activation with stacked bf16 weights FC1 [E, 2·ffn,
// hidden] and FC2 [E, hidden, ffn], no bias (so the layer applies the router probabilities inside
// the activation), FC1's input (the permuted rows) by reference, the activation recomputed in
// backward, fresh bf16 weight gradients (as torch's autograd returns them). Two layers on those
// experts: impl gmoe with the layer's defaults (regather_expert_input: the permuted rows are not
// kept, backward gathers them again from x), and gmoe_keep_input, which keeps them
// (regather_expert_input = false), timed interleaved with it (forward_backward only) and checked
// bitwise against it (dx, dlogits, dW1, dW2: the option must not change a bit). Passes: forward,
// backward (after an untimed forward), forward_backward. FLOPs are the expert GEMMs' (mlp_flops on
// rows = tokens · top_k; backward 2×, forward_backward 3×).
//
// What limits the block: its phases alone, each forward + backward on the case's routing, timed
// interleaved with the block (MoePhases): gmoe_router (router_topk + its backward), gmoe_permute
// (permute with the probabilities + permute_backward), gmoe_experts (the GroupedMLP alone on the
// block's permuted rows and counts: the GEMM floor; its TFLOP/s are the block's FLOPs), gmoe_combine
// (combine + its backward, weights 1 as in the layer), all with pass forward_backward. The block's
// time less their sum is what the layer adds around them (allocation, the regather, the losses).
// A composition's time over gmoe_experts' is the ceiling on the block's speed-up over it.
//
// Memory, through CountingAllocator (every buffer the layer and its experts allocate):
//   peak_mib              the most bytes live at once during one forward + backward (inputs and
//                         weights, which exist before, not counted; the gradients it returns are)
//   kept_bytes_per_token  what forward leaves for backward: bytes live after forward (its output
//                         released) minus before, plus x and the logits, which the layer keeps by
//                         reference (the PyTorch composition's saved tensors include them too)
//
// Correctness first, on every case: one forward + backward on outputs poisoned with NaN, then the
// outputs of a few sampled tokens against an fp64 reference computed from the layer's own choice of
// experts (ids, checked to be a top-k of the logits): out, dx and dlogits by the rule of check.h
// (the largest error at most twice that of a reference in the layer's own precision plus one
// rounding unit at the RMS), and no non-finite element anywhere in them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "bench/check.h"
#include "bench/results.h"
#include "bench/runner.h"
#include "bench/suite.h"
#include "gmoe/allocator.h"
#include "gmoe/grouped_mlp.h"
#include "gmoe/moe_layer.h"

namespace gmoe::bench {

/// An Allocator that forwards to another and counts the bytes live (allocated and not yet freed)
/// and the most live at once since the last reset_peak(). Stream-ordered frees count as freed at
/// the call, as the stream-ordered pool may reuse them from there on.
class CountingAllocator : public Allocator {
 public:
  explicit CountingAllocator(Allocator& base) : base_(&base) {}
  void* allocate(std::size_t bytes, Stream stream) override;
  void free(void* ptr, Stream stream) override;
  Device device() const override { return base_->device(); }
  std::size_t live() const { return live_; }  ///< bytes allocated and not freed
  std::size_t peak() const { return peak_; }  ///< the most live since reset_peak()
  void reset_peak() { peak_ = live_; }

 private:
  Allocator* base_;
  std::unordered_map<void*, std::size_t> sizes_;
  std::size_t live_ = 0, peak_ = 0;
};

/// f32 logits [tokens, E] of a moe case (see the file comment), reproducible from `seed`.
std::vector<float> moe_logits(const BenchCase& c, uint64_t seed);

/// The router of every moe case: softmax, top_k, renormalised.
RouterOptions moe_router(const BenchCase& c);

/// The experts of a moe run (see the file comment): w1 [E, 2·ffn, hidden], w2 [E, hidden, ffn].
GroupedMLP make_bench_moe_experts(const BenchCase& c, const TensorView& w1, const TensorView& w2, Allocator& alloc);
/// The layer around them; regather: MoELayerOptions::regather_expert_input (impl gmoe: the default,
/// true; gmoe_keep_input: false).
MoELayer make_bench_moe(const BenchCase& c, GroupedMLP& experts, Allocator& alloc, bool regather = true);

/// The block's phases alone (see the file comment), on the routing of one set of logits and x, with
/// buffers from `alloc`. Each call runs one phase's forward and backward on `stream` (logits, x,
/// dout: any input set of the case's shapes; the permutation stays the constructor's).
class MoePhases {
 public:
  MoePhases(const BenchCase& c, GroupedMLP& experts, const TensorView& x, const TensorView& logits,
            const TensorView& dout, Allocator& alloc, Stream stream);
  void router(const TensorView& logits, Stream stream);  ///< router_topk, router_topk_backward
  void permute(const TensorView& x, Stream stream);      ///< permute (with probs), permute_backward
  void experts(Stream stream);                           ///< GroupedMLP forward, backward
  void combine(const TensorView& dout, Stream stream);   ///< combine, combine_backward (weights 1)

 private:
  RoutingMap map() const { return {row_of_.view(), src_token_.view()}; }
  RouterOptions router_;
  PermuteOptions permute_;
  GroupedMLP* experts_;
  Allocator* alloc_;
  Tensor ids_, probs_, counts_, dlogits_;          // the router phase's own outputs
  Tensor route_ids_, route_probs_, route_counts_;  // the routing the other phases run on
  Tensor permuted_, pcounts_, row_of_, src_token_, pprobs_, dx_, dprobs_, dpermuted_, out_;
};

/// What the reference needs, for the sampled tokens only: their x, dout (dtype values as floats),
/// logits (as floats), the experts the layer chose, and the weights of just those experts.
struct MoeSample {
  DType dtype = DType::bf16;
  int64_t E = 0, k = 0, H = 0, F = 0, R1 = 0;
  ActivationOptions act;
  std::vector<int64_t> tokens;   ///< the sampled tokens
  std::vector<float> x, dout;    ///< [n, H]
  std::vector<float> logits;     ///< [n, E]
  std::vector<int32_t> ids;      ///< [n, k]: the layer's choice
  std::vector<int64_t> slot;     ///< [E]: the expert's index in w1/w2 below, -1 when not copied
  std::vector<uint8_t> w1, w2;   ///< [S, R1, H], [S, H, F] of dtype: the chosen experts' weights
};

/// About samples / 32 tokens (at least 4, at most 16) of `tokens`, chosen at random from `seed`.
std::vector<int64_t> moe_sample_tokens(int64_t tokens, int samples, uint64_t seed);
/// The distinct experts of `ids` ([n, k]) in first-seen order, and MoeSample::slot for them.
std::vector<int64_t> moe_chosen_experts(const std::vector<int32_t>& ids, int64_t E, std::vector<int64_t>* slot);

/// The layer's outputs at the sampled tokens, and the non-finite elements of the whole outputs.
struct MoeGot {
  std::vector<float> out, dx;  ///< [n, H]
  std::vector<float> dlogits;  ///< [n, E]
  int64_t nonfinite_out = 0, nonfinite_dx = 0, nonfinite_dlogits = 0;
};

struct MoeCheck {
  CheckResult forward;   ///< ids a top-k of the logits, out
  CheckResult backward;  ///< forward's, dx and dlogits
};
/// The check of the file comment.
MoeCheck check_moe(const MoeSample& s, const MoeGot& got);

/// The sample of one checked run of case c from host copies of whole tensors (x, dout, out, dx
/// [tokens, hidden] and logits [tokens, E] of dt; ids i32 [tokens, top_k]; dlogits f32 [tokens, E]):
/// moe_sample_tokens' tokens, their rows, and the non-finite elements of the whole outputs. The
/// caller adds the chosen experts' weights (slot, w1, w2).
void moe_gather(const BenchCase& c, DType dt, int samples, uint64_t seed, const void* x, const void* dout,
                const void* logits, const int32_t* ids, const void* out, const void* dx, const float* dlogits,
                MoeSample* s, MoeGot* got);

/// Empty when a's dx, dlogits and experts' weight gradients are bitwise b's, else what differs.
/// host_bytes(ptr, n): the n bytes at ptr (a device pointer on CUDA) on the host.
std::string moe_bitwise_mismatch(const MoEBackward& a, const MoEBackward& b,
                                 const std::function<std::vector<uint8_t>(const void*, size_t)>& host_bytes);

/// Bytes each routing op reads and writes on a case (the unique bytes: x read once per token, not
/// once per copy), and a plain copy's: the rows of `moe_copy_table`.
struct MoeOpBytes {
  double permute = 0, combine = 0, permute_backward = 0, combine_backward = 0;
  double copy = 0;  ///< a device copy of the permuted rows (tokens · top_k · hidden elements): read + written
};
MoeOpBytes moe_op_bytes(const BenchCase& c, DType dt);

/// The times and memory of one case's layer run.
struct MoeTimes {
  double forward_ms = 0, backward_ms = 0, forward_backward_ms = 0;
  std::optional<double> graph_forward_ms, graph_forward_backward_ms;  ///< CUDA: the captured passes replayed
  std::string graph_note;  ///< why the replays were not timed, if they were not
  std::optional<GraphNodeCounts> forward_nodes, forward_backward_nodes;
  double peak_bytes = 0;           ///< peak_mib's, in bytes
  double kept_bytes = 0;           ///< kept_bytes_per_token's, for all tokens
  std::string kept_detail;         ///< what kept_bytes is made of
  // gmoe_keep_input (regather_expert_input = false): forward_backward, its memory, and whether its
  // outputs and gradients are bitwise gmoe's (empty: yes; else what differs).
  double keep_forward_backward_ms = 0, keep_peak_bytes = 0, keep_kept_bytes = 0;
  std::string keep_kept_detail, keep_mismatch;
  // The phases alone (MoePhases), each forward + backward.
  double router_fb_ms = 0, permute_fb_ms = 0, experts_fb_ms = 0, combine_fb_ms = 0;
  // The routing ops alone, and the copy they are compared with.
  double permute_ms = 0, combine_ms = 0, permute_backward_ms = 0, combine_backward_ms = 0, copy_ms = 0;
};

/// The rows of a case (kind "moe"): impl gmoe (and gmoe_graph on CUDA) forward, backward,
/// forward_backward; gmoe_keep_input forward_backward; the phases gmoe_router, gmoe_permute,
/// gmoe_experts, gmoe_combine forward_backward; gmoe_permute and gmoe_combine forward and backward
/// with their bandwidth and the copy's; device_copy.
std::vector<ResultRow> moe_rows(const BenchCase& c, DType dt, const MoeTimes& t, const MoeCheck& chk);

}  // namespace gmoe::bench
