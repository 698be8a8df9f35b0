// tests/dist/ep_moe_layer_multi_gpu.h — the MoELayer checks of gmoe_tests_ep (expert parallelism on
// the NCCL backend, one process per GPU): what each child runs after the exchange checks of
// ep_multi_gpu.cpp.
#pragma once

#include <cstdint>

#include "gmoe/expert_parallel.h"
#include "gmoe/stream.h"

namespace gmoe::test {

/// Unique ids moe_layer_ep_checks needs (the groups it makes).
constexpr int kMoELayerEpGroups = 1;

/// Rank `rank` of `ranks`, on CUDA device `rank` (current), with `stream` (non-blocking) and the
/// shared `seed`; `ids`: kMoELayerEpGroups unique ids, the same on every rank. Runs the MoELayer
/// checks (EP forward and backward against the single-GPU layer on the global batch, skewed
/// routing with a rank without tokens, backward's exchanges on a second stream with the delayed
/// weight gradients during the combine, one CUDA-graph capture replayed under three routings),
/// prints each failure to stderr and returns how many there were. Collective: every rank calls it.
int moe_layer_ep_checks(int rank, int ranks, uint64_t seed, const EpUniqueId* ids, Stream stream);

}  // namespace gmoe::test
