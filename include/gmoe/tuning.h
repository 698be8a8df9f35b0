// gmoe/tuning.h — explicit overrides of the CUDA backend's kernel heuristics, for tests that must
// run every compiled kernel and for benchmarks that compare them.
//
// The library's behaviour is its heuristics' choice: a default-constructed Tuning overrides
// nothing. The library reads no environment variable; a caller that wants a forced choice says so
// through this API, for the ops it issues from one thread, for as long as a ScopedTuning lives.
#pragma once

#include <cstdint>
#include <string>

namespace gmoe {

/// The bf16/f16 grouped GEMM's mainloop schedule (each names one compiled tile configuration).
enum class GemmTile {
  automatic,    ///< the heuristic's choice (src/cuda/gemm/: choose_tile)
  cooperative,  ///< 128x256x64, two consumer warpgroups sharing one tile
  pingpong,     ///< 128x128x64, two consumer warpgroups on alternate tiles
};

/// The thread-block cluster shape of a grouped GEMM (TMA multicast of the operand tiles that
/// neighbouring blocks share).
enum class ClusterShape { automatic, c1x1, c2x1, c2x2 };

/// The order in which a weight-gradient GEMM walks its output tiles.
enum class WgradRaster { automatic, along_m, along_n };

/// Overrides of the CUDA kernels' heuristics. A field left `automatic` (or `row_chunk` at -1)
/// keeps the heuristic's choice. An override that a call cannot use (a configuration not compiled
/// for its dtype and pass) is ignored for that call: the heuristic chooses. Results never depend
/// on these choices beyond floating-point rounding order; CPU-backend ops ignore them.
struct Tuning {
  GemmTile gemm_tile = GemmTile::automatic;                 ///< bf16/f16 grouped GEMM tile
  ClusterShape cluster = ClusterShape::automatic;           ///< every grouped GEMM's cluster
  ClusterShape fp8_rows_cluster = ClusterShape::automatic;  ///< FP8 fprop/dgrad; automatic: `cluster`
  WgradRaster wgrad_raster = WgradRaster::automatic;        ///< bf16 and FP8 weight gradients
  /// Experts with more rows than this are split into chunks of this many rows (rounded up to a
  /// multiple of 128) in fprop and dgrad: -1 the heuristic's chunk, 0 no splitting.
  int64_t row_chunk = -1;
  /// The SMs a grouped GEMM's persistent grid may occupy (bf16/f16 and FP8, all passes; nothing
  /// else reads it): 0 all of the device's, n > 0 at most n, n < 0 all but -n, as Transformer
  /// Engine's sm_margin (a cap below the device's count is rounded: gemm_sms). For kernels that run beside others on the remaining SMs
  /// (MoELayer's overlapped backward runs its weight gradients beside the exchanges: moe_layer.h).
  /// Only the grid shrinks: the tile choice, and so every output bit, stays the uncapped call's.
  int max_sms = 0;

  /// The SMs a grouped GEMM takes on a device of `device_sms` under max_sms: the device's, or a
  /// cap below it rounded down to a multiple of 4 and at least 4 (a clustered persistent grid,
  /// up to 2x2, must hold whole clusters; CUTLASS sizes it from this count).
  int gemm_sms(int device_sms) const {
    const int cap = max_sms > 0 ? max_sms : device_sms + max_sms;
    if (max_sms == 0 || cap >= device_sms) return device_sms;
    const int whole = cap - cap % 4;
    return whole < 4 ? (device_sms < 4 ? device_sms : 4) : whole;
  }

  /// The cluster forced on FP8 fprop/dgrad: fp8_rows_cluster, else cluster (automatic: none).
  ClusterShape fp8_rows_cluster_forced() const {
    return fp8_rows_cluster != ClusterShape::automatic ? fp8_rows_cluster : cluster;
  }

  bool operator==(const Tuning& o) const {
    return gemm_tile == o.gemm_tile && cluster == o.cluster && fp8_rows_cluster == o.fp8_rows_cluster &&
           wgrad_raster == o.wgrad_raster && row_chunk == o.row_chunk && max_sms == o.max_sms;
  }
  bool operator!=(const Tuning& o) const { return !(*this == o); }
};

/// The overrides in effect for ops issued from the calling thread (default: none).
const Tuning& current_tuning();

/// Puts `tuning` in effect for the ops the calling thread issues while this object lives, and
/// restores the previous overrides when it is destroyed. Scopes nest; each thread has its own.
/// A CUDA graph captured inside a scope keeps the kernels chosen at capture.
class ScopedTuning {
 public:
  explicit ScopedTuning(const Tuning& tuning);
  ~ScopedTuning();
  ScopedTuning(const ScopedTuning&) = delete;
  ScopedTuning& operator=(const ScopedTuning&) = delete;

 private:
  Tuning previous_;
};

/// Names for command lines and reports: "auto", "coop", "pingpong"; "1x1", "2x1", "2x2";
/// "m", "n". parse_* throw gmoe::Error naming `what` on an unknown name.
const char* gemm_tile_name(GemmTile tile);
const char* cluster_shape_name(ClusterShape cluster);
const char* wgrad_raster_name(WgradRaster raster);
GemmTile parse_gemm_tile(const char* name, const char* what);
ClusterShape parse_cluster_shape(const char* name, const char* what);
WgradRaster parse_wgrad_raster(const char* name, const char* what);

/// A Tuning from a command-line spec: comma-separated key=value items, each key at most once, in
/// any order; keys left out keep the heuristic's choice, and "" is the default Tuning. Keys and
/// values: tile=auto|coop|pingpong, cluster=auto|1x1|2x1|2x2, fp8_rows_cluster=auto|1x1|2x1|2x2,
/// raster=auto|m|n, row_chunk=auto|<rows> (auto: -1; 0: no splitting), max_sms=auto|<n>|-<n>
/// (auto: 0, all SMs; -n: all but n), e.g. "tile=coop,cluster=2x1,raster=n,row_chunk=256,max_sms=-24". Throws gmoe::Error naming the bad item, key or
/// value.
Tuning parse_tuning(const std::string& spec);

/// The spec of `tuning` that parse_tuning reads back: its non-default fields in the order above
/// ("" for the default Tuning).
std::string tuning_spec(const Tuning& tuning);

}  // namespace gmoe
