// tests/checkpoint/test_expert_layout.cpp — expert parameters: every layout pair × dtype × bias,
// master weights and moments following the weight's mapping, strictness, GLU gate/up conversion,
// expert-parallel slices and shards, and gmoe-ckpt's conversion.
#include <dirent.h>

#include <set>

#include "ckpt_test_util.h"
#include "gmoe/checkpoint.h"
#include "gmoe/error.h"

namespace gmoe_test {
namespace {

using gmoe::Checkpoint;
using gmoe::ExpertLayout;
using gmoe::ExpertParamKey;
using gmoe::ExpertParamToLoad;
using gmoe::ExpertParamToSave;
using gmoe::ExpertWeights;
using gmoe::GluFormat;
using gmoe::GluLayout;

const ExpertLayout kLayouts[] = {ExpertLayout::stacked, ExpertLayout::per_expert};

// A full set of expert parameters for one layer: weight [E, out, in] in `dtype`, optional bias
// [E, out], fp32 master weight and Adam moments — every per-parameter state.
struct Layer {
  struct Param {
    ExpertParamKey key;
    HostTensor data;  // [E, ...]
  };
  std::vector<Param> params;
};

Layer make_layer(std::mt19937_64& rng, const std::string& stem_prefix, int64_t E, int64_t out,
                 int64_t in, DType dtype, bool bias) {
  Layer l;
  const ExpertParamKey w{stem_prefix + ".weight", ""};
  l.params.push_back({w, HostTensor(dtype, {E, out, in}, rng)});
  l.params.push_back({w.with_state("master.", ""), HostTensor(DType::f32, {E, out, in}, rng)});
  l.params.push_back({w.with_state("", ".exp_avg"), HostTensor(DType::f32, {E, out, in}, rng)});
  l.params.push_back({w.with_state("", ".exp_avg_sq"), HostTensor(DType::f32, {E, out, in}, rng)});
  if (bias) {
    const ExpertParamKey b{stem_prefix + ".bias", ""};
    l.params.push_back({b, HostTensor(dtype, {E, out}, rng)});
    l.params.push_back({b.with_state("", ".exp_avg"), HostTensor(DType::f32, {E, out}, rng)});
  }
  return l;
}

// An ExpertWeights over experts [first, first + count) of `t`, in `layout`.
ExpertWeights as_layout(HostTensor& t, ExpertLayout layout, int64_t first, int64_t count) {
  TensorView all = t.view();
  ExpertWeights w;
  if (layout == ExpertLayout::stacked) {
    TensorView s = all;
    s.shape[0] = count;
    s.data = t.bytes.data() + first * t.expert_bytes();
    w.stacked = s;
  } else {
    for (int64_t e = 0; e < count; ++e) w.list.push_back(all.select0(first + e));
  }
  return w;
}

std::vector<ExpertParamToSave> to_save(Layer& l, ExpertLayout layout, int64_t first, int64_t count) {
  std::vector<ExpertParamToSave> out;
  for (auto& p : l.params) out.push_back(save_spec(p.key, as_layout(p.data, layout, first, count)));
  return out;
}

// Loads experts [first, first + count) of every parameter into fresh poisoned buffers in `layout`
// and compares with the source bytes.
void load_and_compare(const Checkpoint& c, Layer& l, ExpertLayout layout, int64_t E, int64_t first,
                      int64_t count, bool others_in_file = false) {
  std::vector<HostTensor> dst;
  std::vector<ExpertParamToLoad> loads;
  dst.reserve(l.params.size());
  for (auto& p : l.params) {
    std::vector<int64_t> shape = p.data.shape;
    shape[0] = count;
    dst.push_back(HostTensor::poisoned(p.data.dtype, shape));
    loads.push_back(load_spec(p.key, as_layout(dst.back(), layout, 0, count)));
  }
  const auto unexpected = gmoe::load_expert_params(c, loads, E, first, others_in_file);
  EXPECT_TRUE(others_in_file || unexpected.empty());
  for (size_t i = 0; i < l.params.size(); ++i) {
    for (int64_t e = 0; e < count; ++e) {
      ASSERT_EQ(dst[i].slice0(e), l.params[i].data.slice0(first + e))
          << l.params[i].key.stacked_key() << " expert " << first + e;
    }
  }
}

class ExpertLayoutTest : public SeededTest {};

TEST_F(ExpertLayoutTest, RoundTripEveryLayoutPairDtypeAndBias) {
  TempDir dir;
  for (DType dtype : all_dtypes()) {
    for (bool bias : {false, true}) {
      for (ExpertLayout file_layout : kLayouts) {
        for (ExpertLayout mem_layout : kLayouts) {
          SCOPED_TRACE(std::string(gmoe::dtype_name(dtype)) + (bias ? " bias" : " no-bias") +
                       " file " + gmoe::expert_layout_name(file_layout) + " memory " +
                       gmoe::expert_layout_name(mem_layout));
          const int64_t E = uniform(1, 9), out = uniform(1, 12), in = uniform(1, 12);
          Layer l = make_layer(rng, "layers.0.mlp.experts.fc1", E, out, in, dtype, bias);
          // Save from either in-memory layout, too.
          const ExpertLayout save_from = uniform(0, 1) ? ExpertLayout::stacked : ExpertLayout::per_expert;
          const std::string path = dir / "ckpt.safetensors";
          gmoe::save_expert_params(path, to_save(l, save_from, 0, E), file_layout, {{"format", "pt"}});
          Checkpoint c = Checkpoint::open(path);
          for (auto& p : l.params) {
            const gmoe::ExpertParamInfo info = gmoe::find_expert_param(c, p.key, E);
            EXPECT_EQ(info.layout, file_layout);
            EXPECT_EQ(info.num_experts, E);
          }
          load_and_compare(c, l, mem_layout, E, 0, E);
        }
      }
    }
  }
}

TEST_F(ExpertLayoutTest, ExpertParallelSlicesFromEitherLayout) {
  TempDir dir;
  const int64_t E = 8;
  Layer l = make_layer(rng, "layers.3.experts.fc2", E, uniform(1, 10), uniform(1, 10), DType::bf16, true);
  for (ExpertLayout file_layout : kLayouts) {
    const std::string path = dir / (std::string("full_") + gmoe::expert_layout_name(file_layout));
    gmoe::save_expert_params(path, to_save(l, ExpertLayout::stacked, 0, E), file_layout);
    Checkpoint c = Checkpoint::open(path);
    for (int64_t ranks : {1, 2, 4, 8}) {
      for (int64_t r = 0; r < ranks; ++r) {
        for (ExpertLayout mem : kLayouts) {
          SCOPED_TRACE(std::string(gmoe::expert_layout_name(file_layout)) + " ranks " +
                       std::to_string(ranks) + " rank " + std::to_string(r));
          load_and_compare(c, l, mem, E, r * (E / ranks), E / ranks);
        }
      }
    }
  }
}

std::vector<std::string> list_dir(const std::string& path) {
  std::vector<std::string> out;
  DIR* d = opendir(path.c_str());
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') out.push_back(e->d_name);
  }
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

TEST_F(ExpertLayoutTest, ShardedSaveOfAllRanksEqualsSingleProcessSave) {
  const int64_t E = 8;
  Layer l = make_layer(rng, "model.layers.1.mlp.experts.gate_up", E, 2 * uniform(1, 6),
                       uniform(1, 9), DType::bf16, true);
  for (int64_t G : {1, 2}) {
    TempDir single;
    gmoe::ExpertShardOptions opt;
    opt.experts_per_file = G;
    opt.metadata = {{"format", "pt"}};
    gmoe::save_expert_shards(single.path, "model", to_save(l, ExpertLayout::stacked, 0, E), 0, E, opt);
    const std::vector<std::string> files = list_dir(single.path);
    ASSERT_EQ(files.size(), static_cast<size_t>(E / G + 1));
    for (int64_t ranks : {1, 2, 4, 8}) {
      if ((E / ranks) % G != 0) continue;
      SCOPED_TRACE("G " + std::to_string(G) + " ranks " + std::to_string(ranks));
      TempDir multi;
      for (int64_t r = 0; r < ranks; ++r) {
        gmoe::ExpertShardOptions ro = opt;
        ro.write_index = r == 0;
        const int64_t local = E / ranks;
        // Ranks hold their experts in either layout.
        gmoe::save_expert_shards(multi.path, "model",
                                 to_save(l, r % 2 ? ExpertLayout::per_expert : ExpertLayout::stacked,
                                         r * local, local),
                                 r * local, E, ro);
      }
      ASSERT_EQ(list_dir(multi.path), files);
      for (const std::string& f : files) {
        EXPECT_EQ(read_file(multi / f), read_file(single / f)) << f;
      }
      // Load back through the index into any expert-parallel size.
      Checkpoint c = Checkpoint::open(gmoe::expert_shard_index_path(multi.path, "model"));
      for (int64_t r = 0; r < ranks; ++r) {
        load_and_compare(c, l, ExpertLayout::stacked, E, r * (E / ranks), E / ranks);
      }
    }
  }
  TempDir bad;
  expect_error([&] { gmoe::save_expert_shards(bad.path, "m", to_save(l, ExpertLayout::stacked, 1, 2), 1, E, {2, true, {}}); },
               {"multiple of experts_per_file"});
}

TEST_F(ExpertLayoutTest, StrictnessErrorsNameTheKeys) {
  TempDir dir;
  const int64_t E = 6;
  Layer l = make_layer(rng, "experts.fc1", E, 5, 3, DType::f32, false);
  const ExpertParamKey w = l.params[0].key;
  HostTensor& wd = l.params[0].data;
  auto load_w = [&](const std::string& path, int64_t num_experts) {
    HostTensor dst = HostTensor::poisoned(DType::f32, {num_experts, 5, 3});
    gmoe::load_expert_params(Checkpoint::open(path), {load_spec(w, as_layout(dst, ExpertLayout::stacked, 0, num_experts))},
                             num_experts);
  };
  // Missing experts 2 and 4 of a per-expert set.
  {
    std::vector<gmoe::NamedTensor> t;
    for (int64_t e : {0, 1, 3, 5}) t.push_back({w.expert_key(e), wd.view().select0(e)});
    gmoe::save_safetensors(dir / "missing.safetensors", t);
    expect_error([&] { load_w(dir / "missing.safetensors", E); },
                 {"experts.fc1.weight2", "experts.fc1.weight4", "incomplete", "4 of 6"});
  }
  // Trailing experts missing: only detectable against the model's count.
  {
    std::vector<gmoe::NamedTensor> t;
    for (int64_t e = 0; e < E - 1; ++e) t.push_back({w.expert_key(e), wd.view().select0(e)});
    gmoe::save_safetensors(dir / "short.safetensors", t);
    expect_error([&] { load_w(dir / "short.safetensors", E); }, {"experts.fc1.weight5", "missing keys"});
    // More experts in the file than in the model.
    expect_error([&] { load_w(dir / "short.safetensors", E - 2); }, {"experts.fc1.weight4", "past the expected 4"});
  }
  // Both layouts for one parameter.
  {
    gmoe::save_safetensors(dir / "both.safetensors",
                           {{w.stacked_key(), wd.view()}, {w.expert_key(0), wd.view().select0(0)}});
    expect_error([&] { load_w(dir / "both.safetensors", E); }, {"both layouts", "'experts.fc1.weight'", "experts.fc1.weight0"});
  }
  // Not there at all.
  {
    HostTensor other(DType::f32, {2}, rng);
    gmoe::save_safetensors(dir / "absent.safetensors", {{"other", other.view()}});
    expect_error([&] { load_w(dir / "absent.safetensors", E); }, {"missing", "experts.fc1.weight0"});
  }
  // Stacked with the wrong expert count.
  gmoe::save_safetensors(dir / "stacked.safetensors", {{w.stacked_key(), wd.view()}});
  expect_error([&] { load_w(dir / "stacked.safetensors", E + 2); }, {"6 experts, expected 8"});
  // Transposed [in, out] instead of [out, in]: an error naming the key, never a reshape.
  {
    HostTensor tr(DType::f32, {E, 3, 5}, rng);
    gmoe::save_safetensors(dir / "transposed.safetensors", {{w.stacked_key(), tr.view()}});
    expect_error([&] { load_w(dir / "transposed.safetensors", E); },
                 {"'experts.fc1.weight'", "[3, 5]", "transpose", "[out, in]"});
    std::vector<gmoe::NamedTensor> t;
    for (int64_t e = 0; e < E; ++e) t.push_back({w.expert_key(e), tr.view().select0(e)});
    gmoe::save_safetensors(dir / "transposed_pe.safetensors", t);
    expect_error([&] { load_w(dir / "transposed_pe.safetensors", E); }, {"'experts.fc1.weight0'", "transpose"});
  }
  // Another shape mismatch and a dtype mismatch.
  {
    HostTensor bad(DType::f32, {E, 5, 4}, rng), bf(DType::bf16, {E, 5, 3}, rng);
    gmoe::save_safetensors(dir / "shape.safetensors", {{w.stacked_key(), bad.view()}});
    expect_error([&] { load_w(dir / "shape.safetensors", E); }, {"'experts.fc1.weight'", "[5, 4]", "expected [5, 3]"});
    gmoe::save_safetensors(dir / "dtype.safetensors", {{w.stacked_key(), bf.view()}});
    expect_error([&] { load_w(dir / "dtype.safetensors", E); }, {"'experts.fc1.weight'", "BF16", "F32"});
  }
  // Per-expert tensors that disagree.
  {
    HostTensor odd(DType::f32, {4, 3}, rng);
    std::vector<gmoe::NamedTensor> t;
    for (int64_t e = 0; e < E; ++e) t.push_back({w.expert_key(e), e == 3 ? odd.view() : wd.view().select0(e)});
    gmoe::save_safetensors(dir / "ragged.safetensors", t);
    expect_error([&] { load_w(dir / "ragged.safetensors", E); }, {"experts.fc1.weight3", "differ"});
  }
  // Unexpected keys: reported (error by default, returned when allowed). A non-canonical index
  // ("weight01") and an optimizer state nobody asked for are both unexpected.
  {
    HostTensor extra(DType::f32, {5, 3}, rng);
    gmoe::save_safetensors(dir / "unexpected.safetensors",
                           {{w.stacked_key(), wd.view()},
                            {"experts.fc1.weight01", extra.view()},
                            {"experts.fc1.weight.exp_avg", wd.view()}});
    expect_error([&] { load_w(dir / "unexpected.safetensors", E); },
                 {"2 unexpected keys", "experts.fc1.weight01", "experts.fc1.weight.exp_avg"});
    HostTensor dst = HostTensor::poisoned(DType::f32, {E, 5, 3});
    const auto got = gmoe::load_expert_params(Checkpoint::open(dir / "unexpected.safetensors"),
                                              {load_spec(w, as_layout(dst, ExpertLayout::per_expert, 0, E))}, E, 0,
                                              /*allow_unexpected=*/true);
    EXPECT_EQ(got, (std::vector<std::string>{"experts.fc1.weight.exp_avg", "experts.fc1.weight01"}));
    EXPECT_EQ(dst.bytes, wd.bytes);
  }
  // Slices outside the experts.
  expect_error([&] {
    HostTensor dst = HostTensor::poisoned(DType::f32, {4, 5, 3});
    gmoe::load_expert_param(Checkpoint::open(dir / "stacked.safetensors"),
                            load_spec(w, as_layout(dst, ExpertLayout::stacked, 0, 4)), E, 3);
  }, {"[3, 7)", "[0, 6)"});
}

// ---- GLU gate/up ----

TEST_F(ExpertLayoutTest, GluInterleavingMatchesTheDefinition) {
  // F = 4 rows per half, block 2: gate 0,1 | up 0,1 | gate 2,3 | up 2,3.
  std::vector<int32_t> concat = {0, 1, 2, 3, 100, 101, 102, 103};  // gate g_j = j, up u_j = 100 + j
  std::vector<int32_t> inter(8, -1), back(8, -1);
  TensorView c(concat.data(), DType::i32, gmoe::Device::cpu(), {8});
  TensorView i(inter.data(), DType::i32, gmoe::Device::cpu(), {8});
  TensorView b(back.data(), DType::i32, gmoe::Device::cpu(), {8});
  gmoe::convert_glu(c, {GluLayout::concatenated, 1}, i, {GluLayout::interleaved, 2}, 0);
  EXPECT_EQ(inter, (std::vector<int32_t>{0, 1, 100, 101, 2, 3, 102, 103}));
  gmoe::convert_glu(i, {GluLayout::interleaved, 2}, b, {GluLayout::interleaved, 1}, 0);
  EXPECT_EQ(back, (std::vector<int32_t>{0, 100, 1, 101, 2, 102, 3, 103}));
  EXPECT_EQ(gmoe::glu_format_name(gmoe::glu_format_from_string("interleaved:16")), "interleaved:16");
  EXPECT_EQ(gmoe::glu_format_from_string("concat").layout, GluLayout::concatenated);
  expect_error([] { gmoe::glu_format_from_string("interleaved:0"); }, {"positive"});
  expect_error([&] { gmoe::convert_glu(c, {GluLayout::concatenated, 1}, i, {GluLayout::interleaved, 3}, 0); },
               {"block 3", "divide"});
}

TEST_F(ExpertLayoutTest, GluRoundTripThroughSaveAndLoad) {
  TempDir dir;
  for (DType dtype : {DType::bf16, DType::f32, DType::e4m3}) {
    const int64_t E = uniform(1, 5), b = uniform(1, 4), F = b * uniform(1, 4), in = uniform(1, 7);
    SCOPED_TRACE(std::string(gmoe::dtype_name(dtype)) + " block " + std::to_string(b));
    HostTensor w(dtype, {E, 2 * F, in}, rng), bias(dtype, {E, 2 * F}, rng);
    const GluFormat concat{GluLayout::concatenated, 1}, inter{GluLayout::interleaved, b};
    // Model holds concatenated; checkpoint stores interleaved.
    const ExpertParamKey wk{"experts.fc1.weight", ""}, bk{"experts.fc1.bias", ""};
    ExpertParamToSave sw{wk, as_layout(w, ExpertLayout::stacked, 0, E), true, concat, inter};
    ExpertParamToSave sb{bk, as_layout(bias, ExpertLayout::per_expert, 0, E), true, concat, inter};
    gmoe::save_expert_params(dir / "glu.safetensors", {sw, sb}, ExpertLayout::per_expert);
    Checkpoint c = Checkpoint::open(dir / "glu.safetensors");
    // The stored bytes are interleaved: check expert 0 against convert_glu.
    HostTensor expect = HostTensor::poisoned(dtype, {2 * F, in});
    HostTensor w0(dtype, {2 * F, in}, rng);
    w0.bytes = w.slice0(0);
    gmoe::convert_glu(w0.view(), concat, expect.view(), inter, 0);
    EXPECT_EQ(view_bytes(c.view(wk.expert_key(0))), expect.bytes);
    // Load back into concatenated: the original.
    HostTensor lw = HostTensor::poisoned(dtype, {E, 2 * F, in}), lb = HostTensor::poisoned(dtype, {E, 2 * F});
    gmoe::load_expert_params(c,
                             {{wk, as_layout(lw, ExpertLayout::stacked, 0, E), true, inter, concat},
                              {bk, as_layout(lb, ExpertLayout::per_expert, 0, E), true, inter, concat}},
                             E);
    EXPECT_EQ(lw.bytes, w.bytes);
    EXPECT_EQ(lb.bytes, bias.bytes);
    // Stacked [E, 2F, in] along axis 1 matches per-expert conversion.
    HostTensor si = HostTensor::poisoned(dtype, {E, 2 * F, in}), sc = HostTensor::poisoned(dtype, {E, 2 * F, in});
    gmoe::convert_glu(w.view(), concat, si.view(), inter, 1);
    gmoe::convert_glu(si.view(), inter, sc.view(), concat, 1);
    EXPECT_EQ(si.slice0(0), expect.bytes);
    EXPECT_EQ(sc.bytes, w.bytes);
  }
}

// ---- detection and conversion (gmoe-ckpt) ----

TEST_F(ExpertLayoutTest, DetectAndConvertRoundTrip) {
  TempDir dir;
  const int64_t E = uniform(2, 8);
  Layer l0 = make_layer(rng, "model.layers.0.mlp.experts.fc1", E, 2 * uniform(2, 4), uniform(1, 6), DType::bf16, true);
  Layer l1 = make_layer(rng, "model.layers.1.mlp.experts.fc2", E, uniform(1, 6), uniform(1, 6), DType::f16, false);
  HostTensor router(DType::f32, {E, 7}, rng), flag(DType::i64, {1}, rng);
  std::vector<ExpertParamToSave> all = to_save(l0, ExpertLayout::stacked, 0, E);
  for (auto& p : to_save(l1, ExpertLayout::stacked, 0, E)) all.push_back(p);
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  const std::vector<gmoe::NamedTensor> extra = {{"model.layers.0.mlp.router.weight", router.view()},
                                                {"model.step", flag.view()}};
  gmoe::save_expert_params(dir / "stacked.safetensors", all, ExpertLayout::stacked, meta, extra);

  Checkpoint c = Checkpoint::open(dir / "stacked.safetensors");
  const auto found = gmoe::detect_expert_params(c);
  ASSERT_EQ(found.size(), l0.params.size() + l1.params.size());
  for (const auto& d : found) {
    EXPECT_TRUE(d.problem.empty()) << d.problem;
    EXPECT_EQ(d.info.layout, ExpertLayout::stacked);
    EXPECT_EQ(d.info.num_experts, E);
  }

  gmoe::ConvertOptions to_pe;
  to_pe.change_layout = true;
  to_pe.layout = ExpertLayout::per_expert;
  uint64_t last_done = 0, total = 0;
  to_pe.progress = [&](uint64_t done, uint64_t t, const std::string&) {
    EXPECT_GE(done, last_done);
    last_done = done;
    total = t;
  };
  gmoe::convert_checkpoint(dir / "stacked.safetensors", dir / "pe.safetensors", to_pe);
  EXPECT_EQ(last_done, total);
  EXPECT_GT(total, 0u);
  Checkpoint pe = Checkpoint::open(dir / "pe.safetensors");
  for (const auto& d : gmoe::detect_expert_params(pe)) EXPECT_EQ(d.info.layout, ExpertLayout::per_expert);
  load_and_compare(pe, l0, ExpertLayout::stacked, E, 0, E, true);
  load_and_compare(pe, l1, ExpertLayout::per_expert, E, 0, E, true);
  EXPECT_EQ(view_bytes(pe.view("model.step")), flag.bytes);
  EXPECT_EQ(pe.metadata(), meta);

  gmoe::ConvertOptions to_st;
  to_st.change_layout = true;
  to_st.layout = ExpertLayout::stacked;
  gmoe::convert_checkpoint(dir / "pe.safetensors", dir / "back.safetensors", to_st);
  EXPECT_EQ(read_file(dir / "back.safetensors"), read_file(dir / "stacked.safetensors"));

  // GLU on fc1 only: concat → interleaved:1 → concat gives the original bytes; the interleaved
  // file differs and holds the interleaved rows.
  gmoe::ConvertOptions g;
  g.glu_stems = {"fc1"};
  g.glu_from = {GluLayout::concatenated, 1};
  g.glu_to = {GluLayout::interleaved, 1};
  gmoe::convert_checkpoint(dir / "stacked.safetensors", dir / "inter.safetensors", g);
  EXPECT_NE(read_file(dir / "inter.safetensors"), read_file(dir / "stacked.safetensors"));
  std::swap(g.glu_from, g.glu_to);
  g.change_layout = true;
  g.layout = ExpertLayout::per_expert;
  gmoe::convert_checkpoint(dir / "inter.safetensors", dir / "inter_back.safetensors", g);
  gmoe::convert_checkpoint(dir / "inter_back.safetensors", dir / "inter_back2.safetensors", to_st);
  EXPECT_EQ(read_file(dir / "inter_back2.safetensors"), read_file(dir / "stacked.safetensors"));

  // A broken checkpoint is refused before anything is written.
  std::vector<gmoe::NamedTensor> broken = {{"experts.w.weight0", router.view()}, {"experts.w.weight2", router.view()}};
  gmoe::save_safetensors(dir / "broken.safetensors", broken);
  expect_error([&] { gmoe::convert_checkpoint(dir / "broken.safetensors", dir / "never.safetensors", to_st); },
               {"experts.w.weight1", "cannot convert"});
  EXPECT_TRUE(read_file(dir / "never.safetensors").empty());
}

}  // namespace
}  // namespace gmoe_test
