// src/common/tuning.cpp — the calling thread's heuristic overrides (gmoe/tuning.h).
#include "gmoe/tuning.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

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

// row_chunk's value: "auto" (-1) or a whole number >= -1.
int64_t parse_row_chunk(const std::string& value) {
  if (value == "auto") return -1;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  GMOE_CHECK(!value.empty() && *end == '\0' && errno == 0 && v >= -1, "tuning key 'row_chunk': expected auto, ",
             "-1, 0 or a row count, got '", value, "'");
  return v;
}

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

Tuning parse_tuning(const std::string& spec) {
  Tuning t;
  std::string seen = ",";  // the keys given so far, each followed by a comma
  std::size_t at = 0;
  while (at < spec.size()) {
    std::size_t end = spec.find(',', at);
    if (end == std::string::npos) end = spec.size();
    const std::string item = spec.substr(at, end - at);
    at = end + 1;
    const std::size_t eq = item.find('=');
    GMOE_CHECK(eq != std::string::npos && eq > 0, "tuning spec '", spec, "': expected key=value, got '", item, "'");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    GMOE_CHECK(seen.find("," + key + ",") == std::string::npos, "tuning spec '", spec, "': key '", key,
               "' given twice");
    seen += key + ",";
    if (key == "tile") {
      t.gemm_tile = parse_gemm_tile(value.c_str(), "tuning key 'tile'");
    } else if (key == "cluster") {
      t.cluster = parse_cluster_shape(value.c_str(), "tuning key 'cluster'");
    } else if (key == "fp8_rows_cluster") {
      t.fp8_rows_cluster = parse_cluster_shape(value.c_str(), "tuning key 'fp8_rows_cluster'");
    } else if (key == "raster") {
      t.wgrad_raster = parse_wgrad_raster(value.c_str(), "tuning key 'raster'");
    } else if (key == "row_chunk") {
      t.row_chunk = parse_row_chunk(value);
    } else {
      GMOE_FAIL("tuning spec '", spec, "': unknown key '", key,
                "', expected tile, cluster, fp8_rows_cluster, raster or row_chunk");
    }
  }
  GMOE_CHECK(spec.empty() || spec.back() != ',', "tuning spec '", spec, "': expected key=value after the last ','");
  return t;
}

std::string tuning_spec(const Tuning& t) {
  std::string spec;
  const auto add = [&spec](const char* key, const std::string& value) {
    spec += (spec.empty() ? "" : ",") + std::string(key) + "=" + value;
  };
  if (t.gemm_tile != GemmTile::automatic) add("tile", gemm_tile_name(t.gemm_tile));
  if (t.cluster != ClusterShape::automatic) add("cluster", cluster_shape_name(t.cluster));
  if (t.fp8_rows_cluster != ClusterShape::automatic) add("fp8_rows_cluster", cluster_shape_name(t.fp8_rows_cluster));
  if (t.wgrad_raster != WgradRaster::automatic) add("raster", wgrad_raster_name(t.wgrad_raster));
  if (t.row_chunk != -1) add("row_chunk", std::to_string(t.row_chunk));
  return spec;
}

}  // namespace gmoe
