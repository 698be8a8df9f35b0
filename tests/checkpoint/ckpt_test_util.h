// tests/checkpoint/ckpt_test_util.h — helpers of the checkpoint tests: seeded random tensors
// (seed printed on failure, GMOE_TEST_SEED=N to replay), owning CPU buffers, temporary directories.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gmoe/checkpoint.h"
#include "gmoe/error.h"
#include "gmoe/tensor.h"

namespace gmoe_test {

using gmoe::DType;
using gmoe::TensorView;

/// The seed of this test: GMOE_TEST_SEED when set, fresh otherwise.
inline uint64_t test_seed() {
  if (const char* s = std::getenv("GMOE_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
}

/// Base fixture: a fresh seed per test, printed when the test fails.
class SeededTest : public ::testing::Test {
 protected:
  void SetUp() override { rng.seed(seed); }
  void TearDown() override {
    if (HasFailure()) {
      std::fprintf(stderr, "[ seed ] %llu (replay with GMOE_TEST_SEED=%llu)\n",
                   static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
    }
  }
  int64_t uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  }
  uint64_t seed = test_seed();
  std::mt19937_64 rng;
};

/// An owning contiguous CPU tensor filled with random bytes.
struct HostTensor {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  HostTensor() = default;
  HostTensor(DType t, std::vector<int64_t> s, std::mt19937_64& rng) : dtype(t), shape(std::move(s)) {
    int64_t n = static_cast<int64_t>(gmoe::dtype_size(t));
    for (int64_t d : shape) n *= d;
    bytes.resize(static_cast<size_t>(n));
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  }
  /// Zero-filled with a poison byte so unwritten destinations are caught.
  static HostTensor poisoned(DType t, std::vector<int64_t> s) {
    HostTensor h;
    h.dtype = t;
    h.shape = std::move(s);
    int64_t n = static_cast<int64_t>(gmoe::dtype_size(t));
    for (int64_t d : h.shape) n *= d;
    h.bytes.assign(static_cast<size_t>(n), 0xA5);
    return h;
  }
  TensorView view() {
    TensorView v;
    v.data = bytes.data();
    v.dtype = dtype;
    v.ndim = static_cast<int>(shape.size());
    int64_t st = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      v.shape[d] = shape[static_cast<size_t>(d)];
      v.strides[d] = st;
      st *= v.shape[d];
    }
    return v;
  }
  int64_t expert_bytes() const { return static_cast<int64_t>(bytes.size()) / shape[0]; }
  /// Bytes of index i along dimension 0.
  std::vector<uint8_t> slice0(int64_t i) const {
    const size_t n = bytes.size() / static_cast<size_t>(shape[0]);
    return std::vector<uint8_t>(bytes.begin() + static_cast<long>(i * n),
                                bytes.begin() + static_cast<long>((i + 1) * n));
  }
};

inline std::vector<uint8_t> view_bytes(const TensorView& v) {
  const auto* p = static_cast<const uint8_t*>(v.data);
  return std::vector<uint8_t>(p, p + v.nbytes());
}

inline std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

/// A safetensors file from a header text and a data section of `data_bytes` bytes (0x11 each).
inline std::vector<uint8_t> craft(const std::string& header, size_t data_bytes) {
  std::string text(8, '\0');
  for (int i = 0; i < 8; ++i) text[static_cast<size_t>(i)] = static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i));
  text += header;
  text.append(data_bytes, '\x11');
  return std::vector<uint8_t>(text.begin(), text.end());
}

/// A temporary directory removed (with its files) at the end of the test.
struct TempDir {
  std::string path;
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base ? base : "/tmp") + "/gmoe_ckpt_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = buf.data();
  }
  ~TempDir() {
    if (!std::getenv("GMOE_KEEP_TMP")) std::system(("rm -rf '" + path + "'").c_str());
  }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

/// Expects `fn` to throw gmoe::Error whose message contains every one of `parts`.
template <typename Fn>
void expect_error(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected gmoe::Error containing '" << parts[0] << "', nothing was thrown";
  } catch (const gmoe::Error& e) {
    const std::string what = e.what();
    for (const std::string& p : parts) {
      EXPECT_NE(what.find(p), std::string::npos) << "error lacks '" << p << "': " << what;
    }
  }
}

/// A load request without GLU conversion (spelled out so -Wextra sees every field set).
inline gmoe::ExpertParamToLoad load_spec(const gmoe::ExpertParamKey& key, const gmoe::ExpertWeights& dst) {
  gmoe::ExpertParamToLoad p;
  p.key = key;
  p.dst = dst;
  return p;
}

/// A save request without GLU conversion.
inline gmoe::ExpertParamToSave save_spec(const gmoe::ExpertParamKey& key, const gmoe::ExpertWeights& src) {
  gmoe::ExpertParamToSave p;
  p.key = key;
  p.src = src;
  return p;
}

/// The dtypes gmoe reads and writes.
inline std::vector<DType> all_dtypes() {
  return {DType::f32, DType::bf16, DType::f16, DType::e4m3, DType::e5m2, DType::e8m0, DType::i32,
          DType::i64};
}

}  // namespace gmoe_test
