// src/checkpoint/expert_layout.cpp — expert parameters in stacked or per-expert layout: finding
// them in a checkpoint (strictly), loading slices into either layout, GLU gate/up re-ordering,
// and the expert-parallel sharded save.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/internal.h"
#include "common/checked_math.h"
#include "gmoe/checkpoint.h"
#include "gmoe/error.h"

namespace gmoe {

using nlohmann::json;
using namespace ckpt_detail;

const char* expert_layout_name(ExpertLayout layout) {
  return layout == ExpertLayout::stacked ? "stacked" : "per-expert";
}

namespace ckpt_detail {

// The expert index of `key` when it is `stem<e>suffix` with e written canonically (no sign, no
// leading zeros, at most 18 digits so it fits int64); -1 otherwise.
int64_t per_expert_index(const std::string& key, const ExpertParamKey& p) {
  const size_t fixed = p.stem.size() + p.suffix.size();
  if (key.size() <= fixed || key.compare(0, p.stem.size(), p.stem) != 0 ||
      key.compare(key.size() - p.suffix.size(), p.suffix.size(), p.suffix) != 0) {
    return -1;
  }
  const size_t n = key.size() - fixed;
  if (n > 18) return -1;
  int64_t v = 0;
  for (size_t i = 0; i < n; ++i) {
    const char c = key[p.stem.size() + i];
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  if (n > 1 && key[p.stem.size()] == '0') return -1;
  return v;
}

// Names the `missing` keys of [0, n) absent from `experts`: all of them when few, else the first
// and last ten around a count. Work is bounded by the keys present, not by n.
std::string missing_keys(const ExpertParamKey& p, const std::map<int64_t, std::string>& experts,
                         int64_t n, int64_t missing) {
  constexpr int64_t kEach = 10;
  std::vector<std::string> head, tail;
  for (int64_t e = 0; e < n && static_cast<int64_t>(head.size()) < std::min(missing, 2 * kEach); ++e) {
    if (!experts.count(e)) head.push_back(p.expert_key(e));
  }
  if (missing > 2 * kEach) {
    head.resize(kEach);
    for (int64_t e = n - 1; e >= 0 && static_cast<int64_t>(tail.size()) < kEach; --e) {
      if (!experts.count(e)) tail.insert(tail.begin(), p.expert_key(e));
    }
    head.push_back("... (" + std::to_string(missing - 2 * kEach) + " more) ...");
  }
  head.insert(head.end(), tail.begin(), tail.end());
  std::string s;
  for (const std::string& k : head) s += (s.empty() ? "" : ", ") + k;
  return s;
}

}  // namespace ckpt_detail

namespace {

size_t key_size(const ExpertParamKey& p) { return p.stem.size() + p.suffix.size(); }

}  // namespace

namespace ckpt_detail {

// Checks a found parameter and fills `info`; returns the problem, or "" when consistent.
std::string check_param(const Checkpoint& ckpt, const ExpertParamKey& p, bool stacked_present,
                        const std::map<int64_t, std::string>& experts, int64_t num_experts,
                        ExpertParamInfo* info) {
  const std::string sk = p.stacked_key();
  if (!stacked_present && experts.empty()) {
    return "missing: neither '" + sk + "' (stacked) nor '" + p.expert_key(0) + "', '" +
           p.expert_key(1) + "', ... (per-expert) is in the checkpoint";
  }
  if (stacked_present && !experts.empty()) {
    return "both layouts present: stacked '" + sk + "' and per-expert '" +
           experts.begin()->second + "' (" + std::to_string(experts.size()) +
           " keys); a checkpoint must hold one";
  }
  if (stacked_present) {
    const SafetensorsEntry& e = ckpt.entry(sk);
    if (e.shape.empty()) return "stacked '" + sk + "' is 0-d: expected [E, ...]";
    info->layout = ExpertLayout::stacked;
    info->num_experts = e.shape[0];
    info->expert_shape.assign(e.shape.begin() + 1, e.shape.end());
    info->dtype_code = e.dtype_code;
    if (num_experts >= 0 && info->num_experts != num_experts) {
      return "stacked '" + sk + "' has shape " + shape_string(e.shape) + ": " +
             std::to_string(info->num_experts) + " experts, expected " +
             std::to_string(num_experts);
    }
    return "";
  }
  // The count is bounded by the keys present, never by an index or a count taken on trust: a
  // tiny file with key `weight999999999999999999` claims 10^18 experts, so the missing ones are
  // counted, and only the first and last few named, without visiting each.
  const int64_t n = num_experts >= 0 ? num_experts : experts.rbegin()->first + 1;
  std::vector<std::string> extra;
  int64_t present = 0;
  for (const auto& kv : experts) {
    if (kv.first >= n) {
      extra.push_back(kv.second);
    } else {
      ++present;
    }
  }
  if (present < n) {
    return "incomplete per-expert set: " + std::to_string(present) + " of " + std::to_string(n) +
           " experts present; missing keys: " + missing_keys(p, experts, n, n - present);
  }
  if (!extra.empty()) {
    return "per-expert keys past the expected " + std::to_string(n) + " experts: " +
           join_limited(extra);
  }
  const SafetensorsEntry& first = ckpt.entry(experts.begin()->second);
  for (const auto& kv : experts) {
    const SafetensorsEntry& e = ckpt.entry(kv.second);
    if (e.shape != first.shape || e.dtype_code != first.dtype_code) {
      return "per-expert tensors differ: '" + first.name + "' is " + first.dtype_code +
             shape_string(first.shape) + " but '" + e.name + "' is " + e.dtype_code +
             shape_string(e.shape);
    }
  }
  info->layout = ExpertLayout::per_expert;
  info->num_experts = n;
  info->expert_shape = first.shape;
  info->dtype_code = first.dtype_code;
  return "";
}

}  // namespace ckpt_detail

namespace {

// The per-expert views of an ExpertWeights of any rank (ExpertWeights::expert assumes matrices).
std::vector<TensorView> expert_views(const ExpertWeights& w, const std::string& what) {
  std::vector<TensorView> out;
  if (w.stacked.defined()) {
    GMOE_CHECK(w.list.empty(), what, ": give either a stacked tensor or a list, not both");
    GMOE_CHECK(w.stacked.ndim >= 1, what, ": a stacked tensor needs a leading expert dimension");
    for (int64_t e = 0; e < w.stacked.size(0); ++e) out.push_back(w.stacked.select0(e));
  } else {
    out = w.list;
  }
  GMOE_CHECK(!out.empty(), what, ": no experts given");
  for (size_t e = 0; e < out.size(); ++e) {
    const TensorView& v = out[e];
    GMOE_CHECK(v.defined() && v.device.is_cpu(), what, ": expert ", e,
               " must be a CPU tensor, got ", v.str());
    GMOE_CHECK(v.dtype == out[0].dtype && view_shape(v) == view_shape(out[0]), what, ": expert ",
               e, " is ", v.str(), " but expert 0 is ", out[0].str());
    GMOE_CHECK(v.numel() == 0 || v.data != nullptr, what, ": expert ", e, " has no data");
  }
  return out;
}

// Bytes of a CPU view gathered into a contiguous buffer.
std::vector<uint8_t> gather(const TensorView& v) {
  std::vector<uint8_t> out;
  out.reserve(static_cast<size_t>(v.nbytes()));
  emit_view_bytes(v, [&](const void* p, uint64_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  });
  return out;
}

void write_file_atomic(const std::string& path, const std::string& text) {
  AtomicFile f(path);
  f.write(text.data(), text.size());
  f.commit();
}

}  // namespace

ExpertParamInfo find_expert_param(const Checkpoint& ckpt, const ExpertParamKey& key,
                                  int64_t num_experts) {
  const bool stacked = ckpt.contains(key.stacked_key());
  std::map<int64_t, std::string> experts;
  for (const std::string& k : ckpt.keys()) {
    const int64_t e = per_expert_index(k, key);
    if (e >= 0) experts[e] = k;
  }
  ExpertParamInfo info;
  const std::string problem = check_param(ckpt, key, stacked, experts, num_experts, &info);
  GMOE_CHECK(problem.empty(), ckpt.path(), ": expert parameter '", key.stacked_key(), "': ",
             problem);
  return info;
}

GluFormat glu_format_from_string(const std::string& text) {
  if (text == "concat" || text == "concatenated") return GluFormat{GluLayout::concatenated, 1};
  if (text == "interleaved") return GluFormat{GluLayout::interleaved, 1};
  const std::string p = "interleaved:";
  if (text.compare(0, p.size(), p) == 0 && text.size() > p.size() && text.size() - p.size() <= 12) {
    int64_t b = 0;
    for (size_t i = p.size(); i < text.size(); ++i) {
      GMOE_CHECK(text[i] >= '0' && text[i] <= '9', "GLU format '", text,
                 "': block must be a positive integer");
      b = b * 10 + (text[i] - '0');
    }
    GMOE_CHECK(b > 0, "GLU format '", text, "': block must be a positive integer");
    return GluFormat{GluLayout::interleaved, b};
  }
  GMOE_FAIL("unknown GLU format '", text, "': expected concat or interleaved:BLOCK");
}

std::string glu_format_name(const GluFormat& f) {
  return f.layout == GluLayout::concatenated ? "concatenated"
                                             : "interleaved:" + std::to_string(f.block);
}

void convert_glu(const TensorView& src, const GluFormat& from, const TensorView& dst,
                 const GluFormat& to, int axis) {
  GMOE_CHECK(src.device.is_cpu() && dst.device.is_cpu(), "convert_glu: CPU tensors expected, got ",
             src.str(), " and ", dst.str());
  GMOE_CHECK(src.dtype == dst.dtype && view_shape(src) == view_shape(dst),
             "convert_glu: src ", src.str(), " and dst ", dst.str(), " differ");
  GMOE_CHECK(src.is_contiguous() && dst.is_contiguous(), "convert_glu: contiguous tensors expected");
  GMOE_CHECK(axis >= 0 && axis < src.ndim, "convert_glu: axis ", axis, " out of range for ",
             src.str());
  const int64_t rows = src.shape[axis];
  GMOE_CHECK(rows % 2 == 0, "convert_glu: dimension ", axis, " of ", src.str(),
             " must be even (gate and up halves), got ", rows);
  const int64_t F = rows / 2;
  for (const GluFormat* f : {&from, &to}) {
    if (f->layout == GluLayout::interleaved) {
      GMOE_CHECK(f->block > 0 && F % f->block == 0, "convert_glu: block ", f->block,
                 " must divide the ", F, " rows of each half of ", src.str());
    }
  }
  int64_t outer = 1, inner = static_cast<int64_t>(dtype_size(src.dtype));
  for (int d = 0; d < axis; ++d) outer *= src.shape[d];
  for (int d = axis + 1; d < src.ndim; ++d) inner *= src.shape[d];
  const auto* s = static_cast<const uint8_t*>(src.data);
  auto* t = static_cast<uint8_t*>(dst.data);
  if (src.numel() == 0) return;
  GMOE_CHECK(s + src.nbytes() <= t || t + dst.nbytes() <= s, "convert_glu: src and dst overlap");
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t j = 0; j < F; ++j) {
        std::memcpy(t + (o * rows + glu_row(to, h, j, F)) * inner,
                    s + (o * rows + glu_row(from, h, j, F)) * inner, static_cast<size_t>(inner));
      }
    }
  }
}

void load_expert_param(const Checkpoint& ckpt, const ExpertParamToLoad& p, int64_t num_experts,
                       int64_t first) {
  const std::string what = ckpt.path() + ": loading '" + p.key.stacked_key() + "'";
  const std::vector<TensorView> dst = expert_views(p.dst, what);
  const int64_t local = static_cast<int64_t>(dst.size());
  GMOE_CHECK(num_experts > 0 && first >= 0 && first + local <= num_experts, what, ": experts [",
             first, ", ", first + local, ") are not inside [0, ", num_experts, ")");
  for (const TensorView& v : dst) {
    GMOE_CHECK(v.is_contiguous(), what, ": destination experts must be contiguous, got ", v.str());
  }
  const ExpertParamInfo info = find_expert_param(ckpt, p.key, num_experts);
  const std::string want_code = safetensors_dtype_code(dst[0].dtype);
  const std::vector<int64_t> want = view_shape(dst[0]);
  const std::string key0 = info.layout == ExpertLayout::stacked ? p.key.stacked_key()
                                                                 : p.key.expert_key(first);
  GMOE_CHECK(info.dtype_code == want_code, what, ": '", key0, "' is ", info.dtype_code,
             ", the destination is ", want_code, " (convert the checkpoint; no silent casts)");
  if (info.expert_shape != want) {
    std::vector<int64_t> transposed(want.rbegin(), want.rend());
    GMOE_CHECK(!(want.size() == 2 && info.expert_shape == transposed), what, ": '", key0,
               "' holds experts of shape ", shape_string(info.expert_shape),
               ", the transpose of the expected [out, in] = ", shape_string(want),
               ": gmoe stores expert weights as [out, in]; transpose the checkpoint explicitly");
    GMOE_FAIL(what, ": '", key0, "' holds experts of shape ", shape_string(info.expert_shape),
              ", expected ", shape_string(want));
  }
  const bool convert = p.glu && p.checkpoint_glu != p.model_glu;
  GMOE_CHECK(!p.glu || !want.empty(), what, ": a GLU parameter needs a gate/up dimension");
  const uint64_t expert_bytes = static_cast<uint64_t>(dst[0].nbytes());
  for (int64_t i = 0; i < local; ++i) {
    const int64_t e = first + i;
    const uint8_t* src = info.layout == ExpertLayout::stacked
                             ? ckpt.bytes(p.key.stacked_key()) + static_cast<uint64_t>(e) * expert_bytes
                             : ckpt.bytes(p.key.expert_key(e));
    if (convert) {
      convert_glu(make_view(src, dst[i].dtype, want), p.checkpoint_glu, dst[i], p.model_glu, 0);
    } else if (expert_bytes > 0) {
      std::memcpy(dst[i].data, src, expert_bytes);
    }
  }
}

std::vector<std::string> find_unexpected_keys(const Checkpoint& ckpt,
                                              const std::vector<ExpertParamKey>& params,
                                              int64_t num_experts) {
  std::vector<std::string> out;
  for (const std::string& k : ckpt.keys()) {
    bool claimed = false;
    for (const ExpertParamKey& p : params) {
      const int64_t e = per_expert_index(k, p);
      if (k == p.stacked_key() || (e >= 0 && e < num_experts)) {
        claimed = true;
        break;
      }
    }
    if (!claimed) out.push_back(k);
  }
  return out;
}

std::vector<std::string> load_expert_params(const Checkpoint& ckpt,
                                            const std::vector<ExpertParamToLoad>& params,
                                            int64_t num_experts, int64_t first,
                                            bool allow_unexpected) {
  std::vector<ExpertParamKey> keys;
  for (const ExpertParamToLoad& p : params) {
    load_expert_param(ckpt, p, num_experts, first);
    keys.push_back(p.key);
  }
  std::vector<std::string> unexpected = find_unexpected_keys(ckpt, keys, num_experts);
  GMOE_CHECK(allow_unexpected || unexpected.empty(), ckpt.path(), ": ", unexpected.size(),
             " unexpected keys (no parameter claims them): ", join_limited(unexpected));
  return unexpected;
}

namespace {

// Producer of one expert's bytes, GLU-converted from the model's to the checkpoint's layout.
std::function<void(const ByteSink&)> expert_producer(const ExpertParamToSave& p, TensorView v) {
  const bool convert = p.glu && p.model_glu != p.checkpoint_glu;
  if (!convert) return [v](const ByteSink& sink) { emit_view_bytes(v, sink); };
  const GluFormat from = p.model_glu, to = p.checkpoint_glu;
  return [v, from, to](const ByteSink& sink) {
    std::vector<uint8_t> in = gather(v), out(in.size());
    const std::vector<int64_t> shape = view_shape(v);
    convert_glu(make_view(in.data(), v.dtype, shape), from, make_view(out.data(), v.dtype, shape),
                to, 0);
    sink(out.data(), out.size());
  };
}

}  // namespace

void save_expert_params(const std::string& path, const std::vector<ExpertParamToSave>& params,
                        ExpertLayout layout, const std::map<std::string, std::string>& metadata,
                        const std::vector<NamedTensor>& extra, const ProgressFn& progress) {
  std::vector<RawTensor> raw;
  for (const ExpertParamToSave& p : params) {
    const std::string what = path + ": saving '" + p.key.stacked_key() + "'";
    const std::vector<TensorView> experts = expert_views(p.src, what);
    GMOE_CHECK(!p.glu || experts[0].ndim >= 1, what, ": a GLU parameter needs a gate/up dimension");
    const std::string code = safetensors_dtype_code(experts[0].dtype);
    const std::vector<int64_t> shape = view_shape(experts[0]);
    if (layout == ExpertLayout::per_expert) {
      for (size_t e = 0; e < experts.size(); ++e) {
        raw.push_back(RawTensor{p.key.expert_key(static_cast<int64_t>(e)), code, shape,
                                expert_producer(p, experts[e])});
      }
    } else {
      std::vector<int64_t> stacked_shape{static_cast<int64_t>(experts.size())};
      stacked_shape.insert(stacked_shape.end(), shape.begin(), shape.end());
      std::vector<std::function<void(const ByteSink&)>> parts;
      for (const TensorView& v : experts) parts.push_back(expert_producer(p, v));
      raw.push_back(RawTensor{p.key.stacked_key(), code, stacked_shape, [parts](const ByteSink& sink) {
                                for (const auto& part : parts) part(sink);
                              }});
    }
  }
  for (const NamedTensor& t : extra) {
    GMOE_CHECK(t.view.defined() && t.view.device.is_cpu(), path, ": tensor '", t.name,
               "' must be a CPU tensor, got ", t.view.str());
    TensorView v = t.view;
    raw.push_back(RawTensor{t.name, safetensors_dtype_code(v.dtype), view_shape(v),
                            [v](const ByteSink& sink) { emit_view_bytes(v, sink); }});
  }
  write_safetensors_raw(path, std::move(raw), metadata, progress);
}

std::string expert_shard_index_path(const std::string& dir, const std::string& name) {
  return dir + "/" + name + ".safetensors.index.json";
}

void save_expert_shards(const std::string& dir, const std::string& name,
                        const std::vector<ExpertParamToSave>& params, int64_t first,
                        int64_t num_experts, const ExpertShardOptions& options) {
  const int64_t G = options.experts_per_file;
  GMOE_CHECK(!params.empty(), "save_expert_shards: no parameters given");
  GMOE_CHECK(!name.empty() && name.find('/') == std::string::npos,
             "save_expert_shards: name must be a plain file name stem, got '", name, "'");
  GMOE_CHECK(num_experts > 0 && G > 0 && num_experts % G == 0, "save_expert_shards: experts_per_file ",
             G, " must divide num_experts ", num_experts);
  std::vector<std::vector<TensorView>> experts;
  int64_t local = -1;
  for (const ExpertParamToSave& p : params) {
    experts.push_back(expert_views(p.src, "save_expert_shards '" + p.key.stacked_key() + "'"));
    const int64_t n = static_cast<int64_t>(experts.back().size());
    GMOE_CHECK(local < 0 || n == local, "save_expert_shards: '", p.key.stacked_key(), "' holds ",
               n, " experts, the first parameter ", local);
    local = n;
  }
  GMOE_CHECK(first >= 0 && first + local <= num_experts, "save_expert_shards: experts [", first,
             ", ", first + local, ") are not inside [0, ", num_experts, ")");
  GMOE_CHECK(first % G == 0 && local % G == 0, "save_expert_shards: this rank's experts [", first,
             ", ", first + local, ") must start and end on a multiple of experts_per_file ", G,
             " so that each file belongs to one rank");
  const int64_t files = num_experts / G;
  char buf[64];
  auto file_name = [&](int64_t k) {
    std::snprintf(buf, sizeof buf, "-%05lld-of-%05lld.safetensors", static_cast<long long>(k + 1),
                  static_cast<long long>(files));
    return name + buf;
  };
  for (int64_t k = first / G; k < (first + local) / G; ++k) {
    std::vector<RawTensor> raw;
    for (size_t i = 0; i < params.size(); ++i) {
      for (int64_t e = k * G; e < (k + 1) * G; ++e) {
        const TensorView& v = experts[i][static_cast<size_t>(e - first)];
        raw.push_back(RawTensor{params[i].key.expert_key(e), safetensors_dtype_code(v.dtype),
                                view_shape(v), expert_producer(params[i], v)});
      }
    }
    write_safetensors_raw(dir + "/" + file_name(k), std::move(raw), options.metadata, nullptr);
  }
  if (options.write_index) {
    json weight_map = json::object();
    uint64_t total = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      total += static_cast<uint64_t>(experts[i][0].nbytes()) * static_cast<uint64_t>(num_experts);
      for (int64_t e = 0; e < num_experts; ++e) {
        weight_map[params[i].key.expert_key(e)] = file_name(e / G);
      }
    }
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_atomic(expert_shard_index_path(dir, name), index.dump(2) + "\n");
  }
}

// ------------------------------------------------------------------------------------------------
// discovery and conversion

std::vector<DetectedExpertParam> detect_expert_params(const Checkpoint& ckpt,
                                                      const ExpertDetectOptions& options) {
  struct Group {
    ExpertParamKey key;
    bool stacked = false;
    std::map<int64_t, std::string> experts;
    std::vector<std::string> keys;
  };
  std::map<std::pair<std::string, std::string>, Group> groups;
  for (const std::string& k : ckpt.keys()) {
    std::vector<std::string> comps;
    size_t start = 0;
    while (true) {
      const size_t dot = k.find('.', start);
      comps.push_back(k.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    bool in_scope = options.scope_components.empty();
    for (const std::string& c : comps) {
      if (std::find(options.scope_components.begin(), options.scope_components.end(), c) !=
          options.scope_components.end()) {
        in_scope = true;
      }
    }
    if (!in_scope) continue;
    // The last component that is `<name>` or `<name><digits>`.
    size_t comp_begin = 0, pos = 0;
    std::string stem, suffix;
    int64_t index = -2;  // -2: none, -1: stacked
    for (size_t c = 0; c < comps.size(); ++c) {
      comp_begin = pos;
      pos += comps[c].size() + 1;
      for (const std::string& n : options.param_names) {
        if (comps[c].compare(0, n.size(), n) != 0) continue;
        ExpertParamKey probe{k.substr(0, comp_begin + n.size()), k.substr(comp_begin + comps[c].size())};
        if (comps[c].size() == n.size()) {
          index = -1;
        } else {
          const int64_t e = per_expert_index(k, probe);
          if (e < 0) continue;
          index = e;
        }
        stem = probe.stem;
        suffix = probe.suffix;
      }
    }
    if (index == -2) continue;
    Group& g = groups[{stem, suffix}];
    g.key = ExpertParamKey{stem, suffix};
    g.keys.push_back(k);
    if (index == -1) {
      g.stacked = true;
    } else {
      g.experts[index] = k;
    }
  }
  std::vector<DetectedExpertParam> out;
  for (auto& kv : groups) {
    DetectedExpertParam d;
    d.key = kv.second.key;
    d.keys = kv.second.keys;
    d.problem = check_param(ckpt, d.key, kv.second.stacked, kv.second.experts, -1, &d.info);
    out.push_back(std::move(d));
  }
  std::sort(out.begin(), out.end(), [](const DetectedExpertParam& a, const DetectedExpertParam& b) {
    return natural_less(a.key.stacked_key(), b.key.stacked_key());
  });
  return out;
}

namespace ckpt_detail {

void write_like_input(const Checkpoint& ckpt, const std::string& out, std::vector<RawTensor> tensors,
                      const std::map<std::string, std::string>& metadata, const ProgressFn& progress) {
  struct stat st {};
  const int mode = !ckpt.files().empty() && ::stat(ckpt.files()[0].path().c_str(), &st) == 0
                       ? static_cast<int>(st.st_mode & 07777)
                       : -1;
  write_safetensors_raw(out, std::move(tensors), metadata, progress, mode);
}

std::map<std::string, std::string> input_metadata(const Checkpoint& ckpt) {
  return ckpt.files().size() == 1 ? ckpt.files()[0].metadata() : std::map<std::string, std::string>{};
}

void check_output_not_input(const Checkpoint& ckpt, const std::string& out, bool allow) {
  struct stat o {};
  if (::stat(out.c_str(), &o) != 0) return;  // a new file
  std::vector<std::string> inputs{ckpt.path()};
  for (const SafetensorsFile& f : ckpt.files()) inputs.push_back(f.path());
  for (const std::string& p : inputs) {
    struct stat i {};
    if (::stat(p.c_str(), &i) != 0 || i.st_dev != o.st_dev || i.st_ino != o.st_ino) continue;
    GMOE_CHECK(allow, "the output '", out, "' is the input ", p == ckpt.path() ? "" : "file ", "'", p,
               "': refusing to overwrite it (give another output path, or --overwrite-input to ",
               "replace it through a temporary file)");
  }
}

}  // namespace ckpt_detail

std::vector<ConvertPlanEntry> convert_checkpoint(const std::string& in, const std::string& out,
                                                 const ConvertOptions& options) {
  const Checkpoint ckpt = Checkpoint::open(in);
  if (!options.dry_run) check_output_not_input(ckpt, out, options.allow_overwrite_input);
  // FC1 weights stored [in, out] (gpt-oss) hold gate/up along their last dimension.
  std::set<std::string> in_out_fc1;
  if (!options.glu_stems.empty() && options.glu_from != options.glu_to && options.glu_axis < 0) {
    for (const MoeBlock& b : recognise_moe_checkpoint(ckpt).blocks) {
      for (const MoeExpertTensor& t : b.tensors) {
        if (t.role == MoeTensorRole::fc1 && t.orientation == WeightOrientation::in_out) {
          in_out_fc1.insert(t.key.stacked_key());
        }
      }
    }
  }
  const std::vector<DetectedExpertParam> params = detect_expert_params(ckpt, options.detect);
  std::vector<std::string> problems;
  int64_t E = options.num_experts;
  for (const DetectedExpertParam& d : params) {
    if (!d.problem.empty()) {
      problems.push_back("'" + d.key.stacked_key() + "': " + d.problem);
    } else if (E < 0) {
      E = d.info.num_experts;
    } else if (d.info.num_experts != E) {
      problems.push_back("'" + d.key.stacked_key() + "': " + std::to_string(d.info.num_experts) +
                         " experts, expected " + std::to_string(E) +
                         (options.num_experts < 0 ? " (as the first expert parameter)" : ""));
    }
  }
  GMOE_CHECK(problems.empty(), in, ": cannot convert: ", join_limited(problems, 40));

  std::set<std::string> claimed;
  std::vector<RawTensor> raw;
  for (const DetectedExpertParam& d : params) {
    for (const std::string& k : d.keys) claimed.insert(k);
    const ExpertParamInfo& info = d.info;
    const ExpertLayout layout = options.change_layout ? options.layout : info.layout;
    bool glu = false;
    for (const std::string& s : options.glu_stems) {
      if (!s.empty() && d.key.stem.find(s) != std::string::npos) glu = true;
    }
    glu = glu && options.glu_from != options.glu_to;
    const std::string what = in + ": '" + d.key.stacked_key() + "'";
    const int64_t es = safetensors_code_size(info.dtype_code);
    const uint64_t expert_bytes = static_cast<uint64_t>(
        checked_mul(checked_numel(info.expert_shape, what.c_str()), es, what.c_str()));
    if (layout == ExpertLayout::per_expert) {
      GMOE_CHECK(E > 0, what, ": 0 experts: the per-expert layout has no key to hold them (the ",
                 "parameter would vanish); keep the stacked layout");
      // Each per-expert tensor takes more than kMinHeaderEntry bytes of header: a count no header
      // can hold (2^40 empty stacked experts) is refused before any per-expert work.
      constexpr int64_t kMinHeaderEntry = 48;
      const int64_t key_bytes = static_cast<int64_t>(key_size(d.key)) + kMinHeaderEntry;
      GMOE_CHECK(E <= static_cast<int64_t>(kMaxSafetensorsHeaderBytes) / key_bytes, what, ": ", E,
                 " per-expert tensors cannot fit a safetensors header (at most ",
                 kMaxSafetensorsHeaderBytes, " bytes); keep the stacked layout");
    }
    const int rank = static_cast<int>(info.expert_shape.size());
    const int axis = options.glu_axis >= 0 ? options.glu_axis
                     : in_out_fc1.count(d.key.stacked_key()) ? rank - 1
                                                             : 0;
    if (glu) {
      GMOE_CHECK(axis < rank && info.expert_shape[static_cast<size_t>(axis)] % 2 == 0, in, ": '",
                 d.key.stacked_key(), "': GLU conversion along dimension ", axis,
                 " needs an even dimension there (gate and up halves), experts are ",
                 shape_string(info.expert_shape));
      const int64_t F = info.expert_shape[static_cast<size_t>(axis)] / 2;
      for (const GluFormat* f : {&options.glu_from, &options.glu_to}) {
        GMOE_CHECK(f->layout == GluLayout::concatenated || (f->block > 0 && F % f->block == 0), in,
                   ": '", d.key.stacked_key(), "': GLU block ", f->block, " must divide ", F);
      }
    }
    // Source bytes of expert e, resolved lazily so the mapping is touched only while writing.
    const ExpertParamKey key = d.key;
    const ExpertLayout src_layout = info.layout;
    auto src_of = [ckpt, key, src_layout, expert_bytes](int64_t e) {
      return src_layout == ExpertLayout::stacked
                 ? ckpt.bytes(key.stacked_key()) + static_cast<uint64_t>(e) * expert_bytes
                 : ckpt.bytes(key.expert_key(e));
    };
    // GLU conversion moves bytes only, so it works for dtypes gmoe has no DType for: use a 1-byte
    // dtype and the element's bytes as one more (last) dimension.
    std::vector<int64_t> byte_shape = info.expert_shape;
    if (glu) {
      GMOE_CHECK(rank < TensorView::kMaxDims, what, ": GLU conversion of rank-", rank,
                 " experts is not supported");
      byte_shape.push_back(es);
    }
    const GluFormat from = options.glu_from, to = options.glu_to;
    auto emit_expert = [src_of, glu, from, to, byte_shape, expert_bytes, axis](int64_t e,
                                                                               const ByteSink& sink) {
      const uint8_t* src = src_of(e);
      if (!glu) {
        sink(src, expert_bytes);
        return;
      }
      std::vector<uint8_t> buf(expert_bytes);
      convert_glu(make_view(src, DType::e4m3, byte_shape), from,
                  make_view(buf.data(), DType::e4m3, byte_shape), to, axis);
      sink(buf.data(), buf.size());
    };
    if (layout == ExpertLayout::stacked) {
      std::vector<int64_t> shape{E};
      shape.insert(shape.end(), info.expert_shape.begin(), info.expert_shape.end());
      raw.push_back(RawTensor{key.stacked_key(), info.dtype_code, shape,
                              [emit_expert, E, expert_bytes](const ByteSink& sink) {
                                if (expert_bytes == 0) return;  // no work per empty expert
                                for (int64_t e = 0; e < E; ++e) emit_expert(e, sink);
                              }});
    } else {
      for (int64_t e = 0; e < E; ++e) {
        raw.push_back(RawTensor{key.expert_key(e), info.dtype_code, info.expert_shape,
                                [emit_expert, e](const ByteSink& sink) { emit_expert(e, sink); }});
      }
    }
  }
  const size_t expert_tensors = raw.size();
  for (const std::string& k : ckpt.keys()) {
    if (claimed.count(k)) continue;
    const SafetensorsEntry& e = ckpt.entry(k);
    const uint8_t* src = ckpt.bytes(k);
    const uint64_t n = e.nbytes();
    raw.push_back(RawTensor{k, e.dtype_code, e.shape, [src, n](const ByteSink& sink) {
                              // Bounded pieces, so progress moves through large tensors.
                              for (uint64_t o = 0; o < n; o += (64u << 20)) {
                                sink(src + o, std::min<uint64_t>(n - o, 64u << 20));
                              }
                            }});
  }
  std::vector<ConvertPlanEntry> plan;
  for (size_t i = 0; i < raw.size(); ++i) {
    plan.push_back({raw[i].name, raw[i].dtype_code, raw[i].shape,
                    i < expert_tensors ? "expert parameter" : "(copied)"});
  }
  if (options.dry_run) return plan;
  write_like_input(ckpt, out, std::move(raw), input_metadata(ckpt), options.progress);
  return plan;
}

}  // namespace gmoe
