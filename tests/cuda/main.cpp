// tests/cuda/main.cpp — gmoe_tests_cuda's main: GoogleTest's flags, and --tuning SPEC (or
// --tuning=SPEC; gmoe::parse_tuning's syntax, e.g. --tuning tile=coop,cluster=2x1), which puts
// those heuristic overrides in effect for the whole run, so that one build runs every compiled
// kernel configuration (scripts/gpu_check.sh's forced runs):
//   gmoe_tests_cuda --tuning tile=pingpong --gtest_filter='*CudaGroupedGemm*'
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "gmoe/error.h"
#include "gmoe/tuning.h"

namespace {

// The tuning spec from what GoogleTest left in argv; false, having said why, on anything else.
bool read_tuning_spec(int argc, char** argv, std::string* spec) {
  for (int i = 1; i < argc; ++i) {
    const char* arg = argv[i];
    if (std::strcmp(arg, "--tuning") == 0 && i + 1 < argc) {
      *spec = argv[++i];
    } else if (std::strncmp(arg, "--tuning=", 9) == 0) {
      *spec = arg + 9;
    } else {
      std::fprintf(stderr, "gmoe_tests_cuda: unexpected argument '%s' (takes GoogleTest's flags and --tuning SPEC)\n",
                   arg);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::string spec;
  if (!read_tuning_spec(argc, argv, &spec)) return 2;
  gmoe::Tuning tuning;
  try {
    tuning = gmoe::parse_tuning(spec);
  } catch (const gmoe::Error& e) {
    std::fprintf(stderr, "gmoe_tests_cuda: --tuning: %s\n", e.what());
    return 2;
  }
  if (!spec.empty()) std::printf("gmoe_tests_cuda: tuning %s\n", gmoe::tuning_spec(tuning).c_str());
  // The tests run on this thread: every op they issue sees these overrides.
  const gmoe::ScopedTuning scope(tuning);
  return RUN_ALL_TESTS();
}
