// tests/checkpoint/test_interop.cpp — interop with the reference implementation, Python's
// `safetensors` (PyPI): files it writes load in gmoe with identical bytes, and files gmoe writes
// load in it with identical tensors, bf16 and fp8 included. The Python side is interop.py next to
// this file (GMOE_INTEROP_SCRIPT overrides its path, GMOE_PYTHON the interpreter).
//
// Missing Python packages are a failure, not a skip: the test set-up installs them with
//   python3 -m pip install safetensors numpy
// Only where pip truly cannot install may GMOE_INTEROP_ALLOW_SKIP=1 turn the failure into a skip.
#include <sys/wait.h>

#include <nlohmann/json.hpp>

#include "ckpt_test_util.h"
#include "gmoe/checkpoint.h"
#include "gmoe/error.h"

namespace gmoe_test {
namespace {

using nlohmann::json;

std::string script_path() {
  if (const char* p = std::getenv("GMOE_INTEROP_SCRIPT")) return p;
  std::string f = __FILE__;
  return f.substr(0, f.rfind('/') + 1) + "interop.py";
}

std::string python() {
  const char* p = std::getenv("GMOE_PYTHON");
  return p ? p : "python3";
}

// Runs a command, returns its exit status and appends its output (stdout and stderr) to `out`.
int run(const std::string& cmd, std::string* out) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out->append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string to_hex(const std::vector<uint8_t>& b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (uint8_t x : b) {
    s += d[x >> 4];
    s += d[x & 15];
  }
  return s;
}

std::vector<uint8_t> from_hex(const std::string& s) {
  std::vector<uint8_t> b;
  for (size_t i = 0; i + 1 < s.size(); i += 2) b.push_back(static_cast<uint8_t>(std::stoi(s.substr(i, 2), nullptr, 16)));
  return b;
}

class Interop : public SeededTest {
 protected:
  void SetUp() override {
    SeededTest::SetUp();
    std::string out;
    const std::string cmd = python() + " '" + script_path() + "' probe";
    if (run(cmd, &out) != 0) {
      const std::string why = "Python interop unavailable (`" + cmd + "` failed: " + out +
                              "). Install with: python3 -m pip install safetensors numpy";
      if (std::getenv("GMOE_INTEROP_ALLOW_SKIP")) GTEST_SKIP() << why;
      FAIL() << why;
    }
    std::printf("[ interop ] %s", out.c_str());
  }
};

TEST_F(Interop, FilesWrittenByPythonLoadWithIdenticalBytes) {
  TempDir dir;
  std::string out;
  const unsigned long long py_seed = seed % 1000000007ull;
  ASSERT_EQ(run(python() + " '" + script_path() + "' write '" + dir.path + "' " +
                    std::to_string(py_seed), &out), 0) << out;
  const json expected = json::parse(read_file(dir / "py_expected.json"));
  size_t checked = 0;
  for (auto f = expected.begin(); f != expected.end(); ++f) {
    SCOPED_TRACE(f.key());
    gmoe::SafetensorsFile file = gmoe::SafetensorsFile::open(dir / f.key());
    EXPECT_EQ(file.metadata(), (f.value()["metadata"].get<std::map<std::string, std::string>>()));
    EXPECT_EQ(file.tensors().size(), f.value()["tensors"].size());
    for (auto t = f.value()["tensors"].begin(); t != f.value()["tensors"].end(); ++t) {
      SCOPED_TRACE(t.key());
      const gmoe::SafetensorsEntry& e = file.entry(t.key());
      EXPECT_EQ(e.dtype_code, t.value()["dtype"].get<std::string>());
      EXPECT_TRUE(e.has_gmoe_dtype);
      EXPECT_EQ(e.shape, t.value()["shape"].get<std::vector<int64_t>>());
      EXPECT_EQ(view_bytes(file.view(t.key())), from_hex(t.value()["hex"].get<std::string>()));
      ++checked;
    }
  }
  EXPECT_EQ(checked, 15u);

  // Expert layouts across implementations: Python's stacked fp32 weights into a per-expert list,
  // Python's per-expert bf16 weights into one stacked tensor.
  gmoe::Checkpoint np = gmoe::Checkpoint::open(dir / "py_numpy.safetensors");
  HostTensor fc2 = HostTensor::poisoned(DType::f32, {4, 3, 5});
  gmoe::ExpertWeights list;
  for (int64_t e = 0; e < 4; ++e) list.list.push_back(fc2.view().select0(e));
  gmoe::ExpertParamKey fc2_key{"layers.0.experts.fc2.weight", ""};
  gmoe::load_expert_param(np, load_spec(fc2_key, list), 4);
  EXPECT_EQ(fc2.bytes, view_bytes(np.view(fc2_key.stacked_key())));

  gmoe::Checkpoint raw = gmoe::Checkpoint::open(dir / "py_raw.safetensors");
  HostTensor fc1 = HostTensor::poisoned(DType::bf16, {3, 4, 2});
  gmoe::ExpertParamKey fc1_key{"layers.0.experts.fc1.weight", ""};
  gmoe::load_expert_param(raw, load_spec(fc1_key, gmoe::ExpertWeights::from_stacked(fc1.view())), 3);
  for (int64_t e = 0; e < 3; ++e) EXPECT_EQ(fc1.slice0(e), view_bytes(raw.view(fc1_key.expert_key(e))));
}

TEST_F(Interop, FilesWrittenByGmoeLoadInPythonWithIdenticalTensors) {
  TempDir dir;
  json expected = json::object();
  auto record = [&](const std::string& file, const std::map<std::string, std::string>& meta,
                    const std::string& name, const TensorView& v) {
    expected[file]["metadata"] = meta;
    expected[file]["tensors"][name] = {{"dtype", gmoe::safetensors_dtype_code(v.dtype)},
                                       {"shape", std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.ndim)},
                                       {"hex", to_hex(view_bytes(v))}};
  };

  // Every dtype, with expert parameters in the per-expert layout and extras.
  std::vector<HostTensor> keep;
  keep.reserve(64);
  std::vector<gmoe::NamedTensor> extra;
  const std::map<std::string, std::string> meta_all = {{"format", "pt"}, {"writer", "gmoe"}};
  for (DType t : all_dtypes()) {
    keep.emplace_back(t, std::vector<int64_t>{uniform(0, 4), uniform(1, 6)}, rng);
    extra.push_back({std::string("x.") + gmoe::dtype_name(t), keep.back().view()});
    keep.emplace_back(t, std::vector<int64_t>{}, rng);
    extra.push_back({std::string("scalar.") + gmoe::dtype_name(t), keep.back().view()});
  }
  const int64_t E = uniform(2, 5);
  keep.emplace_back(DType::bf16, std::vector<int64_t>{E, uniform(1, 6), uniform(1, 6)}, rng);
  HostTensor& w = keep.back();
  const gmoe::ExpertParamKey wk{"layers.0.experts.fc1.weight", ""};
  gmoe::save_expert_params(dir / "gmoe_all.safetensors",
                           {save_spec(wk, gmoe::ExpertWeights::from_stacked(w.view()))},
                           gmoe::ExpertLayout::per_expert, meta_all, extra);
  for (const auto& t : extra) record("gmoe_all.safetensors", meta_all, t.name, t.view);
  for (int64_t e = 0; e < E; ++e) record("gmoe_all.safetensors", meta_all, wk.expert_key(e), w.view().select0(e));

  // numpy dtypes only, so numpy's loader is exercised too; stacked expert weights.
  std::vector<gmoe::NamedTensor> np;
  const std::map<std::string, std::string> meta_np = {{"format", "np"}};
  for (DType t : {DType::f32, DType::f16, DType::i32, DType::i64}) {
    keep.emplace_back(t, std::vector<int64_t>{uniform(1, 4), uniform(1, 4), uniform(1, 4)}, rng);
    np.push_back({std::string("layers.1.experts.w.") + gmoe::dtype_name(t), keep.back().view()});
    record("gmoe_numpy.safetensors", meta_np, np.back().name, np.back().view);
  }
  gmoe::save_safetensors(dir / "gmoe_numpy.safetensors", np, meta_np);

  const std::string text = expected.dump();
  write_file(dir / "gmoe_expected.json", std::vector<uint8_t>(text.begin(), text.end()));
  std::string out;
  EXPECT_EQ(run(python() + " '" + script_path() + "' check '" + dir.path + "'", &out), 0) << out;
  std::printf("[ interop ] %s", out.c_str());
}

}  // namespace
}  // namespace gmoe_test
