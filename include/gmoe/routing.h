// gmoe/routing.h — token routing for a Mixture-of-Experts block: the router's top-k over expert
// logits (with its auxiliary losses), the permutation of tokens into rows grouped by expert, and
// the probability-weighted combine of the experts' rows back into tokens. Forward and backward.
//
// The counts never leave the device. On CUDA nothing reads them on the host, nothing
// synchronises, scratch comes from the allocator on the op's stream, the number of launches does
// not depend on the routing, and every op can be captured in a CUDA graph and replayed under any
// logits. Every op is deterministic (bitwise the same output for the same input): integer counts
// only, every float sum in a fixed order, no float atomics.
//
// Router (router_topk), per token t over E experts (all math in f32):
//   score[e] = softmax(logits[t])[e]            RouterScore::softmax (Mixtral, Qwen)
//            = sigmoid(logits[t, e])            RouterScore::sigmoid (DeepSeek-V3)
//   choice[e] = score[e] + score_bias[e]        (score_bias optional: selection only)
//   group-limited (n_group > 1): the experts form n_group equal groups of E / n_group; a group's
//     score is the sum of its best m choices, m = min(top_k / topk_group, group size) (at least
//     1) — DeepSeek-V3's top-2 sum at k = 8, topk_group = 4, as Megatron computes it; only the
//     best topk_group groups stay eligible.
//   ids[t, :] = the top_k eligible experts by choice, best first. Ties go to the lower expert id
//     (and the lower group id), so the selection is the same on every backend for equal values;
//     a NaN choice ranks below every number (it is picked only when nothing else is left).
//   probs[t, j] = score[ids[t, j]] (not the choice: the bias never reaches the probabilities),
//     divided by (Σ_j probs[t, j] + 1e-20) when `normalize`, then times `scaling_factor`.
//   counts[e] = the number of (t, j) with ids[t, j] == e (before any capacity drop).
// Softmax then top-k then renormalise is the same as top-k over the logits then softmax over the
// k; softmax without `normalize` keeps the full softmax's probabilities (Megatron's pre-softmax).
//
// Permute: the token rows x[t, :] are copied once per (t, j) into `permuted`, grouped by expert;
// inside an expert, rows are in (token, slot) order — stable, so deterministic. Each expert's group
// is optionally cut at a capacity (the later tokens are dropped) and padded with zero rows up to a
// multiple of `pad_multiple` rows (16 or 128 for the FP8 recipes). The counts written are the
// padded group sizes, so (permuted, counts) are grouped rows (gmoe/grouped.h) the expert GEMMs take
// directly; rows past the padded total are zero. The map (RoutingMap) undoes it.
#pragma once

#include <cstdint>

#include "gmoe/allocator.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// How the router turns logits into scores.
enum class RouterScore : uint8_t {
  softmax,  ///< softmax over the E logits of a token
  sigmoid,  ///< an independent sigmoid per logit
};

/// The router's selection rule (see the file comment for the exact definition).
struct RouterOptions {
  int64_t top_k = 2;                         ///< experts per token, 1..E
  RouterScore score = RouterScore::softmax;  ///< softmax or sigmoid scores
  bool normalize = false;                    ///< renormalise each token's k probabilities to sum 1
  int64_t n_group = 1;                       ///< expert groups (divides E); 1: no group limit
  int64_t topk_group = 1;                    ///< groups kept per token (1..n_group) when n_group > 1
  float scaling_factor = 1.0f;               ///< multiplies the final probabilities
};

/// Top-k routing. logits: [T, E] f32/bf16/f16; score_bias: absent or f32 [E] (selection only);
/// ids: i32 [T, k]; probs: f32 [T, k]; counts: i32/i64 [E] (overwritten, not accumulated).
/// All contiguous, on one device. Throws gmoe::Error naming the argument on bad shapes or
/// dtypes, k > E, n_group not dividing E, topk_group out of range or too few experts in
/// topk_group groups for k.
void router_topk(const TensorView& logits, const RouterOptions& options, const TensorView& ids, const TensorView& probs,
                 const TensorView& counts, const TensorView& score_bias = {}, Stream stream = nullptr,
                 Allocator* alloc = nullptr);

/// The gradient of router_topk's probs with respect to the logits (the selection is a constant,
/// the bias gets none). dprobs: f32 [T, k]; ids: router_topk's; dlogits: [T, E] of the logits'
/// dtype or f32; `accumulate`: dlogits += instead of =. Softmax gives every logit of a token a
/// gradient, sigmoid only the k selected.
void router_topk_backward(const TensorView& logits, const TensorView& ids, const TensorView& dprobs,
                          const RouterOptions& options, const TensorView& dlogits, bool accumulate = false,
                          Stream stream = nullptr, Allocator* alloc = nullptr);

/// The load-balancing loss of Switch / Megatron: loss = coeff · E / (T² · k) · Σ_e counts[e] ·
/// Σ_t q[t, e], i.e. coeff · E · Σ_e f_e · P_e with f_e = counts[e] / (T·k) and P_e the mean of
/// q[:, e], where q is the softmax of the logits (RouterScore::softmax) or the sigmoid scores
/// normalised to sum 1 per token (RouterScore::sigmoid). loss: f32 [1], on the device; 0 when
/// T = 0. counts: router_topk's (i32/i64 [E]); options: top_k and score are used.
void router_aux_loss(const TensorView& logits, const TensorView& counts, const RouterOptions& options, float coeff,
                     const TensorView& loss, Stream stream = nullptr, Allocator* alloc = nullptr);

/// The gradient of router_aux_loss with respect to the logits (counts are constants), times
/// dloss: f32 [1] on the device, or absent for 1. dlogits and `accumulate` as for
/// router_topk_backward.
void router_aux_loss_backward(const TensorView& logits, const TensorView& counts, const RouterOptions& options,
                              float coeff, const TensorView& dloss, const TensorView& dlogits, bool accumulate = false,
                              Stream stream = nullptr, Allocator* alloc = nullptr);

/// The router z-loss: loss = coeff · mean_t (logsumexp_e logits[t, e])², f32 [1]; 0 when T = 0.
void router_z_loss(const TensorView& logits, float coeff, const TensorView& loss, Stream stream = nullptr,
                   Allocator* alloc = nullptr);

/// The gradient of router_z_loss: dlogits[t, e] = dloss · coeff · 2 · lse_t / T · softmax(logits[t])[e].
/// dloss: f32 [1] or absent for 1; dlogits and `accumulate` as for router_topk_backward.
void router_z_loss_backward(const TensorView& logits, float coeff, const TensorView& dloss, const TensorView& dlogits,
                            bool accumulate = false, Stream stream = nullptr, Allocator* alloc = nullptr);

/// How tokens are laid out by expert.
struct PermuteOptions {
  /// Each expert's group is padded with zero rows to a multiple of this (>= 1; 1: no padding).
  int64_t pad_multiple = 1;
  /// > 0: each expert keeps at most expert_capacity(...) of its (token, slot) pairs, the later
  /// tokens dropped; 0: no capacity, nothing dropped.
  double capacity_factor = 0.0;
};

/// Rows per expert under a capacity: ceil(capacity_factor · tokens · k / E); -1 (no limit) when
/// capacity_factor is 0.
int64_t expert_capacity(int64_t tokens, int64_t top_k, int64_t num_experts, const PermuteOptions& options);

/// The rows `permuted` must have (host-known, the largest padded total any routing can reach):
/// min(T·k, E·capacity) + E·(pad_multiple - 1).
int64_t permuted_rows(int64_t tokens, int64_t top_k, int64_t num_experts, const PermuteOptions& options);

/// What undoes a permutation.
struct RoutingMap {
  TensorView row_of;     ///< i32 [T, k]: the permuted row of (t, j), or -1 where it was dropped
  TensorView src_token;  ///< i32 [rows]: the token a permuted row came from, -1 for padding and past the total
};

/// Permutes x: [T, H] (bf16/f16/f32) into permuted: [rows, H] (x's dtype, rows >=
/// permuted_rows(...)) grouped by the expert of ids: i32 [T, k]; counts: i32/i64 [E] gets each
/// expert's padded group size; map gets row_of and src_token. Optional: probs f32 [T, k] ->
/// permuted_probs f32 [rows] (each row's probability, 0 for padding: the router-probability input of
/// GroupedMLP); dropped: i32/i64 [1], the number of (t, j) pairs dropped by the capacity.
/// An id outside [0, E) that only the device sees is treated as dropped (not counted, not in
/// `dropped`) and recorded in the device error word (kDeviceErrorRoutingIndexOutOfRange); the CPU
/// backend throws instead.
void permute(const TensorView& x, const TensorView& ids, const PermuteOptions& options, const TensorView& permuted,
             const TensorView& counts, const RoutingMap& map, const TensorView& probs = {},
             const TensorView& permuted_probs = {}, const TensorView& dropped = {}, Stream stream = nullptr,
             Allocator* alloc = nullptr);

/// The backward of permute: dx[t, :] = Σ_j dpermuted[row_of[t, j], :] over the kept slots, in slot
/// order, in f32, rounded once (0 for a token whose slots were all dropped). dx: [T, H] of
/// dpermuted's dtype. Optional: dpermuted_probs f32 [rows] -> dprobs f32 [T, k] (0 where dropped).
void permute_backward(const TensorView& dpermuted, const RoutingMap& map, const TensorView& dx,
                      const TensorView& dpermuted_probs = {}, const TensorView& dprobs = {}, Stream stream = nullptr,
                      Allocator* alloc = nullptr);

/// Combine: out[t, :] = Σ_j probs[t, j] · expert_out[row_of[t, j], :] over the kept slots, in slot
/// order, in f32, rounded once. expert_out: [rows, H] bf16/f16/f32; out: [T, H] of its dtype;
/// probs: f32 [T, k], or absent for weights of 1.
void combine(const TensorView& expert_out, const RoutingMap& map, const TensorView& probs, const TensorView& out,
             Stream stream = nullptr, Allocator* alloc = nullptr);

/// The backward of combine. dexpert_out[r, :] = probs[t, j] · dout[t, :] for the (t, j) whose row is
/// r, 0 for every other row (padding, past the total); dprobs (optional, f32 [T, k]) = Σ_h dout[t,
/// h] · expert_out[row_of[t, j], h] in f32 (0 where dropped), which needs expert_out.
void combine_backward(const TensorView& dout, const RoutingMap& map, const TensorView& probs,
                      const TensorView& expert_out, const TensorView& dexpert_out, const TensorView& dprobs = {},
                      Stream stream = nullptr, Allocator* alloc = nullptr);

}  // namespace gmoe
