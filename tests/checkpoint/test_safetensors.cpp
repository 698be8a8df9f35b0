// tests/checkpoint/test_safetensors.cpp — the safetensors reader and writer: round trips of every
// dtype, the writer's layout rules, and a clear error for each kind of corrupt or hostile file.
#include <nlohmann/json.hpp>

#include "ckpt_test_util.h"
#include "gmoe/checkpoint.h"
#include "gmoe/error.h"

namespace gmoe_test {
namespace {

using gmoe::Checkpoint;
using gmoe::NamedTensor;
using gmoe::SafetensorsFile;

class Safetensors : public SeededTest {};

uint64_t le64(const std::vector<uint8_t>& b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[static_cast<size_t>(i)];
  return v;
}

TEST_F(Safetensors, RoundTripEveryDtypeAndRank) {
  TempDir dir;
  std::vector<HostTensor> tensors;
  std::vector<NamedTensor> named;
  const std::vector<std::vector<int64_t>> shapes = {
      {}, {0}, {uniform(1, 40)}, {uniform(1, 9), uniform(1, 9)}, {3, 0, 2},
      {uniform(1, 4), uniform(1, 5), uniform(1, 6)}, {2, 1, 2, 1, 2, 3}};
  for (DType t : all_dtypes()) {
    for (size_t s = 0; s < shapes.size(); ++s) tensors.emplace_back(t, shapes[s], rng);
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    named.push_back({"t" + std::to_string(i) + "." + gmoe::dtype_name(tensors[i].dtype),
                     tensors[i].view()});
  }
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "ünïcode ✓"}};
  gmoe::save_safetensors(dir / "a.safetensors", named, meta);

  SafetensorsFile f = SafetensorsFile::open(dir / "a.safetensors");
  EXPECT_EQ(f.metadata(), meta);
  ASSERT_EQ(f.tensors().size(), named.size());
  for (size_t i = 0; i < named.size(); ++i) {
    SCOPED_TRACE(named[i].name);
    const gmoe::SafetensorsEntry& e = f.entry(named[i].name);
    EXPECT_TRUE(e.has_gmoe_dtype);
    EXPECT_EQ(e.dtype, tensors[i].dtype);
    EXPECT_EQ(e.dtype_code, gmoe::safetensors_dtype_code(tensors[i].dtype));
    EXPECT_EQ(e.shape, tensors[i].shape);
    TensorView v = f.view(named[i].name);
    EXPECT_EQ(v.dtype, tensors[i].dtype);
    EXPECT_EQ(view_bytes(v), tensors[i].bytes);
  }
}

TEST_F(Safetensors, WritesStridedViews) {
  TempDir dir;
  HostTensor base(DType::bf16, {uniform(2, 7), uniform(2, 7)}, rng);
  TensorView t = base.view();  // the transpose, as a strided view
  std::swap(t.shape[0], t.shape[1]);
  std::swap(t.strides[0], t.strides[1]);
  gmoe::save_safetensors(dir / "t.safetensors", {{"t", t}});
  const SafetensorsFile file = SafetensorsFile::open(dir / "t.safetensors");  // owns the mapping
  TensorView r = file.view("t");
  ASSERT_EQ(r.size(0), base.shape[1]);
  const auto* src = reinterpret_cast<const uint16_t*>(base.bytes.data());
  const auto* got = static_cast<const uint16_t*>(r.data);
  for (int64_t i = 0; i < base.shape[1]; ++i) {
    for (int64_t j = 0; j < base.shape[0]; ++j) {
      ASSERT_EQ(got[i * base.shape[0] + j], src[j * base.shape[1] + i]) << i << "," << j;
    }
  }
}

TEST_F(Safetensors, WriterLayoutIsAlignedGaplessAndDeterministic) {
  TempDir dir;
  std::vector<HostTensor> ts;
  std::vector<NamedTensor> named;
  for (int i = 0; i < 12; ++i) {
    ts.emplace_back(all_dtypes()[static_cast<size_t>(uniform(0, 7))],
                    std::vector<int64_t>{uniform(0, 5), uniform(1, 7)}, rng);
  }
  for (size_t i = 0; i < ts.size(); ++i) named.push_back({"w" + std::to_string(i), ts[i].view()});
  gmoe::save_safetensors(dir / "a.safetensors", named, {{"k", "v"}});
  std::reverse(named.begin(), named.end());  // input order must not matter
  gmoe::save_safetensors(dir / "b.safetensors", named, {{"k", "v"}});
  const std::vector<uint8_t> a = read_file(dir / "a.safetensors");
  EXPECT_EQ(a, read_file(dir / "b.safetensors"));
  const uint64_t n = le64(a);
  EXPECT_EQ(n % 8, 0u);
  const gmoe::SafetensorsHeader h = gmoe::parse_safetensors(a.data(), a.size(), "a");
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& e : h.tensors) {
    EXPECT_EQ(e.begin % static_cast<uint64_t>(e.element_size), 0u) << e.name;
    ranges.emplace_back(e.begin, e.end);
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t at = 0;
  for (const auto& r : ranges) {
    EXPECT_EQ(r.first, at);
    at = r.second;
  }
  EXPECT_EQ(at, h.data_bytes);  // no gaps and no trailing bytes: what the Rust reader demands
}

TEST_F(Safetensors, WriterRejectsDuplicateNamesAndLeavesNoFile) {
  TempDir dir;
  HostTensor a(DType::f32, {2}, rng);
  expect_error([&] { gmoe::save_safetensors(dir / "x.safetensors", {{"a", a.view()}, {"a", a.view()}}); },
               {"'a'", "twice"});
  expect_error([&] { gmoe::save_safetensors(dir / "x.safetensors", {{"__metadata__", a.view()}}); },
               {"__metadata__"});
  EXPECT_TRUE(read_file(dir / "x.safetensors").empty());
}

// ---- corrupt and hostile inputs ----

// Expects opening the file to fail with all of `parts` (and the file name) in the message; also
// through the in-memory parser.
void expect_corrupt(const TempDir& dir, const std::string& name, const std::vector<uint8_t>& bytes,
                    std::vector<std::string> parts) {
  SCOPED_TRACE(name);
  const std::string path = dir / name;
  write_file(path, bytes);
  parts.push_back(path);
  expect_error([&] { SafetensorsFile::open(path); }, parts);
  parts.back() = "mem:" + name;
  expect_error([&] { gmoe::parse_safetensors(bytes.data(), bytes.size(), "mem:" + name); }, parts);
}

TEST_F(Safetensors, CorruptInputsGiveClearErrors) {
  TempDir dir;
  HostTensor a(DType::bf16, {4, 8}, rng), b(DType::f32, {3}, rng);
  gmoe::save_safetensors(dir / "good.safetensors", {{"layer.a", a.view()}, {"layer.b", b.view()}});
  const std::vector<uint8_t> good = read_file(dir / "good.safetensors");
  ASSERT_NO_THROW(SafetensorsFile::open(dir / "good.safetensors"));

  // Truncated anywhere inside the data: the tensor whose range now runs past the end is named.
  {
    const gmoe::SafetensorsHeader h = gmoe::parse_safetensors(good.data(), good.size(), "good");
    const auto last = std::max_element(h.tensors.begin(), h.tensors.end(),
                                       [](const auto& x, const auto& y) { return x.end < y.end; });
    std::vector<uint8_t> t(good.begin(), good.end() - uniform(1, 12));
    expect_corrupt(dir, "truncated.safetensors", t, {"'" + last->name + "'", "past the end"});
  }
  expect_corrupt(dir, "short.safetensors", {1, 2, 3}, {"too short"});
  expect_corrupt(dir, "empty.safetensors", {}, {"too short"});
  {
    std::vector<uint8_t> t(good.begin(), good.begin() + 20);  // cut inside the header
    expect_corrupt(dir, "cut_header.safetensors", t, {"header length", "past the end"});
  }
  {
    std::vector<uint8_t> t = good;
    const uint64_t n = good.size();  // header length past the end of the file
    for (int i = 0; i < 8; ++i) t[static_cast<size_t>(i)] = static_cast<uint8_t>(n >> (8 * i));
    expect_corrupt(dir, "len_past_end.safetensors", t, {"past the end"});
  }
  {
    std::vector<uint8_t> t = good;
    const uint64_t n = 200'000'000;  // huge header
    for (int i = 0; i < 8; ++i) t[static_cast<size_t>(i)] = static_cast<uint8_t>(n >> (8 * i));
    expect_corrupt(dir, "huge_header.safetensors", t, {"exceeds the limit"});
    for (int i = 0; i < 8; ++i) t[static_cast<size_t>(i)] = 0xff;
    expect_corrupt(dir, "max_header.safetensors", t, {"exceeds the limit"});
  }
  expect_corrupt(dir, "overlap.safetensors",
                 craft(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                       R"("y":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16),
                 {"'x'", "'y'", "overlap"});
  expect_corrupt(dir, "bad_dtype.safetensors",
                 craft(R"({"x":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", 8),
                 {"'x'", "dtype 'F33'"});
  expect_corrupt(dir, "dtype_number.safetensors",
                 craft(R"({"x":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", 8),
                 {"'x'", "dtype"});
  expect_corrupt(dir, "shape_mismatch.safetensors",
                 craft(R"({"x":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}})", 8),
                 {"'x'", "needs 12 bytes", "hold 8"});
  expect_corrupt(dir, "negative_shape.safetensors",
                 craft(R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
                 {"'x'", "non-negative"});
  expect_corrupt(dir, "float_shape.safetensors",
                 craft(R"({"x":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8),
                 {"'x'", "non-negative integers"});
  expect_corrupt(dir, "shape_overflow.safetensors",
                 craft(R"({"x":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
                 {"'x'", "overflow"});
  expect_corrupt(dir, "bytes_overflow.safetensors",
                 craft(R"({"x":{"dtype":"I64","shape":[2305843009213693952],"data_offsets":[0,8]}})", 8),
                 {"'x'", "overflow"});
  expect_corrupt(dir, "reversed_offsets.safetensors",
                 craft(R"({"x":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8),
                 {"'x'", "end before"});
  expect_corrupt(dir, "offsets_past_end.safetensors",
                 craft(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})", 16),
                 {"'x'", "past the end of the data section"});
  expect_corrupt(dir, "offsets_huge.safetensors",
                 craft(R"({"x":{"dtype":"F32","shape":[0],"data_offsets":[18446744073709551615,18446744073709551615]}})", 8),
                 {"'x'", "non-negative integers"});
  expect_corrupt(dir, "invalid_json.safetensors",
                 craft(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8),
                 {"not valid JSON"});
  expect_corrupt(dir, "not_object.safetensors", craft("[1,2]", 0), {"start with '{'"});
  expect_corrupt(dir, "bad_utf8.safetensors", craft("{\"\xff\xfe\":1}", 0), {"not valid JSON"});
  expect_corrupt(dir, "duplicate.safetensors",
                 craft(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                       R"("x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                 {"'x'", "twice"});
  expect_corrupt(dir, "duplicate_field.safetensors",
                 craft(R"({"x":{"dtype":"F32","dtype":"F16","shape":[1],"data_offsets":[0,4]}})", 8),
                 {"'dtype'", "twice"});
  expect_corrupt(dir, "unknown_field.safetensors",
                 craft(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}})", 4),
                 {"'x'", "unknown field 'extra'"});
  expect_corrupt(dir, "missing_field.safetensors",
                 craft(R"({"x":{"dtype":"F32","shape":[1]}})", 4), {"'x'", "data_offsets"});
  expect_corrupt(dir, "entry_not_object.safetensors", craft(R"({"x":3})", 0), {"'x'", "not an object"});
  expect_corrupt(dir, "metadata_value.safetensors", craft(R"({"__metadata__":{"a":1}})", 0),
                 {"__metadata__", "'a'"});
  expect_corrupt(dir, "deep.safetensors",
                 craft("{\"x\":" + std::string(5000, '[') + std::string(5000, ']') + "}", 0),
                 {"nests deeper"});
}

TEST_F(Safetensors, AcceptsGapsZeroSizedTensorsAndUnsupportedDtypes) {
  TempDir dir;
  // Gaps and an empty tensor sitting inside another's range are harmless; BOOL is a valid
  // safetensors dtype gmoe has no DType for: parsed, listed, but not viewable.
  write_file(dir / "g.safetensors",
             craft(R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                   R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[6,6]},)"
                   R"("m":{"dtype":"BOOL","shape":[2],"data_offsets":[10,12]}}   )", 16));
  SafetensorsFile f = SafetensorsFile::open(dir / "g.safetensors");
  EXPECT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.metadata().at("k"), "v");
  EXPECT_FALSE(f.entry("m").has_gmoe_dtype);
  EXPECT_EQ(f.view("e").numel(), 0);
  expect_error([&] { f.view("m"); }, {"'m'", "BOOL"});
  expect_error([&] { f.entry("nope"); }, {"'nope'", dir / "g.safetensors"});
}

// ---- index json (file sets) ----

TEST_F(Safetensors, IndexIsCheckedStrictly) {
  TempDir dir;
  HostTensor a(DType::f32, {3}, rng), b(DType::i64, {2}, rng);
  gmoe::save_safetensors(dir / "p1.safetensors", {{"a", a.view()}});
  gmoe::save_safetensors(dir / "p2.safetensors", {{"b", b.view()}});
  auto index = [&](const std::string& name, const std::string& text) {
    write_file(dir / name, std::vector<uint8_t>(text.begin(), text.end()));
    return dir / name;
  };
  Checkpoint c = Checkpoint::open(index(
      "ok.json", R"({"metadata":{"total_size":28},"weight_map":{"a":"p1.safetensors","b":"p2.safetensors"}})"));
  EXPECT_EQ(c.keys(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(view_bytes(c.view("b")), b.bytes);
  EXPECT_EQ(c.metadata().at("total_size"), "28");
  EXPECT_EQ(c.file_of("b").path(), dir.path + "/p2.safetensors");

  expect_error([&] { Checkpoint::open(index("unlisted.json", R"({"weight_map":{"a":"p1.safetensors","x":"p2.safetensors"}})")); },
               {"'b'", "not listed"});
  expect_error([&] { Checkpoint::open(index("wrong_file.json", R"({"weight_map":{"a":"p2.safetensors","b":"p2.safetensors"}})")); },
               {"'a'"});
  expect_error([&] { Checkpoint::open(index("traversal.json", R"({"weight_map":{"a":"../p1.safetensors"}})")); },
               {"plain names"});
  expect_error([&] { Checkpoint::open(index("bad.json", R"({"weight_map":)")); }, {"not valid JSON"});
  expect_error([&] { Checkpoint::open(index("nomap.json", R"({"metadata":{}})")); }, {"weight_map"});
}

}  // namespace
}  // namespace gmoe_test
