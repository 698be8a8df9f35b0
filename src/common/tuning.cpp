// src/common/tuning.cpp — the calling thread's heuristic overrides (gmoe/tuning.h).
#include "gmoe/tuning.h"

#include <cstring>

#include "gmoe/error.h"

namespace gmoe {
namespace {

// Thread-local: two threads issuing ops on two streams never see each other's overrides.
Tuning& thread_tuning() {
  thread_local Tuning tuning;
  return tuning;
}

template <typename Enum, size_t N>
Enum parse_name(const char* name, const char* what, const char* const (&names)[N]) {
  GMOE_CHECK(name != nullptr, what, ": expected a name, got null");
  for (size_t i = 0; i < N; ++i) {
    if (std::strcmp(name, names[i]) == 0) return static_cast<Enum>(i);
  }
  std::string known;
  for (size_t i = 0; i < N; ++i) known += std::string(i ? ", " : "") + names[i];
  GMOE_FAIL(what, ": unknown value '", name, "', expected one of ", known);
}

// Indexed by the enums' values.
constexpr const char* kTileNames[] = {"auto", "coop", "pingpong"};
constexpr const char* kClusterNames[] = {"auto", "1x1", "2x1", "2x2"};
constexpr const char* kRasterNames[] = {"auto", "m", "n"};

}  // namespace

const Tuning& current_tuning() { return thread_tuning(); }

ScopedTuning::ScopedTuning(const Tuning& tuning) : previous_(thread_tuning()) {
  GMOE_CHECK(tuning.row_chunk >= -1, "tuning.row_chunk: expected -1 (heuristic), 0 (none) or a row count, got ",
             tuning.row_chunk);
  thread_tuning() = tuning;
}

ScopedTuning::~ScopedTuning() { thread_tuning() = previous_; }

const char* gemm_tile_name(GemmTile tile) { return kTileNames[static_cast<int>(tile)]; }
const char* cluster_shape_name(ClusterShape cluster) { return kClusterNames[static_cast<int>(cluster)]; }
const char* wgrad_raster_name(WgradRaster raster) { return kRasterNames[static_cast<int>(raster)]; }

GemmTile parse_gemm_tile(const char* name, const char* what) {
  return parse_name<GemmTile>(name, what, kTileNames);
}
ClusterShape parse_cluster_shape(const char* name, const char* what) {
  return parse_name<ClusterShape>(name, what, kClusterNames);
}
WgradRaster parse_wgrad_raster(const char* name, const char* what) {
  return parse_name<WgradRaster>(name, what, kRasterNames);
}

}  // namespace gmoe
