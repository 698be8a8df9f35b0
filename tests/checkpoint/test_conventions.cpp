// tests/checkpoint/test_conventions.cpp — checkpoints of real model families (Hugging Face Mixtral,
// Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss; Megatron-Core with TE grouped linear; gmoe's own
// modules) recognised from their key names and shapes, and converted between them.
//
// Files are written here with the real key names and the shape ratios of each family (hidden :
// ffn as in the released configs, scaled down). Every conversion is checked value by value: the
// test generates logical experts (gate [F, H], up [F, H], down [H, F], biases), writes them in the
// source form with its own index arithmetic, and reads the converted file back with its own index
// arithmetic for the target form — the library's mapping is never used to check itself. A
// converted checkpoint also runs in gmoe's GroupedMLP and gives what the source model's own
// definition of its experts gives (Mixtral: w2(silu(w1 x) * w3 x); gpt-oss: its clamped SwiGLU
// over interleaved, [in, out] weights with biases), written out here in plain loops.
#include <cmath>
#include <map>

#include "checkpoint/internal.h"  // make_view
#include "ckpt_test_util.h"
#include "gmoe/checkpoint.h"
#include "gmoe/error.h"
#include "gmoe/grouped_mlp.h"

namespace gmoe_test {
namespace {

using gmoe::Checkpoint;
using gmoe::ExpertLayout;
using gmoe::GluFormat;
using gmoe::GluLayout;
using gmoe::MoeConvention;
using gmoe::MoeConvertOptions;
using gmoe::WeightOrientation;

// How one checkpoint stores its experts: naming, layout, gate/up form, orientation.
struct Form {
  std::string conv;   // mixtral, qwen, deepseek, gpt-oss, megatron, gmoe
  bool stacked = false;
  bool separate = true;
  int64_t block = 0;  // fused gate/up: 0 concatenated, else interleaved in blocks of this
  bool in_out = false;
  std::string root = "model.";  // "model." (HF), "decoder." / "module.decoder." (Megatron), "" (gmoe root)
};

// The experts prefix of layer L, spelled out per family.
std::string experts_prefix(const Form& f, int L) {
  const std::string layer = f.root + "layers." + std::to_string(L) + ".";
  if (f.conv == "mixtral") return layer + "block_sparse_moe.experts.";
  return layer + "mlp.experts.";
}

enum class Part { gate, up, fc1, fc2, gate_bias, up_bias, fc1_bias, fc2_bias };

std::string part_name(const Form& f, Part p) {
  const bool hf = f.conv == "qwen" || f.conv == "deepseek";
  switch (p) {
    case Part::gate: return f.conv == "mixtral" ? "w1.weight" : "gate_proj.weight";
    case Part::up: return f.conv == "mixtral" ? "w3.weight" : "up_proj.weight";
    case Part::gate_bias: return "gate_proj.bias";
    case Part::up_bias: return "up_proj.bias";
    case Part::fc1:
      return hf ? "gate_up_proj.weight" : f.conv == "gpt-oss" ? "gate_up_proj" : f.conv == "megatron" ? "linear_fc1.weight" : "fc1.weight";
    case Part::fc1_bias:
      return hf ? "gate_up_proj.bias" : f.conv == "gpt-oss" ? "gate_up_proj_bias" : f.conv == "megatron" ? "linear_fc1.bias" : "fc1.bias";
    case Part::fc2:
      return f.conv == "mixtral" ? "w2.weight" : hf ? "down_proj.weight" : f.conv == "gpt-oss" ? "down_proj"
                                                  : f.conv == "megatron" ? "linear_fc2.weight" : "fc2.weight";
    case Part::fc2_bias:
      return hf ? "down_proj.bias" : f.conv == "gpt-oss" ? "down_proj_bias" : f.conv == "megatron" ? "linear_fc2.bias" : "fc2.bias";
  }
  return "";
}

// Megatron and gmoe append the expert index to the last component; the HF families give it a
// component of its own.
std::string key_of(const Form& f, int L, Part p, int64_t e) {
  const std::string pre = experts_prefix(f, L), name = part_name(f, p);
  const bool attached = f.conv == "megatron" || f.conv == "gmoe";
  if (e < 0) return pre + name;
  return attached ? pre + name + std::to_string(e) : pre + std::to_string(e) + "." + name;
}

// The logical experts of one layer (bf16 bits): gate/up [F, H], down [H, F], biases.
struct Experts {
  int64_t E = 0, H = 0, F = 0;
  bool bias = false;
  std::vector<uint16_t> gate, up, down, gate_b, up_b, down_b;
  uint16_t g(int64_t e, int64_t j, int64_t i) const { return gate[(e * F + j) * H + i]; }
  uint16_t u(int64_t e, int64_t j, int64_t i) const { return up[(e * F + j) * H + i]; }
  uint16_t d(int64_t e, int64_t h, int64_t j) const { return down[(e * H + h) * F + j]; }
};

Experts random_experts(std::mt19937_64& rng, int64_t E, int64_t H, int64_t F, bool bias) {
  Experts x{E, H, F, bias, {}, {}, {}, {}, {}, {}};
  auto fill = [&](std::vector<uint16_t>& v, int64_t n) {
    v.resize(static_cast<size_t>(n));
    for (auto& b : v) b = static_cast<uint16_t>(rng());
  };
  fill(x.gate, E * F * H);
  fill(x.up, E * F * H);
  fill(x.down, E * H * F);
  if (bias) {
    fill(x.gate_b, E * F);
    fill(x.up_b, E * F);
    fill(x.down_b, E * H);
  }
  return x;
}

// Row of gate (h = 0) or up (h = 1) row j among the 2F rows of a fused FC1.
int64_t fused_row(const Form& f, int64_t h, int64_t j, int64_t F) {
  if (f.block == 0) return h * F + j;
  return (j / f.block) * (2 * f.block) + h * f.block + (j % f.block);
}

// Element (r, c) of a logical [rows, cols] matrix in its stored orientation.
int64_t at(const Form& f, int64_t rows, int64_t cols, int64_t r, int64_t c) {
  return f.in_out ? c * rows + r : r * cols + c;
}

// One tensor per expert (or stacked), as {key → bytes, shape}.
struct File {
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<uint16_t>>> t;
  void put(const std::string& k, std::vector<int64_t> shape, std::vector<uint16_t> v) { t[k] = {std::move(shape), std::move(v)}; }
  void save(const std::string& path, const std::map<std::string, HostTensor>& extra = {}) const {
    std::vector<gmoe::NamedTensor> named;
    for (const auto& kv : t) {
      named.push_back({kv.first, gmoe::ckpt_detail::make_view(kv.second.second.data(), DType::bf16, kv.second.first)});
    }
    for (const auto& kv : extra) named.push_back({kv.first, const_cast<HostTensor&>(kv.second).view()});
    gmoe::save_safetensors(path, named);
  }
};

// Writes layer L's experts in form f.
void write_layer(File& file, const Form& f, int L, const Experts& x) {
  const int64_t E = x.E, H = x.H, F = x.F;
  auto weight = [&](Part p, int64_t rows, int64_t cols, auto value) {
    std::vector<int64_t> es = f.in_out ? std::vector<int64_t>{cols, rows} : std::vector<int64_t>{rows, cols};
    std::vector<uint16_t> all(static_cast<size_t>(E * rows * cols));
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) all[static_cast<size_t>(e * rows * cols + at(f, rows, cols, r, c))] = value(e, r, c);
      }
    }
    if (f.stacked) {
      std::vector<int64_t> s{E};
      s.insert(s.end(), es.begin(), es.end());
      file.put(key_of(f, L, p, -1), s, all);
    } else {
      for (int64_t e = 0; e < E; ++e) {
        file.put(key_of(f, L, p, e), es,
                 std::vector<uint16_t>(all.begin() + e * rows * cols, all.begin() + (e + 1) * rows * cols));
      }
    }
  };
  if (f.separate) {
    weight(Part::gate, F, H, [&](int64_t e, int64_t j, int64_t i) { return x.g(e, j, i); });
    weight(Part::up, F, H, [&](int64_t e, int64_t j, int64_t i) { return x.u(e, j, i); });
  } else {
    std::vector<int64_t> inv(static_cast<size_t>(2 * F));  // stored row → (h, j)
    for (int64_t h = 0; h < 2; ++h) for (int64_t j = 0; j < F; ++j) inv[static_cast<size_t>(fused_row(f, h, j, F))] = h * F + j;
    weight(Part::fc1, 2 * F, H, [&](int64_t e, int64_t r, int64_t i) {
      const int64_t l = inv[static_cast<size_t>(r)];
      return l < F ? x.g(e, l, i) : x.u(e, l - F, i);
    });
  }
  weight(Part::fc2, H, F, [&](int64_t e, int64_t h, int64_t j) { return x.d(e, h, j); });
  if (!x.bias) return;
  auto bias = [&](Part p, int64_t n, auto value) {
    std::vector<uint16_t> all(static_cast<size_t>(E * n));
    for (int64_t e = 0; e < E; ++e) for (int64_t r = 0; r < n; ++r) all[static_cast<size_t>(e * n + r)] = value(e, r);
    if (f.stacked) {
      file.put(key_of(f, L, p, -1), {E, n}, all);
    } else {
      for (int64_t e = 0; e < E; ++e) file.put(key_of(f, L, p, e), {n}, std::vector<uint16_t>(all.begin() + e * n, all.begin() + (e + 1) * n));
    }
  };
  if (f.separate) {
    bias(Part::gate_bias, F, [&](int64_t e, int64_t j) { return x.gate_b[static_cast<size_t>(e * F + j)]; });
    bias(Part::up_bias, F, [&](int64_t e, int64_t j) { return x.up_b[static_cast<size_t>(e * F + j)]; });
  } else {
    std::vector<int64_t> inv(static_cast<size_t>(2 * F));
    for (int64_t h = 0; h < 2; ++h) for (int64_t j = 0; j < F; ++j) inv[static_cast<size_t>(fused_row(f, h, j, F))] = h * F + j;
    bias(Part::fc1_bias, 2 * F, [&](int64_t e, int64_t r) {
      const int64_t l = inv[static_cast<size_t>(r)];
      return l < F ? x.gate_b[static_cast<size_t>(e * F + l)] : x.up_b[static_cast<size_t>(e * F + l - F)];
    });
  }
  bias(Part::fc2_bias, H, [&](int64_t e, int64_t h) { return x.down_b[static_cast<size_t>(e * H + h)]; });
}

uint16_t read_u16(const Checkpoint& c, const std::string& key, int64_t index) {
  uint16_t v;
  std::memcpy(&v, c.bytes(key) + 2 * index, 2);
  return v;
}

// Reads layer L of `c` in form f and compares every element with x. Returns the number of
// mismatches (the first few reported).
int64_t compare_layer(const Checkpoint& c, const Form& f, int L, const Experts& x, const std::string& what) {
  const int64_t E = x.E, H = x.H, F = x.F;
  int64_t bad = 0;
  auto check = [&](uint16_t got, uint16_t want, const char* t, int64_t e, int64_t r, int64_t col) {
    if (got == want) return;
    if (++bad <= 5) ADD_FAILURE() << what << ": layer " << L << " " << t << " expert " << e << " (" << r << ", " << col << ")";
  };
  auto get = [](const uint8_t* p, int64_t i) {
    uint16_t v;
    std::memcpy(&v, p + 2 * i, 2);
    return v;
  };
  for (int64_t e = 0; e < E; ++e) {
    // Expert e's bytes of part p, `n` elements per expert.
    auto base = [&](Part p, int64_t n) {
      return f.stacked ? c.bytes(key_of(f, L, p, -1)) + 2 * e * n : c.bytes(key_of(f, L, p, e));
    };
    const uint8_t* gate = f.separate ? base(Part::gate, F * H) : base(Part::fc1, 2 * F * H);
    const uint8_t* up = f.separate ? base(Part::up, F * H) : gate;
    const uint8_t* down = base(Part::fc2, H * F);
    const int64_t rows = f.separate ? F : 2 * F;
    for (int64_t j = 0; j < F; ++j) {
      const int64_t rg = f.separate ? j : fused_row(f, 0, j, F), ru = f.separate ? j : fused_row(f, 1, j, F);
      for (int64_t i = 0; i < H; ++i) {
        check(get(gate, at(f, rows, H, rg, i)), x.g(e, j, i), "gate", e, j, i);
        check(get(up, at(f, rows, H, ru, i)), x.u(e, j, i), "up", e, j, i);
        check(get(down, at(f, H, F, i, j)), x.d(e, i, j), "down", e, i, j);
      }
    }
    if (!x.bias) continue;
    const uint8_t* gb = f.separate ? base(Part::gate_bias, F) : base(Part::fc1_bias, 2 * F);
    const uint8_t* ub = f.separate ? base(Part::up_bias, F) : gb;
    const uint8_t* db = base(Part::fc2_bias, H);
    for (int64_t j = 0; j < F; ++j) {
      check(get(gb, f.separate ? j : fused_row(f, 0, j, F)), x.gate_b[static_cast<size_t>(e * F + j)], "gate bias", e, j, 0);
      check(get(ub, f.separate ? j : fused_row(f, 1, j, F)), x.up_b[static_cast<size_t>(e * F + j)], "up bias", e, j, 0);
    }
    for (int64_t h = 0; h < H; ++h) check(get(db, h), x.down_b[static_cast<size_t>(e * H + h)], "down bias", e, h, 0);
  }
  return bad;
}

// A model family: its source form and the hidden : ffn ratio of its released configs, scaled.
struct Family {
  const char* name;
  Form form;
  MoeConvention conv;
  const char* recognised_family;
  int64_t E, H, F;
  bool bias;
};

// Mixtral-8x7B 4096 : 14336; Qwen3-30B-A3B 2048 : 768; OLMoE 2048 : 1024; DeepSeek-V3
// 7168 : 2048; gpt-oss 2880 : 2880; Megatron (any) 4096 : 1536 here.
std::vector<Family> families() {
  return {
      {"mixtral", {"mixtral", false, true, 0, false, "model."}, MoeConvention::mixtral, "Mixtral", 8, 64, 224, false},
      {"qwen3", {"qwen", false, true, 0, false, "model."}, MoeConvention::qwen, "Qwen3-MoE / OLMoE", 16, 64, 24, false},
      {"olmoe", {"qwen", false, true, 0, false, "model."}, MoeConvention::qwen, "Qwen3-MoE / OLMoE", 8, 64, 32, false},
      {"qwen-stacked", {"qwen", true, true, 0, false, "model."}, MoeConvention::qwen, "Qwen3-MoE / OLMoE", 8, 64, 32, false},
      {"deepseek", {"deepseek", false, true, 0, false, "model."}, MoeConvention::deepseek, "DeepSeek-V3", 16, 112, 32, false},
      {"gpt-oss", {"gpt-oss", true, false, 1, true, "model."}, MoeConvention::gpt_oss, "gpt-oss", 4, 48, 48, true},
      {"megatron", {"megatron", false, false, 0, false, "module.decoder."}, MoeConvention::megatron,
       "Megatron-Core, TE grouped linear", 8, 64, 24, true},
      {"megatron-grouped", {"megatron", true, false, 0, false, "decoder."}, MoeConvention::megatron,
       "Megatron-Core, TE grouped linear (single grouped weight)", 8, 64, 24, false},
      {"gmoe", {"gmoe", true, false, 0, false, "model."}, MoeConvention::gmoe, "gmoe GroupedMLP state_dict", 8, 32, 48, true},
  };
}

class Conventions : public SeededTest {
 protected:
  // Writes two MoE layers of `fam` (and the other tensors of the family) to `path`.
  std::vector<Experts> write_family(const Family& fam, const std::string& path) {
    File file;
    std::map<std::string, HostTensor> extra;
    std::vector<Experts> layers;
    const std::string root = fam.form.root;
    const std::string moe = fam.form.conv == "mixtral" ? "block_sparse_moe." : "mlp.";
    for (int L = 0; L < 2; ++L) {
      layers.push_back(random_experts(rng, fam.E, fam.H, fam.F, fam.bias));
      write_layer(file, fam.form, L, layers.back());
      const std::string l = root + "layers." + std::to_string(L) + ".";
      extra[l + "input_layernorm.weight"] = HostTensor(DType::bf16, {fam.H}, rng);
      const std::string router = fam.form.conv == "mixtral"                                    ? "gate.weight"
                                 : fam.form.conv == "gpt-oss" || fam.form.conv == "megatron" ? "router.weight"
                                                                                              : "gate.weight";
      if (fam.form.conv != "gmoe") extra[l + moe + router] = HostTensor(DType::bf16, {fam.E, fam.H}, rng);
      if (fam.form.conv == "gpt-oss") extra[l + "mlp.router.bias"] = HostTensor(DType::bf16, {fam.E}, rng);
      if (fam.form.conv == "deepseek") {
        extra[l + "mlp.gate.e_score_correction_bias"] = HostTensor(DType::f32, {fam.E}, rng);
        for (const char* n : {"gate_proj", "up_proj"}) {
          extra[l + "mlp.shared_experts." + n + ".weight"] = HostTensor(DType::bf16, {fam.F, fam.H}, rng);
        }
        extra[l + "mlp.shared_experts.down_proj.weight"] = HostTensor(DType::bf16, {fam.H, fam.F}, rng);
      }
      if (fam.form.conv == "megatron") {
        // TE's extra state (FP8 metadata) travels untouched.
        extra[l + "mlp.experts.linear_fc1._extra_state"] = HostTensor(DType::i32, {3}, rng);
        extra[l + "mlp.router.expert_bias"] = HostTensor(DType::f32, {fam.E}, rng);
      }
    }
    if (fam.form.conv == "deepseek") {
      // DeepSeek's first layers are dense: mlp.gate_proj with no experts, not an MoE block.
      extra[root + "layers.2.mlp.gate_proj.weight"] = HostTensor(DType::bf16, {4 * fam.F, fam.H}, rng);
    }
    file.save(path, extra);
    return layers;
  }
};

TEST_F(Conventions, EachFamilyIsRecognisedFromNamesAndShapes) {
  for (const Family& fam : families()) {
    SCOPED_TRACE(fam.name);
    TempDir dir;
    write_family(fam, dir / "in.safetensors");
    const gmoe::MoeCheckpointInfo r = gmoe::recognise_moe_checkpoint(Checkpoint::open(dir / "in.safetensors"));
    ASSERT_TRUE(r.recognised) << (r.problems.empty() ? "" : r.problems[0]);
    EXPECT_EQ(r.convention, fam.conv);
    EXPECT_EQ(r.family, fam.recognised_family);
    ASSERT_EQ(r.blocks.size(), 2u);
    for (int L = 0; L < 2; ++L) {
      const gmoe::MoeBlock& b = r.blocks[static_cast<size_t>(L)];
      EXPECT_EQ(b.layer, L);
      EXPECT_EQ(b.experts, experts_prefix(fam.form, L));
      EXPECT_EQ(b.num_experts, fam.E);
      EXPECT_EQ(b.hidden, fam.H);
      EXPECT_EQ(b.ffn, fam.F);
      EXPECT_TRUE(b.gated);
      EXPECT_EQ(b.separate_gate_up, fam.form.separate);
      EXPECT_EQ(b.tensors.size(), (fam.form.separate ? 3u : 2u) + (fam.bias ? (fam.form.separate ? 3u : 2u) : 0u));
      for (const gmoe::MoeExpertTensor& t : b.tensors) {
        EXPECT_EQ(t.info.layout, fam.form.stacked ? ExpertLayout::stacked : ExpertLayout::per_expert);
        if (t.info.expert_shape.size() == 2) {
          EXPECT_EQ(t.orientation, fam.form.in_out ? WeightOrientation::in_out : WeightOrientation::out_in);
        }
        if (t.role == gmoe::MoeTensorRole::fc1) {
          EXPECT_EQ(t.glu, (GluFormat{fam.form.block ? GluLayout::interleaved : GluLayout::concatenated,
                                      fam.form.block ? fam.form.block : 1}));
        }
      }
      EXPECT_EQ(b.router.count("router.weight"), fam.form.conv == "gmoe" ? 0u : 1u);
      if (fam.form.conv == "deepseek") {
        EXPECT_EQ(b.router.count("score_correction_bias"), 1u);
        EXPECT_EQ(b.shared.size(), 3u);
      }
    }
  }
}

TEST_F(Conventions, Qwen2SharedExpertAndGmoeModuleAtTheRoot) {
  TempDir dir;
  // Qwen2-MoE: one shared expert with its sigmoid gate [1, H] beside 8 routed ones (ratio of
  // Qwen1.5-MoE-A2.7B: hidden 2048, expert ffn 1408, shared 5632).
  File file;
  const Form q{"qwen", false, true, 0, false, "model."};
  write_layer(file, q, 0, random_experts(rng, 8, 64, 44, false));
  std::map<std::string, HostTensor> extra;
  extra["model.layers.0.mlp.gate.weight"] = HostTensor(DType::bf16, {8, 64}, rng);
  extra["model.layers.0.mlp.shared_expert.gate_proj.weight"] = HostTensor(DType::bf16, {176, 64}, rng);
  extra["model.layers.0.mlp.shared_expert.up_proj.weight"] = HostTensor(DType::bf16, {176, 64}, rng);
  extra["model.layers.0.mlp.shared_expert.down_proj.weight"] = HostTensor(DType::bf16, {64, 176}, rng);
  extra["model.layers.0.mlp.shared_expert_gate.weight"] = HostTensor(DType::bf16, {1, 64}, rng);
  file.save(dir / "qwen2.safetensors", extra);
  const auto r = gmoe::recognise_moe_checkpoint(Checkpoint::open(dir / "qwen2.safetensors"));
  ASSERT_TRUE(r.recognised);
  EXPECT_EQ(r.family, "Qwen2-MoE");
  EXPECT_EQ(r.blocks[0].shared.size(), 4u);

  // To Megatron: the shared expert's gate and up become one linear_fc1 [gate; up], its gate
  // weight shared_experts.gate_weight; back to qwen gives every byte again.
  MoeConvertOptions to_m;
  to_m.convention = MoeConvention::megatron;
  gmoe::convert_moe_checkpoint(dir / "qwen2.safetensors", dir / "m.safetensors", to_m);
  const Checkpoint m = Checkpoint::open(dir / "m.safetensors");
  const std::string sh = "decoder.layers.0.mlp.shared_experts.";
  ASSERT_TRUE(m.contains(sh + "linear_fc1.weight"));
  EXPECT_EQ(m.entry(sh + "linear_fc1.weight").shape, (std::vector<int64_t>{352, 64}));
  std::vector<uint8_t> fc1 = view_bytes(m.view(sh + "linear_fc1.weight"));
  std::vector<uint8_t> cat = extra["model.layers.0.mlp.shared_expert.gate_proj.weight"].bytes;
  const auto& upb = extra["model.layers.0.mlp.shared_expert.up_proj.weight"].bytes;
  cat.insert(cat.end(), upb.begin(), upb.end());
  EXPECT_EQ(fc1, cat);
  EXPECT_EQ(view_bytes(m.view("decoder.layers.0.mlp.shared_experts.gate_weight")),
            extra["model.layers.0.mlp.shared_expert_gate.weight"].bytes);
  EXPECT_EQ(view_bytes(m.view("decoder.layers.0.mlp.router.weight")), extra["model.layers.0.mlp.gate.weight"].bytes);
  MoeConvertOptions to_q;
  to_q.convention = MoeConvention::qwen;
  gmoe::convert_moe_checkpoint(dir / "m.safetensors", dir / "q.safetensors", to_q);
  const Checkpoint a = Checkpoint::open(dir / "qwen2.safetensors"), b = Checkpoint::open(dir / "q.safetensors");
  ASSERT_EQ(a.keys(), b.keys());
  for (const std::string& k : a.keys()) EXPECT_EQ(view_bytes(a.view(k)), view_bytes(b.view(k))) << k;

  // gmoe's GroupedMLP state_dict saved on its own: `fc1.weight` at the root, per-expert.
  File g;
  const Form gm{"gmoe", false, false, 0, false, ""};
  auto x = random_experts(rng, 4, 16, 8, true);
  write_layer(g, gm, 0, x);
  // write_layer names it "layers.0.mlp.experts."; rename to the module's own keys.
  File root;
  for (auto& kv : g.t) root.put(kv.first.substr(std::string("layers.0.mlp.experts.").size()), kv.second.first, kv.second.second);
  root.save(dir / "gmoe.safetensors");
  const auto rg = gmoe::recognise_moe_checkpoint(Checkpoint::open(dir / "gmoe.safetensors"));
  ASSERT_TRUE(rg.recognised) << (rg.problems.empty() ? "" : rg.problems[0]);
  EXPECT_EQ(rg.convention, MoeConvention::gmoe);
  EXPECT_EQ(rg.blocks[0].experts, "");
  EXPECT_EQ(rg.blocks[0].tensors[0].key.expert_key(3), "fc1.weight3");
  // A dense model's fc1.weight [out, in] is no expert tensor.
  File dense;
  dense.put("vit.mlp.fc1.weight", {8, 4}, std::vector<uint16_t>(32));
  dense.put("vit.mlp.fc2.weight", {4, 8}, std::vector<uint16_t>(32));
  dense.save(dir / "dense.safetensors");
  EXPECT_FALSE(gmoe::recognise_moe_checkpoint(Checkpoint::open(dir / "dense.safetensors")).recognised);
}

// The targets every family is converted to: the form read back, and the options asking for it.
struct TargetCase {
  const char* name;
  Form form;
  MoeConvertOptions opt;
};

std::vector<TargetCase> targets() {
  std::vector<TargetCase> t;
  auto add = [&](const char* name, Form f, auto set) {
    MoeConvertOptions o;
    set(o);
    t.push_back({name, f, o});
  };
  add("gmoe", {"gmoe", true, false, 0, false, "model."}, [](MoeConvertOptions& o) { o.convention = MoeConvention::gmoe; });
  add("gmoe per-expert interleaved:8", {"gmoe", false, false, 8, false, "model."}, [](MoeConvertOptions& o) {
    o.convention = MoeConvention::gmoe;
    o.layout = ExpertLayout::per_expert;
    o.glu = GluFormat{GluLayout::interleaved, 8};
  });
  add("mixtral", {"mixtral", false, true, 0, false, "model."}, [](MoeConvertOptions& o) { o.convention = MoeConvention::mixtral; });
  add("qwen stacked", {"qwen", true, true, 0, false, "model."}, [](MoeConvertOptions& o) {
    o.convention = MoeConvention::qwen;
    o.layout = ExpertLayout::stacked;
  });
  add("qwen fused interleaved:4 [in, out]", {"qwen", false, false, 4, true, "model."}, [](MoeConvertOptions& o) {
    o.convention = MoeConvention::qwen;
    o.separate_gate_up = false;
    o.glu = GluFormat{GluLayout::interleaved, 4};
    o.orientation = WeightOrientation::in_out;
  });
  add("gpt-oss", {"gpt-oss", true, false, 1, true, "model."}, [](MoeConvertOptions& o) { o.convention = MoeConvention::gpt_oss; });
  add("megatron", {"megatron", false, false, 0, false, "decoder."}, [](MoeConvertOptions& o) { o.convention = MoeConvention::megatron; });
  add("megatron grouped", {"megatron", true, false, 0, false, "decoder."}, [](MoeConvertOptions& o) {
    o.convention = MoeConvention::megatron;
    o.layout = ExpertLayout::stacked;
  });
  return t;
}

TEST_F(Conventions, EveryConversionMatchesAnIndependentSlicingOfTheSource) {
  for (const Family& fam : families()) {
    TempDir dir;
    const std::vector<Experts> layers = write_family(fam, dir / "in.safetensors");
    const Checkpoint in = Checkpoint::open(dir / "in.safetensors");
    for (const TargetCase& tc : targets()) {
      const std::string what = std::string(fam.name) + " -> " + tc.name;
      SCOPED_TRACE(what);
      Form want = tc.form;
      // A Megatron source keeps its root when the naming is kept; HF roots map to decoder.
      if (fam.form.conv == "megatron" && want.conv == "megatron") want.root = fam.form.root;
      if (fam.form.conv == "gmoe" && want.conv == "gmoe") want.root = fam.form.root;
      if (fam.bias && want.conv == "mixtral") {
        expect_error([&] { gmoe::convert_moe_checkpoint(dir / "in.safetensors", dir / "out.safetensors", tc.opt); },
                     {"mixtral naming has no key for", "bias"});
        continue;
      }
      if (want.block && fam.F % want.block != 0) continue;
      // Within one convention, what is not asked for is kept.
      if (fam.conv == *tc.opt.convention) {
        if (!tc.opt.layout) want.stacked = fam.form.stacked;
        if (!tc.opt.separate_gate_up) want.separate = fam.form.separate;
        if (!tc.opt.orientation) want.in_out = fam.form.in_out;
        if (!tc.opt.glu && !fam.form.separate) want.block = fam.form.block;
      }
      const std::vector<gmoe::ConvertPlanEntry> plan =
          gmoe::convert_moe_checkpoint(dir / "in.safetensors", dir / "out.safetensors", tc.opt);
      const Checkpoint out = Checkpoint::open(dir / "out.safetensors");
      for (int L = 0; L < 2; ++L) {
        Experts x = layers[static_cast<size_t>(L)];
        EXPECT_EQ(compare_layer(out, want, L, x, what), 0);
      }
      // The plan names every key written, and nothing else is in the file.
      size_t keys = 0;
      for (const auto& p : plan) keys += p.key.find("{0..") != std::string::npos ? static_cast<size_t>(fam.E) : 1;
      EXPECT_EQ(keys, out.keys().size());
      // Non-expert tensors are carried byte for byte (renamed routers included).
      for (const std::string& k : in.keys()) {
        if (k.find("input_layernorm") != std::string::npos || k.find("_extra_state") != std::string::npos ||
            k.find("layers.2.") != std::string::npos) {
          ASSERT_TRUE(out.contains(k)) << k;
          EXPECT_EQ(view_bytes(out.view(k)), view_bytes(in.view(k))) << k;
        }
      }
      // And converting back gives the source's bytes, key for key.
      MoeConvertOptions back;
      back.convention = fam.conv;
      back.layout = fam.form.stacked ? ExpertLayout::stacked : ExpertLayout::per_expert;
      back.separate_gate_up = fam.form.separate;
      back.glu = GluFormat{fam.form.block ? GluLayout::interleaved : GluLayout::concatenated, fam.form.block ? fam.form.block : 1};
      back.orientation = fam.form.in_out ? WeightOrientation::in_out : WeightOrientation::out_in;
      // A fused FC1's gate/up layout is in the keys of gpt-oss only: name it for the others.
      if (!want.separate) back.glu_from = GluFormat{want.block ? GluLayout::interleaved : GluLayout::concatenated, want.block ? want.block : 1};
      if (fam.form.root == "module.decoder." && want.conv != "megatron") continue;  // `module.` is not restored
      gmoe::convert_moe_checkpoint(dir / "out.safetensors", dir / "back.safetensors", back);
      const Checkpoint b = Checkpoint::open(dir / "back.safetensors");
      std::vector<std::string> kin = in.keys(), kb = b.keys();
      EXPECT_EQ(kin, kb);
      if (kin == kb) {
        for (const std::string& k : kin) EXPECT_EQ(view_bytes(in.view(k)), view_bytes(b.view(k))) << k;
      }
    }
  }
}

TEST_F(Conventions, GptOssGateUpIsDeinterleavedAlongItsLastDimension) {
  // gpt-oss stores gate_up_proj [E, H, 2F]: [in, out], gate and up alternating along 2F. Convert
  // to gmoe (stacked [E, 2F, H], [gate; up]) and check against a slicing written here:
  // gate = gate_up_proj[e, :, 0::2]ᵀ, up = gate_up_proj[e, :, 1::2]ᵀ, down = down_projᵀ.
  TempDir dir;
  const int64_t E = 4, H = 24, F = 40;  // H != F, so a wrong axis or a missing transpose cannot pass
  HostTensor gu(DType::bf16, {E, H, 2 * F}, rng), gub(DType::bf16, {E, 2 * F}, rng), dp(DType::bf16, {E, F, H}, rng);
  gmoe::save_safetensors(dir / "oss.safetensors", {{"model.layers.0.mlp.experts.gate_up_proj", gu.view()},
                                                   {"model.layers.0.mlp.experts.gate_up_proj_bias", gub.view()},
                                                   {"model.layers.0.mlp.experts.down_proj", dp.view()}});
  MoeConvertOptions o;
  o.convention = MoeConvention::gmoe;
  gmoe::convert_moe_checkpoint(dir / "oss.safetensors", dir / "g.safetensors", o);
  const Checkpoint g = Checkpoint::open(dir / "g.safetensors");
  EXPECT_EQ(g.entry("model.layers.0.mlp.experts.fc1.weight").shape, (std::vector<int64_t>{E, 2 * F, H}));
  EXPECT_EQ(g.entry("model.layers.0.mlp.experts.fc2.weight").shape, (std::vector<int64_t>{E, H, F}));
  auto src = [](const HostTensor& t, int64_t i) {
    uint16_t v;
    std::memcpy(&v, t.bytes.data() + 2 * i, 2);
    return v;
  };
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t j = 0; j < F; ++j) {
      for (int64_t i = 0; i < H; ++i) {
        ASSERT_EQ(read_u16(g, "model.layers.0.mlp.experts.fc1.weight", (e * 2 * F + j) * H + i),
                  src(gu, (e * H + i) * 2 * F + 2 * j));
        ASSERT_EQ(read_u16(g, "model.layers.0.mlp.experts.fc1.weight", (e * 2 * F + F + j) * H + i),
                  src(gu, (e * H + i) * 2 * F + 2 * j + 1));
        ASSERT_EQ(read_u16(g, "model.layers.0.mlp.experts.fc2.weight", (e * H + i) * F + j), src(dp, (e * F + j) * H + i));
      }
      ASSERT_EQ(read_u16(g, "model.layers.0.mlp.experts.fc1.bias", e * 2 * F + j), src(gub, e * 2 * F + 2 * j));
      ASSERT_EQ(read_u16(g, "model.layers.0.mlp.experts.fc1.bias", e * 2 * F + F + j), src(gub, e * 2 * F + 2 * j + 1));
    }
  }

  // The generic conversion (--param gate_up_proj --glu gate_up_proj --glu-from interleaved:1
  // --glu-to concat) keeps [in, out] but de-interleaves along the last dimension, not along H.
  gmoe::ConvertOptions gen;
  gen.detect.param_names = {"gate_up_proj"};
  gen.glu_stems = {"gate_up_proj"};
  gen.glu_from = {GluLayout::interleaved, 1};
  gen.glu_to = {GluLayout::concatenated, 1};
  gmoe::convert_checkpoint(dir / "oss.safetensors", dir / "gen.safetensors", gen);
  const Checkpoint c = Checkpoint::open(dir / "gen.safetensors");
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < H; ++i) {
      for (int64_t j = 0; j < F; ++j) {
        ASSERT_EQ(read_u16(c, "model.layers.0.mlp.experts.gate_up_proj", (e * H + i) * 2 * F + j), src(gu, (e * H + i) * 2 * F + 2 * j));
        ASSERT_EQ(read_u16(c, "model.layers.0.mlp.experts.gate_up_proj", (e * H + i) * 2 * F + F + j),
                  src(gu, (e * H + i) * 2 * F + 2 * j + 1));
      }
    }
  }
}

TEST_F(Conventions, CastOnlyWhenAskedAndStackedKeysHaveNoEmptyComponent) {
  TempDir dir;
  File file;
  const Form mix{"mixtral", false, true, 0, false, "model."};
  const Experts x = random_experts(rng, 4, 16, 56, false);
  write_layer(file, mix, 0, x);
  file.save(dir / "m.safetensors");
  MoeConvertOptions st;
  st.layout = ExpertLayout::stacked;
  gmoe::convert_moe_checkpoint(dir / "m.safetensors", dir / "st.safetensors", st);
  const Checkpoint s = Checkpoint::open(dir / "st.safetensors");
  EXPECT_TRUE(s.contains("model.layers.0.block_sparse_moe.experts.w1.weight"));
  for (const std::string& k : s.keys()) EXPECT_EQ(k.find(".."), std::string::npos) << k;
  EXPECT_EQ(gmoe::ExpertParamKey({"m.experts.", ".w1.weight"}).stacked_key(), "m.experts.w1.weight");
  // Stacked Mixtral naming is recognised too, and round-trips.
  EXPECT_EQ(compare_layer(s, Form{"mixtral", true, true, 0, false, "model."}, 0, x, "stacked"), 0);

  // --dtype f32: bf16 → f32 is exact, so every value reads back as its bf16 bits << 16.
  MoeConvertOptions f32;
  f32.cast = DType::f32;
  gmoe::convert_moe_checkpoint(dir / "m.safetensors", dir / "f32.safetensors", f32);
  const Checkpoint f = Checkpoint::open(dir / "f32.safetensors");
  const std::string k = "model.layers.0.block_sparse_moe.experts.2.w3.weight";
  ASSERT_EQ(f.entry(k).dtype_code, "F32");
  for (int64_t j = 0; j < 56; ++j) {
    for (int64_t i = 0; i < 16; ++i) {
      uint32_t bits;
      std::memcpy(&bits, f.bytes(k) + 4 * (j * 16 + i), 4);
      const uint16_t want = x.u(2, j, i);
      const bool nan = (want & 0x7f80) == 0x7f80 && (want & 0x7f);
      if (!nan) ASSERT_EQ(bits, static_cast<uint32_t>(want) << 16) << j << "," << i;
    }
  }
}

// Squared-ReLU experts under Hugging Face names (Nemotron-H; examples/train_moe_lm.py with
// --activation squared_relu): up_proj [F, H] and down_proj [H, F], no gate. The up projection is
// an ungated FC1 of F rows, kept as up_proj through every layout and back from gmoe's fc1.
TEST_F(Conventions, UngatedUpProjectionIsAnFc1OfFRows) {
  TempDir dir;
  const int64_t E = uniform(2, 5), H = 8 * uniform(1, 3), F = 8 * uniform(1, 4);
  const std::string m = "model.layers.0.mlp.experts.";
  std::vector<std::vector<uint16_t>> up(E), down(E);
  File file;
  for (int64_t e = 0; e < E; ++e) {
    up[e].resize(F * H);
    down[e].resize(H * F);
    for (auto& v : up[e]) v = static_cast<uint16_t>(rng());
    for (auto& v : down[e]) v = static_cast<uint16_t>(rng());
    file.put(m + std::to_string(e) + ".up_proj.weight", {F, H}, up[e]);
    file.put(m + std::to_string(e) + ".down_proj.weight", {H, F}, down[e]);
  }
  file.save(dir / "in.safetensors");
  const gmoe::MoeCheckpointInfo r = gmoe::recognise_moe_checkpoint(Checkpoint::open(dir / "in.safetensors"));
  ASSERT_TRUE(r.recognised) << (r.problems.empty() ? "" : r.problems[0]);
  EXPECT_EQ(r.convention, MoeConvention::qwen);
  ASSERT_EQ(r.blocks.size(), 1u);
  const gmoe::MoeBlock& b = r.blocks[0];
  EXPECT_FALSE(b.gated);
  EXPECT_FALSE(b.separate_gate_up);
  EXPECT_EQ(b.num_experts, E);
  EXPECT_EQ(b.hidden, H);
  EXPECT_EQ(b.ffn, F);
  ASSERT_EQ(b.tensors.size(), 2u);
  EXPECT_EQ(b.tensors[0].role, gmoe::MoeTensorRole::fc1);

  // Expert e of `key` (stacked, or per expert when `per_expert`) holds exactly `want`'s bits.
  auto expect_bits = [&](const Checkpoint& c, const std::string& name, bool per_expert,
                         const std::vector<std::vector<uint16_t>>& want, std::vector<int64_t> shape) {
    for (int64_t e = 0; e < E; ++e) {
      const std::string key = per_expert ? m + std::to_string(e) + "." + name : m + name;
      ASSERT_TRUE(c.contains(key)) << key;
      std::vector<int64_t> full = shape;
      if (!per_expert) full.insert(full.begin(), E);
      ASSERT_EQ(c.entry(key).shape, full) << key;
      const uint8_t* p = c.bytes(key) + (per_expert ? 0 : e * F * H * 2);
      EXPECT_EQ(std::memcmp(p, want[e].data(), want[e].size() * 2), 0) << key << " expert " << e;
    }
  };
  auto convert = [&](const std::string& from, const std::string& to, const MoeConvertOptions& o) {
    gmoe::convert_moe_checkpoint(dir / from, dir / to, o);
    return Checkpoint::open(dir / to);
  };
  MoeConvertOptions stacked, per_expert, to_gmoe, to_qwen;
  stacked.layout = ExpertLayout::stacked;
  per_expert.layout = ExpertLayout::per_expert;
  to_gmoe.convention = MoeConvention::gmoe;
  to_qwen.convention = MoeConvention::qwen;
  const Checkpoint s = convert("in.safetensors", "st.safetensors", stacked);
  expect_bits(s, "up_proj.weight", false, up, {F, H});
  expect_bits(s, "down_proj.weight", false, down, {H, F});
  EXPECT_FALSE(s.contains(m + "gate_up_proj.weight"));
  expect_bits(convert("st.safetensors", "pe.safetensors", per_expert), "up_proj.weight", true, up, {F, H});
  // To gmoe's fc1 (F rows, no GLU) and back to Hugging Face names: up_proj again.
  expect_bits(convert("in.safetensors", "g.safetensors", to_gmoe), "fc1.weight", false, up, {F, H});
  const Checkpoint q = convert("g.safetensors", "q.safetensors", to_qwen);
  expect_bits(q, "up_proj.weight", true, up, {F, H});
  expect_bits(q, "down_proj.weight", true, down, {H, F});

  // An up projection of 2F rows with no gate is neither an ungated FC1 nor half of a GLU.
  File twice;
  twice.put(m + "0.up_proj.weight", {2 * F, H}, std::vector<uint16_t>(2 * F * H));
  twice.put(m + "0.down_proj.weight", {H, F}, std::vector<uint16_t>(H * F));
  twice.save(dir / "twice.safetensors");
  const gmoe::MoeCheckpointInfo t = gmoe::recognise_moe_checkpoint(Checkpoint::open(dir / "twice.safetensors"));
  ASSERT_FALSE(t.problems.empty());
  EXPECT_NE(t.problems[0].find("an up weight without its gate weight"), std::string::npos) << t.problems[0];
}

TEST_F(Conventions, SafetyOverwriteDryRunAndMessages) {
  TempDir dir;
  File file;
  write_layer(file, Form{"qwen", false, true, 0, false, "model."}, 0, random_experts(rng, 4, 16, 8, false));
  file.save(dir / "q.safetensors");
  const std::vector<uint8_t> before = read_file(dir / "q.safetensors");
  MoeConvertOptions o;
  o.convention = MoeConvention::gmoe;
  expect_error([&] { gmoe::convert_moe_checkpoint(dir / "q.safetensors", dir / "q.safetensors", o); },
               {"is the input", "--overwrite-input"});
  // Through a link too.
  ASSERT_EQ(symlink("q.safetensors", (dir / "link.safetensors").c_str()), 0);
  expect_error([&] { gmoe::convert_moe_checkpoint(dir / "q.safetensors", dir / "link.safetensors", o); }, {"is the input"});
  gmoe::ConvertOptions gen;
  expect_error([&] { gmoe::convert_checkpoint(dir / "q.safetensors", dir / "q.safetensors", gen); }, {"is the input"});
  EXPECT_EQ(read_file(dir / "q.safetensors"), before);

  // Dry run: the plan, no file.
  o.dry_run = true;
  const auto plan = gmoe::convert_moe_checkpoint(dir / "q.safetensors", dir / "never.safetensors", o);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].key, "model.layers.0.mlp.experts.fc1.weight");
  EXPECT_EQ(plan[0].shape, (std::vector<int64_t>{4, 16, 16}));
  EXPECT_NE(plan[0].source.find("experts.{0..3}.gate_proj.weight + "), std::string::npos) << plan[0].source;
  EXPECT_TRUE(read_file(dir / "never.safetensors").empty());

  // Allowed explicitly: the input is replaced (through a temporary file) and holds the result.
  o.dry_run = false;
  o.allow_overwrite_input = true;
  gmoe::convert_moe_checkpoint(dir / "q.safetensors", dir / "q.safetensors", o);
  EXPECT_TRUE(Checkpoint::open(dir / "q.safetensors").contains("model.layers.0.mlp.experts.fc1.weight"));

  // A broken family: an expert missing, and a gate without its up; messages name the keys.
  File broken;
  const Experts x = random_experts(rng, 4, 16, 8, false);
  write_layer(broken, Form{"mixtral", false, true, 0, false, "model."}, 0, x);
  broken.t.erase("model.layers.0.block_sparse_moe.experts.2.w2.weight");
  broken.save(dir / "broken.safetensors");
  expect_error([&] { gmoe::convert_moe_checkpoint(dir / "broken.safetensors", dir / "o.safetensors", MoeConvertOptions{}); },
               {"cannot convert", "model.layers.0.block_sparse_moe.experts.2.w2.weight", "missing"});
  File half;
  write_layer(half, Form{"mixtral", false, true, 0, false, "model."}, 0, x);
  for (int e = 0; e < 4; ++e) half.t.erase("model.layers.0.block_sparse_moe.experts." + std::to_string(e) + ".w3.weight");
  half.save(dir / "half.safetensors");
  expect_error([&] { gmoe::convert_moe_checkpoint(dir / "half.safetensors", dir / "o.safetensors", MoeConvertOptions{}); },
               {"model.layers.0.block_sparse_moe.experts.", "a gate weight without its up weight"});
  // Forms a convention does not have.
  MoeConvertOptions sep;
  sep.convention = MoeConvention::megatron;
  sep.separate_gate_up = true;
  expect_error([&] { gmoe::convert_moe_checkpoint(dir / "q.safetensors", dir / "o.safetensors", sep); },
               {"megatron naming has no key for gate", "fused"});
  MoeConvertOptions io;
  io.orientation = WeightOrientation::in_out;
  expect_error([&] { gmoe::convert_moe_checkpoint(dir / "q.safetensors", dir / "o.safetensors", io); },
               {"gmoe stores expert weights [out, in]"});
}

// ---- a converted checkpoint runs in GroupedMLP as the source model's experts do ----

std::vector<float> randn(std::mt19937_64& rng, size_t n, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TensorView f32_view(std::vector<float>& v, std::vector<int64_t> shape) {
  return gmoe::ckpt_detail::make_view(v.data(), DType::f32, shape);
}

// Loads a gmoe-named checkpoint of one layer into a GroupedMLP and runs x through it.
std::vector<float> run_grouped_mlp(const std::string& path, const std::string& experts, int64_t E, int64_t H,
                                   int64_t F, bool bias, gmoe::ActivationOptions act, std::vector<float>& x,
                                   std::vector<int32_t>& counts) {
  const Checkpoint c = Checkpoint::open(path);
  std::vector<float> w1(static_cast<size_t>(E * 2 * F * H)), w2(static_cast<size_t>(E * H * F));
  std::vector<float> b1(static_cast<size_t>(E * 2 * F)), b2(static_cast<size_t>(E * H));
  auto stacked = [](TensorView v) {
    gmoe::ExpertWeights w;
    w.stacked = v;  // any rank: biases are [E, N]
    return w;
  };
  std::vector<gmoe::ExpertParamToLoad> load = {
      load_spec({experts + "fc1.weight", ""}, stacked(f32_view(w1, {E, 2 * F, H}))),
      load_spec({experts + "fc2.weight", ""}, stacked(f32_view(w2, {E, H, F})))};
  if (bias) {
    load.push_back(load_spec({experts + "fc1.bias", ""}, stacked(f32_view(b1, {E, 2 * F}))));
    load.push_back(load_spec({experts + "fc2.bias", ""}, stacked(f32_view(b2, {E, H}))));
  }
  gmoe::load_expert_params(c, load, E, 0, /*allow_unexpected=*/true);
  gmoe::GroupedMLPOptions opt;
  opt.activation = act;
  gmoe::GroupedMLP mlp(gmoe::ExpertWeights::from_stacked(f32_view(w1, {E, 2 * F, H})),
                       gmoe::ExpertWeights::from_stacked(f32_view(w2, {E, H, F})),
                       bias ? gmoe::ExpertBias::from_grouped(f32_view(b1, {E, 2 * F})) : gmoe::ExpertBias{},
                       bias ? gmoe::ExpertBias::from_grouped(f32_view(b2, {E, H})) : gmoe::ExpertBias{}, opt);
  gmoe::GroupedMLPContext ctx;
  const int64_t T = static_cast<int64_t>(x.size()) / H;
  TensorView cv;
  cv.data = counts.data();
  cv.dtype = DType::i32;
  cv.ndim = 1;
  cv.shape[0] = E;
  cv.strides[0] = 1;
  gmoe::Tensor y = mlp.forward(f32_view(x, {T, H}), cv, TensorView{}, ctx);
  const float* p = static_cast<const float*>(y.view().data);
  return std::vector<float>(p, p + T * H);
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  double scale = 0, worst = 0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
  // f32 GEMMs against a double reference over a few hundred terms.
  EXPECT_LE(worst, 1e-4 * scale + 1e-6) << what << ": worst |diff| " << worst << " of " << scale;
  EXPECT_GT(scale, 0.0);
}

TEST_F(Conventions, ConvertedMixtralRunsInGroupedMlpAsMixtralDoes) {
  TempDir dir;
  const int64_t E = 8, H = 32, F = 112, T = 61;  // Mixtral's 1 : 3.5
  std::vector<std::vector<float>> w1, w2, w3;
  std::vector<gmoe::NamedTensor> named;
  for (int64_t e = 0; e < E; ++e) {
    w1.push_back(randn(rng, static_cast<size_t>(F * H), 0.2f));
    w3.push_back(randn(rng, static_cast<size_t>(F * H), 0.2f));
    w2.push_back(randn(rng, static_cast<size_t>(H * F), 0.1f));
  }
  const std::string pre = "model.layers.0.block_sparse_moe.experts.";
  for (int64_t e = 0; e < E; ++e) {
    named.push_back({pre + std::to_string(e) + ".w1.weight", f32_view(w1[static_cast<size_t>(e)], {F, H})});
    named.push_back({pre + std::to_string(e) + ".w3.weight", f32_view(w3[static_cast<size_t>(e)], {F, H})});
    named.push_back({pre + std::to_string(e) + ".w2.weight", f32_view(w2[static_cast<size_t>(e)], {H, F})});
  }
  gmoe::save_safetensors(dir / "mixtral.safetensors", named);
  std::vector<int32_t> counts = {9, 0, 17, 1, 0, 20, 6, 8};  // skewed, with empty experts
  std::vector<float> x = randn(rng, static_cast<size_t>(T * H), 1.f);
  // Mixtral's expert: w2(silu(w1 x) * w3 x).
  std::vector<double> want(static_cast<size_t>(T * H), 0.0);
  for (int64_t e = 0, row = 0; e < E; ++e) {
    for (int32_t n = 0; n < counts[static_cast<size_t>(e)]; ++n, ++row) {
      std::vector<double> z(static_cast<size_t>(F));
      for (int64_t j = 0; j < F; ++j) {
        double a = 0, b = 0;
        for (int64_t i = 0; i < H; ++i) {
          a += double(w1[e][j * H + i]) * x[row * H + i];
          b += double(w3[e][j * H + i]) * x[row * H + i];
        }
        z[j] = a / (1 + std::exp(-a)) * b;
      }
      for (int64_t h = 0; h < H; ++h) {
        double s = 0;
        for (int64_t j = 0; j < F; ++j) s += double(w2[e][h * F + j]) * z[j];
        want[row * H + h] = s;
      }
    }
  }
  for (int64_t block : {0, 8}) {
    MoeConvertOptions o;
    o.convention = MoeConvention::gmoe;
    if (block) o.glu = GluFormat{GluLayout::interleaved, block};
    gmoe::convert_moe_checkpoint(dir / "mixtral.safetensors", dir / "g.safetensors", o);
    // The interleave is not in gmoe's keys: the file names it in its metadata, and reads back so.
    const Checkpoint g = Checkpoint::open(dir / "g.safetensors");
    EXPECT_EQ(g.metadata().count("gmoe.fc1_glu"), block ? 1u : 0u);
    EXPECT_EQ(gmoe::recognise_moe_checkpoint(g).blocks.at(0).tensors.at(0).glu, o.glu.value_or(GluFormat{}));
    gmoe::ActivationOptions act;
    act.kind = gmoe::ActivationKind::swiglu;
    act.glu = o.glu.value_or(GluFormat{});
    const std::vector<float> y =
        run_grouped_mlp(dir / "g.safetensors", "model.layers.0.mlp.experts.", E, H, F, false, act, x, counts);
    expect_close(y, want, block ? "interleaved:8" : "concatenated");
  }
}

TEST_F(Conventions, ConvertedGptOssRunsInGroupedMlpAsGptOssDoes) {
  TempDir dir;
  const int64_t E = 4, H = 40, F = 24, T = 37;
  const float alpha = 1.702f, limit = 7.0f;
  std::vector<float> gu = randn(rng, static_cast<size_t>(E * H * 2 * F), 0.6f);  // [E, H, 2F]
  std::vector<float> gub = randn(rng, static_cast<size_t>(E * 2 * F), 0.5f);
  std::vector<float> dp = randn(rng, static_cast<size_t>(E * F * H), 0.2f);  // [E, F, H]
  std::vector<float> dpb = randn(rng, static_cast<size_t>(E * H), 0.5f);
  gmoe::save_safetensors(dir / "oss.safetensors",
                         {{"model.layers.0.mlp.experts.gate_up_proj", f32_view(gu, {E, H, 2 * F})},
                          {"model.layers.0.mlp.experts.gate_up_proj_bias", f32_view(gub, {E, 2 * F})},
                          {"model.layers.0.mlp.experts.down_proj", f32_view(dp, {E, F, H})},
                          {"model.layers.0.mlp.experts.down_proj_bias", f32_view(dpb, {E, H})}});
  std::vector<int32_t> counts = {12, 0, 20, 5};
  std::vector<float> x = randn(rng, static_cast<size_t>(T * H), 1.5f);  // large enough to reach the clamp
  // gpt-oss's experts: gate_up = x @ gate_up_proj[e] + bias; gate, up = gate_up[..., ::2],
  // gate_up[..., 1::2]; gate = min(gate, limit); up = clamp(up, -limit, limit);
  // out = (up + 1) * gate * sigmoid(alpha * gate); y = out @ down_proj[e] + down_proj_bias[e].
  std::vector<double> want(static_cast<size_t>(T * H), 0.0);
  int clamped = 0;
  for (int64_t e = 0, row = 0; e < E; ++e) {
    for (int32_t n = 0; n < counts[static_cast<size_t>(e)]; ++n, ++row) {
      std::vector<double> out(static_cast<size_t>(F));
      for (int64_t j = 0; j < F; ++j) {
        double g = gub[e * 2 * F + 2 * j], u = gub[e * 2 * F + 2 * j + 1];
        for (int64_t i = 0; i < H; ++i) {
          g += double(x[row * H + i]) * gu[(e * H + i) * 2 * F + 2 * j];
          u += double(x[row * H + i]) * gu[(e * H + i) * 2 * F + 2 * j + 1];
        }
        clamped += g > limit || std::fabs(u) > limit;
        g = std::min(g, double(limit));
        u = std::max(std::min(u, double(limit)), -double(limit));
        out[j] = (u + 1) * g / (1 + std::exp(-alpha * g));
      }
      for (int64_t h = 0; h < H; ++h) {
        double s = dpb[e * H + h];
        for (int64_t j = 0; j < F; ++j) s += out[j] * dp[(e * F + j) * H + h];
        want[row * H + h] = s;
      }
    }
  }
  EXPECT_GT(clamped, 0) << "the inputs should reach the clamp";
  for (int64_t block : {0, 1}) {
    MoeConvertOptions o;
    o.convention = MoeConvention::gmoe;
    if (block) o.glu = GluFormat{GluLayout::interleaved, block};
    gmoe::convert_moe_checkpoint(dir / "oss.safetensors", dir / "g.safetensors", o);
    gmoe::ActivationOptions act;
    act.kind = gmoe::ActivationKind::clamped_swiglu;
    act.alpha = alpha;
    act.limit = limit;
    act.glu = o.glu.value_or(GluFormat{});
    const std::vector<float> y =
        run_grouped_mlp(dir / "g.safetensors", "model.layers.0.mlp.experts.", E, H, F, true, act, x, counts);
    expect_close(y, want, block ? "interleaved:1" : "concatenated");
  }
}

}  // namespace
}  // namespace gmoe_test
