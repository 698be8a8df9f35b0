// tools/bench/wall_clock.h — wall-clock timing for the CPU runners of gmoe-bench (the CUDA runners
// time with events: cuda_util.h).
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace gmoe::bench {

/// The median of `v` (the upper one for an even count).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Milliseconds that f() took.
template <typename F>
double wall_ms(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace gmoe::bench
