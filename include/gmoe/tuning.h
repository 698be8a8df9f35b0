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

  /// The cluster forced on FP8 fprop/dgrad: fp8_rows_cluster, else cluster (automatic: none).
  ClusterShape fp8_rows_cluster_forced() const {
    return fp8_rows_cluster != ClusterShape::automatic ? fp8_rows_cluster : cluster;
  }

  bool operator==(const Tuning& o) const {
    return gemm_tile == o.gemm_tile && cluster == o.cluster && fp8_rows_cluster == o.fp8_rows_cluster &&
           wgrad_raster == o.wgrad_raster && row_chunk == o.row_chunk;
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
/// raster=auto|m|n, row_chunk=auto|<rows> (auto: -1; 0: no splitting), e.g.
/// "tile=coop,cluster=2x1,raster=n,row_chunk=256". Throws gmoe::Error naming the bad item, key or
/// value.
Tuning parse_tuning(const std::string& spec);

/// The spec of `tuning` that parse_tuning reads back: its non-default fields in the order above
/// ("" for the default Tuning).
std::string tuning_spec(const Tuning& tuning);

}  // namespace gmoe
