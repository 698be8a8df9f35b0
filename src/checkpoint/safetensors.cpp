// src/checkpoint/safetensors.cpp — the safetensors format: validating parser, mmap reader, writer.
//
// Format: an 8-byte little-endian length N, N bytes of JSON (an object mapping each key to
// {"dtype", "shape", "data_offsets": [begin, end]} plus an optional "__metadata__" string map),
// then the data section; offsets are relative to its start. The parser treats every byte as
// hostile: all arithmetic on sizes is overflow-checked and every range is checked against the
// buffer before anything is dereferenced.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/internal.h"
#include "gmoe/checkpoint.h"
#include "gmoe/error.h"

namespace gmoe {

using nlohmann::json;
using namespace ckpt_detail;

namespace {

struct DtypeCode {
  const char* code;
  int64_t size;
  bool has_gmoe;
  DType dtype;
};

// Every byte-sized dtype of the safetensors format. Those gmoe has no DType for are still parsed
// (their sizes are known), so files mixing them in can be inspected and converted.
constexpr DtypeCode kDtypeCodes[] = {
    {"F32", 4, true, DType::f32},       {"BF16", 2, true, DType::bf16},
    {"F16", 2, true, DType::f16},       {"F8_E4M3", 1, true, DType::e4m3},
    {"F8_E5M2", 1, true, DType::e5m2},  {"F8_E8M0", 1, true, DType::e8m0},
    {"I32", 4, true, DType::i32},       {"I64", 8, true, DType::i64},
    {"F64", 8, false, DType::f32},      {"I8", 1, false, DType::f32},
    {"I16", 2, false, DType::f32},      {"U8", 1, false, DType::f32},
    {"U16", 2, false, DType::f32},      {"U32", 4, false, DType::f32},
    {"U64", 8, false, DType::f32},      {"BOOL", 1, false, DType::f32},
};

const DtypeCode* find_code(const std::string& code) {
  for (const DtypeCode& c : kDtypeCodes) {
    if (code == c.code) return &c;
  }
  return nullptr;
}

uint64_t read_le_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Checks that a JSON value is a non-negative integer that fits in int64; returns it.
bool as_u63(const json& v, uint64_t* out) {
  if (!v.is_number_unsigned()) {
    // nlohmann stores non-negative literals as unsigned; a signed integer here is negative.
    return false;
  }
  uint64_t x = v.get<uint64_t>();
  if (x > static_cast<uint64_t>(INT64_MAX)) return false;
  *out = x;
  return true;
}

// Parses the header JSON with a callback that rejects nesting deeper than the format needs (so
// hostile input cannot build deep trees) and duplicate keys (which nlohmann would silently
// collapse, hiding a second definition of a tensor).
json parse_header_json(const char* begin, const char* end, const std::string& source) {
  std::vector<std::set<std::string>> seen(4);
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    if (event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) {
      GMOE_CHECK(depth <= 2, source, ": header JSON nests deeper than the safetensors format allows");
      if (event == json::parse_event_t::object_start) seen[static_cast<size_t>(depth) + 1].clear();
    } else if (event == json::parse_event_t::key) {
      const std::string& k = parsed.get_ref<const std::string&>();
      GMOE_CHECK(seen[static_cast<size_t>(depth)].insert(k).second, source,
                 ": header JSON defines key '", k, "' twice");
    }
    return true;
  };
  try {
    return json::parse(begin, end, callback, /*allow_exceptions=*/true);
  } catch (const json::exception& e) {
    GMOE_FAIL(source, ": header is not valid JSON: ", e.what());
  }
}

}  // namespace

namespace ckpt_detail {

int64_t safetensors_code_size(const std::string& code) {
  const DtypeCode* c = find_code(code);
  return c ? c->size : 0;
}

bool natural_less(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const bool da = a[i] >= '0' && a[i] <= '9', db = b[j] >= '0' && b[j] <= '9';
    if (da && db) {
      size_t i2 = i, j2 = j;
      while (i2 < a.size() && a[i2] >= '0' && a[i2] <= '9') ++i2;
      while (j2 < b.size() && b[j2] >= '0' && b[j2] <= '9') ++j2;
      // Compare the runs as numbers without converting (runs may be long): strip leading zeros,
      // then the longer run is larger, then lexicographic.
      size_t si = i, sj = j;
      while (si + 1 < i2 && a[si] == '0') ++si;
      while (sj + 1 < j2 && b[sj] == '0') ++sj;
      if (i2 - si != j2 - sj) return i2 - si < j2 - sj;
      int c = a.compare(si, i2 - si, b, sj, j2 - sj);
      if (c != 0) return c < 0;
      if (i2 - i != j2 - j) return i2 - i < j2 - j;  // "01" after "1": keeps the order total
      i = i2;
      j = j2;
    } else {
      if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t d = 0; d < shape.size(); ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

std::vector<int64_t> view_shape(const TensorView& v) {
  return std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.ndim);
}

TensorView make_view(const void* data, DType dtype, const std::vector<int64_t>& shape) {
  GMOE_CHECK(shape.size() <= static_cast<size_t>(TensorView::kMaxDims), "a tensor of rank ",
             shape.size(), " does not fit a TensorView (at most ", TensorView::kMaxDims, ")");
  TensorView v;
  v.data = const_cast<void*>(data);
  v.dtype = dtype;
  v.device = Device::cpu();
  v.ndim = static_cast<int>(shape.size());
  int64_t s = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = shape[static_cast<size_t>(d)];
    v.strides[d] = s;
    s *= v.shape[d];
  }
  return v;
}

std::string join_limited(const std::vector<std::string>& items, size_t max_items) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items.size() > max_items && i == max_items / 2) {
      s += (s.empty() ? "" : ", ") + std::string("... (") +
           std::to_string(items.size() - max_items) + " more) ...";
      i = items.size() - max_items / 2;
    }
    s += (s.empty() ? "" : ", ") + items[i];
  }
  return s;
}

void emit_view_bytes(const TensorView& v, const ByteSink& sink) {
  GMOE_CHECK(v.device.is_cpu(), "writing a tensor: expected a CPU view, got ", v.str());
  const int64_t numel = v.numel();
  if (numel == 0) return;
  GMOE_CHECK(v.data != nullptr, "writing a tensor: ", v.str(), " has no data");
  const int64_t es = static_cast<int64_t>(dtype_size(v.dtype));
  if (v.is_contiguous()) {
    sink(v.data, static_cast<uint64_t>(numel * es));
    return;
  }
  // Strided: gather rows of the last dimension into a bounded buffer.
  constexpr int64_t kChunk = 1 << 20;
  std::vector<uint8_t> buf;
  buf.reserve(kChunk);
  const int nd = v.ndim;
  const int64_t row = v.shape[nd - 1], rstride = v.strides[nd - 1];
  std::array<int64_t, TensorView::kMaxDims> idx{};
  const int64_t rows = numel / row;
  const auto* base = static_cast<const uint8_t*>(v.data);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t off = 0;
    for (int d = 0; d < nd - 1; ++d) off += idx[d] * v.strides[d];
    for (int64_t c = 0; c < row; ++c) {
      const uint8_t* p = base + (off + c * rstride) * es;
      buf.insert(buf.end(), p, p + es);
    }
    if (static_cast<int64_t>(buf.size()) >= kChunk) {
      sink(buf.data(), buf.size());
      buf.clear();
    }
    for (int d = nd - 2; d >= 0; --d) {
      if (++idx[d] < v.shape[d]) break;
      idx[d] = 0;
    }
  }
  if (!buf.empty()) sink(buf.data(), buf.size());
}

}  // namespace ckpt_detail

const char* safetensors_dtype_code(DType t) {
  for (const DtypeCode& c : kDtypeCodes) {
    if (c.has_gmoe && c.dtype == t) return c.code;
  }
  GMOE_FAIL("dtype ", dtype_name(t), " has no safetensors code");
}

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

const SafetensorsEntry* SafetensorsHeader::find(const std::string& name) const {
  // tensors is in natural order, which is a strict weak order: binary search.
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const SafetensorsEntry& e, const std::string& n) {
                               return natural_less(e.name, n);
                             });
  return (it != tensors.end() && it->name == name) ? &*it : nullptr;
}

SafetensorsHeader parse_safetensors(const void* data, uint64_t size, const std::string& source) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  GMOE_CHECK(size >= 8, source, ": file is ", size,
             " bytes, too short for the 8-byte header length (truncated?)");
  SafetensorsHeader h;
  h.header_bytes = read_le_u64(bytes);
  GMOE_CHECK(h.header_bytes <= kMaxSafetensorsHeaderBytes, source, ": header length ",
             h.header_bytes, " exceeds the limit of ", kMaxSafetensorsHeaderBytes,
             " bytes (corrupt or not a safetensors file)");
  GMOE_CHECK(h.header_bytes <= size - 8, source, ": header length ", h.header_bytes,
             " runs past the end of the file (", size, " bytes: at most ", size - 8,
             " available; truncated?)");
  GMOE_CHECK(h.header_bytes >= 2 && bytes[8] == '{', source,
             ": header does not start with '{' (not a safetensors file?)");
  h.data_offset = 8 + h.header_bytes;
  h.data_bytes = size - h.data_offset;

  const char* hb = reinterpret_cast<const char*>(bytes + 8);
  json root = parse_header_json(hb, hb + h.header_bytes, source);
  GMOE_CHECK(root.is_object(), source, ": header JSON is not an object");

  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      GMOE_CHECK(v.is_object(), source, ": __metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        GMOE_CHECK(m.value().is_string(), source, ": __metadata__ entry '", m.key(),
                   "' is not a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    GMOE_CHECK(v.is_object(), source, ": tensor '", name, "': entry is not an object");
    for (auto f = v.begin(); f != v.end(); ++f) {
      GMOE_CHECK(f.key() == "dtype" || f.key() == "shape" || f.key() == "data_offsets", source,
                 ": tensor '", name, "': unknown field '", f.key(), "'");
    }
    GMOE_CHECK(v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"), source,
               ": tensor '", name, "': needs the fields dtype, shape and data_offsets");
    SafetensorsEntry e;
    e.name = name;
    const json& dt = v["dtype"];
    GMOE_CHECK(dt.is_string(), source, ": tensor '", name, "': dtype is not a string");
    e.dtype_code = dt.get<std::string>();
    const DtypeCode* code = find_code(e.dtype_code);
    GMOE_CHECK(code != nullptr, source, ": tensor '", name, "': unknown or unsupported dtype '",
               e.dtype_code, "'");
    e.has_gmoe_dtype = code->has_gmoe;
    e.dtype = code->dtype;
    e.element_size = code->size;

    const json& shape = v["shape"];
    GMOE_CHECK(shape.is_array(), source, ": tensor '", name, "': shape is not an array");
    uint64_t numel = 1;
    bool overflow = false;
    for (const json& s : shape) {
      uint64_t d = 0;
      GMOE_CHECK(as_u63(s, &d), source, ": tensor '", name,
                 "': shape entries must be non-negative integers, got ", s.dump());
      e.shape.push_back(static_cast<int64_t>(d));
      if (d != 0 && numel > static_cast<uint64_t>(INT64_MAX) / d) overflow = true;
      numel *= d;
    }
    // A zero dimension makes numel 0 however large the others are; an overflow before it is
    // still absurd, so it is rejected either way.
    GMOE_CHECK(!overflow, source, ": tensor '", name, "': shape ", shape_string(e.shape),
               " overflows 64-bit element counts");
    GMOE_CHECK(numel <= static_cast<uint64_t>(INT64_MAX) / static_cast<uint64_t>(e.element_size),
               source, ": tensor '", name, "': shape ", shape_string(e.shape),
               " overflows 64-bit byte counts");
    const uint64_t nbytes = numel * static_cast<uint64_t>(e.element_size);

    const json& off = v["data_offsets"];
    GMOE_CHECK(off.is_array() && off.size() == 2, source, ": tensor '", name,
               "': data_offsets must be [begin, end]");
    GMOE_CHECK(as_u63(off[0], &e.begin) && as_u63(off[1], &e.end), source, ": tensor '", name,
               "': data_offsets must be non-negative integers");
    GMOE_CHECK(e.begin <= e.end, source, ": tensor '", name, "': data_offsets [", e.begin, ", ",
               e.end, "] end before they begin");
    GMOE_CHECK(e.end <= h.data_bytes, source, ": tensor '", name, "': data_offsets [", e.begin,
               ", ", e.end, "] run past the end of the data section (", h.data_bytes,
               " bytes; truncated file?)");
    GMOE_CHECK(e.end - e.begin == nbytes, source, ": tensor '", name, "': shape ",
               shape_string(e.shape), " of ", e.dtype_code, " needs ", nbytes,
               " bytes but data_offsets [", e.begin, ", ", e.end, "] hold ", e.end - e.begin);
    h.tensors.push_back(std::move(e));
  }

  // Overlap: sort the non-empty ranges by start; each must start at or after the previous end.
  std::vector<const SafetensorsEntry*> by_offset;
  for (const SafetensorsEntry& e : h.tensors) {
    if (e.end > e.begin) by_offset.push_back(&e);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
              return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
            });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const SafetensorsEntry& a = *by_offset[i - 1];
    const SafetensorsEntry& b = *by_offset[i];
    GMOE_CHECK(b.begin >= a.end, source, ": tensors '", a.name, "' [", a.begin, ", ", a.end,
               ") and '", b.name, "' [", b.begin, ", ", b.end, ") overlap");
  }
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return natural_less(a.name, b.name);
            });
  return h;
}

// ------------------------------------------------------------------------------------------------
// SafetensorsFile

struct SafetensorsFile::Impl {
  std::string path;
  void* map = nullptr;
  uint64_t size = 0;
  SafetensorsHeader header;

  ~Impl() {
    if (map != nullptr) munmap(map, size);
  }
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  GMOE_CHECK(fd >= 0, path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    GMOE_FAIL(path, ": not a regular file");
  }
  impl->size = static_cast<uint64_t>(st.st_size);
  if (impl->size < 8) {
    ::close(fd);
    GMOE_FAIL(path, ": file is ", impl->size,
              " bytes, too short for the 8-byte header length (truncated?)");
  }
  void* m = mmap(nullptr, impl->size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  GMOE_CHECK(m != MAP_FAILED, path, ": mmap failed: ", std::strerror(map_errno));
  impl->map = m;
  impl->header = parse_safetensors(m, impl->size, path);
  SafetensorsFile f;
  f.impl_ = std::move(impl);
  return f;
}

const std::string& SafetensorsFile::path() const { return impl_->path; }
const SafetensorsHeader& SafetensorsFile::header() const { return impl_->header; }

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  GMOE_CHECK(e != nullptr, impl_->path, ": no tensor '", name, "'");
  return *e;
}

const uint8_t* SafetensorsFile::bytes(const SafetensorsEntry& e) const {
  return static_cast<const uint8_t*>(impl_->map) + impl_->header.data_offset + e.begin;
}

TensorView SafetensorsFile::view(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  GMOE_CHECK(e.has_gmoe_dtype, impl_->path, ": tensor '", name, "' has dtype ", e.dtype_code,
             ", which gmoe has no DType for");
  GMOE_CHECK(e.shape.size() <= static_cast<size_t>(TensorView::kMaxDims), impl_->path,
             ": tensor '", name, "' has rank ", e.shape.size(), ", more than a TensorView holds");
  return make_view(bytes(e), e.dtype, e.shape);
}

// ------------------------------------------------------------------------------------------------
// writer

namespace ckpt_detail {

void write_safetensors_raw(const std::string& path, std::vector<RawTensor> tensors,
                           const std::map<std::string, std::string>& metadata,
                           const ProgressFn& progress) {
  std::set<std::string> names;
  std::vector<std::pair<int64_t, uint64_t>> sizes;  // element size, bytes, per tensor
  for (const RawTensor& t : tensors) {
    GMOE_CHECK(t.name != "__metadata__", path, ": '__metadata__' is not a valid tensor name");
    GMOE_CHECK(names.insert(t.name).second, path, ": tensor '", t.name, "' given twice");
    const int64_t es = safetensors_code_size(t.dtype_code);
    GMOE_CHECK(es > 0, path, ": tensor '", t.name, "': unknown dtype code '", t.dtype_code, "'");
  }
  // Descending element size keeps every tensor aligned to its element size (the data section
  // starts 8-aligned); then natural key order, for determinism.
  std::sort(tensors.begin(), tensors.end(), [](const RawTensor& a, const RawTensor& b) {
    const int64_t sa = safetensors_code_size(a.dtype_code), sb = safetensors_code_size(b.dtype_code);
    return sa != sb ? sa > sb : natural_less(a.name, b.name);
  });

  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::vector<uint64_t> nbytes;
  for (const RawTensor& t : tensors) {
    uint64_t n = static_cast<uint64_t>(safetensors_code_size(t.dtype_code));
    for (int64_t s : t.shape) {
      GMOE_CHECK(s >= 0, path, ": tensor '", t.name, "': negative size in ", shape_string(t.shape));
      n *= static_cast<uint64_t>(s);
    }
    header[t.name] = {{"dtype", t.dtype_code}, {"shape", t.shape}, {"data_offsets", {offset, offset + n}}};
    nbytes.push_back(n);
    offset += n;
  }
  const uint64_t total = offset;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    GMOE_FAIL(path, ": cannot encode the header (keys and metadata must be UTF-8): ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');

  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  GMOE_CHECK(f != nullptr, tmp, ": cannot create: ", std::strerror(errno));
  bool ok = true;
  auto put = [&](const void* p, uint64_t n) {
    if (ok && n > 0 && std::fwrite(p, 1, n, f) != n) ok = false;
  };
  try {
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
    put(len, 8);
    put(text.data(), text.size());
    uint64_t done = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const RawTensor& t = tensors[i];
      uint64_t written = 0;
      t.produce([&](const void* p, uint64_t n) {
        GMOE_CHECK(written + n <= nbytes[i], path, ": tensor '", t.name, "' produced more than its ",
                   nbytes[i], " bytes");
        put(p, n);
        written += n;
        done += n;
        if (progress) progress(done, total, t.name);
      });
      GMOE_CHECK(written == nbytes[i], path, ": tensor '", t.name, "' produced ", written,
                 " bytes, expected ", nbytes[i]);
      if (progress && nbytes[i] == 0) progress(done, total, t.name);
    }
    if (std::fflush(f) != 0) ok = false;
  } catch (...) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
  const int err = errno;
  if (std::fclose(f) != 0) ok = false;
  if (!ok) {
    std::remove(tmp.c_str());
    GMOE_FAIL(path, ": write failed: ", std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rerr = errno;
    std::remove(tmp.c_str());
    GMOE_FAIL(path, ": cannot rename the temporary file into place: ", std::strerror(rerr));
  }
}

}  // namespace ckpt_detail

void save_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                      const std::map<std::string, std::string>& metadata,
                      const ProgressFn& progress) {
  std::vector<RawTensor> raw;
  raw.reserve(tensors.size());
  for (const NamedTensor& t : tensors) {
    GMOE_CHECK(t.view.defined(), path, ": tensor '", t.name, "' is absent");
    GMOE_CHECK(t.view.device.is_cpu(), path, ": tensor '", t.name,
               "' must be on the CPU to be written, got ", t.view.str());
    GMOE_CHECK(t.view.numel() == 0 || t.view.data != nullptr, path, ": tensor '", t.name,
               "' has no data");
    TensorView v = t.view;
    raw.push_back(RawTensor{t.name, safetensors_dtype_code(v.dtype), view_shape(v),
                            [v](const ByteSink& sink) { emit_view_bytes(v, sink); }});
  }
  write_safetensors_raw(path, std::move(raw), metadata, progress);
}

}  // namespace gmoe
