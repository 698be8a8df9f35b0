// tests/cpu/test_tuning.cpp — gmoe/tuning.h: parse_tuning reads every key and value and names the
// bad key or value it refuses; tuning_spec writes what parse_tuning reads back (random Tunings);
// ScopedTuning scopes nest and restore, and each thread sees only its own.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "common/expect_error.h"
#include "common/harness.h"
#include "gmoe/tuning.h"

namespace gmoe::test {
namespace {

TEST(Tuning, EmptySpecIsTheDefault) {
  EXPECT_EQ(parse_tuning(""), Tuning{});
  EXPECT_EQ(tuning_spec(Tuning{}), "");
  EXPECT_EQ(current_tuning(), Tuning{}) << "no scope is open: nothing is overridden";
}

TEST(Tuning, ParsesEveryKey) {
  const Tuning t = parse_tuning("tile=coop,cluster=2x1,fp8_rows_cluster=2x2,raster=n,row_chunk=256");
  EXPECT_EQ(t.gemm_tile, GemmTile::cooperative);
  EXPECT_EQ(t.cluster, ClusterShape::c2x1);
  EXPECT_EQ(t.fp8_rows_cluster, ClusterShape::c2x2);
  EXPECT_EQ(t.wgrad_raster, WgradRaster::along_n);
  EXPECT_EQ(t.row_chunk, 256);
  // Any order; a key left out keeps the heuristic.
  const Tuning u = parse_tuning("row_chunk=0,raster=m,tile=pingpong");
  EXPECT_EQ(u.gemm_tile, GemmTile::pingpong);
  EXPECT_EQ(u.cluster, ClusterShape::automatic);
  EXPECT_EQ(u.fp8_rows_cluster, ClusterShape::automatic);
  EXPECT_EQ(u.wgrad_raster, WgradRaster::along_m);
  EXPECT_EQ(u.row_chunk, 0);
  EXPECT_EQ(parse_tuning("cluster=1x1").cluster, ClusterShape::c1x1);
  // "auto" is accepted everywhere and is the default.
  EXPECT_EQ(parse_tuning("tile=auto,cluster=auto,fp8_rows_cluster=auto,raster=auto,row_chunk=auto"), Tuning{});
  EXPECT_EQ(parse_tuning("row_chunk=-1"), Tuning{});
}

TEST(Tuning, RefusesNamingTheBadKeyOrValue) {
  GMOE_EXPECT_ERROR(parse_tuning("tile=wide"), "tuning key 'tile'", "'wide'", "coop, pingpong");
  GMOE_EXPECT_ERROR(parse_tuning("tile=coop,cluster=3x1"), "tuning key 'cluster'", "'3x1'", "2x2");
  GMOE_EXPECT_ERROR(parse_tuning("fp8_rows_cluster=1x2"), "tuning key 'fp8_rows_cluster'", "'1x2'");
  GMOE_EXPECT_ERROR(parse_tuning("raster=k"), "tuning key 'raster'", "'k'");
  GMOE_EXPECT_ERROR(parse_tuning("row_chunk=-2"), "tuning key 'row_chunk'", "'-2'");
  GMOE_EXPECT_ERROR(parse_tuning("row_chunk=12x"), "tuning key 'row_chunk'", "'12x'");
  GMOE_EXPECT_ERROR(parse_tuning("row_chunk="), "tuning key 'row_chunk'", "''");
  GMOE_EXPECT_ERROR(parse_tuning("row_chunk=99999999999999999999"), "tuning key 'row_chunk'");
  GMOE_EXPECT_ERROR(parse_tuning("tiles=coop"), "unknown key 'tiles'", "expected tile, cluster");
  GMOE_EXPECT_ERROR(parse_tuning("tile"), "expected key=value", "got 'tile'");
  GMOE_EXPECT_ERROR(parse_tuning("=coop"), "expected key=value", "got '=coop'");
  GMOE_EXPECT_ERROR(parse_tuning("tile=coop,,raster=n"), "expected key=value", "got ''");
  GMOE_EXPECT_ERROR(parse_tuning("tile=coop,"), "after the last ','");
  GMOE_EXPECT_ERROR(parse_tuning("tile=coop,raster=n,tile=pingpong"), "key 'tile' given twice");
  GMOE_EXPECT_ERROR(parse_tuning(" tile=coop"), "unknown key ' tile'");
}

// Random Tunings, written by tuning_spec and read back by parse_tuning.
TEST(Tuning, SpecRoundTrips) {
  Rng rng;
  for (int i = 0; i < 200; ++i) {
    Tuning t;
    t.gemm_tile = static_cast<GemmTile>(rng.integer(0, 2));
    t.cluster = static_cast<ClusterShape>(rng.integer(0, 3));
    t.fp8_rows_cluster = static_cast<ClusterShape>(rng.integer(0, 3));
    t.wgrad_raster = static_cast<WgradRaster>(rng.integer(0, 2));
    t.row_chunk = rng.integer(0, 3) == 0 ? -1 : rng.integer(0, 1 << 20);
    const std::string spec = tuning_spec(t);
    SCOPED_TRACE(spec);
    EXPECT_EQ(parse_tuning(spec), t);
    EXPECT_EQ(spec.empty(), t == Tuning{});
  }
}

TEST(Tuning, ScopesNestAndRestore) {
  const Tuning outer = parse_tuning("tile=coop,row_chunk=512");
  const Tuning inner = parse_tuning("cluster=2x2,raster=m");
  {
    ScopedTuning a(outer);
    EXPECT_EQ(current_tuning(), outer);
    {
      ScopedTuning b(inner);
      EXPECT_EQ(current_tuning(), inner) << "an inner scope replaces the outer one whole, it does not merge";
      {
        ScopedTuning c(Tuning{});
        EXPECT_EQ(current_tuning(), Tuning{}) << "a default scope turns every override off";
      }
      EXPECT_EQ(current_tuning(), inner);
    }
    EXPECT_EQ(current_tuning(), outer);
    // A refused scope leaves the one in effect untouched.
    Tuning bad;
    bad.row_chunk = -2;
    GMOE_EXPECT_ERROR(ScopedTuning refused(bad), "tuning.row_chunk", "-2");
    EXPECT_EQ(current_tuning(), outer);
  }
  EXPECT_EQ(current_tuning(), Tuning{});
}

TEST(Tuning, EachThreadHasItsOwn) {
  const Tuning mine = parse_tuning("tile=pingpong,fp8_rows_cluster=1x1");
  const Tuning theirs = parse_tuning("raster=n,row_chunk=128");
  ScopedTuning scope(mine);
  Tuning seen_at_start, seen_in_scope, seen_after;
  std::thread other([&] {
    seen_at_start = current_tuning();
    {
      ScopedTuning s(theirs);
      seen_in_scope = current_tuning();
    }
    seen_after = current_tuning();
  });
  other.join();
  EXPECT_EQ(seen_at_start, Tuning{}) << "another thread saw this thread's overrides";
  EXPECT_EQ(seen_in_scope, theirs);
  EXPECT_EQ(seen_after, Tuning{});
  EXPECT_EQ(current_tuning(), mine) << "another thread's scope changed this thread's overrides";
}

TEST(Tuning, Fp8RowsClusterFallsBackToTheCluster) {
  EXPECT_EQ(parse_tuning("").fp8_rows_cluster_forced(), ClusterShape::automatic);
  EXPECT_EQ(parse_tuning("cluster=2x1").fp8_rows_cluster_forced(), ClusterShape::c2x1);
  EXPECT_EQ(parse_tuning("fp8_rows_cluster=2x2").fp8_rows_cluster_forced(), ClusterShape::c2x2);
  EXPECT_EQ(parse_tuning("cluster=1x1,fp8_rows_cluster=2x2").fp8_rows_cluster_forced(), ClusterShape::c2x2);
}

}  // namespace
}  // namespace gmoe::test
