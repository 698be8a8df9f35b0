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
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/internal.h"
#include "common/checked_math.h"
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

// Builds the DOM from SAX events, refusing nesting past `max_depth` (so hostile input cannot build
// deep trees) and duplicate keys (which a map would silently collapse, hiding a second definition
// of a tensor). Linear in the input: a duplicate is found by one lookup in the object being
// built (nlohmann's callback parser instead rescans the parent at every closing brace, quadratic
// in the number of tensors).
class StrictJsonBuilder {
 public:
  StrictJsonBuilder(json* root, int max_depth, const std::string& source, const char* what)
      : root_(root), max_depth_(max_depth), source_(source), what_(what) {}

  bool null() { return put(json(nullptr)); }
  bool boolean(bool v) { return put(json(v)); }
  bool number_integer(json::number_integer_t v) { return put(json(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return put(json(v)); }
  bool number_float(json::number_float_t v, const json::string_t&) { return put(json(v)); }
  bool string(json::string_t& v) { return put(json(std::move(v))); }
  bool binary(json::binary_t& v) { return put(json::binary(std::move(v))); }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    json& obj = *stack_.back();
    GMOE_CHECK(obj.find(k) == obj.end(), source_, ": ", what_, " JSON defines key '", k, "' twice");
    key_ = &obj[k];
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    GMOE_FAIL(source_, ": ", what_, " is not valid JSON: ", e.what());
  }

 private:
  // Places a value where the parser is: the root, the pending key of an object, or an array.
  json* place(json&& v) {
    if (stack_.empty()) {
      *root_ = std::move(v);
      return root_;
    }
    json& parent = *stack_.back();
    if (parent.is_object()) {
      *key_ = std::move(v);
      return key_;
    }
    parent.push_back(std::move(v));
    return &parent.back();
  }
  bool put(json&& v) {
    place(std::move(v));
    return true;
  }
  bool open(json&& v) {
    GMOE_CHECK(static_cast<int>(stack_.size()) < max_depth_, source_, ": ", what_,
               " JSON nests deeper than ", max_depth_, " levels, more than the format allows");
    stack_.push_back(place(std::move(v)));
    return true;
  }
  bool close() {
    stack_.pop_back();
    return true;
  }

  json* root_;
  int max_depth_;
  const std::string& source_;
  const char* what_;
  // The open objects and arrays. The pointers stay valid: a container only grows while it is the
  // innermost open one, and an array's earlier elements are closed by then (a std::vector may
  // move them, but nothing points into them any more).
  std::vector<json*> stack_;
  json* key_ = nullptr;
};

}  // namespace

namespace ckpt_detail {

json parse_json_strict(const char* begin, const char* end, int max_depth, const std::string& source,
                       const char* what) {
  // nlohmann's lexer takes a NUL byte for the end of the input; JSON text never holds one raw
  // (Python's reader rejects such files), and whatever follows must not be silently ignored.
  const void* nul = std::memchr(begin, '\0', static_cast<size_t>(end - begin));
  GMOE_CHECK(nul == nullptr, source, ": ", what, " holds a NUL byte at offset ",
             static_cast<const char*>(nul) - begin, " (JSON text never does)");
  json root;
  StrictJsonBuilder builder(&root, max_depth, source, what);
  try {
    json::sax_parse(begin, end, &builder);
  } catch (const json::exception& e) {
    GMOE_FAIL(source, ": ", what, " is not valid JSON: ", e.what());
  }
  return root;
}

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

std::string printable(const std::string& text) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  auto escape = [&](unsigned char c) {
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  const auto* b = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = b[i];
    if (c >= 0x20 && c < 0x7f) {
      if (c == '\\') out += '\\';
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    // A well-formed UTF-8 sequence of 2-4 bytes (no overlong forms, no surrogates) passes, unless
    // it encodes a C1 control (U+0080..U+009F; U+009B is a terminal's CSI).
    size_t len = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) ok = (b[i + k] & 0xc0) == 0x80;
    if (ok && len == 3) ok = !(c == 0xe0 && b[i + 1] < 0xa0) && !(c == 0xed && b[i + 1] >= 0xa0);
    if (ok && len == 4) ok = !(c == 0xf0 && b[i + 1] < 0x90) && !(c == 0xf4 && b[i + 1] >= 0x90);
    if (ok && len == 2) ok = !(c == 0xc2 && b[i + 1] < 0xa0);
    if (ok) {
      out.append(text, i, len);
      i += len;
    } else {
      escape(c);
      ++i;
    }
  }
  return out;
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
  // Every stride below is a product of sizes: they fit when all the non-zero sizes' product does.
  (void)checked_numel(shape, "a checkpoint tensor view: contiguous strides");
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
    sink(v.data, static_cast<uint64_t>(v.nbytes()));
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

int64_t SafetensorsEntry::numel() const { return checked_numel(shape, name.c_str()); }

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
  // The format's deepest value is a shape or data_offsets array: depth 3.
  json root = parse_json_strict(hb, hb + h.header_bytes, 3, source, "header");
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
    // Every product of the sizes must fit: the element and byte counts, and the contiguous
    // strides, which ignore a zero size elsewhere ([0, 2^62, 4] holds no element, but its row
    // stride 2^64 does not fit). So the product of the non-zero sizes, in bytes, must fit.
    int64_t span = 1;
    bool empty = false, overflow = false;
    for (const json& s : shape) {
      uint64_t d = 0;
      GMOE_CHECK(as_u63(s, &d), source, ": tensor '", name,
                 "': shape entries must be non-negative integers, got ", s.dump());
      e.shape.push_back(static_cast<int64_t>(d));
      if (d == 0) {
        empty = true;
      } else if (__builtin_mul_overflow(span, static_cast<int64_t>(d), &span)) {
        overflow = true;
      }
    }
    GMOE_CHECK(!overflow && !__builtin_mul_overflow(span, e.element_size, &span), source,
               ": tensor '", name, "': shape ", shape_string(e.shape), " of ", e.dtype_code,
               " overflows 64-bit byte counts or strides");
    const uint64_t nbytes = empty ? 0 : static_cast<uint64_t>(span);

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

AtomicFile::AtomicFile(const std::string& path, int mode) : path_(path) {
  // A symlink is written through: its target gets the new contents and the link stays. A link
  // whose target does not exist is refused rather than guessed at.
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
    char* real = realpath(path.c_str(), nullptr);
    GMOE_CHECK(real != nullptr, path, ": is a symlink whose target cannot be resolved (",
               std::strerror(errno), "); refusing to replace the link with a file");
    target_ = real;
    std::free(real);
  } else {
    target_ = path;
  }
  // Permissions: `mode` when given, else those of the file being replaced, else the default.
  const bool exists = ::stat(target_.c_str(), &st) == 0;
  GMOE_CHECK(!exists || S_ISREG(st.st_mode), path, ": exists and is not a regular file");
  mode_ = mode >= 0 ? mode : exists ? static_cast<int>(st.st_mode & 07777) : -1;

  const size_t slash = target_.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : target_.substr(0, slash == 0 ? 1 : slash);
  // An unnamed file (O_TMPFILE) vanishes with the process however it dies; it is named only at
  // commit. Where the filesystem or /proc lacks support, a named temporary file is used and
  // removed on every failure that unwinds.
  if (access("/proc/self/fd", X_OK) == 0) {
    fd_ = ::open(dir.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0666);
  }
  if (fd_ < 0) {
    tmp_ = target_ + ".tmp." + std::to_string(getpid());
    fd_ = ::open(tmp_.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0666);
    GMOE_CHECK(fd_ >= 0, tmp_, ": cannot create: ", std::strerror(errno));
  }
  if (mode_ >= 0 && fchmod(fd_, static_cast<mode_t>(mode_)) != 0) {
    const int err = errno;
    discard();
    GMOE_FAIL(path, ": cannot set permissions ", mode_, ": ", std::strerror(err));
  }
  buf_.reserve(kBuffer);
}

AtomicFile::~AtomicFile() { discard(); }

void AtomicFile::discard() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
  tmp_.clear();
}

void AtomicFile::write_all(const void* p, uint64_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd_, b, static_cast<size_t>(std::min<uint64_t>(n, 1u << 30)));
    if (w < 0 && errno == EINTR) continue;
    GMOE_CHECK(w > 0, path_, ": write failed: ", std::strerror(errno));
    b += w;
    n -= static_cast<uint64_t>(w);
  }
}

void AtomicFile::write(const void* p, uint64_t n) {
  if (n >= kBuffer) {
    flush();
    write_all(p, n);
    return;
  }
  if (buf_.size() + n > kBuffer) flush();
  const auto* b = static_cast<const uint8_t*>(p);
  buf_.insert(buf_.end(), b, b + n);
}

void AtomicFile::flush() {
  write_all(buf_.data(), buf_.size());
  buf_.clear();
}

void AtomicFile::commit() {
  flush();
  // The data reaches the disk before the name does: after a power loss the path holds the old
  // file or the new one, never a half-written one.
  GMOE_CHECK(fsync(fd_) == 0, path_, ": fsync failed: ", std::strerror(errno));
  if (tmp_.empty()) {  // unnamed: link it under a temporary name, then rename over the target
    const std::string tmp = target_ + ".tmp." + std::to_string(getpid());
    ::unlink(tmp.c_str());  // a leftover of an earlier process with our pid
    const std::string proc = "/proc/self/fd/" + std::to_string(fd_);
    GMOE_CHECK(linkat(AT_FDCWD, proc.c_str(), AT_FDCWD, tmp.c_str(), AT_SYMLINK_FOLLOW) == 0, path_,
               ": cannot name the temporary file: ", std::strerror(errno));
    tmp_ = tmp;
  }
  const int err = ::close(fd_) == 0 ? 0 : errno;
  fd_ = -1;
  GMOE_CHECK(err == 0, path_, ": close failed: ", std::strerror(err));
  GMOE_CHECK(std::rename(tmp_.c_str(), target_.c_str()) == 0, path_,
             ": cannot rename the temporary file into place: ", std::strerror(errno));
  tmp_.clear();
  // The rename itself is made durable by syncing the directory.
  const size_t slash = target_.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : target_.substr(0, slash == 0 ? 1 : slash);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    ::close(dfd);
  }
}

void write_safetensors_raw(const std::string& path, std::vector<RawTensor> tensors,
                           const std::map<std::string, std::string>& metadata,
                           const ProgressFn& progress, int mode) {
  std::set<std::string> names;
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
  int64_t offset = 0;
  std::vector<uint64_t> nbytes;
  for (const RawTensor& t : tensors) {
    const std::string what = path + ": tensor '" + t.name + "' of shape " + shape_string(t.shape);
    const int64_t n = checked_mul(checked_numel(t.shape, what.c_str()),
                                  safetensors_code_size(t.dtype_code), what.c_str());
    const int64_t end = checked_add(offset, n, what.c_str());
    header[t.name] = {{"dtype", t.dtype_code}, {"shape", t.shape}, {"data_offsets", {offset, end}}};
    nbytes.push_back(static_cast<uint64_t>(n));
    offset = end;
  }
  const uint64_t total = static_cast<uint64_t>(offset);
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    GMOE_FAIL(path, ": cannot encode the header (keys and metadata must be UTF-8): ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  GMOE_CHECK(text.size() <= kMaxSafetensorsHeaderBytes, path, ": the header would be ", text.size(),
             " bytes, past the limit of ", kMaxSafetensorsHeaderBytes, " that readers accept");

  AtomicFile f(path, mode);  // removed unless committed, however this unwinds
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  f.write(len, 8);
  f.write(text.data(), text.size());
  uint64_t done = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const RawTensor& t = tensors[i];
    uint64_t written = 0;
    t.produce([&](const void* p, uint64_t n) {
      GMOE_CHECK(written + n <= nbytes[i], path, ": tensor '", t.name, "' produced more than its ",
                 nbytes[i], " bytes");
      f.write(p, n);
      written += n;
      done += n;
      if (progress) progress(done, total, t.name);
    });
    GMOE_CHECK(written == nbytes[i], path, ": tensor '", t.name, "' produced ", written,
               " bytes, expected ", nbytes[i]);
    if (progress && nbytes[i] == 0) progress(done, total, t.name);
  }
  f.commit();
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
