// src/checkpoint/conventions.cpp — the MoE checkpoint conventions of Hugging Face models,
// Megatron-Core and gmoe: recognising them from key names and shapes, and converting between them
// (naming, stacked / per-expert, separate or fused gate/up in any interleave, [out, in] or
// [in, out], dtype).
//
// Every conversion goes through one picture of an expert: FC1 as 2F logical rows in [gate; up]
// order over H columns, FC2 as H rows over F columns. A source tensor is read, and a target tensor
// written, through a map from logical rows to its own stored rows (GLU layout, separate halves)
// and an orientation ([in, out] stores a logical row as a column). Values are moved, never
// recomputed, so a conversion is bit-exact unless a cast is asked for.
#include <algorithm>
#include <climits>
#include <cstring>
#include <set>

#include "checkpoint/internal.h"
#include "common/checked_math.h"
#include "common/float_convert.h"
#include "gmoe/checkpoint.h"
#include "gmoe/error.h"

namespace gmoe {

using namespace ckpt_detail;

const char* moe_convention_name(MoeConvention c) {
  switch (c) {
    case MoeConvention::gmoe: return "gmoe";
    case MoeConvention::mixtral: return "mixtral";
    case MoeConvention::qwen: return "qwen";
    case MoeConvention::deepseek: return "deepseek";
    case MoeConvention::gpt_oss: return "gpt-oss";
    case MoeConvention::megatron: return "megatron";
  }
  return "?";
}

MoeConvention moe_convention_from_string(const std::string& text) {
  const std::pair<const char*, MoeConvention> names[] = {
      {"gmoe", MoeConvention::gmoe},         {"mixtral", MoeConvention::mixtral},
      {"qwen", MoeConvention::qwen},         {"qwen2-moe", MoeConvention::qwen},
      {"qwen3-moe", MoeConvention::qwen},    {"olmoe", MoeConvention::qwen},
      {"deepseek", MoeConvention::deepseek}, {"deepseek-v2", MoeConvention::deepseek},
      {"deepseek-v3", MoeConvention::deepseek}, {"gpt-oss", MoeConvention::gpt_oss},
      {"gpt_oss", MoeConvention::gpt_oss},   {"megatron", MoeConvention::megatron},
      {"mcore", MoeConvention::megatron}};
  for (const auto& n : names) {
    if (text == n.first) return n.second;
  }
  GMOE_FAIL("unknown convention '", text,
            "': expected gmoe, mixtral, qwen (also qwen2-moe, qwen3-moe, olmoe), deepseek, gpt-oss "
            "or megatron");
}

const char* weight_orientation_name(WeightOrientation o) {
  return o == WeightOrientation::out_in ? "[out, in]" : "[in, out]";
}

const char* moe_tensor_role_name(MoeTensorRole r) {
  switch (r) {
    case MoeTensorRole::fc1: return "fc1";
    case MoeTensorRole::gate: return "gate";
    case MoeTensorRole::up: return "up";
    case MoeTensorRole::fc2: return "fc2";
    case MoeTensorRole::fc1_bias: return "fc1_bias";
    case MoeTensorRole::gate_bias: return "gate_bias";
    case MoeTensorRole::up_bias: return "up_bias";
    case MoeTensorRole::fc2_bias: return "fc2_bias";
  }
  return "?";
}

namespace {

bool is_bias(MoeTensorRole r) {
  return r == MoeTensorRole::fc1_bias || r == MoeTensorRole::gate_bias ||
         r == MoeTensorRole::up_bias || r == MoeTensorRole::fc2_bias;
}

bool starts_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

// ---- the conventions ------------------------------------------------------------------------

struct RoleName {
  MoeTensorRole role;
  const char* name;
};

// One convention's names. Keys are `<module>experts.<e>.<name>` (index component) or
// `<module>experts.<name><e>` (attached index); the stacked key drops the index.
struct Spec {
  MoeConvention conv;
  const char* module;           // the MoE block's module under its layer
  bool attached;                // the expert index is appended to the last component
  std::vector<RoleName> names;  // expert tensors
  ExpertLayout layout;          // defaults when converting into this convention
  bool separate;
  GluFormat glu;
  WeightOrientation orientation;
  const char* router_weight;  // under the block's module; nullptr: the convention has none
  const char* router_bias;
  const char* score_bias;
  const char* shared;       // shared experts' module ("shared_expert.")
  bool shared_fused;        // shared expert FC1 as one [gate; up] weight (linear_fc1)
  const char* shared_gate;  // the shared expert's gate weight, under the block's module
};

const std::vector<Spec>& specs() {
  using R = MoeTensorRole;
  const GluFormat concat{GluLayout::concatenated, 1};
  const std::vector<RoleName> hf = {
      {R::gate, "gate_proj.weight"},     {R::up, "up_proj.weight"},
      {R::fc2, "down_proj.weight"},      {R::fc1, "gate_up_proj.weight"},
      {R::gate_bias, "gate_proj.bias"},  {R::up_bias, "up_proj.bias"},
      {R::fc2_bias, "down_proj.bias"},   {R::fc1_bias, "gate_up_proj.bias"}};
  static const std::vector<Spec> all = {
      {MoeConvention::gmoe, "mlp.", true,
       {{R::fc1, "fc1.weight"}, {R::fc2, "fc2.weight"}, {R::fc1_bias, "fc1.bias"}, {R::fc2_bias, "fc2.bias"}},
       ExpertLayout::stacked, false, concat, WeightOrientation::out_in, "router.weight", "router.bias",
       "router.expert_bias", nullptr, false, nullptr},
      {MoeConvention::mixtral, "block_sparse_moe.", false,
       {{R::gate, "w1.weight"}, {R::up, "w3.weight"}, {R::fc2, "w2.weight"}},
       ExpertLayout::per_expert, true, concat, WeightOrientation::out_in, "gate.weight", nullptr, nullptr,
       nullptr, false, nullptr},
      {MoeConvention::qwen, "mlp.", false, hf, ExpertLayout::per_expert, true, concat,
       WeightOrientation::out_in, "gate.weight", "gate.bias", "gate.e_score_correction_bias",
       "shared_expert.", false, "shared_expert_gate.weight"},
      {MoeConvention::deepseek, "mlp.", false, hf, ExpertLayout::per_expert, true, concat,
       WeightOrientation::out_in, "gate.weight", "gate.bias", "gate.e_score_correction_bias",
       "shared_experts.", false, nullptr},
      {MoeConvention::gpt_oss, "mlp.", false,
       {{R::fc1, "gate_up_proj"}, {R::fc1_bias, "gate_up_proj_bias"}, {R::fc2, "down_proj"},
        {R::fc2_bias, "down_proj_bias"}},
       ExpertLayout::stacked, false, GluFormat{GluLayout::interleaved, 1}, WeightOrientation::in_out,
       "router.weight", "router.bias", nullptr, nullptr, false, nullptr},
      {MoeConvention::megatron, "mlp.", true,
       {{R::fc1, "linear_fc1.weight"}, {R::fc2, "linear_fc2.weight"}, {R::fc1_bias, "linear_fc1.bias"},
        {R::fc2_bias, "linear_fc2.bias"}},
       ExpertLayout::per_expert, false, concat, WeightOrientation::out_in, "router.weight", "router.bias",
       "router.expert_bias", "shared_experts.", true, "shared_experts.gate_weight"},
  };
  return all;
}

const Spec& spec_of(MoeConvention c) {
  for (const Spec& s : specs()) {
    if (s.conv == c) return s;
  }
  GMOE_FAIL("no such convention");
}

const char* name_of(const Spec& s, MoeTensorRole r) {
  for (const RoleName& n : s.names) {
    if (n.role == r) return n.name;
  }
  return nullptr;
}

ExpertParamKey key_for(const Spec& s, const std::string& experts, const char* name) {
  return s.attached ? ExpertParamKey{experts + name, ""} : ExpertParamKey{experts, std::string(".") + name};
}

// The canonical decimal index at the end of `s` (no leading zeros, at most 18 digits): its
// length, 0 when there is none.
size_t trailing_index(const std::string& s, size_t end) {
  size_t b = end;
  while (b > 0 && s[b - 1] >= '0' && s[b - 1] <= '9') --b;
  const size_t n = end - b;
  if (n == 0 || n > 18 || (n > 1 && s[b] == '0')) return 0;
  return n;
}

// `experts` is a valid experts prefix: ends with the component "experts." (or, for gmoe, any
// prefix ending with a dot, or nothing).
bool experts_prefix_ok(const std::string& b, bool any) {
  if (any) return b.empty() || b.back() == '.';
  return ends_with(b, "experts.") && (b.size() == 8 || b[b.size() - 9] == '.');
}

struct Group {
  ExpertParamKey key;
  bool stacked = false;
  std::map<int64_t, std::string> experts;
  std::vector<std::string> keys;
};

// a == 2b, without overflow for the huge sizes a zero-element tensor may claim.
bool is_twice(int64_t a, int64_t b) { return b >= 0 && b <= INT64_MAX / 2 && a == 2 * b; }

// The metadata entry naming a fused FC1's gate/up layout where the keys do not tell it.
constexpr const char* kGluMetadata = "gmoe.fc1_glu";

struct Candidate {
  std::map<MoeTensorRole, Group> roles;
};

// Matches `k` against one name of a spec: fills the experts prefix, the role's key and the index
// (-1 stacked). False when it does not match.
bool match(const std::string& k, const Spec& s, const RoleName& n, std::string* experts,
           ExpertParamKey* key, int64_t* index) {
  const std::string name = n.name;
  const bool any = s.conv == MoeConvention::gmoe;
  if (s.attached) {
    const size_t digits = trailing_index(k, k.size());
    const std::string base = k.substr(0, k.size() - digits);
    if (!ends_with(base, name)) return false;
    *experts = base.substr(0, base.size() - name.size());
    if (!experts_prefix_ok(*experts, any)) return false;
    *key = ExpertParamKey{*experts + name, ""};
    *index = digits ? std::stoll(k.substr(k.size() - digits)) : -1;
    return true;
  }
  if (!ends_with(k, name) || k.size() == name.size() || k[k.size() - name.size() - 1] != '.') {
    return false;
  }
  const std::string rest = k.substr(0, k.size() - name.size());  // ends with '.'
  if (experts_prefix_ok(rest, false)) {
    *experts = rest;
    *key = ExpertParamKey{rest, "." + name};
    *index = -1;
    return true;
  }
  const size_t digits = trailing_index(rest, rest.size() - 1);
  if (digits == 0) return false;
  const std::string b = rest.substr(0, rest.size() - 1 - digits);
  if (!experts_prefix_ok(b, false)) return false;
  *experts = b;
  *key = ExpertParamKey{b, "." + name};
  *index = std::stoll(rest.substr(b.size(), digits));
  return true;
}

// The layer prefix ("model.layers.3.") and index of a module path; "" and -1 when it has none.
void find_layer(const std::string& module, std::string* prefix, int64_t* layer) {
  *prefix = "";
  *layer = -1;
  size_t pos = 0;
  while ((pos = module.find("layers.", pos)) != std::string::npos) {
    if (pos == 0 || module[pos - 1] == '.') {
      const size_t b = pos + 7;
      size_t e = b;
      while (e < module.size() && module[e] >= '0' && module[e] <= '9') ++e;
      if (e > b && e - b <= 18 && e < module.size() && module[e] == '.') {
        *prefix = module.substr(0, e + 1);
        *layer = std::stoll(module.substr(b, e - b));
      }
    }
    pos += 7;
  }
}

// Builds a block from its candidate; returns the problem, "" when consistent.
std::string build_block(const Checkpoint& ckpt, const Spec& s, const std::string& experts,
                        Candidate& c, const GluFormat* fused_glu, MoeBlock* b) {
  using R = MoeTensorRole;
  b->experts = experts;
  b->module = experts;
  if (ends_with(experts, "experts.")) b->module = experts.substr(0, experts.size() - 8);
  find_layer(b->module, &b->layer_prefix, &b->layer);
  for (auto& kv : c.roles) {
    MoeExpertTensor t;
    t.role = kv.first;
    t.key = kv.second.key;
    t.keys = kv.second.keys;
    const std::string p = check_param(ckpt, t.key, kv.second.stacked, kv.second.experts, -1, &t.info);
    if (!p.empty()) return "'" + t.key.stacked_key() + "': " + p;
    const size_t want = is_bias(t.role) ? 1 : 2;
    if (t.info.expert_shape.size() != want) {
      return "'" + t.key.stacked_key() + "': experts of shape " + shape_string(t.info.expert_shape) +
             ", expected a " + (want == 1 ? "vector" : "matrix") + " per expert";
    }
    b->tensors.push_back(t);
  }
  auto find = [&](R r) -> MoeExpertTensor* {
    for (MoeExpertTensor& t : b->tensors) {
      if (t.role == r) return &t;
    }
    return nullptr;
  };
  MoeExpertTensor *fc1 = find(R::fc1), *gate = find(R::gate), *up = find(R::up), *fc2 = find(R::fc2);
  const std::string where = "experts '" + experts + "'";
  if (fc2 == nullptr) return where + ": no FC2 (down projection) weight";
  // An up projection with no gate anywhere is the FC1 of an ungated MLP (squared-ReLU experts:
  // `up_proj` and `down_proj`, as Nemotron-H names them); it must then have F rows (checked below).
  const bool ungated_up = fc1 == nullptr && gate == nullptr && up != nullptr && find(R::gate_bias) == nullptr;
  if (ungated_up) {
    up->role = R::fc1;
    if (MoeExpertTensor* up_bias = find(R::up_bias)) up_bias->role = R::fc1_bias;
    fc1 = up;
    up = nullptr;
  }
  if (fc1 != nullptr && (gate != nullptr || up != nullptr)) {
    return where + ": both a fused gate/up weight and separate gate/up weights";
  }
  if (fc1 == nullptr && (gate == nullptr || up == nullptr)) {
    return where + ": " + (gate ? "a gate weight without its up weight" : up ? "an up weight without its gate weight"
                                                                               : "no FC1 (gate/up) weight");
  }
  b->num_experts = fc2->info.num_experts;
  for (const MoeExpertTensor& t : b->tensors) {
    if (t.info.num_experts != b->num_experts) {
      return where + ": '" + t.key.stacked_key() + "' holds " + std::to_string(t.info.num_experts) +
             " experts, '" + fc2->key.stacked_key() + "' " + std::to_string(b->num_experts);
    }
  }
  const std::vector<int64_t>& s2 = fc2->info.expert_shape;
  b->separate_gate_up = fc1 == nullptr;
  if (b->separate_gate_up) {
    if (gate->info.expert_shape != up->info.expert_shape || gate->info.dtype_code != up->info.dtype_code) {
      return where + ": gate '" + gate->key.stacked_key() + "' is " + gate->info.dtype_code +
             shape_string(gate->info.expert_shape) + " but up '" + up->key.stacked_key() + "' is " +
             up->info.dtype_code + shape_string(up->info.expert_shape);
    }
    // [F, H] with [H, F], or both transposed: the same test; the shapes cannot tell orientation.
    const std::vector<int64_t>& g = gate->info.expert_shape;
    if (g[0] != s2[1] || g[1] != s2[0]) {
      return where + ": gate experts " + shape_string(g) + " and FC2 experts " + shape_string(s2) +
             " do not fit gate [F, H] with FC2 [H, F] (or both transposed)";
    }
    const WeightOrientation o = s.orientation;
    b->hidden = o == WeightOrientation::out_in ? g[1] : g[0];
    b->ffn = o == WeightOrientation::out_in ? g[0] : g[1];
    b->gated = true;
    for (MoeExpertTensor& t : b->tensors) t.orientation = o;
  } else {
    const std::vector<int64_t>& s1 = fc1->info.expert_shape;
    // out_in: fc1 [R, H], fc2 [H, F]; in_out: fc1 [H, R], fc2 [F, H]; R = 2F (gated) or F.
    const bool fits_oi = s1[1] == s2[0] && (is_twice(s1[0], s2[1]) || s1[0] == s2[1]);
    const bool fits_io = s1[0] == s2[1] && (is_twice(s1[1], s2[0]) || s1[1] == s2[0]);
    if (!fits_oi && !fits_io) {
      return where + ": FC1 experts " + shape_string(s1) + " and FC2 experts " + shape_string(s2) +
             " fit neither [out, in] (FC1 [2F, H], FC2 [H, F]) nor [in, out] (FC1 [H, 2F], FC2 [F, H])";
    }
    const WeightOrientation o = fits_oi && fits_io ? s.orientation
                                : fits_oi          ? WeightOrientation::out_in
                                                   : WeightOrientation::in_out;
    b->hidden = o == WeightOrientation::out_in ? s2[0] : s2[1];
    b->ffn = o == WeightOrientation::out_in ? s2[1] : s2[0];
    const int64_t rows = o == WeightOrientation::out_in ? s1[0] : s1[1];
    b->gated = is_twice(rows, b->ffn) && b->ffn > 0;
    if (ungated_up && rows != b->ffn) {
      return where + ": an up weight without its gate weight, and with " + std::to_string(rows) +
             " outputs, not F = " + std::to_string(b->ffn) + " (an ungated MLP's up projection)";
    }
    for (MoeExpertTensor& t : b->tensors) t.orientation = o;
  }
  GluFormat glu = s.glu;
  if (fused_glu) {
    glu = *fused_glu;
  } else if (s.conv != MoeConvention::gpt_oss && ckpt.metadata().count(kGluMetadata)) {
    // Written by convert_moe_checkpoint where the keys cannot tell (see there).
    const std::string& text = ckpt.metadata().at(kGluMetadata);
    try {
      glu = glu_format_from_string(text);
    } catch (const Error&) {
      return "metadata " + std::string(kGluMetadata) + " = '" + text + "' is not a gate/up layout";
    }
  }
  const int64_t R1 = b->gated ? 2 * b->ffn : b->ffn;
  for (MoeExpertTensor& t : b->tensors) {
    if (t.role == R::fc1 || t.role == R::fc1_bias) t.glu = glu;
    int64_t want = 0;
    switch (t.role) {
      case R::fc1_bias: want = R1; break;
      case R::gate_bias:
      case R::up_bias: want = b->ffn; break;
      case R::fc2_bias: want = b->hidden; break;
      default: continue;
    }
    if (t.info.expert_shape[0] != want) {
      return where + ": bias '" + t.key.stacked_key() + "' has experts of shape " +
             shape_string(t.info.expert_shape) + ", expected [" + std::to_string(want) + "]";
    }
  }
  if (b->separate_gate_up && (find(R::fc1_bias) != nullptr)) return where + ": a fused FC1 bias with separate gate/up weights";
  if (!b->separate_gate_up && (find(R::gate_bias) || find(R::up_bias))) {
    return where + ": separate gate/up biases with a fused FC1 weight";
  }
  if ((find(R::gate_bias) == nullptr) != (find(R::up_bias) == nullptr)) {
    return where + ": a gate bias without an up bias or the reverse";
  }
  if (b->gated && glu.layout == GluLayout::interleaved && (glu.block <= 0 || b->ffn % glu.block != 0)) {
    return where + ": gate/up interleave block " + std::to_string(glu.block) + " does not divide F = " +
           std::to_string(b->ffn);
  }
  std::sort(b->tensors.begin(), b->tensors.end(),
            [](const MoeExpertTensor& x, const MoeExpertTensor& y) { return x.role < y.role; });
  // Router and shared experts beside the experts, whichever convention names them.
  const std::pair<const char*, const char*> router[] = {
      {"gate.weight", "router.weight"},
      {"router.weight", "router.weight"},
      {"gate.bias", "router.bias"},
      {"router.bias", "router.bias"},
      {"gate.e_score_correction_bias", "score_correction_bias"},
      {"router.expert_bias", "score_correction_bias"},
      {"router.e_score_correction_bias", "score_correction_bias"}};
  for (const auto& r : router) {
    if (ckpt.contains(b->module + r.first)) b->router[r.second] = b->module + r.first;
  }
  const std::pair<const char*, const char*> shared[] = {
      {"shared_expert.gate_proj.weight", "gate"},   {"shared_expert.up_proj.weight", "up"},
      {"shared_expert.down_proj.weight", "fc2"},    {"shared_expert_gate.weight", "gate_weight"},
      {"shared_experts.gate_proj.weight", "gate"},  {"shared_experts.up_proj.weight", "up"},
      {"shared_experts.down_proj.weight", "fc2"},   {"shared_experts.linear_fc1.weight", "fc1"},
      {"shared_experts.linear_fc2.weight", "fc2"},  {"shared_experts.gate_weight", "gate_weight"}};
  for (const auto& r : shared) {
    if (ckpt.contains(b->module + r.first)) b->shared[r.second] = b->module + r.first;
  }
  return "";
}

}  // namespace

MoeCheckpointInfo recognise_moe_checkpoint(const Checkpoint& ckpt, const GluFormat* fused_glu) {
  MoeCheckpointInfo out;
  // (convention, experts prefix) → the tensors found there.
  std::map<std::pair<int, std::string>, Candidate> cands;
  for (const std::string& k : ckpt.keys()) {
    if (ends_with(k, "experts.gate_up_proj_blocks") || ends_with(k, "experts.gate_up_proj_scales")) {
      out.problems.push_back("'" + k + "': MXFP4-quantized experts (gpt-oss *_blocks / *_scales) are not " +
                             "read; dequantize them to bf16 first");
    }
    const SafetensorsEntry& entry = ckpt.entry(k);
    for (const Spec& s : specs()) {
      if (s.conv == MoeConvention::deepseek) continue;  // the names of qwen; told apart below
      for (const RoleName& n : s.names) {
        std::string experts;
        ExpertParamKey key;
        int64_t index = -1;
        if (!match(k, s, n, &experts, &key, &index)) continue;
        // Shapes decide too: a stacked weight is [E, a, b], one expert's [a, b]; a bias one rank
        // less. A dense `fc1.weight` [out, in] is no expert tensor.
        const size_t rank = (is_bias(n.role) ? 1 : 2) + (index < 0 ? 1 : 0);
        if (entry.shape.size() != rank) continue;
        Group& g = cands[{static_cast<int>(s.conv), experts}].roles[n.role];
        g.key = key;
        g.keys.push_back(k);
        if (index < 0) {
          g.stacked = true;
        } else {
          g.experts[index] = k;
        }
      }
    }
  }
  std::set<int> convs;
  for (auto& kv : cands) {
    const Spec& s = spec_of(static_cast<MoeConvention>(kv.first.first));
    // gmoe's names are generic (fc1/fc2 under any prefix): a group without FC2 is not a block.
    if (s.conv == MoeConvention::gmoe && !kv.second.roles.count(MoeTensorRole::fc2)) continue;
    MoeBlock b;
    const std::string problem = build_block(ckpt, s, kv.first.second, kv.second, fused_glu, &b);
    if (!problem.empty()) {
      out.problems.push_back(std::string(moe_convention_name(s.conv)) + " naming: " + problem);
      continue;
    }
    convs.insert(kv.first.first);
    out.blocks.push_back(std::move(b));
  }
  if (convs.size() > 1) {
    std::string names;
    for (int c : convs) names += (names.empty() ? "" : ", ") + std::string(moe_convention_name(static_cast<MoeConvention>(c)));
    out.problems.push_back("MoE blocks of several conventions in one checkpoint: " + names);
    return out;
  }
  if (convs.empty()) return out;
  std::sort(out.blocks.begin(), out.blocks.end(), [](const MoeBlock& x, const MoeBlock& y) {
    if (x.layer != y.layer) return x.layer < y.layer;
    return natural_less(x.experts, y.experts);
  });
  out.recognised = out.problems.empty();
  out.convention = static_cast<MoeConvention>(*convs.begin());
  bool shared_plural = false, shared_single = false, score = false, stacked = false;
  for (const MoeBlock& b : out.blocks) {
    for (const auto& kv : b.shared) {
      (kv.second.find("shared_experts.") != std::string::npos ? shared_plural : shared_single) = true;
    }
    score = score || b.router.count("score_correction_bias");
    for (const MoeExpertTensor& t : b.tensors) stacked = stacked || t.info.layout == ExpertLayout::stacked;
  }
  switch (out.convention) {
    case MoeConvention::gmoe: out.family = "gmoe GroupedMLP state_dict"; break;
    case MoeConvention::mixtral: out.family = "Mixtral"; break;
    case MoeConvention::qwen:
      // The shared experts' module names the family first (DeepSeek: shared_experts, Qwen2:
      // shared_expert); without shared experts the router's correction bias marks DeepSeek-V3.
      if (shared_plural || (score && !shared_single)) {
        out.convention = MoeConvention::deepseek;
        out.family = score ? "DeepSeek-V3" : "DeepSeek-V2";
      } else {
        out.family = shared_single ? "Qwen2-MoE" : "Qwen3-MoE / OLMoE";
      }
      break;
    case MoeConvention::deepseek: out.family = "DeepSeek"; break;
    case MoeConvention::gpt_oss: out.family = "gpt-oss"; break;
    case MoeConvention::megatron:
      out.family = stacked ? "Megatron-Core, TE grouped linear (single grouped weight)"
                           : "Megatron-Core, TE grouped linear";
      break;
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// conversion

namespace {

// A matrix of `rows` logical rows of `cols` elements, stored row-major, or transposed ([cols, rows]).
struct Mat {
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  int64_t rows = 0;
  bool transposed = false;
};

template <typename T>
void copy_elems(const uint8_t* s, int64_t s_step, uint8_t* d, int64_t d_step, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, s + i * s_step * static_cast<int64_t>(sizeof(T)), sizeof(T));
    std::memcpy(d + i * d_step * static_cast<int64_t>(sizeof(T)), &v, sizeof(T));
  }
}

// Logical row sr of s into logical row dr of d (cols elements of es bytes).
void copy_row(const Mat& s, int64_t sr, const Mat& d, int64_t dr, int64_t cols, int64_t es) {
  const uint8_t* sp = s.src + (s.transposed ? sr : sr * cols) * es;
  uint8_t* dp = d.dst + (d.transposed ? dr : dr * cols) * es;
  const int64_t ss = s.transposed ? s.rows : 1, ds = d.transposed ? d.rows : 1;
  if (ss == 1 && ds == 1) {
    std::memcpy(dp, sp, static_cast<size_t>(cols * es));
    return;
  }
  switch (es) {
    case 1: copy_elems<uint8_t>(sp, ss, dp, ds, cols); break;
    case 2: copy_elems<uint16_t>(sp, ss, dp, ds, cols); break;
    case 4: copy_elems<uint32_t>(sp, ss, dp, ds, cols); break;
    case 8: copy_elems<uint64_t>(sp, ss, dp, ds, cols); break;
    default:
      for (int64_t i = 0; i < cols; ++i) std::memcpy(dp + i * ds * es, sp + i * ss * es, static_cast<size_t>(es));
  }
}

bool is_float_code(const std::string& c) { return c == "F32" || c == "BF16" || c == "F16"; }

DType dtype_of_code(const std::string& c) {
  return c == "F32" ? DType::f32 : c == "BF16" ? DType::bf16 : DType::f16;
}

// The bytes of `n` elements of float code `from` cast to `to`.
std::vector<uint8_t> cast_bytes(const uint8_t* p, uint64_t nbytes, const std::string& from, DType to) {
  const DType f = dtype_of_code(from);
  const int64_t n = static_cast<int64_t>(nbytes / dtype_size(f));
  std::vector<uint8_t> out(static_cast<size_t>(n) * dtype_size(to));
  for (int64_t i = 0; i < n; ++i) store_float(out.data(), to, i, load_float(p, f, i));
  return out;
}

// Emits `bytes` to `sink`, cast when asked and the code is a float one.
void emit(const uint8_t* p, uint64_t n, const std::string& code, const std::optional<DType>& cast,
          const ByteSink& sink) {
  if (cast && is_float_code(code) && dtype_of_code(code) != *cast) {
    // Bounded pieces, so a large tensor never needs a second copy of itself.
    const uint64_t es = dtype_size(dtype_of_code(code)), piece = es * (16u << 20);
    for (uint64_t o = 0; o < n; o += piece) {
      const std::vector<uint8_t> c = cast_bytes(p + o, std::min(piece, n - o), code, *cast);
      sink(c.data(), c.size());
    }
    return;
  }
  for (uint64_t o = 0; o < n; o += (64u << 20)) sink(p + o, std::min<uint64_t>(n - o, 64u << 20));
}

std::string code_after_cast(const std::string& code, const std::optional<DType>& cast) {
  return cast && is_float_code(code) ? safetensors_dtype_code(*cast) : code;
}

std::string display(const MoeExpertTensor& t) {
  if (t.info.layout == ExpertLayout::stacked) return t.key.stacked_key();
  return t.key.stem + "{0.." + std::to_string(t.info.num_experts - 1) + "}" + t.key.suffix;
}

std::string glu_words(bool separate, const GluFormat& g) {
  return separate ? "separate gate/up" : "gate/up " + glu_format_name(g);
}

// Maps a layer prefix between the Hugging Face (`model.layers.L.`) and Megatron
// (`[module.]decoder.layers.L.`) model roots; anything else is kept.
std::string map_layer_prefix(const std::string& p, MoeConvention from, MoeConvention to) {
  const bool from_m = from == MoeConvention::megatron, to_m = to == MoeConvention::megatron;
  if (from_m == to_m) return p;
  if (to_m && starts_with(p, "model.layers.")) return "decoder." + p.substr(6);
  std::string q = p;
  if (from_m && starts_with(q, "module.")) q = q.substr(7);
  if (from_m && starts_with(q, "decoder.layers.")) return "model." + q.substr(8);
  return q;
}

// The target form of one block.
struct Target {
  const Spec* spec;
  std::string module, experts;
  ExpertLayout layout;
  bool separate;
  GluFormat glu;
  WeightOrientation orientation;
};

struct PlanItem {
  ConvertPlanEntry entry;
  std::vector<RawTensor> raw;
};

}  // namespace

std::vector<ConvertPlanEntry> convert_moe_checkpoint(const std::string& in, const std::string& out,
                                                     const MoeConvertOptions& o) {
  using R = MoeTensorRole;
  const Checkpoint ckpt = Checkpoint::open(in);
  const GluFormat* glu_from = o.glu_from ? &*o.glu_from : nullptr;
  const MoeCheckpointInfo info = recognise_moe_checkpoint(ckpt, glu_from);
  GMOE_CHECK(info.problems.empty(), in, ": cannot convert: ", join_limited(info.problems, 20));
  GMOE_CHECK(info.recognised, in, ": no MoE expert weights of a known convention found (gmoe, ",
             "Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss, Megatron-Core); `gmoe-ckpt ",
             "inspect` lists the keys; --scope/--param convert keys of other names");
  if (o.cast) {
    GMOE_CHECK(*o.cast == DType::f32 || *o.cast == DType::bf16 || *o.cast == DType::f16,
               "cast: expected f32, bf16 or f16, got ", dtype_name(*o.cast));
  }
  if (!o.dry_run) check_output_not_input(ckpt, out, o.allow_overwrite_input);
  const MoeConvention src_conv = info.convention;
  const MoeConvention dst_conv = o.convention.value_or(src_conv);
  const Spec& ts = spec_of(dst_conv);
  const bool same = dst_conv == src_conv;
  const std::string tname = moe_convention_name(dst_conv);

  std::vector<PlanItem> plan;
  std::set<std::string> claimed;
  std::set<std::string> fused_glus;  // the gate/up layouts of the fused FC1s written
  for (const MoeBlock& b : info.blocks) {
    for (const MoeExpertTensor& t : b.tensors) claimed.insert(t.keys.begin(), t.keys.end());
    const MoeExpertTensor* src[8] = {};
    for (const MoeExpertTensor& t : b.tensors) src[static_cast<int>(t.role)] = &t;
    const MoeExpertTensor& fc2 = *src[static_cast<int>(R::fc2)];
    Target tg;
    tg.spec = &ts;
    if (same) {
      tg.module = b.module;
      tg.experts = b.experts;
    } else {
      tg.module = map_layer_prefix(b.layer_prefix, src_conv, dst_conv) + ts.module;
      tg.experts = tg.module + "experts.";
    }
    tg.layout = o.layout.value_or(same ? fc2.info.layout : ts.layout);
    tg.separate = b.gated && o.separate_gate_up.value_or(same ? b.separate_gate_up : ts.separate);
    const GluFormat src_glu = b.separate_gate_up ? ts.glu : src[static_cast<int>(R::fc1)]->glu;
    tg.glu = o.glu.value_or(same && !b.separate_gate_up ? src_glu : ts.glu);
    tg.orientation = o.orientation.value_or(same ? fc2.orientation : ts.orientation);
    const std::string where = in + ": experts '" + b.experts + "'";
    GMOE_CHECK(b.gated || !o.separate_gate_up.value_or(false), where,
               ": FC1 is not gated (its rows are F = ", b.ffn, ", not 2F): there is no gate and up to separate");
    GMOE_CHECK(!(tg.orientation == WeightOrientation::in_out &&
                 (dst_conv == MoeConvention::gmoe || dst_conv == MoeConvention::megatron)),
               where, ": ", tname, " stores expert weights [out, in]; --orientation in-out is not one of its forms");
    const int64_t E = b.num_experts, H = b.hidden, F = b.ffn, R1 = b.gated ? 2 * F : F;
    if (b.gated && !tg.separate) fused_glus.insert(glu_format_name(tg.glu));
    if (!tg.separate && b.gated && tg.glu.layout == GluLayout::interleaved) {
      GMOE_CHECK(tg.glu.block > 0 && F % tg.glu.block == 0, where, ": gate/up interleave block ",
                 tg.glu.block, " does not divide F = ", F);
    }
    if (tg.layout == ExpertLayout::per_expert) {
      GMOE_CHECK(E > 0, where, ": 0 experts: the per-expert layout has no key to hold them; keep the stacked layout");
      // Each per-expert tensor takes more than a few dozen bytes of header: a count no header
      // can hold (2^40 empty stacked experts) is refused before any per-expert work.
      constexpr int64_t kMinHeaderEntry = 48;
      const int64_t key_bytes = static_cast<int64_t>(tg.experts.size()) + 24 + kMinHeaderEntry;
      GMOE_CHECK(E <= static_cast<int64_t>(kMaxSafetensorsHeaderBytes) / key_bytes, where, ": ", E,
                 " per-expert tensors cannot fit a safetensors header (at most ", kMaxSafetensorsHeaderBytes,
                 " bytes); keep the stacked layout");
    }
    // The target tensors: role, and which source roles feed it.
    struct Out {
      R role;
      bool weight;
      bool fc1_like;
    };
    std::vector<Out> outs;
    const bool has_bias1 = src[static_cast<int>(R::fc1_bias)] || src[static_cast<int>(R::gate_bias)];
    if (tg.separate) {
      outs.push_back({R::gate, true, true});
      outs.push_back({R::up, true, true});
    } else {
      outs.push_back({R::fc1, true, true});
    }
    outs.push_back({R::fc2, true, false});
    if (has_bias1) {
      if (tg.separate) {
        outs.push_back({R::gate_bias, false, true});
        outs.push_back({R::up_bias, false, true});
      } else {
        outs.push_back({R::fc1_bias, false, true});
      }
    }
    if (src[static_cast<int>(R::fc2_bias)]) outs.push_back({R::fc2_bias, false, false});

    for (const Out& ot : outs) {
      // An ungated FC1 is the up projection where the convention stores gate and up separately.
      const bool up_named = !b.gated && ts.separate && (ot.role == R::fc1 || ot.role == R::fc1_bias);
      const char* name = name_of(ts, up_named ? (ot.weight ? R::up : R::up_bias) : ot.role);
      GMOE_CHECK(name != nullptr, where, ": ", tname, " naming has no key for ", moe_tensor_role_name(ot.role),
                 ot.role == R::gate || ot.role == R::up
                     ? " (it stores gate and up fused: leave --gate-up as it is, or pick another --to)"
                 : ot.role == R::fc1 ? " (it stores gate and up separately: --gate-up separate)"
                                     : " (its experts have no biases)");
      const ExpertParamKey key = key_for(ts, tg.experts, name);
      // Sources: for FC1-like targets the separate gate/up or the fused FC1 (weights or biases).
      const MoeExpertTensor* s_fc1 = src[static_cast<int>(ot.weight ? R::fc1 : R::fc1_bias)];
      const MoeExpertTensor* s_gate = src[static_cast<int>(ot.weight ? R::gate : R::gate_bias)];
      const MoeExpertTensor* s_up = src[static_cast<int>(ot.weight ? R::up : R::up_bias)];
      const MoeExpertTensor* s_fc2 = src[static_cast<int>(ot.weight ? R::fc2 : R::fc2_bias)];
      const MoeExpertTensor* first = ot.fc1_like ? (b.separate_gate_up ? s_gate : s_fc1) : s_fc2;
      const std::string code = first->info.dtype_code;
      const int64_t es = safetensors_code_size(code);
      GMOE_CHECK(es > 0, where, ": '", first->key.stacked_key(), "' has dtype ", code,
                 ", which is not byte-sized: it can be copied but not converted");
      const bool half = ot.role == R::gate || ot.role == R::up || ot.role == R::gate_bias || ot.role == R::up_bias;
      const int64_t rows = ot.fc1_like ? (half ? F : R1) : H;
      const int64_t cols = ot.weight ? (ot.fc1_like ? H : F) : 1;
      const bool dst_t = ot.weight && tg.orientation == WeightOrientation::in_out;
      std::vector<int64_t> eshape = ot.weight ? (dst_t ? std::vector<int64_t>{cols, rows} : std::vector<int64_t>{rows, cols})
                                              : std::vector<int64_t>{rows};
      const uint64_t out_bytes = static_cast<uint64_t>(checked_mul(checked_mul(rows, cols, "expert"), es, "expert"));
      // Source pointers of expert e.
      const Checkpoint c = ckpt;
      auto ptr = [c](const MoeExpertTensor* t, int64_t e) -> const uint8_t* {
        if (t->info.layout == ExpertLayout::per_expert) return c.bytes(t->key.expert_key(e));
        int64_t n = safetensors_code_size(t->info.dtype_code);
        for (int64_t d : t->info.expert_shape) n *= d;
        return c.bytes(t->key.stacked_key()) + static_cast<uint64_t>(e) * static_cast<uint64_t>(n);
      };
      const bool src_t = ot.weight && fc2.orientation == WeightOrientation::in_out;
      const bool gated = b.gated, sep_src = b.separate_gate_up, fc1_like = ot.fc1_like;
      const GluFormat sg = src_glu, dg = tg.glu;
      const R role = ot.role;
      const MoeExpertTensor *pg = s_gate, *pu = s_up, *pf = s_fc1, *p2 = s_fc2;
      auto build = [=](int64_t e, std::vector<uint8_t>& buf) {
        buf.resize(out_bytes);
        if (out_bytes == 0) return;  // no work for empty experts, however many rows they claim
        const Mat d{nullptr, buf.data(), rows, dst_t};
        if (!fc1_like) {
          const Mat s{ptr(p2, e), nullptr, rows, src_t};
          for (int64_t r = 0; r < rows; ++r) copy_row(s, r, d, r, cols, es);
          return;
        }
        const Mat sgm = sep_src ? Mat{ptr(pg, e), nullptr, F, src_t} : Mat{};
        const Mat sum = sep_src ? Mat{ptr(pu, e), nullptr, F, src_t} : Mat{};
        const Mat sf = sep_src ? Mat{} : Mat{ptr(pf, e), nullptr, R1, src_t};
        for (int64_t cr = 0; cr < R1; ++cr) {
          const int64_t h = gated ? cr / F : 0, j = gated ? cr % F : cr;
          if ((role == R::gate || role == R::gate_bias) && h != 0) continue;
          if ((role == R::up || role == R::up_bias) && h != 1) continue;
          const int64_t dr = half ? j : gated ? glu_row(dg, h, j, F) : cr;
          if (sep_src) {
            copy_row(h ? sum : sgm, j, d, dr, cols, es);
          } else {
            copy_row(sf, gated ? glu_row(sg, h, j, F) : cr, d, dr, cols, es);
          }
        }
      };
      const std::optional<DType> cast = o.cast;
      auto produce = [build, code, cast, out_bytes](int64_t e, const ByteSink& sink) {
        std::vector<uint8_t> buf;
        build(e, buf);
        emit(buf.data(), out_bytes, code, cast, sink);
      };
      // The plan's words.
      std::string from;
      if (fc1_like && sep_src) {
        from = display(*s_gate) + " + " + display(*s_up);
      } else {
        from = display(*first);
      }
      std::vector<std::string> ops;
      if (first->info.layout != tg.layout) ops.push_back(tg.layout == ExpertLayout::stacked ? "stacked" : "split per expert");
      if (fc1_like && gated) {
        const std::string a = glu_words(sep_src, sg), z = half ? "separate gate/up" : glu_words(false, dg);
        if (a != z) ops.push_back(a + " -> " + z);
      }
      if (ot.weight && src_t != dst_t) ops.push_back("transposed to " + std::string(weight_orientation_name(tg.orientation)));
      if (code_after_cast(code, cast) != code) ops.push_back("cast from " + code);
      std::string words = from;
      for (size_t i = 0; i < ops.size(); ++i) words += (i ? ", " : " (") + ops[i] + (i + 1 == ops.size() ? ")" : "");
      if (ops.empty()) words += " (copied)";

      PlanItem item;
      item.entry.dtype_code = code_after_cast(code, cast);
      item.entry.source = words;
      if (tg.layout == ExpertLayout::stacked) {
        item.entry.key = key.stacked_key();
        item.entry.shape = {E};
        item.entry.shape.insert(item.entry.shape.end(), eshape.begin(), eshape.end());
        item.raw.push_back(RawTensor{key.stacked_key(), item.entry.dtype_code, item.entry.shape,
                                     [produce, E, out_bytes](const ByteSink& sink) {
                                       if (out_bytes == 0) return;
                                       for (int64_t e = 0; e < E; ++e) produce(e, sink);
                                     }});
      } else {
        item.entry.key = key.stem + "{0.." + std::to_string(E - 1) + "}" + key.suffix;
        item.entry.shape = eshape;
        for (int64_t e = 0; e < E; ++e) {
          item.raw.push_back(RawTensor{key.expert_key(e), item.entry.dtype_code, eshape,
                                       [produce, e](const ByteSink& sink) { produce(e, sink); }});
        }
      }
      plan.push_back(std::move(item));
    }

    // Router tensors follow their block.
    const std::pair<const char*, const char*> router_names[] = {
        {"router.weight", ts.router_weight}, {"router.bias", ts.router_bias},
        {"score_correction_bias", ts.score_bias}};
    std::vector<std::pair<std::string, std::string>> renames;  // source key → target key
    for (const auto& r : router_names) {
      auto it = b.router.find(r.first);
      if (it == b.router.end()) continue;
      renames.push_back({it->second, same || r.second == nullptr ? it->second : tg.module + r.second});
    }
    // Shared experts: renamed, their gate/up fused into one FC1 or split out of it for megatron.
    const auto& sh = b.shared;
    const bool src_fused = sh.count("fc1") > 0;
    if (!sh.empty() && !same && ts.shared != nullptr && (src_fused ? sh.count("fc2") : sh.count("gate") && sh.count("up") && sh.count("fc2"))) {
      const std::string m = tg.module + ts.shared;
      const std::string fc2_name = ts.shared_fused ? "linear_fc2.weight" : "down_proj.weight";
      renames.push_back({sh.at("fc2"), m + fc2_name});
      if (sh.count("gate_weight")) {
        renames.push_back({sh.at("gate_weight"), ts.shared_gate ? tg.module + ts.shared_gate : sh.at("gate_weight")});
      }
      if (src_fused == ts.shared_fused) {
        if (src_fused) {
          renames.push_back({sh.at("fc1"), m + "linear_fc1.weight"});
        } else {
          renames.push_back({sh.at("gate"), m + "gate_proj.weight"});
          renames.push_back({sh.at("up"), m + "up_proj.weight"});
        }
      } else if (!src_fused) {
        // [gate; up] along the output rows of [out, in] weights: the bytes one after the other.
        const SafetensorsEntry& g = ckpt.entry(sh.at("gate"));
        const SafetensorsEntry& u = ckpt.entry(sh.at("up"));
        GMOE_CHECK(g.shape == u.shape && g.dtype_code == u.dtype_code && g.shape.size() == 2, where,
                   ": shared expert gate '", g.name, "' is ", g.dtype_code, shape_string(g.shape), " but up '",
                   u.name, "' is ", u.dtype_code, shape_string(u.shape));
        claimed.insert(g.name);
        claimed.insert(u.name);
        const uint8_t *gp = ckpt.bytes(g.name), *up = ckpt.bytes(u.name);
        const uint64_t n = g.nbytes();
        const std::string code = g.dtype_code;
        const std::optional<DType> cast = o.cast;
        PlanItem item;
        item.entry = {m + "linear_fc1.weight", code_after_cast(code, cast), {2 * g.shape[0], g.shape[1]},
                      g.name + " + " + u.name + " (concatenated [gate; up])"};
        item.raw.push_back(RawTensor{item.entry.key, item.entry.dtype_code, item.entry.shape,
                                     [gp, up, n, code, cast](const ByteSink& sink) {
                                       emit(gp, n, code, cast, sink);
                                       emit(up, n, code, cast, sink);
                                     }});
        plan.push_back(std::move(item));
      } else {
        const SafetensorsEntry& f = ckpt.entry(sh.at("fc1"));
        GMOE_CHECK(f.shape.size() == 2 && f.shape[0] % 2 == 0, where, ": shared expert FC1 '", f.name, "' is ",
                   shape_string(f.shape), ", expected [2F, H] ([gate; up])");
        claimed.insert(f.name);
        const uint8_t* fp = ckpt.bytes(f.name);
        const uint64_t n = f.nbytes() / 2;
        const std::string code = f.dtype_code;
        const std::optional<DType> cast = o.cast;
        for (int h = 0; h < 2; ++h) {
          PlanItem item;
          item.entry = {m + (h ? "up_proj.weight" : "gate_proj.weight"), code_after_cast(code, cast),
                        {f.shape[0] / 2, f.shape[1]}, f.name + (h ? " rows [F, 2F) (up)" : " rows [0, F) (gate)")};
          const uint8_t* p = fp + h * n;
          item.raw.push_back(RawTensor{item.entry.key, item.entry.dtype_code, item.entry.shape,
                                       [p, n, code, cast](const ByteSink& sink) { emit(p, n, code, cast, sink); }});
          plan.push_back(std::move(item));
        }
      }
    }
    for (const auto& rn : renames) {
      claimed.insert(rn.first);
      const SafetensorsEntry& e = ckpt.entry(rn.first);
      const uint8_t* p = ckpt.bytes(rn.first);
      const uint64_t n = e.nbytes();
      const std::string code = e.dtype_code;
      const std::optional<DType> cast = o.cast;
      PlanItem item;
      item.entry = {rn.second, code_after_cast(code, cast), e.shape,
                    rn.first == rn.second ? "(copied)" : "renamed from " + rn.first};
      if (item.entry.dtype_code != code) item.entry.source += " (cast from " + code + ")";
      item.raw.push_back(RawTensor{rn.second, item.entry.dtype_code, e.shape,
                                   [p, n, code, cast](const ByteSink& sink) { emit(p, n, code, cast, sink); }});
      plan.push_back(std::move(item));
    }
  }
  // Everything else, byte for byte under its own name (cast when asked).
  for (const std::string& k : ckpt.keys()) {
    if (claimed.count(k)) continue;
    const SafetensorsEntry& e = ckpt.entry(k);
    const uint8_t* p = ckpt.bytes(k);
    const uint64_t n = e.nbytes();
    const std::string code = e.dtype_code;
    const std::optional<DType> cast = o.cast;
    PlanItem item;
    item.entry = {k, code_after_cast(code, cast), e.shape, code_after_cast(code, cast) != code ? "(cast from " + code + ")" : "(copied)"};
    item.raw.push_back(RawTensor{k, item.entry.dtype_code, e.shape,
                                 [p, n, code, cast](const ByteSink& sink) { emit(p, n, code, cast, sink); }});
    plan.push_back(std::move(item));
  }
  std::vector<ConvertPlanEntry> entries;
  std::vector<RawTensor> raw;
  std::set<std::string> written;
  for (PlanItem& it : plan) {
    entries.push_back(it.entry);
    for (RawTensor& r : it.raw) {
      GMOE_CHECK(written.insert(r.name).second, in, ": two tensors would be written as '", r.name,
                 "' (", it.entry.source, "); the checkpoint already holds a key of the target's name");
      raw.push_back(std::move(r));
    }
  }
  if (o.dry_run) return entries;
  std::map<std::string, std::string> metadata = input_metadata(ckpt);
  // A fused FC1 in a layout its convention does not imply is named in the metadata, so that the
  // file describes itself to recognise_moe_checkpoint (gpt-oss's layout is in its keys).
  metadata.erase(kGluMetadata);
  if (dst_conv != MoeConvention::gpt_oss && fused_glus.size() == 1 && *fused_glus.begin() != glu_format_name(ts.glu)) {
    metadata[kGluMetadata] = *fused_glus.begin();
  }
  write_like_input(ckpt, out, std::move(raw), metadata, o.progress);
  return entries;
}

}  // namespace gmoe
