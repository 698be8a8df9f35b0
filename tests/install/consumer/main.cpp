// tests/install/consumer/main.cpp — a program outside the project that finds the installed gmoe
// package (find_package(gmoe), gmoe::gmoe) and runs one op on the CPU backend.
#include <gmoe/grouped_gemm.h>
#include <cstdio>
#include <vector>
int main() {
  std::vector<float> x(4 * 8, 1.f), w(2 * 3 * 8, 0.5f), y(4 * 3);
  std::vector<int> counts = {1, 3};
  gmoe::TensorView xv(x.data(), gmoe::DType::f32, gmoe::Device::cpu(), {4, 8});
  gmoe::TensorView wv(w.data(), gmoe::DType::f32, gmoe::Device::cpu(), {2, 3, 8});
  gmoe::TensorView cv(counts.data(), gmoe::DType::i32, gmoe::Device::cpu(), {2});
  gmoe::TensorView yv(y.data(), gmoe::DType::f32, gmoe::Device::cpu(), {4, 3});
  gmoe::grouped_gemm_fprop(xv, gmoe::ExpertWeights::from_stacked(wv), cv, yv);
  std::printf("y[0] = %g (expect 4)\n", y[0]);
  return y[0] == 4.f ? 0 : 1;
}
